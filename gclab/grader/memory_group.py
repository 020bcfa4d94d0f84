"""A memory cgroup of its own for each verdict process: the kernel's count of every page charged to it.

A process's resident figures (`gclab.procfs`: `VmRSS`, `VmHWM`) count the pages mapped into it.  A process can
move what it holds out of them and keep it: into a memfd or a file it maps shared, whose pages it then drops
from itself (`madvise(MADV_DONTNEED)`; the data stays in shared memory or the page cache, which no process's
figure counts).  Measured: lesson 04's views left in reference cycles, each batch moved so once a newer view
was made, kept test_no_cycle's 2 points while their process said passed (5/8, where the honest wrong fix gets
3/8).  A memory cgroup counts every page charged to its processes, anonymous, shared memory and page cache
alike, and the kernel keeps its peak (`memory.max_usage_in_bytes`, which writing 0 resets to the current
figure, so a peak can be read for a window).

The grader makes a group for each verdict, under its own (`gclab-verdict-<grader pid>-<random>`); the verdict
process joins it before any of the learner's code runs (`join`) and whatever it starts is born in it.  Behind
the kernel's walls (`gclab.grader.sandbox`) the cgroup file system is read-only and no capability is left, so
the learner's code can neither reset the peak nor leave; without them, a process that leaves is seen at the
next reading (`MemoryGroup.read` says None) and its test refuted.

cgroup v1's memory hierarchy only, where the grader may make a group in its own (root, or a delegated
one): elsewhere (`available()` says why not) the resident figures decide alone, and README says what they
cannot see.  GCLAB_GRADE_MEMORY_GROUP=0 makes none.
"""
from __future__ import annotations

import errno
import os
import secrets
import time

__all__ = ["MemoryGroup", "available", "join"]

HIERARCHY = "/sys/fs/cgroup/memory"
PREFIX = "gclab-verdict-"
USAGE, PEAK = "memory.usage_in_bytes", "memory.max_usage_in_bytes"


def _memory_path(pid: int | str = "self") -> str | None:
    """The path of `pid`'s memory cgroup in the v1 hierarchy (`/proc/PID/cgroup`'s "memory" line)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if "memory" in controllers.split(","):
                    return path
    except (OSError, ValueError):
        pass
    return None


def _own_folder() -> str | None:
    path = _memory_path()
    if path is None:
        return None
    folder = os.path.join(HIERARCHY, path.lstrip("/"))
    return folder if os.path.exists(os.path.join(folder, PEAK)) else None


_AVAILABLE: list = []


def available() -> str | None:
    """None where this process may make memory groups for its verdicts, else why not, in a sentence (tried
    once: a group made and removed)."""
    if os.environ.get("GCLAB_GRADE_MEMORY_GROUP") == "0":
        return "the grader was told to make none (GCLAB_GRADE_MEMORY_GROUP=0)"
    if not _AVAILABLE:
        _AVAILABLE.append(_try_one())
    return _AVAILABLE[0]


def _try_one() -> str | None:
    folder = _own_folder()
    if folder is None:
        return f"this machine has no cgroup v1 memory hierarchy at {HIERARCHY} holding this process"
    try:
        group = MemoryGroup(folder)
    except OSError as error:
        return f"a memory cgroup could not be made in {folder}: {error.strerror}"
    group.remove()
    return None


class MemoryGroup:
    """One verdict's memory cgroup, made in `parent` (this process's own group)."""

    def __init__(self, parent: str):
        _sweep(parent)
        self.path = os.path.join(parent, f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        os.mkdir(self.path)
        self.cgroup = "/" + os.path.relpath(self.path, HIERARCHY)    # as /proc/PID/cgroup names it

    @classmethod
    def made(cls) -> "MemoryGroup | None":
        """A new group for a verdict, or None where none can be made here."""
        if available() is not None:
            return None
        folder = _own_folder()
        try:
            return cls(folder) if folder else None
        except OSError:
            return None

    def read(self, pids) -> tuple[int, int] | None:
        """(bytes charged to the group now, its peak since the last reading), the peak then reset; None where
        a process of `pids` is not in the group (it left, or never joined) or the group cannot be read."""
        if any(self._outside(pid) for pid in pids):
            return None
        try:
            charged, peak = _number(os.path.join(self.path, USAGE)), _number(os.path.join(self.path, PEAK))
            with open(os.path.join(self.path, PEAK), "w") as f:
                f.write("0")
        except (OSError, ValueError):
            return None
        return charged, max(peak, charged)

    def _outside(self, pid: int) -> bool:
        """Is `pid` a running process outside the group?  One that ended is in none: /proc shows a zombie,
        not yet reaped, in the hierarchy's root, and one reaped since the session was listed not at all."""
        path = _memory_path(pid)
        return path not in (self.cgroup, None) and not _ended(pid)

    def remove(self) -> None:
        """Remove the group once its processes have ended (a process killed is gone from it once reaped)."""
        _remove(self.path, wait_s=2.0)


def join(path: str | None) -> None:
    """Move this process into the group at `path` (in the verdict process, before the learner's code runs)."""
    if not path:
        return
    try:
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    except OSError:
        pass            # the grader sees the process outside its group and reads no figure of it


def _ended(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _number(path: str) -> int:
    with open(path) as f:
        return int(f.read())


def _remove(path: str, wait_s: float) -> bool:
    end = time.monotonic() + wait_s
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError as error:
            if error.errno != errno.EBUSY or time.monotonic() >= end:
                return False
            time.sleep(0.02)


def _sweep(parent: str) -> None:
    """Remove the groups a grader that ended left behind (killed before it removed them)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(PREFIX):
            continue
        grader = name[len(PREFIX):].split("-", 1)[0]
        if grader.isdigit() and not os.path.exists(f"/proc/{grader}"):
            _remove(os.path.join(parent, name), wait_s=0)
