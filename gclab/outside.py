"""Moments at which a reader outside this process may take its own figures of it.

A program that makes a run of calls on someone's behalf (the requests `serving.serve_inline` serves,
the steps of `checks.run_flat_check`) calls `mark()` before the first call and after each one.
Where nobody reads, a mark does nothing.  Where the course's grader runs the process, each mark
stops it until the grader has read, from `/proc`, how long the process has been on the CPU: the
CPU time of every call is then known outside the process, whatever the process says about itself
(a collection inside a call shows as tens of milliseconds in a call that takes one).

A program that sends a load to a server of its own (`serving.run_load`) asks `load()` first: where
the grader runs the process, the grader sends that load itself, from a process of its own, reading
the server's CPU time at every request sent and every answer, and hands back what it saw.
"""
from __future__ import annotations

__all__ = ["load", "loads_by", "mark", "marked", "read_by"]

_readers: list = []        # changed in place, never rebound: gclab's names are pinned in a graded process
_loaders: list = []


def mark() -> None:
    """The boundary of a call: before the first of a run, after each one."""
    for reader in _readers:
        reader()


def read_by(reader) -> None:
    """Call `reader()` at every mark from now on (None: nobody reads)."""
    _readers[:] = [] if reader is None else [reader]


def marked(function):
    """`function`, each call of it marked (the run's first mark is made now)."""
    mark()

    def call(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        finally:
            mark()
    return call


def load(argv: list, server_pid: int):
    """The rows of a load (`python -m gclab.serving load` arguments `argv`) that a reader outside
    sent to the server process `server_pid`; None where no one outside sends loads."""
    for loader in _loaders:
        return loader(argv, server_pid)
    return None


def loads_by(loader) -> None:
    """Send every load through `loader(argv, server_pid)` from now on (None: each program sends its own)."""
    _loaders[:] = [] if loader is None else [loader]
