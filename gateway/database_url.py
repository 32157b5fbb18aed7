"""CONVEYOR_DATABASE_URL as each library reads it, hosts and options intact.

Users write one URL (or a libpq `key=value` conninfo), possibly naming several hosts in
libpq's way
(`postgresql+psycopg://u:p@/conveyor?host=pg-a,pg-b&port=5432,5432&target_session_attrs=read-write`).
psycopg reads it as libpq does; a change of database goes through a URL parser, never
string surgery, so the query string (the host list) survives.
"""

from __future__ import annotations

from urllib.parse import quote, urlsplit, urlunsplit

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from conveyor.settings import normalize_database_url


def libpq(database_url: str) -> str:
    """The URL as libpq (psycopg) reads it: its own scheme, the rest unchanged."""
    if not _is_url(database_url):
        return database_url
    parts = urlsplit(normalize_database_url(database_url))
    return urlunsplit(parts._replace(scheme="postgresql"))


def with_database(database_url: str, name: str) -> str:
    """The same server(s) and options, another database."""
    if not _is_url(database_url):
        return make_conninfo(database_url, dbname=name)
    parts = urlsplit(normalize_database_url(database_url))
    return urlunsplit(parts._replace(path="/" + quote(name, safe="")))


def database_name(database_url: str) -> str:
    return str(conninfo_to_dict(libpq(database_url)).get("dbname") or "")


def _is_url(database_url: str) -> bool:
    return "://" in database_url
