"""A throwaway PostgreSQL server for the tests of sweeps on a shared study (test_sweep_shared.py).

`PostgresServer.start()` makes a cluster with initdb in a fresh temporary folder, starts it with
pg_ctl on a free loopback port (its unix socket in that folder too: nothing of the machine's own
PostgreSQL is touched) and stops it and removes the folder on `stop()`. The server's binaries are
Debian's (`postgresql`, which `make test` installs: scripts/setup.sh --with-postgres) or any on PATH;
`find_binaries()` says why when there are none, for the tests' skip reason.

PostgreSQL refuses to run as root: under root (CI, this machine) the cluster belongs to an
unprivileged user (`postgres` where Debian's package made it, else `nobody`) and every server
command runs through `runuser -u USER --`.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from helpers import free_port, fresh_password, server_home

USER = "gputrain"  # the cluster's superuser, with PASSWORD (scram-sha-256 on TCP)


def find_binaries() -> tuple[Path | None, str]:
    """(folder of initdb/pg_ctl/postgres, "") or (None, why not)."""
    folders = [Path(p).parent for p in filter(None, [shutil.which("pg_ctl")])]
    folders += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                                        key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit() else 0,
                                        reverse=True)]
    for folder in folders:
        if all((folder / tool).exists() for tool in ("initdb", "pg_ctl", "postgres")):
            if os.geteuid() == 0 and shutil.which("runuser") is None:
                return None, "PostgreSQL refuses to run as root and runuser is missing to run it as another user"
            return folder, ""
    return None, ("no PostgreSQL server binaries (initdb, pg_ctl): install Debian's postgresql "
                  "(make test does: scripts/setup.sh --with-postgres)")


@dataclass
class PostgresServer:
    bin: Path
    folder: Path
    port: int = 0
    password: str = field(default_factory=fresh_password)
    owner: str | None = None

    @classmethod
    def start_new(cls) -> PostgresServer:
        binaries, why = find_binaries()
        if binaries is None:
            raise RuntimeError(why)
        folder, owner = server_home("gputrain-pg-", "postgres", "nobody")
        server = cls(binaries, folder, owner=owner)
        pwfile = folder / "pw"
        pwfile.write_text(server.password + "\n")
        if server.owner is not None:
            shutil.chown(pwfile, server.owner)
        server._run("initdb", "-D", str(folder / "data"), "-U", USER, "--auth=scram-sha-256", f"--pwfile={pwfile}",
                    "-E", "UTF8", "--no-sync", "--no-instructions")
        pwfile.unlink()
        for _ in range(3):  # a port taken between its choice and the start: another one
            server.port = free_port()
            try:
                server.start()
                break
            except subprocess.CalledProcessError:
                continue
        else:
            raise RuntimeError(f"PostgreSQL did not start: {(folder / 'log').read_text()[-2000:]}")
        return server

    def _run(self, tool: str, *args: str, timeout: float = 120) -> None:
        argv = [str(self.bin / tool), *args]
        if self.owner is not None:
            argv = ["runuser", "-u", self.owner, "--", *argv]
        subprocess.run(argv, check=True, capture_output=True, timeout=timeout, cwd=self.folder)

    def start(self) -> None:
        # fsync off: a test server; its data may be lost in a machine crash, never in a server restart
        options = (f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c full_page_writes=off -c max_connections=200")
        self._run("pg_ctl", "-D", str(self.folder / "data"), "-w", "-t", "60", "-l", str(self.folder / "log"),
                  "-o", options, "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.folder / "data"), "-w", "-t", "60", "-m", mode, "stop")

    def remove(self) -> None:
        try:
            self.stop("immediate")
        except subprocess.CalledProcessError:
            pass  # already stopped
        shutil.rmtree(self.folder, ignore_errors=True)

    def url(self, database: str, password: bool = True, scheme: str = "postgresql") -> str:
        secret = f":{self.password}" if password else ""
        return f"{scheme}://{USER}{secret}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh database (one per test: the tests share the server, never a study)."""
        import psycopg

        name = "sweep_" + uuid.uuid4().hex[:12]
        deadline = time.monotonic() + 30
        while True:
            try:
                with psycopg.connect(host="127.0.0.1", port=self.port, user=USER, password=self.password,
                                     dbname="postgres", autocommit=True, connect_timeout=10) as con:
                    con.execute(f'CREATE DATABASE "{name}"')
                return name
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
