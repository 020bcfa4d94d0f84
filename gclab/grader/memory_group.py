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

cgroup v1's memory hierarchy, where the grader may make a group in its own (root, or a delegated one), or
cgroup v2's (`memory.current`, `memory.peak`), in the nearest group at or above its own whose children have
the memory controller (at the root, where it may, the grader enables it), where it may make one (root, or
a delegated subtree: a systemd user service with `Delegate=yes`, or the scope of the user's own systemd manager
that `in_a_user_scope` gives a grader that can make none where it is).  From Linux 6.12 a v2 peak is reset for
the descriptor that writes to it, which the grader keeps; before, a window's peak is the group's peak where
that rose in the window, else the larger of the charges at its two ends: never more than the window's own,
and memory held at the window's end always shows.  Elsewhere (`available()` says why not) the resident figures decide alone, and README says what
they cannot see.  GCLAB_GRADE_MEMORY_GROUP=0 makes none.
"""
from __future__ import annotations

import dataclasses
import errno
import functools
import os
import secrets
import shutil
import subprocess
import sys
import time

__all__ = ["MemoryGroup", "available", "in_a_user_scope", "join"]

V1_HIERARCHY = "/sys/fs/cgroup/memory"
PREFIX = "gclab-verdict-"


@dataclasses.dataclass(frozen=True)
class Hierarchy:
    """The cgroup hierarchy that holds the memory controller: where it is mounted and its files' names."""
    mount: str
    version: int
    usage: str
    peak: str                   # cgroup v2's is absent before Linux 5.19: the charges alone are read there

    def folder(self, path: str) -> str:
        return os.path.normpath(os.path.join(self.mount, path.lstrip("/")))

    def path(self, folder: str) -> str:
        """`folder` as /proc/PID/cgroup names it."""
        relative = os.path.relpath(folder, self.mount)
        return "/" if relative == "." else "/" + relative


@functools.cache
def hierarchy() -> Hierarchy | None:
    """The memory controller's hierarchy on this machine: cgroup v1's where it has one, else cgroup v2's where
    the memory controller is there; None where neither."""
    if os.path.exists(os.path.join(V1_HIERARCHY, "memory.max_usage_in_bytes")):
        return Hierarchy(V1_HIERARCHY, 1, "memory.usage_in_bytes", "memory.max_usage_in_bytes")
    mount = _cgroup2_mount()
    if mount is None or "memory" not in _words(os.path.join(mount, "cgroup.controllers")):
        return None
    return Hierarchy(mount, 2, "memory.current", "memory.peak")


def _cgroup2_mount() -> str | None:
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if fields[fields.index("-") + 1] == "cgroup2":
                    return fields[4]
    except (OSError, ValueError, IndexError):
        pass
    return None


def _words(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().split()
    except OSError:
        return []


def _memory_path(pid: int | str = "self") -> str | None:
    """`pid`'s group in the memory controller's hierarchy (`/proc/PID/cgroup`: v1's "memory" line, or v2's "0::")."""
    where = hierarchy()
    if where is None:
        return None
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                number, controllers, path = line.rstrip("\n").split(":", 2)
                if (where.version == 1 and "memory" in controllers.split(",")) or (where.version == 2 and number == "0"):
                    return path
    except (OSError, ValueError):
        pass
    return None


def _parent_folder() -> str | None:
    """Where this process makes its verdicts' groups: v1, its own group; v2, the nearest group at or above its own
    whose children have the memory controller (at the hierarchy's root, enabled there where it is not yet)."""
    where, path = hierarchy(), _memory_path()
    if where is None or path is None:
        return None
    folder = where.folder(path)
    if where.version == 1:
        return folder if os.path.exists(os.path.join(folder, where.peak)) else None
    while True:
        if "memory" in _words(os.path.join(folder, "cgroup.subtree_control")):
            return folder
        if os.path.samefile(folder, where.mount):
            return folder if _enable_memory(folder) else None
        folder = os.path.dirname(folder)


def _enable_memory(folder: str) -> bool:
    try:
        with open(os.path.join(folder, "cgroup.subtree_control"), "w") as f:
            f.write("+memory")
        return True
    except OSError:
        return False


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
    if hierarchy() is None:
        return (f"this machine has neither a cgroup v1 memory hierarchy ({V1_HIERARCHY}) nor the memory "
                "controller in a cgroup v2 hierarchy")
    folder = _parent_folder()
    if folder is None:
        return "no group at or above this process's own has the memory controller for its children"
    try:
        group = MemoryGroup(folder)
    except OSError as error:
        return f"a memory cgroup could not be made in {folder}: {error.strerror}"
    group.remove()
    return None


# set in a grader run again in a scope of the user's systemd manager (`in_a_user_scope`), so that it is done once
USER_SCOPE_ENV = "GCLAB_GRADE_USER_SCOPE"
LINGER_FOLDER = "/var/lib/systemd/linger"
_SYSTEMD_RUN_SCOPE = ("--user", "--scope", "--quiet", "--property=MemoryAccounting=yes", "--")
CAN_MAKE_ONE = "from gclab.grader import memory_group as m; raise SystemExit(m.available() is not None)"


def in_a_user_scope(argv: list[str]) -> list[str] | None:
    """`argv` as a command that runs it in a new scope of this user's systemd manager, where a grader that can
    make no memory group here (cgroup v2, no root, no delegated subtree: a login session) can make them; None
    where it can make them here, or where that scope cannot be had or would not help (tried once, with a
    Python that says whether it could make one there), or would end before the grading does.

    systemd's user@.service delegates the memory controller to the user's own manager (`Delegate=pids memory
    cpu`), whose tree its user owns; `systemd-run --user --scope` starts a command in it.  That manager, and
    every process in its tree, ends with the user's last session unless the user lingers (`loginctl
    enable-linger`), where a grading left running in a terminal multiplexer after logging out would end with
    it: only a lingering user's grader moves."""
    if os.environ.get(USER_SCOPE_ENV) or os.environ.get("GCLAB_GRADE_MEMORY_GROUP") == "0" or available() is None \
            or not lingers():
        return None
    where, systemd_run = hierarchy(), shutil.which("systemd-run")
    if where is None or where.version != 2 or systemd_run is None:
        return None
    try:
        tried = subprocess.run([systemd_run, *_SYSTEMD_RUN_SCOPE, sys.executable, "-c", CAN_MAKE_ONE],
                               env={**os.environ, USER_SCOPE_ENV: "1"}, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [systemd_run, *_SYSTEMD_RUN_SCOPE, *argv] if tried.returncode == 0 else None


def lingers() -> bool:
    """Whether systemd keeps this user's own manager running with no session open (`loginctl enable-linger`)."""
    import pwd
    try:
        return os.path.exists(os.path.join(LINGER_FOLDER, pwd.getpwuid(os.getuid()).pw_name))
    except KeyError:
        return False


class MemoryGroup:
    """One verdict's memory cgroup, made in `parent` (`_parent_folder()`)."""

    def __init__(self, parent: str):
        _sweep(parent)
        self.hierarchy = hierarchy()
        self.path = os.path.join(parent, f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        os.mkdir(self.path)
        self.cgroup = self.hierarchy.path(self.path)
        self._group_peak, self._charged = 0, 0      # cgroup v2: the group's peak and charge at the last reading
        self._peak_fd = _resettable_peak(os.path.join(self.path, self.hierarchy.peak)) if self.hierarchy.version == 2 \
            else None

    @classmethod
    def made(cls) -> "MemoryGroup | None":
        """A new group for a verdict, or None where none can be made here."""
        if available() is not None:
            return None
        folder = _parent_folder()
        try:
            return cls(folder) if folder else None
        except OSError:
            return None

    def read(self, pids) -> tuple[int, int] | None:
        """(bytes charged to the group now, its peak since the last reading); None where
        a process of `pids` is not in the group (it left, or never joined) or the group cannot be read."""
        if any(self._outside(pid) for pid in pids):
            return None
        try:
            charged, peak = _number(os.path.join(self.path, self.hierarchy.usage)), self._window_peak()
        except (OSError, ValueError):
            return None
        self._charged = charged
        return charged, max(peak, charged)

    def _window_peak(self) -> int:
        """The group's peak since the last reading: v1's, reset; v2's, reset through this reader's own
        descriptor (Linux 6.12 and later), else where it rose since, else the larger of the charges at the
        window's two ends (the caller's max)."""
        peak_file = os.path.join(self.path, self.hierarchy.peak)
        if self.hierarchy.version == 1:
            peak = _number(peak_file)
            with open(peak_file, "w") as f:
                f.write("0")
            return peak
        if self._peak_fd is not None:
            peak = int(os.pread(self._peak_fd, 64, 0))
            os.pwrite(self._peak_fd, b"reset", 0)
            return peak
        group_peak = _number(peak_file) if os.path.exists(peak_file) else 0
        rose, self._group_peak = group_peak > self._group_peak, max(group_peak, self._group_peak)
        return group_peak if rose else self._charged

    def _outside(self, pid: int) -> bool:
        """Is `pid` a running process outside the group?  One that ended is in none: /proc shows a zombie,
        not yet reaped, in the hierarchy's root, and one reaped since the session was listed not at all."""
        path = _memory_path(pid)
        return path not in (self.cgroup, None) and not _ended(pid)

    def remove(self) -> None:
        """Remove the group once its processes have ended (a process killed is gone from it once reaped)."""
        if self._peak_fd is not None:
            os.close(self._peak_fd)
            self._peak_fd = None
        _remove(self.path, wait_s=2.0)


def _resettable_peak(path: str) -> int | None:
    """A descriptor of cgroup v2's `memory.peak` through which a write resets the peak it reads (Linux 6.12 and
    later; None before, where the file cannot be written)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        os.pwrite(fd, b"reset", 0)
        return fd
    except OSError:
        os.close(fd)
        return None


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
