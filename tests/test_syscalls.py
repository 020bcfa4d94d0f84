"""gclab.syscalls: a process that refuses itself new processes, passing descriptors and reaching into
others still runs threads, torch and plain sockets; the refusals hold in C (libc through ctypes), in the
threads it had before, and in what it makes afterwards."""
import subprocess
import sys

import pytest

from gclab import syscalls

pytestmark = pytest.mark.skipif(syscalls.available() is not None, reason=str(syscalls.available()))


def _run(code: str) -> list[str]:
    prelude = ("import ctypes, os, socket, threading\nfrom gclab import syscalls\n"
               "def outcome(call):\n    try:\n        return repr(call())\n"
               "    except OSError as exc:\n        return type(exc).__name__ + ' ' + str(exc.errno)\n")
    done = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_a_process_made_by_any_route_is_refused_and_threads_are_not():
    said = _run("libc = ctypes.CDLL(None)\n"
                "waiting = threading.Event()\n"
                "forked_in_an_earlier_thread = []\n"
                "def earlier():\n    waiting.wait()\n    forked_in_an_earlier_thread.append(libc.fork())\n"
                "t = threading.Thread(target=earlier)\nt.start()\n"
                "assert syscalls.refuse(syscalls.NEW_PROCESSES) is None\n"
                "waiting.set()\nt.join()\n"
                "print(outcome(os.fork), libc.fork(), forked_in_an_earlier_thread[0])\n"
                "import subprocess\nprint(outcome(lambda: subprocess.run(['true'])).replace(' ', '_'))\n"
                "ran = []\nthread = threading.Thread(target=lambda: ran.append(1))\nthread.start()\nthread.join()\n"
                "import torch\nprint(ran, float(torch.ones(4).sum()))\n")
    assert said == ["PermissionError", "1", "-1", "-1", "PermissionError_1", "[1]", "4.0"]


def test_descriptors_cannot_be_passed_and_plain_sockets_still_talk():
    said = _run("assert syscalls.refuse(syscalls.PASSING_DESCRIPTORS) is None\n"
                "a, b = socket.socketpair()\n"
                "import array\n"
                "fds = array.array('i', [a.fileno()])\n"
                "print(outcome(lambda: a.sendmsg([b'x'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])))\n"
                "a.send(b'y')\nprint(b.recv(1))\n")
    assert said == ["PermissionError", "1", "b'y'"]


def test_another_process_cannot_be_traced_or_have_a_descriptor_taken():
    said = _run("assert syscalls.refuse(syscalls.REACH) is None\n"
                "libc = ctypes.CDLL(None, use_errno=True)\n"
                "PTRACE_ATTACH, SYS_pidfd_getfd = 16, 438\n"
                "parent = os.getppid()\n"
                "print(libc.ptrace(PTRACE_ATTACH, parent, 0, 0), ctypes.get_errno())\n"
                "pidfd = os.pidfd_open(parent)\n"
                "print(libc.syscall(SYS_pidfd_getfd, pidfd, 0, 0), ctypes.get_errno())\n"
                "child = os.fork()\n"                                     # REACH alone: processes stay allowed
                "if child == 0:\n    os._exit(7)\n"
                "print(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))\n")
    assert said == ["-1", "1", "-1", "1", "7"]


def test_memory_cannot_be_paged_out_and_an_allocators_advice_still_passes():
    said = _run("assert syscalls.refuse(syscalls.PAGING_OUT) is None\n"
                "import mmap\n"
                "libc = ctypes.CDLL(None, use_errno=True)\n"
                "libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]\n"
                "block = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)\nblock.write(b'x' * (1 << 20))\n"
                "address = ctypes.addressof(ctypes.c_char.from_buffer(block))\n"
                "MADV_DONTNEED, MADV_COLD, MADV_PAGEOUT, SYS_process_madvise = 4, 20, 21, 440\n"
                "for advice in (MADV_PAGEOUT, MADV_COLD):\n"
                "    print(libc.madvise(address, 1 << 20, advice), ctypes.get_errno())\n"
                "print(outcome(lambda: block.madvise(MADV_PAGEOUT)).replace(' ', '_'))\n"
                "pidfd = os.pidfd_open(os.getpid())\n"
                "print(libc.syscall(SYS_process_madvise, pidfd, 0, 0, MADV_PAGEOUT, 0), ctypes.get_errno())\n"
                "print(libc.madvise(address, 1 << 20, MADV_DONTNEED), block[:1])\n"
                "import torch\nprint(float(torch.ones(1 << 22).sum()))\n")
    assert said == ["-1", "1", "-1", "1", "PermissionError_1", "-1", "1", "0", "b'\\x00'", "4194304.0"]
