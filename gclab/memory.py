"""Measure the bytes that live tensors hold on a device.

`Meter` is the one way the course measures tensor memory:

* on a CUDA device it reads the caching allocator (`torch.cuda.memory_allocated`),
  and a budget is enforced by the real allocator;
* on the CPU it counts, exactly, the storage bytes of every tensor created while the
  meter is active and still alive, and a budget is *simulated*: an allocation that
  would pass it raises `torch.OutOfMemoryError` before the machine's memory is at risk.

The CPU count is made by a `TorchDispatchMode` that sees every aten operation,
forward and backward.  An operation whose schema says its result aliases an input
(views, in-place and `out=` variants) allocates nothing, unless it resizes a counted
storage; any other result's storage is new and is counted until the storage is freed,
which happens the instant its last reference (a variable, a view, an autograd graph)
goes away.  What it cannot see: tensors created before the meter started (and storage
they grow later), and memory that is not a tensor's.  A tensor made by
`torch.from_numpy` inside the meter is counted although numpy owns its buffer.
"""
from __future__ import annotations

import contextlib
import gc
import mmap
import os
import re
import sys
import tempfile
import time
import types
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["AllocationCensus", "Meter", "MeterPoint", "ProcessMemory", "cuda_bytes", "default_device", "describe_device",
           "device_storage",
           "format_bytes", "process_memory"]

MiB = 1024**2

# Operations whose schema returns an alias of their input, yet which are how a tensor
# built outside the dispatcher (torch.tensor([...])) first appears to it.
_LIFT_OPS = {"aten::lift_fresh", "aten::lift_fresh_copy", "aten::lift"}


def default_device() -> torch.device:
    """The device the course runs on: the current CUDA device when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def describe_device(device) -> str:
    """One line that says what the meter measures on `device`."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return f"CUDA device {device} ({name}): the caching allocator's own counters, a real budget"
    return ("CPU: exact byte count of live tensor storage; "
            "no GPU here, so any device budget is simulated by the meter")


def cuda_bytes(device=None, what: str = "allocated_bytes", which: str = "current") -> int:
    """A figure of PyTorch's CUDA caching allocator: `what` is "allocated_bytes" (live tensors,
    `torch.cuda.memory_allocated`) or "reserved_bytes" (`memory_reserved`), `which` is "current"
    or "peak"; 0 before CUDA is initialised.

    Read from `torch.cuda.memory_stats_as_nested_dict`, not through `torch.cuda.memory_allocated()`
    and its siblings: those flatten the statistics with a nested function that refers to itself,
    so each call leaves a reference cycle holding every statistic (about 250 objects on a GPU) for
    the collector.  A meter read every step would then set off collections of its own, and free
    the very cycles a lesson is measuring."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    return stats.get(what, {}).get("all", {}).get(which, 0)


def format_bytes(n: float) -> str:
    """Bytes as a short human string: 512 B, 3.00 KiB, 2.00 MiB, 1.50 GiB."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", 1024**3), ("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"


def device_storage(tensor, device=None):
    """(key, storage, bytes) of a strided tensor's storage; bytes as the device counts them
    (the CUDA allocator rounds every block up to 512 bytes); None for one it cannot read, or
    one on another device than `device` (when given)."""
    try:
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            return None
        if device is not None and tensor.device != device:
            return None
        storage = tensor.untyped_storage()
    except Exception:                     # a tensor subclass, a functional wrapper
        return None
    return storage_entry(storage)


def storage_entry(storage):
    """(key, storage, bytes) of an untyped storage, bytes as its device counts them; None for one
    it cannot read."""
    try:
        nbytes = storage.nbytes()
        if storage.device.type == "cuda":
            nbytes = -(-nbytes // 512) * 512
        return storage._cdata, storage, nbytes
    except Exception:
        return None


@dataclass(frozen=True)
class MeterPoint:
    """One point of a meter's timeline."""
    label: str
    seconds: float      # since the meter started
    allocated: int      # bytes, as `Meter.allocated()` returned


_ALLOCATES, _MUTATES, _VIEWS = "allocates", "mutates", "views"


def _op_kind(func) -> str:
    """What an op can do to storage, read from its schema: make new storage (no result
    aliases an input), write into an input's storage (in-place and out= variants, which
    may resize it), or only view existing storage."""
    schema = func._schema
    if schema.name in _LIFT_OPS or not any(ret.alias_info is not None for ret in schema.returns):
        return _ALLOCATES
    return _MUTATES if schema.is_mutable else _VIEWS


# A sparse tensor has no storage of its own: the dense tensors it is made of hold its bytes.
_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        if obj.layout == torch.strided:
            yield obj
        else:                     # sparse: its parts; opaque (mkldnn): no storage to count
            for part in _SPARSE_PARTS.get(obj.layout, ()):
                yield getattr(obj, part)()
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


_expired = torch.UntypedStorage._expired
_free_weak_ref = torch.UntypedStorage._free_weak_ref


class _Ballast:
    """A tiny collector-tracked object, held in reserve to keep the meter collector-neutral.

    Asking a tensor for its storage creates a Python storage object that lives as long as
    the storage and counts as one allocation towards the collector's generation-0
    threshold, which no unmetered program pays.  For each such object the meter frees one
    `_Ballast`, and gives one back when a storage is freed by reference counting, so a
    metered loop triggers collections when the same loop unmetered would (see
    tests/test_memory.py::test_metering_does_not_change_when_the_collector_runs).
    """
    __slots__ = ()


_BALLAST_RESERVE = 65536     # about 2 MiB; enough for 65k storages alive at once or freed by a collection
_ballast: list = []


def _refill_ballast():
    was_enabled = gc.isenabled()
    gc.disable()        # one collection at most after a refill, not one per 700 objects
    try:
        _ballast.extend(_Ballast() for _ in range(_BALLAST_RESERVE - len(_ballast)))
    finally:
        if was_enabled:
            gc.enable()


_refill_ballast()


class _CpuStorageTracker(TorchDispatchMode):
    """Counts live CPU storages created while it is the active dispatch mode.

    Its bookkeeping is dicts of plain integers (a storage's address, a C-level weak
    reference to it, its size): none of it is tracked by Python's collector, so metering
    a loop does not change when the collector runs, which is what lessons measure.
    """

    def __init__(self, budget: int | None):
        super().__init__()
        self.budget = budget
        self._weak: dict[int, int] = {}   # storage address -> weak reference handle
        self._size: dict[int, int] = {}   # storage address -> bytes
        self._counted = 0                 # bytes in _size, some perhaps freed since the last sweep
        self.peak = 0
        self._kinds: dict = {}            # op -> _ALLOCATES, _MUTATES or _VIEWS
        self._collections = 0             # collections seen so far
        self._collections_at_sweep = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Torch wraps a mode's __torch_dispatch__ so that torch.compile never traces it,
        # and that wrapper imports torch._dynamo (over a second) on its first call.  The
        # meter measures eager code and does not run under torch.compile: no wrapper.
        return False

    def __enter__(self):
        gc.callbacks.append(self._on_gc)
        return super().__enter__()

    def __exit__(self, *exc):
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        result = super().__exit__(*exc)
        _refill_ballast()     # after measuring, so the refill's allocations land outside it
        return result

    def _on_gc(self, phase, info):
        if phase == "start":
            self._collections += 1

    @property
    def total(self) -> int:
        """Bytes held by live counted storages, exact at the moment of the call."""
        return self._sweep()

    def _sweep(self) -> int:
        weak = self._weak
        freed = [key for key, ref in weak.items() if _expired(ref)]
        if freed:
            size = self._size
            for key in freed:
                _free_weak_ref(weak.pop(key))
                self._counted -= size.pop(key)
            # Storages freed by a collection did not lower the collector's count (it had
            # just been reset); those freed by reference counting did, so give that back.
            if self._collections == self._collections_at_sweep:
                for _ in freed:
                    _ballast.append(_Ballast())
        self._collections_at_sweep = self._collections
        return self._counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = _op_kind(func)
        if kind is _ALLOCATES:
            if type(out) is torch.Tensor and out.layout is torch.strided and out.is_cpu:
                storage = out.untyped_storage()          # the common case, inlined: one new tensor
                ref = self._weak.get(storage._cdata)
                if ref is not None and _expired(ref):
                    self._sweep()                        # a freed storage's address was reused
                    ref = None
                if ref is None:
                    self._admit_one(storage, func)
                return out
            new = self._new_storages(out)
            if new:
                self._admit(new, func)
        elif kind is _MUTATES:
            self._regrow(out, func)
        return out

    def _new_storages(self, out):
        """{storage address: storage} for the CPU storages in `out` not counted yet."""
        if type(out) is torch.Tensor and out.layout is torch.strided:
            tensors = (out,)              # the common case, without a generator
        else:
            tensors = _tensors(out)
        found = {}
        weak = self._weak
        for tensor in tensors:
            if not tensor.is_cpu:
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in found:
                continue
            if key in weak:
                if not _expired(weak[key]):
                    continue              # already counted
                self._sweep()             # a freed storage's address was reused
            found[key] = storage
        return found

    def _admit(self, new, func):
        sizes = {key: storage.nbytes() for key, storage in new.items()}
        nbytes = sum(sizes.values())
        if self._counted + nbytes > self.peak or (self.budget is not None
                                                   and self._counted + nbytes > self.budget):
            self._sweep()                 # make the count exact before judging it
        if self.budget is not None and self._counted + nbytes > self.budget:
            raise self._over_budget(f"{func._schema.name} tried to allocate {format_bytes(nbytes)} "
                                    f"with {format_bytes(self._counted)} of the "
                                    f"{format_bytes(self.budget)} budget already held by live tensors")
        for key, storage in new.items():
            self._track(key, storage, sizes[key])
        if self._counted > self.peak:
            self.peak = self._counted

    def _admit_one(self, storage, func):
        """`_admit` for one storage not counted yet, without its dicts when no peak or budget is near."""
        nbytes = storage.nbytes()
        if self._counted + nbytes > self.peak or (self.budget is not None
                                                  and self._counted + nbytes > self.budget):
            self._admit({storage._cdata: storage}, func)
        else:
            self._track(storage._cdata, storage, nbytes)

    def _track(self, key, storage, nbytes):
        self._weak[key] = storage._weak_ref()
        if _ballast:
            _ballast.pop()
        self._size[key] = nbytes
        self._counted += nbytes

    @staticmethod
    def _over_budget(what: str) -> torch.OutOfMemoryError:
        return torch.OutOfMemoryError(
            f"Simulated CPU budget exceeded: {what}. (No GPU here: gclab.memory.Meter "
            "enforces this budget in place of the CUDA allocator.)")

    def _regrow(self, out, func):
        """An in-place or out= op can resize a counted storage (`out=` into an empty tensor,
        `resize_`): count its new size.  The bytes are already taken, so they are counted
        even when they pass the budget, and then the budget error is raised."""
        for tensor in _tensors(out):
            if not tensor.is_cpu:
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key not in self._weak or _expired(self._weak[key]):
                continue                  # not created under this meter
            delta = storage.nbytes() - self._size[key]
            if not delta:
                continue
            self._size[key] += delta
            self._counted += delta
            if delta > 0:
                self._sweep()
                self.peak = max(self.peak, self._counted)
                if self.budget is not None and self._counted > self.budget:
                    raise self._over_budget(f"{func._schema.name} grew a tensor by {format_bytes(delta)} "
                                            f"to {format_bytes(self._counted)} held, past the "
                                            f"{format_bytes(self.budget)} budget")

    def forget_all(self):
        """Stop counting and release the weak references."""
        for ref in self._weak.values():
            _free_weak_ref(ref)
        self._weak.clear()
        self._size.clear()
        self._counted = 0


class Meter:
    """Bytes held by live tensors on one device, with a peak, an optional budget and a timeline.

    >>> with Meter("cpu") as m:
    ...     x = torch.zeros(1024)
    ...     m.allocated()
    4096

    On CPU the count starts at 0 and covers tensors created inside the `with` block.
    On CUDA `allocated()` is `torch.cuda.memory_allocated()` (everything live on the
    device) and `baseline` is its value on entry; compare `growth()` to judge a leak
    the same way on both.
    """

    def __init__(self, device=None, budget: int | None = None):
        self.device = torch.device(device) if device is not None else default_device()
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"Meter measures 'cpu' or 'cuda' tensors, not {self.device.type!r}")
        if budget is not None and budget <= 0:
            raise ValueError(f"budget must be a positive number of bytes, got {budget!r}")
        self.budget = budget
        # The timeline is kept as lists of plain numbers and strings: appending to them
        # allocates no object the collector counts, so recording does not change when it runs.
        self._labels: list[str] = []
        self._seconds: list[float] = []
        self._bytes: list[int] = []
        self.baseline = 0
        self.oom: MeterPoint | None = None
        self._tracker: _CpuStorageTracker | None = None
        self._cuda_fraction: float | None = None
        self._started: float | None = None   # time.perf_counter() when the meter started
        self._active = False

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def started(self) -> float | None:
        """`time.perf_counter()` when the meter started (None before), to line it up with gcwatch."""
        return self._started

    @property
    def simulated(self) -> bool:
        """True when the budget is enforced by the meter rather than a real allocator."""
        return not self.is_cuda

    def describe(self) -> str:
        return describe_device(self.device)

    # -- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> "Meter":
        if self._active:
            raise RuntimeError("this Meter is already running; create a new one")
        self._active = True
        self._started = time.perf_counter()
        if self.is_cuda:
            self._enter_cuda()
        else:
            self._tracker = _CpuStorageTracker(self.budget)
            self._tracker.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and issubclass(exc_type, torch.OutOfMemoryError) and self.oom is None:
            self.oom = self._point("OOM")
        if self.is_cuda:
            self._exit_cuda()
        else:
            self._final = (self._tracker.total, self._tracker.peak)
            self._tracker.__exit__(exc_type, exc, tb)
            self._tracker.forget_all()
        self._active = False
        return False

    @contextlib.contextmanager
    def paused(self):
        """Nothing of the meter in the process while the block runs: on CPU no dispatch mode is
        active and no hook is in gc.callbacks, so code cannot tell it from an unmetered run.
        Tensors made and freed inside are never seen; counted ones freed inside are.  (On CUDA
        the meter installs nothing, and reading the allocator's count goes on.)"""
        if self.is_cuda or not self._active:
            yield self
            return
        self._tracker.__exit__(None, None, None)
        try:
            yield self
        finally:
            self._tracker.__enter__()

    def _enter_cuda(self):
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.baseline = cuda_bytes(self.device)
        if self.budget is not None:
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(self.device).total_memory
            cap = cuda_bytes(self.device, "reserved_bytes") + self.budget
            get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.6
            self._cuda_fraction = get_fraction(self.device) if get_fraction else 1.0
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), self.device)

    def _exit_cuda(self):
        self._final = (cuda_bytes(self.device), cuda_bytes(self.device, which="peak"))
        if self._cuda_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(self._cuda_fraction, self.device)
            self._cuda_fraction = None

    # -- readings --------------------------------------------------------------------
    def allocated(self) -> int:
        """Bytes held right now by live tensors on the device (see the class docstring)."""
        if not self._active:
            return self._final[0] if self._started is not None else 0
        if self.is_cuda:
            return cuda_bytes(self.device)
        return self._tracker.total

    def growth(self) -> int:
        """`allocated()` minus its value when the meter started."""
        return self.allocated() - self.baseline

    def peak(self) -> int:
        """The most `allocated()` has been since the meter started."""
        if not self._active:
            return self._final[1] if self._started is not None else 0
        if self.is_cuda:
            return cuda_bytes(self.device, which="peak")
        return self._tracker.peak

    def reserved(self) -> int:
        """Bytes the device's allocator holds, cached blocks included.

        On CUDA, `torch.cuda.memory_reserved()`: PyTorch's part of what `nvidia-smi` shows,
        which stays up after tensors die until `torch.cuda.empty_cache()`.  The CPU meter has
        no cache to report (PyTorch's CPU allocator hands a freed tensor's bytes straight
        back to the C library), so there it equals `allocated()` at every moment, and
        `empty_cache()` changes nothing.
        """
        if self.is_cuda and self._active:
            return cuda_bytes(self.device, "reserved_bytes")
        return self.allocated()

    def record(self, label: str = "") -> int:
        """Append the current reading to `timeline`; returns the bytes allocated now."""
        allocated = self.allocated()
        self._labels.append(label)
        self._seconds.append(time.perf_counter() - self._started)
        self._bytes.append(allocated)
        return allocated

    @property
    def timeline(self) -> list[MeterPoint]:
        """The recorded points, in order."""
        return [MeterPoint(*point) for point in zip(self._labels, self._seconds, self._bytes)]

    def _point(self, label: str) -> MeterPoint:
        return MeterPoint(label, time.perf_counter() - self._started, self.allocated())

    def __repr__(self):
        state = "running" if self._active else "stopped"
        budget = f", budget={format_bytes(self.budget)}" if self.budget else ""
        return (f"<Meter {self.device} {state}: allocated={format_bytes(self.allocated())}, "
                f"peak={format_bytes(self.peak())}{budget}>")


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


def _warm_up_dispatch():
    """Torch builds its Python dispatch machinery the first time a mode is used, leaving
    about 1,700 objects in reference cycles.  Do that here, once, and collect them, so a
    learner's first `Meter` does not hand the collector garbage that is not theirs."""
    with _CpuStorageTracker(budget=None) as tracker:
        torch.zeros(1).add(1)
    tracker.forget_all()
    gc.collect()


_warm_up_dispatch()



# -- a census of allocations, from torch's profiler ------------------------------------
class AllocationCensus:
    """The bytes torch's allocators (CPU and CUDA) hand out while the census runs and do not take
    back, read from the profiler's allocation events.  The allocators send those whatever made
    the tensor, so the census sees what `Meter`'s dispatch mode cannot (tensors made with torch's
    dispatch turned off).  Memory allocated before the census is not counted, nor is its release,
    so freeing memory reserved beforehand cannot offset what is kept; the exception is `carried`,
    what an earlier census counted and left `alive`, whose release does count.  Only the
    allocations of the thread that runs it are seen (and of autograd's threads).

    >>> with AllocationCensus() as census:
    ...     census.mark()
    ...     kept = torch.zeros(1024)
    ...     census.mark()
    >>> census.held()
    [0, 4096]

    On a CUDA GPU torch's profiler reports no CUDA allocation unless it traces the GPU too (seen
    on an H100, torch 2.11): there the CUDA side is read from the caching allocator's own history
    (`_CudaHistory`), which every thread's allocations go into.

    The profiler writes notes on the C library's stderr when it starts, stops, or sees memory
    freed that was allocated before it; they are silenced while the census runs.  `error` says
    why there is no count: a profiler (or CUDA's memory history) was already running, or
    something stopped this one.
    """

    _MARK = "gclab.census.mark"

    def __init__(self, carried: dict | None = None):
        self.error: str | None = None
        self.alive: dict = dict(carried or {})     # (device, address) -> bytes, at the end
        self._held: list[int] = []
        self._running = False
        self._quiet = None
        self._marks = 0
        self._cuda = _CudaHistory.for_this_process()

    @property
    def available(self) -> bool:
        """False in a torch whose profiler API the census does not know: then it counts nothing."""
        return _PROFILER is not None

    def __enter__(self) -> "AllocationCensus":
        if not self.available:
            return self
        if _PROFILER.running():
            self.error = "torch's profiler was already running, so allocations could not be counted"
            return self
        self._quiet = _stderr_silenced()
        self._quiet.__enter__()
        try:
            _PROFILER.prepare(_PROFILER.config, _PROFILER.activities)
            _PROFILER.enable(_PROFILER.config, _PROFILER.activities, _PROFILER.scopes)
        except Exception as exc:
            self._quiet.__exit__(None, None, None)
            self.error = f"torch's profiler could not start ({exc})"
            return self
        self._running = True
        if self._cuda is not None:
            self._cuda.start()
        return self

    def mark(self) -> None:
        """A point to read the count at (a user-scope record_function, in the profiler's clock)."""
        if self._running:
            self._marks += 1
            with torch.profiler.record_function(self._MARK):
                pass
            if self._cuda is not None:
                self._cuda.mark()

    def __exit__(self, *exc):
        if not self._running:
            return False
        self._running = False
        try:
            result = _PROFILER.disable()
        except Exception:
            result = None
        finally:
            self._quiet.__exit__(None, None, None)
        base = sum(self.alive.values())
        cuda_held = self._cuda.stop(self.alive) if self._cuda is not None else []
        if result is not None:
            skipped = self._cuda.name if self._cuda is not None else None
            self._held = [base + n for n in
                          _count(result.experimental_event_tree(), self._MARK, self.alive, skipped)]
        if result is None or len(self._held) != self._marks:     # stopped (and started again) meanwhile
            self.error = "the code that ran stopped the profiler that counts allocations"
        elif self._cuda is not None and (self._cuda.error or len(cuda_held) != self._marks):
            self.error = self._cuda.error or "the code that ran stopped CUDA's memory history that counts allocations"
        elif self._cuda is not None:
            self._held = [n + m for n, m in zip(self._held, cuda_held)]
        return False

    def held(self) -> list[int] | None:
        """Bytes held at each mark by what was allocated while the census ran, and what it
        carried (None with an `error`, or where the census is not `available`)."""
        return None if self.error or not self.available else self._held


def _count(tree, mark: str, alive: dict, skipped_device: str | None = None) -> list[int]:
    """The profiler's allocation events replayed in order on `alive`: the bytes they added at each
    mark (those of `skipped_device`, which the CUDA history counts, left out)."""
    events, stack = [], list(tree)
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _PROFILER.allocation:
            fields = event.extra_fields
            device = str(fields.device)
            if device != skipped_device:
                events.append((event.start_time_ns, 1, fields.ptr, fields.alloc_size, device))
        elif event.name == mark:
            events.append((event.start_time_ns, 0, 0, 0, ""))
    return _replay([(ptr, size, device) if is_allocation else None
                    for _, is_allocation, ptr, size, device in sorted(events)], alive)


def _replay(events, alive: dict) -> list[int]:
    """`events` in order, each None (a mark) or (address, bytes, device): bytes > 0 an allocation,
    else a release.  Applied to `alive`; returns the bytes added since the start at each mark."""
    held, total = [], 0
    for event in events:
        if event is None:
            held.append(total)
            continue
        ptr, size, device = event
        if size > 0:
            total += size - alive.get((device, ptr), 0)
            alive[device, ptr] = size
        else:                     # a release; of memory allocated before (and not carried), ignored
            total -= alive.pop((device, ptr), 0)
    return held


class _CudaHistory:
    """The CUDA side of an `AllocationCensus`: the caching allocator's history of its own actions
    (`torch.cuda.memory._record_memory_history`, with no stack kept), read back from `_snapshot()`.
    Marks are allocations of the smallest block, freed at once, on a stream of the census's own that
    no other code uses: the history keeps its actions in order, and the marks among them.  The
    history is empty when it starts (turning it off clears it), so its first allocation is the
    census's start (after the segment the allocator may map for it: seen on an H100, torch 2.11);
    where it is not, the history was restarted or wrapped round, and there is no count."""

    MAX_ENTRIES = 1_000_000
    # The history is a vector that grows as it fills and keeps its capacity when cleared: filled this
    # far at the first start on a device, it grows no more in a check's measured part (whose heap is read).
    ROOM = 30_000

    def __init__(self, device: torch.device):
        self.device, self.name = device, str(device)
        self.error: str | None = None
        self._stream = None

    @classmethod
    def for_this_process(cls) -> "_CudaHistory | None":
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return None             # no CUDA tensor exists before CUDA starts; a step that starts it is counted by the meter
        return cls(torch.device("cuda", torch.cuda.current_device()))

    def start(self) -> None:
        if _cuda_history_enabled():
            self.error = "CUDA's memory history was already being recorded, so allocations could not be counted"
            return
        try:
            if self.name not in _MARK_STREAMS:
                _MARK_STREAMS[self.name] = torch.cuda.Stream(self.device)
            self._stream = _MARK_STREAMS[self.name]
            if self.name not in _HISTORY_WITH_ROOM:
                self._record()
                for _ in range(self.ROOM // 3):  # three entries each: alloc, free_requested, free_completed
                    self._mark_block()
                torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
                _HISTORY_WITH_ROOM.add(self.name)
            self._record()
            self._mark_block()                   # the start
        except Exception as exc:
            self.error = f"CUDA's memory history could not start ({exc})"
            self._stream = None
            with contextlib.suppress(Exception):
                torch.cuda.memory._record_memory_history(enabled=None, device=self.device)

    def _record(self) -> None:
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                 max_entries=self.MAX_ENTRIES, device=self.device)

    def _mark_block(self) -> None:
        torch.cuda.caching_allocator_delete(torch.cuda.caching_allocator_alloc(1, self.device, self._stream))

    def mark(self) -> None:
        if self._stream is not None:
            self._mark_block()

    def stop(self, alive: dict) -> list[int]:
        """The bytes added at each mark (applied to `alive`); [] with an `error`."""
        if self._stream is None:
            return []
        recording = _cuda_history_enabled()
        try:
            snapshot = torch.cuda.memory._snapshot(self.device) if recording else {}
        finally:
            if recording:
                torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
        traces = snapshot.get("device_traces", [])
        events = _history_events(traces[self.device.index] if self.device.index < len(traces) else [], self.name,
                                 self._stream.cuda_stream)
        if events is None:
            self.error = ("the code that ran stopped CUDA's memory history that counts allocations" if not recording
                          else "CUDA's memory history was restarted or overflowed while it counted allocations")
            return []
        return _replay(events, alive)


_HISTORY_WITH_ROOM: set = set()         # devices whose history has been given room (`_CudaHistory.ROOM`)
_MARK_STREAMS: dict = {}                # device -> the stream the census marks on


def _cuda_history_enabled() -> bool:
    probe = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    return bool(probe()) if probe is not None else False


def _history_events(entries, device: str, marks_stream: int | None = None):
    """The allocator's history as `_replay` takes it: the program's allocations and releases, and a
    mark for each allocation on the marks' stream after the first (the census's start).  That stream
    is `marks_stream` where the history names it so, else the stream of the first allocation.  None
    where the history does not begin with that start: nothing but the allocator's own bookkeeping
    (segments mapped, frees completed) may come before it, or it was restarted, or wrapped round."""
    first = next((i for i, e in enumerate(entries) if e.get("action") in ("alloc", "free_requested")), None)
    if first is None or entries[first].get("action") != "alloc":
        return None
    streams = {e.get("stream") for e in entries if e.get("action") == "alloc"}
    if marks_stream not in streams:
        marks_stream = entries[first].get("stream")
    if entries[first].get("stream") != marks_stream:
        return None
    events = []
    for entry in entries[first + 1:]:
        action = entry.get("action")
        if action not in ("alloc", "free_requested"):
            continue
        if entry.get("stream") == marks_stream:
            if action == "alloc":
                events.append(None)
            continue
        size = entry.get("size", 0)
        events.append((entry.get("addr"), size if action == "alloc" else -size, device))
    return events


@contextlib.contextmanager
def _stderr_silenced():
    null = _open(os.devnull, os.O_WRONLY)
    try:
        with _stderr_into(null):
            yield
    finally:
        _close(null)


def _census_profiler():
    """torch's low-level profiler API, as the census uses it, or None in a torch that has it otherwise."""
    try:
        from torch._C._autograd import _disable_profiler, _enable_profiler, _prepare_profiler, _profiler_enabled
        from torch._C._profiler import (
            _EventType, _ExperimentalConfig, ProfilerActivity, ProfilerConfig, ProfilerState, RecordScope)
        config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
    except (ImportError, AttributeError, TypeError):
        return None
    return types.SimpleNamespace(
        prepare=_prepare_profiler, enable=_enable_profiler, disable=_disable_profiler, running=_profiler_enabled,
        allocation=_EventType.Allocation, config=config,
        # the allocators report every device's allocations to the profiler's CPU side: no CUDA tracing
        activities={ProfilerActivity.CPU},
        # allocation events only: no operator is recorded, which would cost more than the step
        scopes={RecordScope.USER_SCOPE})


_PROFILER = _census_profiler()
