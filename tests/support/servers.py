"""Private RabbitMQ and PostgreSQL servers for fault tests and the chaos run.

Fault tests never stop, kill or restart the machine's shared servers: they start
their own, on free ports, with their own data directories, and kill those by pid.

* `RabbitNode`: one RabbitMQ node from the package's own `sbin/` scripts (Debian's
  `/usr/sbin` wrappers would use the shared node's environment), with its own node
  name, ports, config file, empty env file and HOME (the Erlang cookie).
  `restart()` is a clean stop and start, `kill()` a SIGKILL of the Erlang VM,
  `start()` brings it back on the same data (durable queues and messages survive),
  `freeze()`/`thaw()` stop and continue it (SIGSTOP: no socket closes).
* `RabbitCluster`: three such nodes sharing a cookie, joined into one cluster.
* `PostgresServer`: one PostgreSQL cluster (`initdb`, run as the `postgres` user
  when we are root), `kill()` SIGKILLs the postmaster and its backends, `start()`
  recovers from the crash.
* `PgBouncer`: a PgBouncer in front of a PostgreSQL server, in session or transaction mode.

All clean up after themselves (`stop()`, and at interpreter exit).
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from tests.support.processes import free_port

_RABBIT_SBIN = sorted(glob.glob("/usr/lib/rabbitmq/lib/rabbitmq_server-*/sbin"))
_PG_BIN = sorted(glob.glob("/usr/lib/postgresql/*/bin"))


def rabbitmq_available() -> bool:
    return bool(_RABBIT_SBIN)


def postgres_available() -> bool:
    return bool(_PG_BIN)


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _wait_port(port: int, timeout: float, up: bool = True) -> None:
    deadline = time.monotonic() + timeout
    while _port_open(port) != up:
        if time.monotonic() > deadline:
            raise TimeoutError(f"port {port} not {'open' if up else 'closed'} after {timeout}s")
        time.sleep(0.1)


def _children(pid: int) -> list[int]:
    """Every descendant of `pid`, from /proc (our own processes only, by pid)."""
    found: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        found.setdefault(ppid, []).append(int(entry.name))
    result, todo = [], [pid]
    while todo:
        for child in found.get(todo.pop(), []):
            result.append(child)
            todo.append(child)
    return result


def _kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """`sig` (SIGKILL, SIGSTOP or SIGCONT) to `pid` and every descendant. For the first two
    the tree is stopped first, a process at a time until a listing finds none left running:
    a process that forks while its children are listed (a postmaster under load) would
    otherwise leave a child out, alive after a SIGKILL, and a PostgreSQL backend left holding
    the cluster's shared memory keeps it from starting again."""
    if sig == signal.SIGCONT:  # a stopped tree forks nothing: one listing is all of it
        members = [pid, *_children(pid)]
    else:
        members = _stopped_tree(pid)
    if sig != signal.SIGSTOP:
        for member in members:
            _signal(member, sig)


def _stopped_tree(pid: int) -> list[int]:
    """Each member is listed again once seen stopped (a fork under way has then finished)."""
    stopped: list[int] = []
    while fresh := [m for m in [pid, *_children(pid)] if m not in stopped]:
        for member in fresh:
            _signal(member, signal.SIGSTOP)
        deadline = time.monotonic() + 2.0
        while any(_state(m) not in ("T", "t", "Z", "") for m in fresh):
            if time.monotonic() > deadline:
                break
            time.sleep(0.001)
        stopped += fresh
    return stopped


def _state(pid: int) -> str:
    """A process's state letter from /proc ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


class RabbitNode:
    def __init__(
        self,
        base: Path | None = None,
        cookie: str | None = None,
        config: str = "",
        rabbit_env: str = "",
    ) -> None:
        """`config` is added to rabbitmq.conf; `rabbit_env` is Erlang terms for the `rabbit`
        application's environment in advanced.config (settings rabbitmq.conf has no key for),
        e.g. `{dead_letter_worker_publisher_confirm_timeout, 1000}`."""
        if not _RABBIT_SBIN:
            raise RuntimeError("rabbitmq-server is not installed")
        self.sbin = Path(_RABBIT_SBIN[-1])
        self.base = base or Path(tempfile.mkdtemp(prefix="conveyor-rabbit-"))
        self.name = f"conveyor-{uuid.uuid4().hex[:8]}@localhost"
        self.port = free_port()
        self.dist_port = free_port()
        home = self.base / "home"
        home.mkdir(parents=True, exist_ok=True)
        (home / ".erlang.cookie").write_text(cookie or uuid.uuid4().hex)
        (home / ".erlang.cookie").chmod(0o400)
        (self.base / "empty.env").write_text("")
        (self.base / "enabled_plugins").write_text("[].\n")
        (self.base / "advanced.config").write_text(f"[{{rabbit, [{rabbit_env}]}}].\n")
        (self.base / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\nloopback_users = none\n{config}"
        )
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.base / "log"),
            "RABBITMQ_CONF_ENV_FILE": str(self.base / "empty.env"),
            "RABBITMQ_CONFIG_FILE": str(self.base / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.base / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.base / "enabled_plugins"),
            # A frozen or killed peer is noticed in seconds, not a minute.
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel net_ticktime 10",
        }
        self._proc: subprocess.Popen[bytes] | None = None
        atexit.register(self.stop)

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    @property
    def pid(self) -> int | None:
        """The Erlang VM's pid (the server script's child)."""
        if self._proc is None or self._proc.poll() is not None:
            return None
        beams = [p for p in _children(self._proc.pid) if _comm(p) == "beam.smp"]
        return beams[0] if beams else None

    def start(self, timeout: float = 90.0, wait: bool = True) -> RabbitNode:
        log = open(self.base / "server.out", "ab")
        self._proc = subprocess.Popen(
            [str(self.sbin / "rabbitmq-server")],
            env=self.env,
            cwd=self.base,  # an Erlang crash dump lands here, not in the caller's folder
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        if wait:
            self.wait(timeout)
        return self

    def wait(self, timeout: float = 90.0) -> None:
        try:
            _wait_port(self.port, timeout)  # the AMQP listener opens last, once the node booted
        except TimeoutError as exc:
            out = self.base / "server.out"
            tail = out.read_text(errors="replace")[-2000:] if out.exists() else ""
            raise TimeoutError(f"{exc}; {self.name} said:\n{tail}") from None

    def freeze(self) -> None:
        """SIGSTOP: the node holds its sockets open and answers nothing."""
        if self._proc is not None:
            _kill_tree(self._proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        if self._proc is not None:
            _kill_tree(self._proc.pid, signal.SIGCONT)

    def ctl(self, *args: str, timeout: float = 60.0, tool: str = "rabbitmqctl") -> str:
        """`tool` (rabbitmqctl, rabbitmq-diagnostics…) run against this node; its output, or
        RuntimeError when it fails."""
        done = subprocess.run(
            [str(self.sbin / tool), "-n", self.name, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)}: {done.stderr[-500:]}")
        return done.stdout

    def kill(self) -> None:
        """SIGKILL: no socket is closed cleanly, nothing is flushed."""
        if self._proc is not None:
            _kill_tree(self._proc.pid)
            self._proc.wait(timeout=30)
            self._proc = None
        _wait_port(self.port, 30, up=False)

    def restart(self, down_for: float = 1.0) -> None:
        """A clean stop_app / start_app: every connection drops, the VM stays."""
        self.ctl("stop_app")
        time.sleep(down_for)
        self.ctl("start_app")
        _wait_port(self.port, 60)

    def stop(self) -> None:
        if self._proc is not None:
            _kill_tree(self._proc.pid)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            self._proc = None
        shutil.rmtree(self.base, ignore_errors=True)


class RabbitCluster:
    """`size` private nodes joined into one cluster; `urls` is the `;`-separated node list."""

    def __init__(self, size: int = 3) -> None:
        cookie = uuid.uuid4().hex
        # A node back from a freeze finds itself partitioned from the others: `autoheal`
        # restarts it into the cluster (about a minute here). With the default, `ignore`, it
        # would carry on with a view of its own; `pause_minority` did not pause it (3.10).
        config = "cluster_partition_handling = autoheal\n"
        self.nodes = [RabbitNode(cookie=cookie, config=config) for _ in range(size)]

    @property
    def urls(self) -> str:
        return ";".join(node.url for node in self.nodes)

    def start(self, timeout: float = 120.0) -> RabbitCluster:
        for node in self.nodes:
            node.start(wait=False)
        for node in self.nodes:
            node.wait(timeout)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            node.ctl("stop_app")
            node.ctl("join_cluster", first.name)
            node.ctl("start_app")
            node.wait(timeout)
        return self

    def wait_healthy(self, timeout: float = 120.0) -> None:
        """Until every node runs, sees all the others and reports no partition (a node back
        from a freeze or a crash may take a while to be told it had left), and no node is
        critical to a quorum queue's quorum: the members on a node back from a freeze are
        online again. Without that, a fault right after took a queue's quorum away (its
        publishes refused until the node came back), which is two faults at once."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if all(self._healthy(node) for node in self.nodes):
                    return
            except (RuntimeError, ValueError, subprocess.TimeoutExpired):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not healthy after {timeout}s")
            time.sleep(1.0)

    def _healthy(self, node: RabbitNode) -> bool:
        status = json.loads(node.ctl("cluster_status", "--formatter", "json", timeout=15))
        running = set(status.get("running_nodes") or [])
        if running != {n.name for n in self.nodes} or status.get("partitions"):
            return False
        # fails (RuntimeError) while some quorum queue would lose its quorum without this node
        node.ctl("check_if_node_is_quorum_critical", tool="rabbitmq-diagnostics", timeout=15)
        return True

    def node_of(self, name: str) -> RabbitNode:
        """The node of an Erlang node name as `rabbitmqctl` prints it."""
        return next(node for node in self.nodes if node.name == name)

    def leader(self, queue: str) -> RabbitNode:
        """The node that leads a quorum queue now (asked of any node that answers)."""
        for node in self.nodes:
            if node.pid is None:
                continue
            try:
                listing = node.ctl("list_queues", "name", "leader", "--no-table-headers", "-q")
            except RuntimeError:
                continue
            for line in listing.splitlines():
                name, _, leader = line.strip().partition("\t")
                if name == queue and leader.strip():
                    return self.node_of(leader.strip())
        raise LookupError(f"no leader for {queue}")

    def stop(self) -> None:
        for node in self.nodes:
            node.thaw()
            node.stop()


class PostgresServer:
    def __init__(self, primary: PostgresServer | None = None) -> None:
        """A new cluster (`initdb`), or with `primary` a streaming standby of it."""
        if not _PG_BIN:
            raise RuntimeError("PostgreSQL is not installed")
        self.bin = Path(_PG_BIN[-1])
        self.base = Path(tempfile.mkdtemp(prefix="conveyor-pg-"))
        self.data = self.base / "data"
        self.port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self._as_user: list[str] = []
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            shutil.chown(self.base, "postgres", "postgres")
            self._as_user = ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]
        if primary is None:
            command = ["initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync"]
        else:  # a copy of the primary that follows it (-R: standby.signal, primary_conninfo)
            command = ["pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.port), "-U"]
            command += ["postgres", "-D", str(self.data), "-R", "-X", "stream", "--no-sync"]
        subprocess.run(
            [*self._as_user, str(self.bin / command[0]), *command[1:]],
            check=True,
            capture_output=True,
            timeout=120,
        )
        atexit.register(self.stop)

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None or self._proc.poll() is not None else self._proc.pid

    def start(self, timeout: float = 60.0) -> PostgresServer:
        log = open(self.base / "server.out", "ab")
        self._proc = subprocess.Popen(
            [
                *self._as_user,
                str(self.bin / "postgres"),
                "-D",
                str(self.data),
                "-p",
                str(self.port),
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                f"unix_socket_directories={self.base}",
                "-c",
                "max_connections=200",
                "-c",
                "fsync=on",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        _wait_port(self.port, timeout)
        self._wait_accepting(timeout)
        return self

    def _wait_accepting(self, timeout: float) -> None:
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.admin_url, connect_timeout=2):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def sql(self, statement: str) -> None:
        import psycopg

        with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=5) as conn:
            conn.execute(statement)

    def synchronous(self) -> None:
        """Commits wait for a standby to have them (the no-loss setting of SPEC §11.7)."""
        self.sql("ALTER SYSTEM SET synchronous_standby_names = '*'")
        self.sql("SELECT pg_reload_conf()")

    def promote(self) -> None:
        """The standby becomes a primary and accepts writes."""
        self.sql("SELECT pg_promote(wait => true)")

    def kill(self) -> None:
        """SIGKILL of the postmaster and its backends: a crash, recovered at the next start."""
        if self._proc is not None:
            _kill_tree(self._proc.pid)
            self._proc.wait(timeout=30)
            self._proc = None
        _wait_port(self.port, 30, up=False)

    def shut_down(self) -> None:
        """A fast shutdown (SIGINT): sessions end, the data is left consistent."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGINT)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _kill_tree(self._proc.pid)
            self._proc = None

    def stop(self) -> None:
        self.shut_down()
        shutil.rmtree(self.base, ignore_errors=True)


class PgBouncer:
    """PgBouncer in `mode` (session, transaction) in front of the server of `database_url`,
    which every database name reaches; `url(database_url)` is that URL through it. Run as
    the `postgres` user when we are root (it refuses root)."""

    def __init__(self, database_url: str, mode: str) -> None:
        from urllib.parse import urlsplit

        found = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")
        if not found:
            raise RuntimeError("pgbouncer is not installed")
        server = urlsplit(database_url)
        self.user = server.username or "postgres"
        self.base = Path(tempfile.mkdtemp(prefix="conveyor-pgbouncer-"))
        self.port = free_port()
        (self.base / "users.txt").write_text(f'"{self.user}" "{server.password or ""}"\n')
        (self.base / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={server.hostname or '127.0.0.1'} port={server.port or 5432}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {self.base / 'users.txt'}\npool_mode = {mode}\n"
            f"max_client_conn = 200\ndefault_pool_size = 20\nlogfile = {self.base / 'log'}\n"
        )
        command = [found, str(self.base / "pgbouncer.ini")]
        if os.geteuid() == 0:
            shutil.chown(self.base, "postgres", "postgres")
            for path in self.base.iterdir():
                shutil.chown(path, "postgres", "postgres")
            command[1:1] = ["-u", "postgres"]
        self._proc = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True
        )
        atexit.register(self.stop)
        _wait_port(self.port, 30)

    def url(self, database_url: str) -> str:
        from urllib.parse import urlsplit, urlunsplit

        parts = urlsplit(database_url)
        return urlunsplit(parts._replace(netloc=f"{self.user}@127.0.0.1:{self.port}"))

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        shutil.rmtree(self.base, ignore_errors=True)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
