"""Starting model servers and load generators: the `python -m gclab.serving` command, and a zygote.

Each server or load generator is a process of its own, forked from this process's zygote
(`gclab.zygote`, which imported torch and uvicorn and built the usual heap once: half a second of CPU
saved per server), or, where there cannot be one (GCLAB_SERVING_FORK=0, no pidfds), a fresh isolated
Python.  Either way it runs as `python -m gclab.serving serve|load ARGV...` would.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import weakref

from ..environment import starting_environment
from .load import load_main
from .server import ATTRIBUTION, HEAP_OBJECTS, _PREBUILT_HEAPS, long_lived_heap, serve

def _python_module(module: str, *args: str) -> list[str]:
    """The command that runs `module` in a fresh, isolated Python (-I): neither the current folder
    nor PYTHON* variables reach its sys.path, so a `uvicorn.py` or `gclab/` that the learner's code
    wrote beside its notebook is never imported in place of the real one."""
    return [sys.executable, "-I", "-m", module, *args]


def preload() -> None:
    """What a server and a load generator import, and the usual long-lived heap, built once
    (gclab.zygote forks them after this: half a second of CPU saved per server)."""
    import starlette.applications  # noqa: F401
    import starlette.responses  # noqa: F401
    import starlette.routing  # noqa: F401
    import torch  # noqa: F401
    import uvicorn  # noqa: F401
    import uvicorn.lifespan.off  # noqa: F401
    import uvicorn.loops.asyncio  # noqa: F401
    import uvicorn.protocols.http.h11_impl  # noqa: F401
    _PREBUILT_HEAPS[HEAP_OBJECTS] = long_lived_heap(HEAP_OBJECTS)


def forked(request: dict, fds: list) -> None:
    """In a child of the zygote: run `python -m gclab.serving ARGV...` as if started so (this
    module is __main__), its stdout and stderr the requester's."""
    import traceback
    stdout, stderr = fds
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.modules["__main__"] = sys.modules[__package__]      # gclab.serving, as `python -m gclab.serving` has it
    try:
        main(request["argv"])
    except BaseException:              # SystemExit included: the same message a fresh Python prints
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


_ZYGOTE: list = []
_ZYGOTE_LOCK = threading.Lock()
_RETIRED: list = []         # zygotes started before this process's dumpability changed: their servers run on


def _zygote():
    """This process's serving zygote, started on first use, and again where this process's dumpability changed
    since (its servers are as traceable as the process that asks for them); None where there cannot be one
    (no pidfds: not Linux), or with GCLAB_SERVING_FORK=0 (each server a fresh Python)."""
    from .. import zygote
    if (os.environ.get("GCLAB_SERVING_FORK") == "0" or not zygote.available()
            or not hasattr(os, "pidfd_open") or not hasattr(signal, "pidfd_send_signal")):
        return None
    with _ZYGOTE_LOCK:
        if _ZYGOTE and _ZYGOTE[0].alive() and _ZYGOTE[0].dumpable != zygote._dumpable():
            # its servers would be as traceable as this process was (sandbox.shield), not as it is now
            _RETIRED.append(_ZYGOTE.pop())
        if not _ZYGOTE or not _ZYGOTE[0].alive():
            _ZYGOTE[:] = [zygote.Zygote("gclab.serving", env=starting_environment(), new_session=False)]
        return _ZYGOTE[0]


def prestart() -> None:
    """Start this process's zygote now, in the background (it imports torch and uvicorn, a couple
    of seconds of CPU), so that the first servers started later do not wait for it."""
    _zygote()


class _ForkedProcess:
    """A server or load generator forked by the zygote: what ModelServer needs of a Popen,
    through a pidfd (its exit status went to the zygote, which reaped it)."""

    def __init__(self, pid: int, pidfd: int, stdout):
        self.pid, self.stdout, self.returncode = pid, stdout, None
        self._pidfd = pidfd
        self._closer = weakref.finalize(self, os.close, pidfd)

    def wait(self, timeout: float | None = None):
        if self.returncode is None:
            if not select.select([self._pidfd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"gclab.serving (pid {self.pid})", timeout)
            self.returncode = 0
        return self.returncode

    def poll(self):
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, number: int) -> None:
        if self.poll() is None:
            try:
                signal.pidfd_send_signal(self._pidfd, number)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _spawn(argv: list[str], stderr):
    """`python -m gclab.serving ARGV...`, stdout a pipe read as text, stderr the file `stderr`:
    forked from this process's zygote where there is one, else a fresh isolated Python."""
    zygote = _zygote()
    if zygote is not None:
        # a fork is a new process: the guard's rule on them holds for the learner's code here too
        sys.audit("subprocess.Popen", sys.executable, argv, None, None)
        read, write = os.pipe()
        try:
            pid, pidfd = zygote.fork({"argv": argv}, [write, stderr.fileno()])
        except OSError:
            os.close(read)
        else:
            if pidfd is not None:
                return _ForkedProcess(pid, pidfd, os.fdopen(read, "r"))
            os.close(read)
        finally:
            os.close(write)
    return subprocess.Popen(_python_module("gclab.serving", *argv), stdout=subprocess.PIPE, stderr=stderr,
                            text=True, env=starting_environment())


def _kill(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def main(argv=None) -> int:
    args = main_parser().parse_args(argv)
    if args.command == "serve":
        serve(args.heap_objects, args.attribution, args.policy, args.device, args.cache_size, args.idle_after,
              args.device_ms, args.workdir)
    else:
        if args.network_of:
            join_network_of(args.network_of)
        load_main(args.url, args.rate, args.count, args.poisson, args.seed, args.timeout, args.burst, args.lull,
                  args.watch_cpu)
    return 0


def join_network_of(pid: int) -> None:
    """Join the network namespace of process `pid` (a model server walled in by the grader, whose 127.0.0.1
    is its own), so that the load reaches it: through its user namespace first where this process has no
    capability over the machine's (the user who made that namespace has every one in it).  Linux's setns,
    while this process has one thread."""
    if os.stat("/proc/self/ns/net").st_ino == os.stat(f"/proc/{pid}/ns/net").st_ino:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for name, kind in ([("user", 0x10000000)] if os.geteuid() != 0 else []) + [("net", 0x40000000)]:
        handle = os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY)
        try:
            if libc.setns(handle, kind) != 0:
                code = ctypes.get_errno()
                raise OSError(code, f"joining the server's {name} namespace: {os.strerror(code)}")
        finally:
            os.close(handle)


def main_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gclab.serving")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--heap-objects", type=int, default=HEAP_OBJECTS)
    s.add_argument("--attribution", choices=ATTRIBUTION, default="off")
    s.add_argument("--policy")
    s.add_argument("--workdir", help="the folder the policy may write to (default: a new temporary one)")
    s.add_argument("--device", default="cpu")
    s.add_argument("--cache-size", type=int, default=100)
    s.add_argument("--idle-after", type=float, default=0.01)
    s.add_argument("--device-ms", type=float, default=5.0)
    c = sub.add_parser("load")
    c.add_argument("url")
    c.add_argument("--rate", type=float, required=True)
    c.add_argument("--count", type=int, required=True)
    c.add_argument("--poisson", action="store_true")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--timeout", type=float, default=60)
    c.add_argument("--burst", type=int, default=0)
    c.add_argument("--lull", type=float, default=0.0)
    c.add_argument("--watch-cpu", type=int, help="a process whose CPU time to read at each request sent and answered")
    c.add_argument("--network-of", type=int, help="a process whose network namespace to send the load in")
    return parser
