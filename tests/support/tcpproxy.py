"""A TCP proxy a test can sever or pause, to cut the broker or the database off
one process without disturbing the real servers that other tests share."""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit


class TcpProxy:
    """Forwards 127.0.0.1:<port> to an upstream address until `sever()`.

    While severed, existing connections are reset and new ones are refused
    (accepted then closed at once), as a broker outage looks to a client.
    While paused, connections stay open but no byte goes through either way,
    as a stalled server looks to a client. `orphan()` resets the clients' side only: the
    server keeps each connection open, as a cluster keeps a frozen node's connections
    until it gives up on that node.

    With `more` upstreams it stands in for a Kubernetes Service in front of a cluster:
    each new connection goes to the next upstream that accepts one.
    """

    def __init__(
        self, upstream_host: str, upstream_port: int, more: Sequence[tuple[str, int]] = ()
    ) -> None:
        self.upstreams = [(upstream_host, upstream_port), *more]
        self._next = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._open = threading.Event()
        self._open.set()
        self._flowing = threading.Event()
        self._flowing.set()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._upstream: set[socket.socket] = set()
        self._orphans: set[socket.socket] = set()  # upstream sides kept open by `orphan()`
        self._closed = False
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._open.is_set():
                client.close()
                continue
            upstream = self._connect_upstream()
            if upstream is None:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns.update((client, upstream))
                self._upstream.add(upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _connect_upstream(self) -> socket.socket | None:
        for _ in self.upstreams:
            address = self.upstreams[self._next % len(self.upstreams)]
            self._next += 1
            try:
                return socket.create_connection(address, timeout=2)
            except OSError:
                continue
        return None

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self._flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                self._drop(s)

    def _drop(self, s: socket.socket) -> None:
        with self._lock:
            if s in self._orphans:
                return
            self._conns.discard(s)
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()

    def sever(self) -> None:
        self._open.clear()
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            self._drop(s)

    def url(self, url: str) -> str:
        """`url` (user, password, path and query kept) through this proxy."""
        parts = urlsplit(url)
        auth, at, _ = parts.netloc.rpartition("@")
        return urlunsplit(parts._replace(netloc=f"{auth}{at}127.0.0.1:{self.port}"))

    def orphan(self) -> None:
        """Resets every client connection, and leaves its server side open and silent."""
        with self._lock:
            self._orphans.update(self._upstream)
            clients = [s for s in self._conns if s not in self._upstream]
        for s in clients:
            self._drop(s)

    def restore(self) -> None:
        self._open.set()

    def pause(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._closed = True
        self.resume()
        with self._lock:
            orphans, self._orphans = self._orphans, set()
        for s in orphans:
            self._drop(s)
        self.sever()
        self._listener.close()
