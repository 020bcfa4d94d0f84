"""The whole process's memory, read from outside torch: the C library's heap and the process's mappings.

`process_memory()` is what a check reads where tensors might escape the `Meter`: a tensor made in another
thread, with torch's dispatch turned off, or over memory the code mapped itself.  It measures the bytes in
use in glibc's heap (`mallinfo2`, where torch's CPU allocator puts every storage), the process's other
writable mappings and resident shared memory (`/proc/self/maps`, `/proc/self/status`), and Python's
small-object blocks.

What it cannot see: which object holds the bytes (none is exact per tensor: the heap rounds, mappings
come in pages, so judge growth over many steps); device memory (a GPU's); and anything at all where the
C library is not glibc 2.33 or later (macOS, musl): there `process_memory()` returns None.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import re
import sys
import tempfile
from dataclasses import dataclass

__all__ = ["ProcessMemory", "process_memory"]


@dataclass(frozen=True)
class ProcessMemory:
    """What the whole process holds, read from outside torch, so that code cannot tell it is
    being read and no tensor escapes it, whichever thread made it and however:

    * `heap`: bytes in use in the C library's heap (glibc's `mallinfo2`), where torch's CPU
      allocator puts every tensor's storage;
    * `mapped`: bytes of memory mapped by other routes (`mmap`: a tensor made with
      `torch.frombuffer` over an `mmap.mmap` of memory or of a file, shared memory): the
      process's writable mappings of memory and of files (`/proc/self/maps`) and its resident
      shared memory (RssShmem), less what the C heap has mapped (glibc's `malloc_info`),
      Python's small-object arenas and threads' stacks;
    * `blocks`: Python's small-object blocks in use (`sys.getallocatedblocks`).

    None is exact per tensor (the heap rounds, mappings come in pages), so judge `total`'s growth
    over many steps."""
    heap: int
    blocks: int
    mapped: int = 0

    @property
    def total(self) -> int:
        """Bytes the process holds in its heap and its other mappings."""
        return self.heap + self.mapped


def _libc():
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        libc.mallinfo2, libc.malloc_info, libc.fdopen, libc.fclose    # glibc 2.33 or later
    except (OSError, AttributeError):       # not glibc (macOS, musl), or an older one
        return None

    class _Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")]
    libc.mallinfo2.restype = _Info
    libc.fdopen.restype = ctypes.c_void_p
    libc.fdopen.argtypes = [ctypes.c_int, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    return libc


# bound at import, before any learner's code runs
_LIBC = _libc()
_SHARED = re.compile(rb"^RssShmem:\s+(\d+) kB", re.MULTILINE)
_MAPPING = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+ *(.*)$", re.MULTILINE)
_ARENAS = re.compile(rb"^([\d,]+) arenas \* (\d+) bytes/arena", re.MULTILINE)
_MALLOC_LARGE_BLOCKS = re.compile(rb'<total type="mmap" count="\d+" size="(\d+)"/>')
_MALLOC_OPEN_HEAPS = re.compile(rb'<aspace type="mprotect" size="(\d+)"/>')
# shared memory (counted, as far as it is touched, by RssShmem) and devices' memory (a GPU's)
_SHARED_MEMORY_FILES = (b"/dev/", b"/memfd:", b"/SYSV")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# /proc/self/maps is read into memory mapped once (pages touched only as far as it reaches), so
# that reading it maps nothing new
_MAPS_BUFFER = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE) if hasattr(mmap, "MAP_PRIVATE") else None
_open, _read, _readv, _close, _dup, _dup2 = os.open, os.read, os.readv, os.close, os.dup, os.dup2
_getallocatedblocks, _debugmallocstats, _temporary_file = sys.getallocatedblocks, sys._debugmallocstats, tempfile.TemporaryFile


def _read_proc(name: str, into: mmap.mmap | None = None) -> bytes | memoryview | None:
    """/proc/self/`name` (None where there is none), read whole into `into` when given."""
    try:
        fd = _open(f"/proc/self/{name}", os.O_RDONLY)
    except OSError:
        return None
    try:
        if into is None:
            return _read(fd, 1 << 16)
        view, filled = memoryview(into), 0
        while filled < len(into) and (got := _readv(fd, [view[filled:]])):
            filled += got
        return None if filled == len(into) else view[:filled]     # too many mappings to read: None
    finally:
        _close(fd)


def _kernel_counts() -> tuple[int, int] | None:
    """(bytes mapped privately or from files, writable, bytes of shared memory resident), from
    /proc (None where there is none).  Threads' stacks are left out: a thread that torch or the
    kernel starts (a thread pool's first use) maps eight MiB, which is no step's.  A stack is the
    mapping right above a one-page guard that nothing may touch."""
    if _MAPS_BUFFER is None:
        return None
    maps, status = _read_proc("maps", into=_MAPS_BUFFER), _read_proc("status")
    if maps is None or status is None:
        return None
    private, guard_end = 0, -1
    for mapping in _MAPPING.finditer(maps):        # one match at a time: no list of thousands of objects
        start, end, perms, path = int(mapping[1], 16), int(mapping[2], 16), mapping[3], mapping[4]
        if perms == b"---p" and end - start == _PAGE:
            guard_end = end
            continue
        if perms == b"rw-p" and (not path or path == b"[heap]") and start != guard_end:
            private += end - start
        elif perms[:2] == b"rw" and path[:1] == b"/" and not path.startswith(_SHARED_MEMORY_FILES):
            private += end - start          # a file mapped to be written: a library's data, or a tensor's
        guard_end = -1
    shared = _SHARED.search(status)
    return private, int(shared[1]) * 1024 if shared else 0


def _captured(write) -> bytes:
    """What `write(fd)` writes into a file descriptor (a C library's report)."""
    with _temporary_file() as caught:
        write(caught.fileno())
        caught.seek(0)
        return caught.read()


@contextlib.contextmanager
def _stderr_into(fd: int):
    """The C library's stderr (file descriptor 2) writes into `fd` meanwhile."""
    saved = _dup(2)
    try:
        _dup2(fd, 2)
        yield
    finally:
        _dup2(saved, 2)
        _close(saved)


def _to_stderr(fd: int) -> None:
    with _stderr_into(fd):
        _debugmallocstats()


def _small_object_arenas() -> int | None:
    """Bytes in Python's small-object arenas (pymalloc maps them itself, a MiB at a time): 0 when
    Python does not use pymalloc, None when its report cannot be read.  The interpreter says so
    only on stderr (`sys._debugmallocstats`), so that is caught in a file."""
    stats = _captured(_to_stderr)
    found = _ARENAS.search(stats)
    if found is None:
        return None if stats else 0
    return int(found[1].replace(b",", b"")) * int(found[2])


def _malloc_info(fd: int) -> None:
    stream = _LIBC.fdopen(_dup(fd), b"w")
    _LIBC.malloc_info(0, stream)
    _LIBC.fclose(stream)


def _malloc_mapped() -> int | None:
    """Bytes the C heap has mapped: its large blocks, each mapped alone, and its arenas' heaps as
    far as they are open for use (a thread's arena that shrank keeps its mapping: `mallinfo2`'s
    `arena` would count it out, `malloc_info`'s "mprotect" size does not)."""
    report = _captured(_malloc_info)
    totals = report[report.rfind(b"</heap>"):]         # after every arena's own lines: the process's
    large, heaps = _MALLOC_LARGE_BLOCKS.search(totals), _MALLOC_OPEN_HEAPS.search(totals)
    return int(large[1]) + int(heaps[1]) if large and heaps else None


def process_memory(mappings: bool = True) -> ProcessMemory | None:
    """The process's memory now (see `ProcessMemory`), or None where the C library cannot say.
    `mappings=False` skips reading the mappings (`mapped` is 0): a tenth of the time, for what
    only the heap can show (converting numbers to Python objects maps nothing)."""
    if _LIBC is None:
        return None
    if not mappings:
        info = _LIBC.mallinfo2()
        return ProcessMemory(info.uordblks + info.hblkhd, _getallocatedblocks())
    for _ in range(4):
        # reading makes a few Python objects and C buffers, which may take a new arena or heap
        # space: read the allocators on both sides of the kernel's count, again if they moved
        arenas, malloc_mapped = _small_object_arenas(), _malloc_mapped()
        counts = _kernel_counts()
        info = _LIBC.mallinfo2()
        if (_small_object_arenas(), _malloc_mapped()) == (arenas, malloc_mapped):
            break
    mapped = 0
    if counts and arenas is not None and malloc_mapped is not None:   # else mappings cannot be told apart
        private, shared = counts
        mapped = private + shared - malloc_mapped - arenas
    return ProcessMemory(info.uordblks + info.hblkhd, _getallocatedblocks(), max(mapped, 0))
