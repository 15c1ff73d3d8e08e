"""A throwaway PostgreSQL server for the tests that need a real one (distributed sweeps, MLflow on Postgres).

The session fixture `postgres` runs `initdb` in a temporary folder, starts the server on 127.0.0.1 and a free
port, creates the two databases the docker-compose stack has (`mlflow`, `optuna`) and stops and deletes it
all after the session. It depends on no system service: only on the server binaries (Debian:
`apt-get install -y --no-install-recommends postgresql`) and a Python driver (`psycopg[binary]`, in the
`dev` extra). Without them the tests that use it are skipped, with the reason.

PostgreSQL refuses to run as root; as root the server runs as the `postgres` user (created by the Debian
package) through `runuser`.
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

USER = PASSWORD = "domino"            # the same credentials as docker-compose.yml's defaults


def server_bindir() -> Path | None:
    """The folder with initdb/pg_ctl: on PATH, or Debian's /usr/lib/postgresql/<version>/bin (not on PATH)."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(on_path).resolve().parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    return Path(found[-1]).parent if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PostgresServer:
    port: int
    root: Path
    bindir: Path
    databases: list[str] = field(default_factory=list)

    def url(self, db: str, driver: str = "") -> str:
        """postgresql://… for `db`; driver="psycopg" gives postgresql+psycopg://…"""
        scheme = "postgresql+" + driver if driver else "postgresql"
        return f"{scheme}://{USER}:{PASSWORD}@127.0.0.1:{self.port}/{db}"

    def sql(self, statement: str, db: str = "postgres"):
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user=USER, password=PASSWORD, dbname=db,
                             autocommit=True) as conn:
            cur = conn.execute(statement)
            return cur.fetchall() if cur.description else None

    def create_database(self, name: str) -> str:
        """A fresh, empty database (as a new deployment has); returns its postgresql:// URL."""
        self.sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.sql(f'CREATE DATABASE "{name}"')
        self.databases.append(name)
        return self.url(name)


def _as_server_user(cmd: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return cmd
    runuser = shutil.which("runuser")
    if runuser:
        return [runuser, "-u", "postgres", "--"] + cmd
    return ["su", "postgres", "-s", "/bin/sh", "-c", " ".join(cmd)]


def _skip_reason() -> str | None:
    if server_bindir() is None:
        return ("PostgreSQL server binaries not installed (Debian: apt-get install -y --no-install-recommends "
                "postgresql); .ci/run installs them")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "no PostgreSQL driver: pip install 'psycopg[binary]' (in the dev extra)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run the server as"
    return None


@pytest.fixture(scope="session")
def postgres():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    bindir = server_bindir()
    # not under pytest's tmp_path: that is private to root (0700) and the server runs as `postgres`
    root = Path(tempfile.mkdtemp(prefix="domino-pg-"))
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(root, pw.pw_uid, pw.pw_gid)
    (root / "pw").write_text(PASSWORD + "\n")
    if os.geteuid() == 0:
        os.chown(root / "pw", pw.pw_uid, pw.pw_gid)
    data, log = root / "data", root / "server.log"
    port = free_port()
    run = dict(capture_output=True, text=True, timeout=120)
    init = subprocess.run(_as_server_user([str(bindir / "initdb"), "-D", str(data), "-U", USER,
                                           "--auth=scram-sha-256", f"--pwfile={root / 'pw'}", "-E", "UTF8",
                                           "--no-sync"]), **run)
    if init.returncode:
        shutil.rmtree(root, ignore_errors=True)
        pytest.fail(f"initdb failed: {init.stderr[-1500:]}")
    # throwaway: no fsync; enough connections for a few workers with Optuna's and MLflow's pools
    opts = f"-h 127.0.0.1 -p {port} -k {root} -c fsync=off -c full_page_writes=off -c max_connections=100"
    start = subprocess.run(_as_server_user([str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w",
                                            "-t", "60", "-o", opts, "start"]), **run)
    server = PostgresServer(port, root, bindir)
    try:
        if start.returncode:
            pytest.fail(f"pg_ctl start failed: {start.stdout[-800:]} {start.stderr[-800:]} "
                        f"{log.read_text()[-1500:] if log.exists() else ''}")
        for _ in range(50):                          # -w waits for the socket; be sure TCP answers too
            try:
                server.sql("SELECT 1")
                break
            except Exception:
                time.sleep(0.2)
        for db in ("mlflow", "optuna"):              # what docker/postgres-init creates in the compose stack
            server.create_database(db)
        yield server
    finally:
        subprocess.run(_as_server_user([str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w",
                                        "stop"]), **run)
        shutil.rmtree(root, ignore_errors=True)
