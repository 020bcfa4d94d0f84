"""What a process may no longer ask of the kernel: a seccomp filter (Linux), installed for good.

The grader's own figures of a process (its CPU time, which sockets it holds: `gclab.procfs`) are of
the process it watches; code that could hand that process's work to another, or reach into another
process, could make those figures another process's.  So a process that runs a learner's code under
the grader's watch refuses it, in the kernel, where no Python code can take the refusal back:

- `REACH`: tracing another process or reading and writing its memory (`ptrace`, `process_vm_readv`,
  `process_vm_writev`) and taking its descriptors (`pidfd_getfd`);
- `NEW_PROCESSES`: a process made by `fork`, `vfork` or `clone` (threads stay allowed: `clone` with
  `CLONE_THREAD`; `clone3`, whose flags a filter cannot read, says ENOSYS, and glibc then makes its
  threads with `clone`);
- `PASSING_DESCRIPTORS`: `sendmsg`/`recvmsg` and their batch forms, the only way a descriptor goes from
  one process to another it did not start (`SCM_RIGHTS`);
- `PAGING_OUT`: pushing its own memory out to swap, so that memory it still holds leaves its resident
  figures (`madvise` with `MADV_PAGEOUT` or `MADV_COLD`; `process_madvise`, which gives only such advice).
  Every other `madvise`, which allocators give, stays allowed.

A refused call fails with EPERM.  Filters stack and are inherited by every process made afterwards;
none can be removed.  `refuse` needs `PR_SET_NO_NEW_PRIVS`, which it sets (the kernel's walls already
have).  On a machine that is not x86-64 or AArch64 Linux it installs nothing and says why.
"""
from __future__ import annotations

import ctypes
import errno
import platform
import struct
import sys

REACH = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd")
NEW_PROCESSES = ("fork", "vfork", "clone", "clone3")
PASSING_DESCRIPTORS = ("sendmsg", "recvmsg", "sendmmsg", "recvmmsg")
PAGING_OUT = ("madvise", "process_madvise")

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_NUMBERS = {
    "x86_64": {"ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438,
               "fork": 57, "vfork": 58, "clone": 56, "clone3": 435, "sendmsg": 46, "recvmsg": 47,
               "sendmmsg": 307, "recvmmsg": 299, "madvise": 28, "process_madvise": 440, "seccomp": 317},
    # the generic table: no fork or vfork (glibc makes processes with clone)
    "aarch64": {"ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_getfd": 438,
                "clone": 220, "clone3": 435, "sendmsg": 211, "recvmsg": 212, "sendmmsg": 269,
                "recvmmsg": 243, "madvise": 233, "process_madvise": 440, "seccomp": 277},
}
_X32_BIT = 0x40000000           # x86-64's x32 calls: the same calls under other numbers
_CLONE_THREAD = 0x00010000
_MADV_COLD, _MADV_PAGEOUT = 20, 21
_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC = 1, 1
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
# classic BPF: load a word of seccomp_data, jump if equal / greater or equal / any bit set, return
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_NR, _ARCH, _ARG0, _ARG2 = 0, 4, 16, 32      # an argument's low word (both machines are little-endian)


class _Filter(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _program(machine: str, names) -> list[tuple[int, int, int, int]]:
    """The filter, as (code, jump if true, jump if false, k) instructions."""
    numbers = _NUMBERS[machine]
    refuse, nosys = _RET_ERRNO | errno.EPERM, _RET_ERRNO | errno.ENOSYS
    body = []
    for name in names:
        if name not in numbers:
            continue
        if name == "clone":                 # a thread passes; a process is refused
            body += [(_JEQ, 0, 4, numbers[name]), (_LD_ABS, 0, 0, _ARG0), (_JSET, 0, 1, _CLONE_THREAD),
                     (_RET, 0, 0, _RET_ALLOW), (_RET, 0, 0, refuse)]
        elif name == "madvise":             # advice that pages out is refused; an allocator's passes
            body += [(_JEQ, 0, 5, numbers[name]), (_LD_ABS, 0, 0, _ARG2), (_JEQ, 2, 0, _MADV_COLD),
                     (_JEQ, 1, 0, _MADV_PAGEOUT), (_RET, 0, 0, _RET_ALLOW), (_RET, 0, 0, refuse)]
        else:
            body += [(_JEQ, 0, 1, numbers[name]), (_RET, 0, 0, nosys if name == "clone3" else refuse)]
    head = [(_LD_ABS, 0, 0, _ARCH), (_JEQ, 1, 0, _AUDIT_ARCH[machine]), (_RET, 0, 0, refuse),  # another ABI: none
            (_LD_ABS, 0, 0, _NR)]
    if machine == "x86_64":
        head += [(_JGE, 0, 1, _X32_BIT), (_RET, 0, 0, refuse)]
    return head + body + [(_RET, 0, 0, _RET_ALLOW)]


def available() -> str | None:
    """None where `refuse` can install a filter here, else why not."""
    if not sys.platform.startswith("linux"):
        return f"no seccomp on {sys.platform}"
    if platform.machine() not in _NUMBERS:
        return f"no system call table for {platform.machine()} here"
    return None


def refuse(*groups) -> str | None:
    """Refuse this process, and every process it makes from now on, the calls of `groups` (tuples of
    names above), in every thread.  None once installed, else why not (nothing is then refused)."""
    why = available()
    if why:
        return why
    machine = platform.machine()
    names = [name for group in groups for name in group]
    code = b"".join(struct.pack("HBBI", *instruction) for instruction in _program(machine, names))
    buffer = ctypes.create_string_buffer(code, len(code))
    program = _Filter(len(code) // 8, ctypes.addressof(buffer))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return f"prctl(PR_SET_NO_NEW_PRIVS) failed: {errno.errorcode.get(ctypes.get_errno(), '?')}"
    if libc.syscall(ctypes.c_long(_NUMBERS[machine]["seccomp"]), ctypes.c_long(_SECCOMP_SET_MODE_FILTER),
                    ctypes.c_long(_SECCOMP_FILTER_FLAG_TSYNC), ctypes.byref(program)) != 0:
        return f"seccomp(SECCOMP_SET_MODE_FILTER) failed: {errno.errorcode.get(ctypes.get_errno(), '?')}"
    return None
