"""A throwaway PostgreSQL server for tests: `initdb` and `pg_ctl` in a temporary folder, on
a free port of loopback, stopped and deleted afterwards.

    with PostgresServer() as pg:
        url = pg.create_database("t1")      # postgresql://treadle@127.0.0.1:PORT/t1

The binaries are found on PATH, else in the distributions' folders
(/usr/lib/postgresql/<version>/bin on Debian and Ubuntu, /usr/pgsql-<version>/bin on
RHEL), or in $TREADLE_PG_BIN. PostgreSQL refuses to run as root: under root the server runs
as the `postgres` user if there is one, else as `nobody`.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

USER = "treadle"  # the database superuser initdb makes (trust authentication, loopback only)


def find_bin_dir() -> Path | None:
    """The folder holding pg_ctl and initdb, or None if PostgreSQL is not installed."""
    wanted = os.environ.get("TREADLE_PG_BIN")
    if wanted:
        return Path(wanted)
    on_path = shutil.which("pg_ctl")
    if on_path and shutil.which("initdb"):
        return Path(on_path).resolve().parent
    found = glob.glob("/usr/lib/postgresql/*/bin/pg_ctl") + glob.glob("/usr/pgsql-*/bin/pg_ctl")
    found.sort(key=lambda p: [int(x) for x in p.split("/") if x.isdigit()] or [0])
    return Path(found[-1]).parent if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    def __init__(self, bin_dir: Path | None = None):
        self.bin_dir = bin_dir or find_bin_dir()
        if self.bin_dir is None:
            raise FileNotFoundError("no PostgreSQL binaries (initdb, pg_ctl) found")
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="treadle-pg-"))
        self.data = self.root / "data"
        self.owner = _unprivileged_user() if os.geteuid() == 0 else None
        if self.owner is not None:
            os.chown(self.root, self.owner.pw_uid, self.owner.pw_gid)

    @property
    def url_prefix(self) -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}"

    def _run(self, *args: str) -> None:
        kwargs = {}
        if self.owner is not None:
            kwargs = {"user": self.owner.pw_uid, "group": self.owner.pw_gid, "extra_groups": []}
        subprocess.run(
            [str(self.bin_dir / args[0]), *args[1:]],
            check=True,
            capture_output=True,
            cwd=self.root,
            **kwargs,
        )

    def start(self) -> PostgresServer:
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            USER,
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-sync",
            "--locale=C",
        )
        # fsync off: a test database need not survive a power cut, and commits get cheap
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c max_connections=200"
        )
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-o",
            options,
            "-l",
            str(self.root / "server.log"),
            "-w",
            "-t",
            "60",
            "start",
        )
        return self

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(f"{self.url_prefix}/postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"{self.url_prefix}/{name}"

    def log(self) -> str:
        path = self.root / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _unprivileged_user() -> pwd.struct_passwd:
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError("running as root, and no postgres or nobody user to run PostgreSQL as")
