"""A real PostgreSQL server for the tests, in a temporary folder of its own.

Debian's server binaries (package `postgresql`) are in /usr/lib/postgresql/VERSION/bin/.
initdb refuses to run as root, so as root the server runs as the `postgres` user that the
package creates (through runuser), in a folder owned by it.  It listens on 127.0.0.1 only,
on a free port, with `trust` authentication and fsync off: a throw-away gradebook.

Without the binaries a test that needs the server is skipped, unless GCLAB_REQUIRE_POSTGRES=1
(CI sets it, and .ci/run installs the package): then it fails.
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

REQUIRE = "GCLAB_REQUIRE_POSTGRES"
TOOLS = ("initdb", "pg_ctl", "postgres", "createdb")


class Unavailable(Exception):
    """No PostgreSQL server can be started here (and that is not a failure)."""


def bin_dir() -> Path:
    """The newest /usr/lib/postgresql/VERSION/bin that has the server's tools."""
    found = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")]
    found = [d for d in found if all((d / tool).is_file() for tool in TOOLS)]
    if not found:
        raise Unavailable("no PostgreSQL server in /usr/lib/postgresql/*/bin/ "
                          "(Debian: apt-get install postgresql)")
    return max(found, key=lambda d: float(d.parent.name) if d.parent.name.replace(".", "").isdigit() else 0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(cmd, cwd: Path) -> None:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({done.returncode}):\n{done.stdout}{done.stderr}")


class Server:
    def __init__(self, bindir: Path, folder: Path, port: int, run_as: list[str]):
        self.bindir, self.folder, self.port, self.run_as = bindir, folder, port, run_as

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A new, empty database; its SQLAlchemy URL."""
        _run([self.bindir / "createdb", "-h", "127.0.0.1", "-p", self.port, "-U", "postgres", name], self.folder)
        return self.url(name)

    def stop(self) -> None:
        try:
            _run(self.run_as + [self.bindir / "pg_ctl", "-D", self.folder / "data", "-m", "immediate", "-w", "stop"],
                 self.folder)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def start() -> Server:
    """Initialise a cluster in a new temporary folder and start its server."""
    bindir = bin_dir()
    run_as = []
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            raise Unavailable("running as root and no `postgres` user to run the server as") from None
        run_as = ["runuser", "-u", "postgres", "--"]
    folder = Path(tempfile.mkdtemp(prefix="gclab-postgres-"))
    if run_as:
        os.chown(folder, user.pw_uid, user.pw_gid)
    try:
        _run(run_as + [bindir / "initdb", "-D", folder / "data", "-U", "postgres", "-A", "trust",
                       "-E", "UTF8", "--locale=C", "--no-sync"], folder)
        for attempt in range(3):        # the free port may be taken before the server binds it
            port = _free_port()
            options = f"-h 127.0.0.1 -p {port} -k {folder} -F -c synchronous_commit=off -c full_page_writes=off"
            try:
                _run(run_as + [bindir / "pg_ctl", "-D", folder / "data", "-l", folder / "server.log",
                               "-o", options, "-w", "-t", "60", "start"], folder)
                return Server(bindir, folder, port, run_as)
            except RuntimeError:
                if attempt == 2:
                    raise
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


@contextmanager
def running():
    """A started server, stopped at the end; a skip where none can start (a failure with
    GCLAB_REQUIRE_POSTGRES=1)."""
    try:
        server = start()
    except Unavailable as why:
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{why}, and {REQUIRE}=1 requires it", pytrace=False)
        pytest.skip(f"{why}; set {REQUIRE}=1 to fail instead")
    try:
        yield server
    finally:
        server.stop()
