"""A fork server: a process that imported a module's heavy dependencies once, then forks a
child for each request.

    python -I -m gclab.zygote SOCKET_FD MODULE dumpable|undumpable     (started by Zygote(MODULE))

The server runs `MODULE.preload()` once.  For each request (a JSON object and file
descriptors, passed over a Unix socket with SCM_RIGHTS) it forks a child that runs
`MODULE.forked(request, fds)` and never comes back into the server's loop; the requester
gets the child's pid and, where Linux has them, a pidfd, to wait for the child and signal it
without racing pid reuse.  Children are reaped by the kernel; nothing of one reaches the next,
since each is a fork of the same untouched server.  The server exits when the requester
closes its socket, or dies, and its children with it (`die_with_parent`).  It runs isolated
(-I): nothing in the current folder or in PYTHON* variables is imported in place of the real
modules.

Who forks from one:
- gclab.grader.launch, verdict processes (`gclab.grader.verdict`: torch, matplotlib, IPython and
  gclab imported once, about 2 s saved per submission; each shown, by `show_as`, with a JupyterLab
  kernel's command line under a server named `jupyter-lab`, as a learner's kernel is);
- gclab.serving, model servers and load generators (torch, uvicorn and starlette imported
  once, about 1.5 s saved per server, 0.15 s per load).
"""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading


class Zygote:
    """The requester's side: starts the server, asks it for children."""

    def __init__(self, module: str, env: dict | None = None, new_session: bool = True, room: int = 0,
                 flags: tuple = ()):
        """`new_session=False` keeps the server and its children in the requester's process group,
        so that whoever kills that group (a grader ending a verdict) ends them too.  `room`: the length
        the command line must have, at least, for a child to show another one in its place (`show_as`).
        `flags`: the Python's own options (`-O`); PYTHON* variables it ignores (-I)."""
        self.lock = threading.Lock()
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # a requester that may not be traced (gclab.grader.sandbox.shield) has a server that may not be either
        self.dumpable = _dumpable()
        argv = [sys.executable, "-I", *flags, "-m", "gclab.zygote", str(theirs.fileno()), module,
                "dumpable" if self.dumpable else "undumpable"]
        self.room, self.flags = room, tuple(flags)
        self.proc = subprocess.Popen(with_room(argv, room),
                                     env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                                     start_new_session=new_session)
        theirs.close()

    def fork(self, request: dict, fds: list) -> tuple[int, int | None]:
        """A child for `request`, handed `fds`: its pid and a pidfd for it (None where there is none)."""
        with self.lock:
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            reply, pidfds, _, _ = socket.recv_fds(self.sock, 4096, 1)
        if not reply:
            raise OSError("the zygote server ended")
        return int(json.loads(reply)["pid"]), (pidfds[0] if pidfds else None)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """End the server (it ends when its socket closes), and the children it forked with it."""
        self.sock.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def with_room(argv: list[str], room: int) -> list[str]:
    """`argv`, with one more argument where it is shorter than `room` bytes as /proc/PID/cmdline holds it: the
    room a process (or a child it forks) needs to show another command line of that length (`show_as`)."""
    taken = sum(len(os.fsencode(arg)) + 1 for arg in argv)
    return argv + ["-" * (room - taken - 1)] if room > taken else argv


def available() -> bool:
    """Can this platform run a zygote (Unix sockets that pass file descriptors, fork)?"""
    return hasattr(socket, "send_fds") and hasattr(os, "fork")


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when its parent ends (Linux's PR_SET_PDEATHSIG), and end it
    now if `parent` has already gone.  A grader killed mid-grading (SIGTERM, a closed terminal) runs no
    clean-up: its verdict process, in a session of its own, would otherwise run on unwatched (a
    submission that loops forever, for good).  Where there is no prctl (not Linux), only the latter."""
    prctl = getattr(_LIBC, "prctl", None)
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def show_as(args: list[str], name: str | None = None) -> bool:
    """Have the system show this process as started with the command line `args` (what
    /proc/PID/cmdline, ps and psutil read: the memory that held the real one, overwritten) and, with
    `name`, named so (/proc/PID/comm, Linux's PR_SET_NAME).  A command line longer than the real one
    does not fit: False, and nothing changes.  One shorter leaves empty arguments at its end."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
        start, end = int(fields[45]), int(fields[46])        # arg_start, arg_end (fields 48 and 49)
    except (OSError, IndexError, ValueError):
        return False
    data = b"\0".join(os.fsencode(arg) for arg in args) + b"\0"
    if len(data) > end - start or _LIBC is None:
        return False
    ctypes.memmove(start, data.ljust(end - start, b"\0"), end - start)
    if name is not None:
        _LIBC.prctl(_PR_SET_NAME, ctypes.c_char_p(os.fsencode(name)[:15]), 0, 0, 0)
    return True


def _libc():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


_LIBC = _libc() if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG, _PR_GET_DUMPABLE, _PR_SET_DUMPABLE, _PR_SET_NAME = 1, 3, 4, 15


def _dumpable() -> bool:
    """May a process of the same user trace this one (Linux's PR_GET_DUMPABLE; a fresh program may)?"""
    return _LIBC is None or _LIBC.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) == 1


def serve(sock: socket.socket, module_name: str, dumpable: bool = True) -> None:
    if not dumpable and _LIBC is not None:
        _LIBC.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)     # and so are the children, unless they say otherwise
    module = importlib.import_module(module_name)
    module.preload()
    server = os.getpid()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)       # children are reaped by the kernel
    signal.signal(signal.SIGINT, signal.SIG_IGN)        # a Ctrl-C meant for the requester
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, 65536, 4)
        except OSError:
            return
        if not data:
            return
        request = json.loads(data)
        pid = os.fork()
        if pid == 0:
            _become(sock, module, request, fds, server)
        for fd in fds:
            os.close(fd)
        pidfd = _pidfd(pid)
        socket.send_fds(sock, [json.dumps({"pid": pid}).encode()], [pidfd] if pidfd is not None else [])
        if pidfd is not None:
            os.close(pidfd)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):      # not Linux 5.3+, or the child has already gone
        return None


def _become(sock: socket.socket, module, request: dict, fds: list, server: int) -> None:
    """In the forked child: never returns into the server's loop, nor outlives the server (which
    ends when its requester does)."""
    try:
        die_with_parent(server)
        sock.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)     # KeyboardInterrupt, as in any Python
        module.forked(request, fds)
    finally:
        os._exit(0)


def main() -> int:
    serve(socket.socket(fileno=int(sys.argv[1])), sys.argv[2], dumpable=sys.argv[3] != "undumpable")
    return 0


if __name__ == "__main__":
    sys.exit(main())
