"""A step's memory stays flat: `run_flat_check` runs it again and again and says, in a sentence, how
much memory each watched step kept, and who holds it.

What it measures: the meter's count of live tensor bytes after each watched step (`gclab.memory.Meter`),
with the collector off and then on; the storages torch's allocators handed out while watched
(`AllocationCensus`); and, with nothing of the check's in the process (the meter paused, no hook in
`gc.callbacks`), the process's heap and mappings and the storages its objects reach. What it cannot
see: memory kept by a step that runs fewer times than it does, or only on inputs it never gives.
"""
from __future__ import annotations

import array
import contextlib
import gc
import sys
import time
from dataclasses import dataclass, field

import torch

from . import outside
from .gcwatch import Collection, GCWatch
from .held import GraphCensus, HeldBytes, HeldReport, StorageCensus, Unfrozen, graphs_held
from .memory import AllocationCensus, Meter, ProcessMemory, cuda_bytes, format_bytes, process_memory
from .observed import observe

__all__ = ["FlatReport", "run_flat_check", "assert_flat", "assert_graphs_do_not_grow", "UNWATCHED_AT_LEAST"]


# -- memory flat ---------------------------------------------------------------------
@dataclass
class FlatReport:
    """What happened while `step` ran repeatedly: first with the automatic collector off (the
    last `unwatched` of those iterations with nothing of the check's in the process), then
    (`collector_on` iterations) with it on, so that code which leaks only while the collector
    runs (or checks `gc.isenabled()`), or only while nothing measures it, is caught too."""
    device: torch.device
    iterations: int
    growth: list[int] = field(default_factory=list)          # bytes above baseline after each iteration
    collections: list[Collection] = field(default_factory=list)
    results: list = field(default_factory=list)
    reenabled_gc: bool = False
    error: BaseException | None = None
    collector_on: int = 0                                      # then these, the first `unwatched` of them
                                                               # with the collector off, the rest with it on
    growth_collector_on: list[int] = field(default_factory=list)
    results_collector_on: list = field(default_factory=list)
    held: "HeldReport | None" = None                           # with run_flat_check(holder=...): who holds it
    unwatched: int = 0
    heap_watched: int | None = None                            # heap bytes gained over the watched iterations,
                                                               # beyond what keeping their results costs
    heap_watched_over: int = 0                                 # ... over that many of them (the last ones)
    heap_unwatched: list[int] = field(default_factory=list)    # heap bytes above the unwatched part's start
    blocks_unwatched: list[int] = field(default_factory=list)  # Python objects (small blocks) above it
    device_unwatched: list[int] = field(default_factory=list)  # CUDA: allocated bytes above it
    heap_collector_on: list[int] = field(default_factory=list)  # heap bytes above the collector-on part's start
    collections_unwatched: int = 0
    allocated_watched: list[int] = field(default_factory=list)  # bytes torch's allocators handed out over the
                                                               # watched iterations and still held, after each
    census_error: str | None = None                            # why those could not be counted
    tensors_kept_unwatched: int = 0                            # bytes of tensors the unwatched iterations left
                                                               # alive, beyond those they replaced
    tensors_kept_collector_on: int = 0                         # ... and those with the collector on
    frozen: bool = False                                       # the step froze objects (gc.freeze())

    @property
    def leaked(self) -> int:
        return max(self.growth + self.growth_collector_on, default=0)

    @property
    def _held_collector_on(self) -> list[tuple[int, int]]:
        """(iteration, bytes) where memory was above its baseline with the collector on."""
        if not self.unwatched:
            return [(i, g) for i, g in enumerate(self.growth_collector_on, 1) if g > 0]
        return [(i, max(g, h)) for i, (g, h) in enumerate(zip(self.growth_collector_on, self.heap_collector_on), 1)
                if h > self.HEAP_SLACK]

    @property
    def _on_path_ok(self) -> bool:
        # collections may run on this path and free older garbage, so memory may end below its baseline
        return (len(self.growth_collector_on) == self.with_collector_on and not self._held_collector_on
                and self.tensors_kept_collector_on <= 0)

    @property
    def with_collector_on(self) -> int:
        return self.collector_on - self.unwatched

    # What the process's memory (heap and mappings) may gain over the unwatched iterations of a leak-free step: a few
    # hundred bytes of first-time costs (measured: at most 2.2 KiB over the course's lessons; in
    # a Jupyter kernel, 16 KiB once, other threads included), below one leaked tensor of any
    # lesson (64 KiB).
    HEAP_SLACK = 32 * 1024
    # ... and over the watched iterations, beyond the results kept as data: the meter's bookkeeping
    # (measured: at most 2 KiB per iteration)
    HEAP_PER_WATCHED_ITERATION = 8 * 1024
    # Python's small objects (floats, short lists, dicts: sys.getallocatedblocks) the unwatched
    # iterations may add: an entry or two in a history list per step is a few; a copy of a step's
    # outputs as numbers is thousands
    BLOCKS_SLACK, BLOCKS_PER_UNWATCHED_ITERATION = 256, 64

    # What torch's allocators may hand out and keep over the watched iterations when the meter saw
    # every tensor come back: nothing (measured: 0 over every lesson's steps)
    ALLOCATED_SLACK = 0

    @property
    def ok_so_far(self) -> bool:
        return (self.error is None and all(g == 0 for g in self.growth) and not self.collections
                and not self.reenabled_gc and not self._hidden_from_the_meter and not self._allocated_unseen
                and self._unwatched_ok and not self.frozen)

    @property
    def _allocated_unseen(self) -> bool:
        """Torch's allocators handed out memory that was still held after the watched iterations,
        or could not be asked: the meter's count is not the whole story."""
        return self.census_error is not None or (
            not any(self.growth) and max(self.allocated_watched, default=0) > self.ALLOCATED_SLACK)

    @property
    def _hidden_from_the_meter(self) -> bool:
        """The meter saw memory come back, yet the process's heap grew past what keeping the
        results explains: tensors made where the CPU meter cannot see them."""
        allowed = self.HEAP_SLACK + self.HEAP_PER_WATCHED_ITERATION * self.heap_watched_over
        return not any(self.growth) and self.heap_watched is not None and self.heap_watched > allowed

    @property
    def _unwatched_ok(self) -> bool:
        return (max(self.heap_unwatched, default=0) <= self.HEAP_SLACK and not any(self.device_unwatched)
                and not self.collections_unwatched and not self._objects_kept_unwatched
                and self.tensors_kept_unwatched <= 0)

    @property
    def _objects_kept_unwatched(self) -> int:
        """Python objects the unwatched iterations kept beyond the allowance (0 if within it)."""
        kept = max(self.blocks_unwatched, default=0)
        allowed = self.BLOCKS_SLACK + self.BLOCKS_PER_UNWATCHED_ITERATION * len(self.blocks_unwatched)
        return kept if kept > allowed else 0

    @property
    def ok(self) -> bool:
        return (self.ok_so_far and len(self.growth) == self.iterations
                and len(self.heap_unwatched) == self.unwatched and self._on_path_ok)

    def _explain_hidden(self) -> list[str]:
        if not self._hidden_from_the_meter:
            return []
        over = self.heap_watched_over
        meanwhile = "meanwhile" if over == len(self.growth) else f"over the last {over} of them"
        return [f"the meter saw memory come back after each of {len(self.growth)} iterations, yet the process's memory "
                f"grew by {format_bytes(self.heap_watched)} {meanwhile} (about "
                f"{format_bytes(self.heap_watched / max(over, 1))} per iteration): the code keeps "
                "memory the meter cannot see: tensors made in another thread, with torch's dispatch turned off "
                "or over memory mapped by hand (mmap), or copies of their data (lists of numbers, numpy arrays). "
                "They are memory all the same."]

    def _explain_unseen(self) -> list[str]:
        if not self._allocated_unseen:
            return []
        if self.census_error is not None:
            return [f"{self.census_error}: the check counts what torch allocates with its profiler (on CUDA, with "
                    "the allocator's memory history), and cannot judge the code without it. Run the check with "
                    "neither running, and do not start or stop one inside the step."]
        kept = self.allocated_watched[-1]
        return [f"the meter saw memory come back after each of {len(self.growth)} iterations, yet torch's "
                f"allocator handed out {format_bytes(max(self.allocated_watched))} meanwhile that was still held "
                f"(about {format_bytes(kept / max(len(self.allocated_watched), 1))} per iteration, counted by "
                "torch's profiler): the code keeps tensors the meter cannot see, made with torch's dispatch "
                "turned off. They are memory all the same."]

    def _explain_unwatched(self) -> list[str]:
        where = (f"in {self.unwatched} more iteration{'s' if self.unwatched != 1 else ''} with the collector off, "
                 "run with nothing of the "
                 "check's in the process (no meter, no profiler, no hook in gc.callbacks)")
        lines = []
        grew = max(self.heap_unwatched, default=0)
        if grew > self.HEAP_SLACK:
            lines.append(
                f"{where}, the process's memory grew by {format_bytes(grew)} (about "
                f"{format_bytes(self.heap_unwatched[-1] / len(self.heap_unwatched))} per iteration): the code "
                "keeps memory alive when it is not measured, or makes tensors where the meter cannot see "
                "them (another thread, torch's dispatch turned off, memory mapped by hand). A fix must free "
                "its memory whether or not anything watches it.")
        if self._objects_kept_unwatched:
            lines.append(
                f"{where}, the process kept {self._objects_kept_unwatched:,} more Python objects (about "
                f"{self._objects_kept_unwatched // len(self.blocks_unwatched):,} per iteration): the code keeps "
                "a copy of what each step made (numbers, lists, requests). Keep per step only what is needed, "
                "a number or two.")
        if self.tensors_kept_unwatched > 0:
            lines.append(
                f"{where}, tensors holding {format_bytes(self.tensors_kept_unwatched)} (about "
                f"{format_bytes(self.tensors_kept_unwatched / self.unwatched)} per iteration) were left alive, "
                "beyond those they replaced: the code keeps tensors when it is not measured (and gave back "
                "memory it had reserved, for the process's memory to look level). A fix must free its "
                "tensors whether or not anything watches it.")
        if any(self.device_unwatched):
            lines.append(f"{where}, the device's allocated memory grew by {format_bytes(max(self.device_unwatched))}.")
        if self.collections_unwatched:
            lines.append(
                f"{where}, the collector ran {self.collections_unwatched} time(s) (counted by gc.get_stats()): "
                "a fix must free memory by reference counting alone, watched or not.")
        return lines

    def _explain_growth(self, first) -> str:
        """Memory above the baseline: growing with every iteration, or held at a level it stopped at
        (the latest step's tensors kept in one place: a global, a default argument, an attribute)."""
        (first_i, first_g), last_i, last_g = first, len(self.growth), self.growth[-1]
        if first_g < 0:
            return (f"memory did not stay at its baseline: {format_bytes(-first_g)} below it after iteration {first_i}"
                    f", {format_bytes(last_g)} from it after iteration {last_i}. A step let go of something the steps "
                    "before it kept (an attribute set on some steps only, such as a step that is skipped): every "
                    "step must leave the same memory behind.")
        start = (f"memory did not return to its baseline: {format_bytes(first_g)} above it after "
                 f"iteration {first_i}, {format_bytes(last_g)} after iteration {last_i}")
        earlier = self.growth[:max(first_i, last_i // 2)]
        if last_i >= first_i + 2 and 0 < last_g <= max(earlier):
            if self.collections:
                return (f"{start}, never more than {format_bytes(max(self.growth))} in between: each collection "
                        "during the check freed what the steps before had left, never the latest step's. The step "
                        "leaves its tensors in reference cycles, which only the collector frees; a fix lets "
                        "reference counting free them.")
            return (f"{start}, never more than {format_bytes(max(self.growth))} in between: it stopped growing. "
                    "Something keeps the latest step's tensors (a global, a default argument, an attribute that "
                    "each step replaces), not every step's; a fix keeps none of them once the step is done.")
        # the leak per iteration from where it started: the first iteration above the baseline counts as one
        per_iteration = (last_g - first_g) / (last_i - first_i) if last_i > first_i else first_g
        return (f"{start} (about {format_bytes(per_iteration)} per iteration). Something still refers to "
                "the tensors each step creates.")

    def explain(self) -> str:
        if self.ok:
            unwatched = (f", then after {self.unwatched} more with nothing of the check's watching (measured "
                         "by the process's memory: its heap and mappings)" if self.unwatched else "")
            also = (f", and after each of {self.with_collector_on} more with the collector on"
                    if self.with_collector_on else "")
            return (f"memory was back at its baseline after each of {self.iterations} iterations "
                    f"on {self.device}, with the collector off and no collection{unwatched}{also}: reference "
                    "counting alone frees it.")
        lines = []
        if self.error is not None:
            where = (f"after {len(self.growth)} of {self.iterations} iterations"
                     if len(self.growth) < self.iterations else
                     f"after {len(self.heap_unwatched)} of {self.unwatched} unwatched iterations"
                     if len(self.heap_unwatched) < self.unwatched else
                     f"after {len(self.growth_collector_on)} of {self.with_collector_on} iterations with the collector on")
            lines.append(f"the step raised {type(self.error).__name__}: {self.error} ({where})")
        bad = [(i, g) for i, g in enumerate(self.growth, 1) if g != 0]
        if self.collections:               # first: what the step leaned on explains what memory did
            gens = sorted({c.generation for c in self.collections})
            lines.append(
                f"the collector ran {len(self.collections)} time(s) during the check "
                f"(generation {', '.join(map(str, gens))}), with the automatic collector off: the step called "
                "gc.collect() (or switched the collector on). A fix must free memory by reference counting "
                "alone.")
        if bad:
            lines.append(self._explain_growth(bad[0]))
            if self.held is not None:
                lines.append(self.held.explain())
        if self.reenabled_gc:
            lines.append("the step switched the automatic collector back on (gc.enable()).")
        if self.frozen:
            lines.append(
                "the step froze objects while it was checked (gc.freeze()): frozen objects are out of sight of the "
                "collector and of the census of the tensors a step keeps, so a step that freezes cannot be shown "
                "to keep nothing. Freeze once, after warm-up, outside the step.")
        lines += self._explain_hidden() + self._explain_unseen() + self._explain_unwatched()
        held_on = self._held_collector_on
        if held_on and not bad:
            i, g = held_on[0]
            lines.append(
                f"with the collector switched on, memory was {format_bytes(g)} above its baseline after "
                f"iteration {i} of {len(self.growth_collector_on)}: the code keeps tensors alive when the "
                "collector is on (does it behave differently depending on gc.isenabled()?). A fix must "
                "free memory by reference counting whether the collector is on or off.")
        if self.tensors_kept_collector_on > 0 and not bad:
            lines.append(
                f"in {self.with_collector_on} more iterations with the collector on and nothing of the check's "
                f"watching, tensors holding {format_bytes(self.tensors_kept_collector_on)} were left alive, beyond "
                "those they replaced: the code keeps tensors when the collector is on and nothing measures it. "
                "A fix must free its tensors whether the collector is on or off, watched or not.")
        return " ".join(lines)


def _plain(value):
    """A step's result as plain Python data, so keeping it keeps no tensor alive."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


# Unwatched iterations, whatever `collector_on` asks: a leak of a few KiB per step only shows
# over several (8 KiB a step is 64 KiB over eight, twice the heap's slack)
UNWATCHED_AT_LEAST = 8


def run_flat_check(step, iterations: int = 20, device=None, warmup: int = 0,
                   collector_on: int | None = None, holder=None, holder_name: str | None = None) -> FlatReport:
    """Call `step(i)` for i in range(warmup + iterations) with the automatic collector off and the
    meter watching, then more times with nothing of the check's in the process: half of
    `collector_on` (default: a quarter of `iterations`, at least 2), but at least
    `UNWATCHED_AT_LEAST`, with the collector off, and the other half with it on.

    The meter's baseline is taken after the warm-up iterations; after every watched iteration
    memory must be back at that baseline, to the byte, and no collection (automatic or
    explicit) may run.  Torch's profiler counts those iterations' allocations too
    (`AllocationCensus`, from the allocators themselves): what they keep must come back by its
    count as well, so tensors made with torch's dispatch turned off, which the CPU meter cannot
    see, are caught even when memory reserved beforehand is freed to hide them.  In the
    unwatched iterations the meter is paused (no dispatch mode) and no hook is in gc.callbacks, so code cannot behave well only while watched.  Where the
    process's memory can be read (`process_memory`: every CPU tensor's bytes, whichever thread
    made them and however), those with the collector off must leave the process's memory, the
    CUDA allocator's count and the collector's statistics where they were; those with the
    collector on may run collections, but memory must still be back at (or below) its level
    before them after every iteration: a fix must not depend on the collector being off.
    Elsewhere all `collector_on` run with the collector on, measured by the meter.  The
    collector's previous state is restored after.  Every step is marked for a reader outside the
    process (`gclab.outside`).

    `holder`: the object whose code the step runs (a trainer, a cache), for the learner's
    self-check.  When memory did not come back, the report then also says which of its
    attributes holds the bytes (`FlatReport.held`, see `HeldBytes`), read after the check, so
    the measurement itself is the same with or without it.  `holder_name` is how to write it
    (default: its name in the notebook, found with `gclab.refs.reference_paths`).
    """
    if collector_on is None:
        collector_on = max(2, iterations // 4)
    if process_memory(mappings=False) is not None and collector_on >= 2:
        unwatched = max(collector_on // 2, UNWATCHED_AT_LEAST)
        collector_on = unwatched + collector_on - collector_on // 2
    else:
        unwatched = 0
    meter = Meter(device)
    report = FlatReport(device=meter.device, iterations=iterations, collector_on=collector_on, unwatched=unwatched)
    watch = GCWatch()
    held = None
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with meter:
            try:
                with AllocationCensus() as warming_up:      # what the warm-up keeps, whose release counts
                    warming_up.mark()
                    for i in range(warmup):
                        _plain(step(i))
                baseline = meter.allocated()
                marker = Unfrozen()
                if holder is not None:
                    held = _watch_holder(holder, holder_name, meter.device)
                heap_start, kept = _settled_memory(), 0
                heap_from = _heap_read_from(meter.device, iterations)
                with AllocationCensus(warming_up.alive) as census, watch:
                    census.mark()
                    outside.mark()
                    for n, i in enumerate(range(warmup, warmup + iterations)):
                        if n == heap_from and n and heap_start is not None:
                            heap_start, kept = _settled_memory(), 0
                        result, cost = _kept_as_data(step, i)
                        report.results.append(result)
                        kept += cost
                        report.growth.append(meter.allocated() - baseline)
                        census.mark()
                        outside.mark()
                        if gc.isenabled():
                            report.reenabled_gc = True
                            gc.disable()
                _read_census(report, warming_up, census)
                if heap_start is not None:         # read after the census, whose events take heap
                    report.heap_watched = _settled_memory().total - heap_start.total - kept
                    report.heap_watched_over = iterations - heap_from
                report.collections = list(watch.collections)
                if report.ok_so_far:
                    with meter.paused() if unwatched else contextlib.nullcontext():
                        _run_unwatched_parts(step, meter, report, start=warmup + iterations, carried=census.alive,
                                             marker=marker)
            except Exception as exc:          # reported, not raised: the report says what happened
                report.error = exc.with_traceback(None)   # its frames would hold the step's tensors
            if held is not None:
                if any(report.growth) and not report.ok:
                    report.held = _held_report(held, meter.allocated() - baseline,
                                               len(report.growth) + len(report.growth_collector_on))
                held.close()
    finally:
        report.collections = list(watch.collections)
        if was_enabled:
            gc.enable()
        else:
            gc.disable()
    observe("the flat check: growth after each watched step, collections", [*report.growth, len(report.collections)])
    return report


def _heap_read_from(device, iterations: int) -> int:
    """The watched iteration from which the process's memory is compared: the first, except on CUDA.
    There the driver loads a kernel's code into the process's heap the first time it runs (measured on
    an H100, torch 2.11: 50 MiB for the first sum, 200 MiB for a first forward and backward, 24 MiB
    more for the second), so a step's first calls take memory that is not the step's; from the second
    half on, a step that keeps memory still shows it, one that took the driver's does not.  (The
    profiler's events of the first half, freed when it stops, are a few KiB on the lenient side.)"""
    return iterations // 2 if device.type == "cuda" else 0


def _census(report: FlatReport, marker: Unfrozen) -> StorageCensus:
    """The tensor storages alive now; and whether the step has frozen objects since the check began
    (`Unfrozen`), which the census cannot list."""
    census = StorageCensus(marker)
    report.frozen = report.frozen or census.frozen
    return census


def _read_census(report: FlatReport, warming_up: AllocationCensus, census: AllocationCensus) -> None:
    error = warming_up.error or census.error
    if error:
        report.census_error = error
    elif census.available:                  # else a torch whose profiler API it does not know: no count
        held = census.held()
        report.allocated_watched = [bytes_ - held[0] for bytes_ in held[1:]]


def _settled_memory():
    """The process's memory, the least of a few readings a millisecond apart: what another thread
    holds for an instant (a Jupyter kernel's thread sending a cell's output) is not the step's."""
    best = process_memory()
    for _ in range(3 if best is not None else 0):
        time.sleep(0.001)
        now = process_memory(mappings=False)       # the mappings are the kernel's count: read once
        best = ProcessMemory(min(best.heap, now.heap), min(best.blocks, now.blocks), best.mapped)
    return best


def _kept_as_data(step, i):
    """`step(i)`'s result as plain data, and what keeping it that way costs the process's heap
    (0 where the heap cannot be read): the check's own cost, not the step's.  Credited only for
    data made of Python's own types and plain tensors, whose conversion runs none of the
    learner's code, and never more than the data's own size: a result cannot pass off memory
    it keeps as the cost of converting it."""
    result = step(i)
    before = process_memory(mappings=False)
    plain = _plain(result)
    if before is None or not _is_plain_data(result):
        return plain, 0
    # never below 0: with the collector on, a collection during the conversion frees older garbage
    return plain, max(0, min(process_memory(mappings=False).heap - before.heap, _data_bytes(plain)))


_PLAIN_TYPES = frozenset({int, float, bool, complex, str, bytes, type(None)})


def _is_plain_data(value, depth: int = 0) -> bool:
    kind = type(value)
    if kind in _PLAIN_TYPES or kind is torch.Tensor:
        return True
    if depth < 8 and kind in (list, tuple):
        return all(_is_plain_data(item, depth + 1) for item in value)
    if depth < 8 and kind is dict:
        return all(_is_plain_data(k, depth + 1) and _is_plain_data(v, depth + 1) for k, v in value.items())
    return False


def _data_bytes(value, depth: int = 0) -> int:
    """An upper bound on the bytes plain data (numbers, strings, nested lists, tuples and dicts) takes."""
    size = sys.getsizeof(value, 0)
    if depth < 8 and type(value) in (list, tuple):
        size += sum(_data_bytes(item, depth + 1) for item in value)
    elif depth < 8 and type(value) is dict:
        size += sum(_data_bytes(k, depth + 1) + _data_bytes(v, depth + 1) for k, v in value.items())
    return size


def _collections_so_far() -> int:
    return sum(generation["collections"] for generation in gc.get_stats())


def _run_unwatched_parts(step, meter, report: FlatReport, start: int, carried, marker: Unfrozen) -> None:
    """The unwatched iterations, collector off then on; `carried`: what the step made while watched."""
    storages, made = _run_unwatched(step, report, start, carried, marker)
    try:
        if report.ok_so_far:
            _run_collector_on(step, meter, report, start + report.unwatched, storages, set(carried) | made, marker)
    finally:
        if storages is not None:
            storages.close()


def _run_unwatched(step, report: FlatReport, start: int, carried, marker: Unfrozen) -> tuple[StorageCensus | None, set]:
    """The unwatched, collector-off part of `run_flat_check`: the process's heap and the device's
    count above their values before it, after each iteration, and the collections that ran;
    then the tensor storages it left alive that it did not find (`StorageCensus`), less those
    it freed that the step had made before (`carried`: the allocation census's survivors).
    Returns the census after it (the caller closes it) and where the storages it made are, for
    the next part to replace."""
    if not report.unwatched:
        return None, set()
    storages_before = _census(report, marker)
    try:
        # readings go into arrays made beforehand, and results are not kept, so that the check
        # itself allocates nothing between readings: all they show is the step's
        heap, blocks, device = (array.array("q", bytes(8 * report.unwatched)) for _ in range(3))
        collections, device_start, before = _collections_so_far(), _device_bytes(report.device), _settled_memory()
        for n in range(report.unwatched):
            step(start + n)
            now = _settled_memory()
            heap[n], blocks[n] = now.total - before.total, now.blocks - before.blocks
            device[n] = _device_bytes(report.device) - device_start
            outside.mark()
            if gc.isenabled():
                report.reenabled_gc = True
                gc.disable()
        report.collections_unwatched = _collections_so_far() - collections
        report.heap_unwatched, report.blocks_unwatched = list(heap), list(blocks)
        report.device_unwatched = list(device)
        storages_after = _census(report, marker)
        report.tensors_kept_unwatched = storages_after.new_bytes(storages_before, carried)
        return storages_after, storages_after.new_places(storages_before)
    finally:
        storages_before.close()


def _device_bytes(device) -> int:
    return cuda_bytes(device) if device.type == "cuda" else 0


def _run_collector_on(step, meter, report: FlatReport, start: int, storages_before: StorageCensus | None = None,
                      carried=frozenset(), marker: Unfrozen | None = None) -> None:
    """The collector-on part of `run_flat_check`: growth after each iteration, collections allowed.

    After an unwatched part it runs unwatched too (the meter paused) and is judged by the
    process's heap: what a step keeps from one call to the next (a trainer's gradients, a
    cache's recent models) was made while the meter was paused, so the meter's count would
    move as watched steps replace it, with no byte more held.  Then, as after the unwatched
    part, the tensor storages it left alive beyond `storages_before` (the census after the
    unwatched part: what this collection frees of it, the unwatched part counted as kept), less
    those it replaced of the step's (`carried`)."""
    gc.collect()                 # garbage left from before must not be freed inside the measurement
    baseline, heap_baseline, kept = meter.allocated(), _settled_memory(), 0
    gc.enable()
    try:
        for i in range(start, start + report.with_collector_on):
            result, cost = _kept_as_data(step, i)
            report.results_collector_on.append(result)
            kept += cost
            report.growth_collector_on.append(meter.allocated() - baseline)
            if report.unwatched:
                report.heap_collector_on.append(_settled_memory().total - heap_baseline.total - kept)
            outside.mark()
    finally:
        gc.disable()
        if storages_before is not None:
            storages_after = _census(report, marker)
            report.tensors_kept_collector_on = storages_after.new_bytes(storages_before, carried)
            storages_after.close()


def assert_flat(report: FlatReport) -> None:
    assert report.ok, report.explain()


def assert_graphs_do_not_grow(step, holder, holder_name: str, iterations: int = 10, start: int = 0,
                              warmup: int = 1) -> None:
    """Call `step(i)` for `warmup` values of i from `start`, then for `iterations` more; every autograd graph
    that `holder` keeps must be no bigger after those than before them.  A graph that each step extends (a
    running total of losses) keeps a few hundred bytes of nodes per step on the heap after backward() freed
    what it saved: the tensor meter sees nothing, the node count does.  Nor may the graphs alive anywhere
    else in the process grow (`GraphCensus`: a total kept in a global or on the holder's class), unless the
    holder itself now keeps new ones, new tensors the memory check names."""
    def run(steps):
        for i in steps:
            try:
                step(i)
            except Exception as error:       # said, as run_flat_check says it
                raise AssertionError(f"the step raised {type(error).__name__}: {error} (step {i})") from None

    run(range(start, start + warmup))
    gc.collect()                   # graphs in garbage are not kept: only those still reachable count
    before, process_before = graphs_held(holder, holder_name), GraphCensus()
    run(range(start + warmup, start + warmup + iterations))
    gc.collect()
    after, process_after = graphs_held(holder, holder_name), GraphCensus()
    grown = [(path, before[path], size) for path, size in after.items() if size > before.get(path, size)]
    assert not grown, "; ".join(
        f"{path} carries an autograd graph that grew from {was:,} to {now:,} nodes in {iterations} steps: each "
        "step links its graph to it (a running total such as `total += loss` does), and backward() frees only "
        "the tensors a graph saved, so its nodes pile up on the heap, where the memory check cannot see them. "
        "Keep a number (loss.item()) or a tensor without a graph (loss.detach())" for path, was, now in grown[:2])
    # graphs the holder keeps that it did not keep before are new tensors it holds, which the memory check
    # names; the graphs alive anywhere else must not grow either
    holds_new = set(after) - set(before)
    assert holds_new or process_after.nodes <= process_before.nodes, _graphs_grown_elsewhere(
        process_before, process_after, holder_name, iterations)


def _graphs_grown_elsewhere(before: GraphCensus, after: GraphCensus, holder_name: str, iterations: int) -> str:
    gained, tensor = after.most_grown(before)
    where = ""
    if tensor is not None:
        from .refs import reference_paths
        paths = reference_paths(tensor, max_paths=1)
        where = f" The graph that grew most ({gained:,} nodes more) is kept by {paths[0]}." if paths else ""
    del tensor
    return (f"the autograd graphs alive in the process grew from {before.nodes:,} to {after.nodes:,} nodes in "
            f"{iterations} steps, though nothing {holder_name} holds grew: something else keeps each step's graph "
            "(a running total such as `TOTAL = TOTAL + loss` in a global or on a class, a log record or a list that "
            f"holds a tensor with its graph).{where} "
            "backward() frees only the tensors a graph saved, so its nodes pile up on the heap, where the memory "
            "check cannot see them. Keep a number (loss.item()) or a tensor without a graph (loss.detach())")


def _held_report(held: HeldBytes, growth: int, iterations: int) -> "HeldReport | None":
    try:
        return held.report(growth, iterations)
    except Exception:            # a self-check's extra: it never breaks the check itself
        return None


def _watch_holder(holder, name, device) -> "HeldBytes | None":
    try:
        return HeldBytes(holder, name, device)
    except Exception:            # a self-check's extra: it never breaks the check itself
        return None


