"""Measure the bytes that live tensors hold on a device.

`Meter` is the one way the course measures tensor memory:

* on a CUDA device it reads the caching allocator's count of live tensor bytes (the figure
  `torch.cuda.memory_allocated` gives, read through `memory_stats_as_nested_dict`: see
  `cuda_bytes`), and a budget is enforced by the real allocator;
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

Two readings from outside the dispatch mode, for what it cannot see, live beside it and are
importable from here too: `gclab.census.AllocationCensus` (what torch's allocators hand out) and
`gclab.process_memory.process_memory` (what the whole process holds).
"""
from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .census import AllocationCensus  # noqa: F401  (gclab.memory's names: see there)
from .process_memory import ProcessMemory, process_memory  # noqa: F401  (see there)

__all__ = ["AllocationCensus", "CachingDevice", "Meter", "MeterPoint", "ProcessMemory", "cuda_bytes", "default_device",
           "describe_device", "device_storage", "peak_growth", "format_bytes", "held_while_and_after",
           "process_memory"]

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


def held_while_and_after(make, use, device=None, collector: bool = True) -> tuple[int, int]:
    """`obj = make(); use(obj)` under a `Meter` on `device`, with the automatic collector on or, with
    `collector=False`, off (only reference counting frees): the bytes held once `use` returned, while
    `obj` is alive, and those still held after the last reference this function had to `obj` is dropped.
    Neither reading runs a collection."""
    with contextlib.ExitStack() as stack:
        if not collector:
            was_enabled = gc.isenabled()
            gc.disable()
            if was_enabled:
                stack.callback(gc.enable)
        meter = stack.enter_context(Meter(device))
        obj = make()
        use(obj)
        kept = meter.growth()
        del obj
        return kept, meter.growth()


def peak_growth(call, device=None) -> int:
    """The most `call()` allocated at once on `device` (its Meter's peak above the start), what it
    returned included; it is dropped when the call is done."""
    with Meter(device) as meter:
        call()
        return meter.peak() - meter.baseline


class CachingDevice:
    """A device that other tensors already use (`others` bytes of them) and whose allocator keeps freed
    blocks cached until `torch.cuda.empty_cache()`, as CUDA's does, to measure code against:

        with CachingDevice(cached=MiB):          # 1 MiB of freed blocks cached when measuring starts
            readings = measure(make_tensor)

    On CUDA: the real allocator, with `others` bytes of tensors allocated on entry and `cached` bytes
    allocated and freed (so that the allocator caches them).  On the CPU it is SIMULATED (`simulated`
    is True): while it is entered, every `Meter` reads as that allocator would, from the meter's exact
    count: `allocated()` and `peak()` count the others' bytes too (a meter's `baseline` starts there),
    `reserved()` also counts the blocks cached, every block a meter's tensors needed so far until
    `torch.cuda.empty_cache()` (which does nothing without CUDA) hands back those no live tensor uses.

    `seal(function, name)` wraps each function it installs on `Meter` and on `torch.cuda` (a hidden test
    passes one made with `gclab.checks.sealed_call`, so that what it installs leads nowhere of its own).
    """

    def __init__(self, cached: int = 0, others: int = 3 * MiB, device=None, seal=None):
        self.cached, self.others = cached, others
        self.device = torch.device(device) if device is not None else default_device()
        self.seal = seal or (lambda function, name: function)
        self._meters, self._others, self._installed = [], None, None

    @property
    def simulated(self) -> bool:
        return self.device.type == "cpu"

    def __enter__(self) -> "CachingDevice":
        self._others = torch.empty(self.others // 4, device=self.device)
        if not self.simulated:
            if self.cached:
                torch.empty(self.cached // 4, device=self.device)      # made and freed: cached
            return self
        given = {name: Meter.__dict__[name] for name in ("__enter__", "allocated", "peak", "reserved")}
        meters, others, cached = self._meters, self.others, [self.cached]

        def enter(meter):
            out = given["__enter__"](meter)
            meter.baseline, meter._cached_floor, meter._peak_at_empty = others, None, 0
            meters.append(meter)
            return out

        def reserved(meter):
            live, top = given["allocated"](meter), given["peak"](meter)
            if getattr(meter, "_cached_floor", None) is None:
                return top + others + cached[0]      # every block needed so far is still cached
            meter._cached_floor = max(live, meter._cached_floor, top if top > meter._peak_at_empty else 0)
            return meter._cached_floor + others + cached[0]

        def empty_cache():
            cached[0] = 0
            for meter in meters:
                meter._cached_floor, meter._peak_at_empty = given["allocated"](meter), given["peak"](meter)

        self._installed = (given, torch.cuda.empty_cache)
        seal = self.seal
        Meter.__enter__, Meter.reserved = seal(enter, "__enter__"), seal(reserved, "reserved")
        Meter.allocated = seal(lambda meter: given["allocated"](meter) + others, "allocated")
        Meter.peak = seal(lambda meter: given["peak"](meter) + others, "peak")
        torch.cuda.empty_cache = seal(empty_cache, "empty_cache")
        return self

    def __exit__(self, *exc):
        if self._installed is not None:
            given, empty_cache = self._installed
            for name, function in given.items():
                setattr(Meter, name, function)
            torch.cuda.empty_cache = empty_cache
            self._installed = None
        self._meters.clear()
        self._others = None
        return False


def _warm_up_dispatch():
    """Torch builds its Python dispatch machinery the first time a mode is used, leaving
    about 1,700 objects in reference cycles.  Do that here, once, and collect them, so a
    learner's first `Meter` does not hand the collector garbage that is not theirs."""
    with _CpuStorageTracker(budget=None) as tracker:
        torch.zeros(1).add(1)
    tracker.forget_all()
    gc.collect()


_warm_up_dispatch()
