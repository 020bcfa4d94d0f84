"""Moments at which a reader outside this process may take its own figures of it.

A program that makes a run of calls on someone's behalf (the requests `serving.serve_inline` serves,
the steps of `checks.run_flat_check`) calls `mark()` before the first call and after each one.
Where nobody reads, a mark does nothing.  Where the course's grader runs the process, each mark
stops it until the grader has read, from `/proc`, how long the process has been on the CPU: the
CPU time of every call is then known outside the process, whatever the process says about itself
(a collection inside a call shows as tens of milliseconds in a call that takes one).
"""
from __future__ import annotations

__all__ = ["mark", "marked", "read_by"]

_readers: list = []        # changed in place, never rebound: gclab's names are pinned in a graded process


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
