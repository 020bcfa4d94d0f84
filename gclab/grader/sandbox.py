"""Walls the kernel keeps around a verdict process, so that the learner's code cannot reach what decides a grade.

The guard (`gclab.guard`) refuses, inside the verdict process, writes outside the grading folder and reads of
the course: a refusal that code in that process can walk around (ctypes' `open`, `torch.save`, or an array
over the guard's own memory).  These walls are the kernel's, set before the learner's code runs:

- `enter`, in the verdict process: namespaces of its own.  A network one, with its own loopback and nothing
  else (no gradebook server, no Dask scheduler, no other machine).  A PID one, with a /proc of its own, in
  which the learner's code runs as the first process: it can name no process outside, so it can signal none
  (the grader, a verdict graded beside it, the instructor's JupyterLab; tracing one, or opening its memory,
  the user namespace below already refuses).
  A mount one, in which every file system is read-only but the grading folder, and the course's folders
  (`hidden`: its solutions, hidden tests, the reference's figures, the gradebook) are empty but for what the
  grader's tools load from them (gclab, the Python environment), and so are the user's home (keys, tokens)
  and the folders where the machine's programs keep their sockets (/tmp, /var/tmp, /run: a socket is
  reached through a read-only mount, and some, such as a terminal multiplexer's, run commands); /dev/shm is
  a small one of its own.  An IPC one.  A user one, whose every capability is then dropped, so that the
  walls cannot be taken down again from inside (nor from a namespace made anew: the read-only flags of
  mounts handed to a less privileged namespace are locked), nor the grader's memory read or written
  (`shield`);
- `shield`, in the grader and its zygotes: not dumpable (Linux's PR_SET_DUMPABLE), so that a process of the
  same user without CAP_SYS_PTRACE over the machine (the learner's, behind `enter`) can neither trace it nor
  open its memory (`/proc/PID/mem`, `process_vm_writev`);
- `end_within`: every process left in the verdict's user namespace or one nested in it killed when the
  verdict ends (the kernel ends a PID namespace's processes with its first; this covers any other way out).

The process that enters stays outside the PID namespace (the grader's handle on the verdict: its session,
its signals): it forks the namespace's first process, which returns from `enter` and goes on as the
verdict, while it waits for it with no capability, passes the grader's interrupts on, and ends as it ends.

Linux only.  Where the kernel refuses user namespaces (Ubuntu 24.04's AppArmor, for one: sysctl
`kernel.apparmor_restrict_unprivileged_userns=0` allows them), `enter` says why and the verdict runs as
before, behind the guard alone; the grader sees it (`walled`) and says so.  `GCLAB_GRADE_WALLS=0` builds none.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import signal
import socket
import struct
import sys

from .. import procfs

__all__ = ["Held", "available", "end_within", "enter", "hold", "namespace_of", "shield", "walled"]

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWNET, _CLONE_NEWPID, _CLONE_NEWIPC = (
    0x00020000, 0x10000000, 0x40000000, 0x20000000, 0x08000000)
_SIOCSIFFLAGS, _IFF_UP, _IFF_LOOPBACK, _IFF_RUNNING = 0x8914, 0x1, 0x8, 0x40
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
_MOUNT_ATTR_RDONLY, _AT_RECURSIVE, _AT_FDCWD = 0x1, 0x8000, -100
_SYS_MOUNT_SETATTR = 442                    # the same number on x86-64 and arm64
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 1, 4, 24, 38, 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_NS_GET_PARENT = 0xB702                     # _IO(0xb7, 0x2)
# where the machine's programs keep their sockets (a terminal multiplexer's, the user's systemd, X11's, an
# agent's): hidden as the course is, but for the grading folder and the tools kept; /dev/shm made anew
SOCKET_FOLDERS = ("/tmp", "/var/tmp", "/run")
SHARED_MEMORY, SHARED_MEMORY_SIZE = "/dev/shm", "64m"


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


class Refused(OSError):
    """The kernel would not build a wall: what it said, and at which step."""


def _check(result: int, step: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise Refused(code, f"{step}: {os.strerror(code)}")


def shield() -> None:
    """Make this process undumpable: no process of the same user without CAP_SYS_PTRACE over the machine's
    user namespace may trace it or open its memory.  Its forks inherit this (a verdict undoes it: `enter`)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def enter(workdir: str, hidden=(), keep=()) -> str | None:
    """Wall this process in (see the module's docstring): None once it is, else why not, in a sentence.
    Call it while the process has one thread (the kernel's rule for a new user namespace), before any of
    the learner's code runs.  `keep`: folders under `hidden` that stay visible (read-only), beside this
    Python's own (its environment, its standard library, the user's site-packages)."""
    if _LIBC is None:
        return "the grader's walls need Linux"
    # dumpable again first: the grader reads this process (/proc/PID/clear_refs), and a process may write
    # its own uid_map only while its /proc files are its own
    _LIBC.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
    try:
        _own_namespaces()
        _hide([*hidden, *SOCKET_FOLDERS, _home()], [*keep, *_python_folders()], workdir)
        _first_of_a_pid_namespace()
        _proc_and_shared_memory_of_its_own()
        _read_only_but(workdir, SHARED_MEMORY)
        _drop_capabilities()
    except Refused as refused:
        return f"the kernel refused the grader's walls ({refused.strerror})"
    except OSError as error:          # a folder to keep that cannot be opened, a mount point not made
        return f"the grader's walls could not be built ({error})"
    return None


def _own_namespaces() -> None:
    """A user, a mount, a network and an IPC namespace of this process's own, and a PID one for its children:
    the capability to mount, over these mounts alone, changes that reach no other process, and a network of
    its own loopback alone.  The same ids inside as outside."""
    uid, gid = os.geteuid(), os.getegid()
    _check(_LIBC.unshare(_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWPID),
           "a user, mount, network, IPC and PID namespace")
    _map_ids(uid, gid)
    _check(_LIBC.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "private mounts")
    _loopback_up()


def _loopback_up() -> None:
    """127.0.0.1 in the new network namespace (a lesson's model server listens there; the grader's load
    reaches it from a process that joins this namespace: gclab.serving's `--network-of`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", _IFF_UP | _IFF_LOOPBACK | _IFF_RUNNING))
        except OSError as error:
            raise Refused(error.errno, f"the loopback interface: {error.strerror}") from None


def _map_ids(uid: int, gid: int) -> None:
    """The same user and group ids inside the new user namespace as outside (what `id` says is unchanged)."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        except FileNotFoundError:          # setgroups: a kernel older than 3.19
            continue
        except OSError as error:
            if name != "setgroups":        # a privileged process may map without denying setgroups
                raise Refused(error.errno, f"mapping the {name[:3]}s: {error.strerror}") from None


def _hide(hidden, keep, workdir: str) -> None:
    """An empty, read-only folder over each of `hidden`, with the folders of `keep` (and the grading folder)
    that lie under it put back in their places."""
    # each as named (a link in the course to a Python environment elsewhere is kept as a folder) and resolved
    keep = [os.path.abspath(k) for k in (*keep, workdir)]
    keep += [os.path.realpath(k) for k in keep]
    for folder in {os.path.realpath(h) for h in hidden}:
        if not os.path.isdir(folder):
            continue
        inside = sorted({k for k in keep if k == folder or k.startswith(folder + os.sep)})
        if folder in inside:
            continue                       # the whole folder is kept
        handles = [(k, os.open(k, os.O_PATH | os.O_DIRECTORY)) for k in inside if os.path.isdir(k)]
        try:
            _check(_LIBC.mount(b"tmpfs", os.fsencode(folder), b"tmpfs", 0, b"size=64k,mode=755"),
                   f"hiding {folder}")
            for path, handle in handles:
                os.makedirs(path, exist_ok=True)
                _check(_LIBC.mount(os.fsencode(f"/proc/self/fd/{handle}"), os.fsencode(path), None,
                                   _MS_BIND | _MS_REC, None), f"keeping {path}")
        finally:
            for _, handle in handles:
                os.close(handle)


def _python_folders() -> list[str]:
    import site
    return [sys.prefix, sys.base_prefix, sys.exec_prefix, site.getusersitepackages()]


def _home() -> str:
    """The user's home as the system has it (the verdict's HOME is its grading folder): keys, tokens,
    other courses."""
    import pwd
    try:
        home = pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        return "/nonexistent"
    return home if home not in ("", "/") else "/nonexistent"


def _first_of_a_pid_namespace() -> None:
    """Fork the first process of the PID namespace this one made for its children: it returns, and goes on
    as the verdict; this one (the grader's handle on the verdict) never does (`_wait_outside`)."""
    dropped, said = os.pipe()
    first = os.fork()
    if first == 0:
        os.close(said)
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)      # ended with the process outside
        if not os.read(dropped, 1):
            os._exit(1)                      # which has already gone
        os.close(dropped)
        return
    os.close(dropped)
    _wait_outside(first, said)


def _wait_outside(first: int, said: int) -> None:
    """The process outside the PID namespace, once it has forked its first: no capability (the grader sees
    it walled in as well: `walled`), the grader's interrupts passed on (as nbgrader interrupts a runaway
    cell), and an end as the first process's.  The grader's SIGTERM ends it, and the first process with it."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)      # its child's end is waited for, not discarded
        try:
            _drop_capabilities()
        except Refused:
            pass                             # the grader sees it is not walled in, and says so
        os.write(said, b"\0")
        os.close(said)
        signal.signal(signal.SIGINT, lambda *_: _pass_on(first, signal.SIGINT))
        status = os.waitpid(first, 0)[1]
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
    finally:
        os._exit(code)


def _pass_on(pid: int, signal_number: int) -> None:
    try:
        os.kill(pid, signal_number)
    except OSError:
        pass                                 # it has just ended


def _proc_and_shared_memory_of_its_own() -> None:
    """A /proc that lists this PID namespace's processes alone (the machine's would name the others); an
    empty /dev/shm of its own, small."""
    _check(_LIBC.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None), "a /proc of its own")
    if os.path.isdir(SHARED_MEMORY):
        _check(_LIBC.mount(b"tmpfs", os.fsencode(SHARED_MEMORY), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                           f"size={SHARED_MEMORY_SIZE},mode=1777".encode()), "a /dev/shm of its own")


def _read_only_but(workdir: str, *writable: str) -> None:
    """Every mount read-only, recursively; the grading folder a writable mount of its own, and `writable`
    (mounts this namespace made) writable again."""
    folder = os.fsencode(os.path.realpath(workdir))
    _check(_LIBC.mount(folder, folder, None, _MS_BIND | _MS_REC, None), "the grading folder")
    _set_attr(b"/", _AT_RECURSIVE, set_=_MOUNT_ATTR_RDONLY, step="read-only mounts")
    _set_attr(folder, 0, clear=_MOUNT_ATTR_RDONLY, step="a writable grading folder")
    for path in writable:
        if os.path.isdir(path):
            _set_attr(os.fsencode(path), 0, clear=_MOUNT_ATTR_RDONLY, step=f"a writable {path}")


def _set_attr(path: bytes, flags: int, set_: int = 0, clear: int = 0, step: str = "") -> None:
    attr = _MountAttr(set_, clear, 0, 0)
    result = _LIBC.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, ctypes.c_char_p(path), flags, ctypes.byref(attr),
                           ctypes.sizeof(attr))
    if result != 0 and ctypes.get_errno() == errno.ENOSYS:
        raise Refused(errno.ENOSYS, f"{step}: this kernel has no mount_setattr (Linux 5.12)")
    _check(result, step)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


def _drop_capabilities() -> None:
    """No capability left, in this user namespace or any other, nor any that running a program could give
    back: the walls stay up (a mount's flags cannot change without CAP_SYS_ADMIN over its namespace, and a
    new namespace's copies of these mounts are locked read-only)."""
    for capability in range(64):
        if _LIBC.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            if ctypes.get_errno() == errno.EINVAL:     # past the last capability this kernel knows
                break
            _check(-1, "dropping the capabilities")
    _LIBC.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header, data = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0), (ctypes.c_uint32 * 6)()
    _check(_LIBC.capset(ctypes.byref(header), data), "dropping the capabilities")
    _check(_LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no new privileges")


# -- the grader's side ---------------------------------------------------------------------------------------
def namespace_of(pid: int) -> int | None:
    """The inode of process `pid`'s user namespace, or None if it has gone."""
    try:
        return os.stat(f"/proc/{pid}/ns/user").st_ino
    except OSError:
        return None


def walled(pid: int) -> bool:
    """Whether process `pid` runs behind the walls, as the system shows it: in a user namespace other than
    the caller's, with no capability, its children in a PID namespace of their own, its root mounted
    read-only."""
    if namespace_of(pid) in (None, namespace_of(os.getpid())):
        return False
    try:
        if os.stat(f"/proc/{pid}/ns/pid_for_children").st_ino == os.stat(f"/proc/{pid}/ns/pid").st_ino:
            return False
        with open(f"/proc/{pid}/status") as status:
            capabilities = next((line.split()[1] for line in status if line.startswith("CapEff:")), "1")
        with open(f"/proc/{pid}/mountinfo") as mounts:
            root = [line.split() for line in mounts if line.split()[4] == "/"][-1:]     # the one on top
    except OSError:
        return False
    return int(capabilities, 16) == 0 and bool(root) and root[0][5].split(",")[0] == "ro"


class Held:
    """A process's user namespace, held open: while it is, the kernel gives its number to no other
    namespace (a number freed when the last process in it ends is soon another verdict's)."""

    def __init__(self, pid: int):
        self.fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY)
        self.inode = os.fstat(self.fd).st_ino

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def hold(pid: int) -> Held | None:
    """Process `pid`'s user namespace, held (see Held); None if the process has gone."""
    try:
        return Held(pid)
    except OSError:
        return None


def end_within(held: Held | None) -> list[int]:
    """Kill every process in the held user namespace or one nested in it, until none is left, then let the
    namespace go; the pids killed.  Nothing where it is None or the caller's own (a verdict that could not
    `enter`)."""
    if held is None:
        return []
    killed = []
    try:
        if held.inode == namespace_of(os.getpid()):
            return []
        for _ in range(100):
            found = [pid for pid in _pids() if pid not in killed and _descends_from(pid, held.inode) and _runs(pid)]
            if not found:
                break
            for pid in found:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            killed += found
    finally:
        held.close()
    return killed


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _runs(pid: int) -> bool:
    """Not ended (an ended process waits, as a zombie, to be reaped)."""
    fields = procfs._stat_fields(pid)
    return bool(fields) and fields[0] != "Z"


def _descends_from(pid: int, namespace: int) -> bool:
    try:
        fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY)
    except OSError:
        return False
    try:
        for _ in range(33):                 # the kernel nests user namespaces 32 deep at most
            if os.fstat(fd).st_ino == namespace:
                return True
            try:
                parent = fcntl.ioctl(fd, _NS_GET_PARENT)
            except OSError:                 # the machine's own namespace, or one above the caller's
                return False
            os.close(fd)
            fd = parent
        return False
    finally:
        os.close(fd)


def available() -> str | None:
    """None where a process can be walled in here (tried in a child), else why not."""
    if _LIBC is None or not hasattr(os, "fork"):
        return "the grader's walls need Linux"
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(read)
                os.write(write, (enter(folder) or "").encode()[:500])
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            why = pipe.read().decode()
        os.waitpid(pid, 0)
    return why or None
