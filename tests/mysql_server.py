"""A throwaway MySQL server (MariaDB) for the tests of sweeps on a shared study (test_sweep_shared.py).

`MysqlServer.start_new()` makes a data folder with mariadb-install-db in a fresh temporary folder, starts
mariadbd on a free loopback port (its unix socket and pid file in that folder too: nothing of the
machine's own MySQL is touched), makes the user USER with a fresh password, and stops it and removes
the folder on `remove()`. The binaries are Debian's `mariadb-server` (which `make test` installs:
scripts/setup.sh --with-mysql) or any on PATH; `find_binaries()` says why when there are none.

Under root (CI, this machine) the server runs as an unprivileged user (`mysql` where Debian's package
made it, else `nobody`): mariadbd drops to it itself (--user) and owns the folder.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from helpers import free_port, fresh_password, server_home

USER = "gputrain"  # the sweeps' user, with PASSWORD (over TCP)
_SEARCH = [None, "/usr/sbin", "/usr/bin", "/usr/local/mysql/bin"]  # None: PATH


def _which(*names: str) -> Path | None:
    for folder in _SEARCH:
        for name in names:
            found = shutil.which(name, path=folder)
            if found:
                return Path(found)
    return None


def find_binaries() -> tuple[tuple[Path, Path, Path] | None, str]:
    """((server, install-db, client), "") or (None, why not)."""
    server, install, client = _which("mariadbd", "mysqld"), _which("mariadb-install-db", "mysql_install_db"), \
        _which("mariadb", "mysql")
    if server is None or install is None or client is None:
        return None, ("no MySQL server binaries (mariadbd, mariadb-install-db, mariadb): install Debian's "
                      "mariadb-server (make test does: scripts/setup.sh --with-mysql)")
    return (server, install, client), ""


@dataclass
class MysqlServer:
    server: Path
    install: Path
    client: Path
    folder: Path
    port: int = 0
    password: str = field(default_factory=fresh_password)
    owner: str | None = None
    process: subprocess.Popen | None = None

    @classmethod
    def start_new(cls) -> MysqlServer:
        binaries, why = find_binaries()
        if binaries is None:
            raise RuntimeError(why)
        folder, owner = server_home("gputrain-mysql-", "mysql", "nobody")
        server = cls(*binaries, folder, owner=owner)
        user = [f"--user={server.owner}"] if server.owner else []
        subprocess.run([str(server.install), "--no-defaults", f"--datadir={folder / 'data'}", *user,
                        "--auth-root-authentication-method=normal", "--skip-test-db"],
                       check=True, capture_output=True, timeout=120, cwd=folder)
        for _ in range(3):  # a port taken between its choice and the start: another one
            server.port = free_port()
            if server.start():
                break
        else:
            raise RuntimeError(f"MariaDB did not start: {(folder / 'error.log').read_text()[-2000:]}")
        server.sql(f"CREATE USER '{USER}'@'%' IDENTIFIED BY '{server.password}'; "
                   f"GRANT ALL PRIVILEGES ON *.* TO '{USER}'@'%'; FLUSH PRIVILEGES;")
        return server

    def start(self) -> bool:
        """Start mariadbd; whether it answers within 60 s."""
        user = [f"--user={self.owner}"] if self.owner else []
        # no binary log and no flush at each commit: a test server (its data may be lost in a machine
        # crash, never in a server restart)
        self.process = subprocess.Popen(
            [str(self.server), "--no-defaults", f"--datadir={self.folder / 'data'}", *user,
             f"--socket={self.folder / 'sock'}", f"--port={self.port}", "--bind-address=127.0.0.1",
             "--skip-name-resolve", f"--pid-file={self.folder / 'pid'}", f"--log-error={self.folder / 'error.log'}",
             "--innodb-flush-log-at-trx-commit=0", "--skip-log-bin", "--max-connections=200"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.folder)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            if subprocess.run([str(self.client), "--no-defaults", f"--socket={self.folder / 'sock'}", "-u", "root",
                               "-e", "SELECT 1"], capture_output=True, timeout=30).returncode == 0:
                return True
            time.sleep(0.3)
        return False

    def sql(self, statements: str) -> None:
        """Run SQL as the server's root, over its socket."""
        subprocess.run([str(self.client), "--no-defaults", f"--socket={self.folder / 'sock'}", "-u", "root", "-e",
                        statements], check=True, capture_output=True, timeout=60)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def url(self, database: str, password: bool = True) -> str:
        secret = f":{self.password}" if password else ""
        return f"mysql://{USER}{secret}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh database (one per test: the tests share the server, never a study)."""
        name = "sweep_" + uuid.uuid4().hex[:12]
        self.sql(f"CREATE DATABASE `{name}`")
        return name
