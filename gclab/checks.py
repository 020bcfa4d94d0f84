"""Checks that self-check cells and hidden tests share.

Each check returns a report that can say, in a sentence, what went wrong and by how
much; the `assert_*` helpers turn a failed report into an AssertionError with that
sentence, which is what a learner (and nbgrader's feedback) sees.
"""
from __future__ import annotations

import array
import contextlib
import gc
import math
import sys
import time
import types
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch

from . import outside
from .gcwatch import Collection, GCWatch
from .held import GraphCensus, HeldBytes, HeldReport, StorageCensus, Unfrozen, graphs_held
from .memory import AllocationCensus, Meter, ProcessMemory, cuda_bytes, format_bytes, process_memory

__all__ = ["FlatReport", "run_flat_check", "assert_flat", "Comparison", "compare",
           "assert_matches", "plain", "integrity_problems", "assert_untampered", "PolicyReport",
           "run_policy_check", "assert_policy", "assert_graphs_do_not_grow", "sealed_call"]

# What the grading relies on, as it was when gclab.checks was first imported (the
# notebook's locked set-up cell imports it before any student code runs); read-only, so that
# no entry can be changed in place to match a replacement.
_ORIGINALS = types.MappingProxyType({
    "gc.collect": gc.collect, "gc.disable": gc.disable, "gc.enable": gc.enable,
    "gc.isenabled": gc.isenabled, "gc.get_count": gc.get_count,
    "gc.get_threshold": gc.get_threshold, "gc.set_threshold": gc.set_threshold,
    "gc.set_debug": gc.set_debug, "gc.get_debug": gc.get_debug, "gc.garbage": gc.garbage,
    "gc.callbacks": gc.callbacks, "time.perf_counter": time.perf_counter,
    "weakref.finalize": weakref.finalize, "torch.OutOfMemoryError": torch.OutOfMemoryError,
})
_OWN = types.MappingProxyType({})   # set at the end of the module: this module's own functions


def _current(name):
    module, attr = name.split(".", 1)
    return getattr({"gc": gc, "time": time, "weakref": weakref, "torch": torch}[module], attr)


def integrity_problems() -> list[str]:
    """Names of the functions the checks rely on that no longer are what they were."""
    problems = [name for name, original in _ORIGINALS.items() if _current(name) is not original]
    problems += [f"gclab.checks.{name}" for name, fn in _OWN.items() if globals().get(name) is not fn]
    return problems


def assert_untampered() -> None:
    problems = integrity_problems()
    assert not problems, ("the grader's tools were replaced by the notebook's code: "
                          + ", ".join(problems) + ". Restore them (restart the kernel) and run again.")


# -- memory flat ---------------------------------------------------------------------
@dataclass
class FlatReport:
    """What happened while `step` ran repeatedly: first with the automatic collector off (the
    last `unwatched` of those iterations with nothing of the grader's in the process), then
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
                 "grader's in the process (no meter, no profiler, no hook in gc.callbacks)")
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
            unwatched = (f", then after {self.unwatched} more with nothing of the grader's watching (measured "
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
                f"in {self.with_collector_on} more iterations with the collector on and nothing of the grader's "
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
    meter watching, then more times with nothing of the grader's in the process: half of
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


# -- results equal the reference -----------------------------------------------------
@dataclass
class Comparison:
    name: str
    ok: bool
    text: str

    def __str__(self):
        return self.text


def _flatten(value):
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist()
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            out.extend(_flatten(v))
        return out
    return [value]


_PLAIN_SCALARS = (bool, int, float, str, type(None))
_PLAIN_NAMES = {bool: "bool", int: "int", float: "float", str: "str", list: "list", tuple: "tuple", dict: "dict",
                torch.Tensor: "torch.Tensor"}


def _a(name: str) -> str:
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def _type_name(kind) -> str:
    return kind.__qualname__ if kind.__module__ in ("builtins", "__main__") else f"{kind.__module__}.{kind.__qualname__}"


def _is_numpy_scalar(value) -> bool:
    """One of numpy's own scalar types (np.float64, np.int64, np.bool_), not a subclass made elsewhere."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.generic) and type(value).__module__ == "numpy"


def plain(value, name: str = "the value"):
    """`value`, checked to be plain data before a test compares it: a bool, int, float, str or
    None (numpy's own scalars become these), an exact torch.Tensor, or a list, tuple or dict of
    plain data, each of exactly that type.
    A subclass or another object could answer ==, float() or len() with whatever the test hopes
    to see, so it is refused with an AssertionError that says what `name` is and what was expected."""
    kind = type(value)
    if kind in _PLAIN_SCALARS or kind is torch.Tensor:
        return value
    if _is_numpy_scalar(value):
        return value.item()             # np.float64 from a numpy sum: numpy's own type, its Python value
    if kind is dict:
        return {plain(key, f"a key of {name}"): plain(item, f"{name}[{key!r}]") for key, item in value.items()}
    if kind in (list, tuple):
        return kind(plain(item, f"{name}[{i}]") for i, item in enumerate(value))
    base = next((t for t in _PLAIN_NAMES if isinstance(value, t)), None)
    if base is None:
        raise AssertionError(f"{name} is {_a(_type_name(kind))}, expected plain data (a number, a str, None, "
                             "a list, tuple or dict of them, or a torch.Tensor)")
    raise AssertionError(f"{name} is {_a(_type_name(kind))} (a subclass of {_PLAIN_NAMES[base]}), "
                         f"expected {_a(_PLAIN_NAMES[base])}")


def compare(name: str, got, expected, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> Comparison:
    """Compare two results element by element and say what matched and by how much it did not."""
    got_flat, exp_flat = _flatten(got), _flatten(expected)
    if len(got_flat) != len(exp_flat):
        return Comparison(name, False, f"{name}: expected {len(exp_flat)} values, got {len(got_flat)}")
    bad = []
    for i, (g, e) in enumerate(zip(got_flat, exp_flat)):
        try:
            same = math.isclose(g, e, rel_tol=rel_tol, abs_tol=abs_tol)
        except TypeError:
            same = g == e
        if not same:
            bad.append((i, g, e))
    if not bad:
        return Comparison(name, True, f"{name}: all {len(exp_flat)} values match the reference")
    i, g, e = bad[0]
    try:
        off = abs(g - e)
        diff = f" (off by {off})" if isinstance(off, int) else f" (off by {off:.6g})"
    except TypeError:
        diff = ""
    return Comparison(name, False, f"{name}: {len(bad)} of {len(exp_flat)} values differ from the "
                      f"reference; first at position {i}: got {g!r}, expected {e!r}{diff}")


def assert_matches(name: str, got, expected, **tolerances) -> None:
    observe(name, got)
    result = compare(name, got, expected, **tolerances)
    assert result.ok, result.text


# -- what a test saw, for the grader to compare with the reference solution's ------------------
# The grader does not take a test's "passed" on the word of the process that ran it: it compares what
# the test observed (the values compared above, what a flat check's steps returned, what a test
# records with `observe`) with what the same test observed running the reference solution.
_OBSERVED: list = []
OBSERVED_VALUES_LIMIT = 2000        # values kept per observation


def observe(name: str, value) -> None:
    """Record `value` (plain data, tensors, or lists of them) as something the running test saw."""
    _OBSERVED.append([str.__str__(name) if type(name) is str else "?", _observable(value)])


def observations(clear: bool = True) -> list:
    """[[name, [values]], ...] recorded since the last call (`clear`: start afresh)."""
    seen = list(_OBSERVED)
    if clear:
        _OBSERVED.clear()
    return seen


def _observable(value) -> list:
    """`value` flattened to at most OBSERVED_VALUES_LIMIT JSON values: a number, str, bool or None as
    it is (NaN and infinities as text), anything else as "<object>" (two right answers may return
    objects of different classes)."""
    try:
        flat = _flatten(value)
    except Exception:
        flat = [value]
    out = []
    for item in flat[:OBSERVED_VALUES_LIMIT]:
        kind = type(item)
        if kind is float and not math.isfinite(item):
            out.append(repr(item))
        elif kind in (bool, int, float, str, type(None)):
            out.append(item)
        elif _is_numpy_scalar(item):
            out.append(_observable(item.item())[0])
        else:
            out.append("<object>")
    return out


# -- a test's function handed to the notebook's code ------------------------------------
# A function defined in a hidden test leads whoever holds it to the test's namespace: its __globals__ (and
# any closure cell) is writable, and no audit event sees it read, so code handed one could rewrite what the
# test counts.  `sealed_call` hands over a stand-in that leads nowhere of the test's.
def sealed_call(function, note=None, *, name=None):
    """`call, record = sealed_call(function, note)`: `call` to hand the notebook's code in place of
    `function` (a function of the test's own), `record` for the test alone.

    `call(*args, **kwargs)` runs `function(*args, **kwargs)` and returns what it returned, or raises the
    exception it raised (its traceback dropped: the frames in it are the test's).  `call` leads its holder
    to none of the test's state: its __globals__ is an empty dict of its own, its closure cells (its own)
    hold a generator's `send` and a message, and `function`, `note` and what was recorded live in that
    generator's locals, which the grading guard lets no learner code read (generator.gi_frame, a
    traceback's frames and the collector's object graph are refused).  Whatever the holder rewrites in
    `call` changes what its own calls through `call` do, never what `record` returns.

    `note(args, kwargs, outcome)`, called after each call with what the call was given and what `function`
    returned or the exception it raised (`isinstance(outcome, BaseException)` tells them apart when
    `function` may raise), returns the entry `record()` lists for that call; keep in an entry only what the
    test needs (a weakref.ref to a result keeps it no longer alive than its holder does).  Without a note,
    each call's entry is None: `len(record())` is the number of calls.  An exception that `note` raises is
    raised to the caller in place of the outcome, and nothing is recorded for that call.

    `record()` returns the entries so far, in order, as a new list; when the notebook's code stopped the
    generator behind `call` (through `send.__self__`: close(), throw()), it raises an AssertionError that
    says so.  `name`: `call`'s __name__ (the one the notebook's code sees; default `function.__name__`).

    Calls do not nest: a call made while another call of the same `call` runs (from `function`, or from
    another thread) raises ValueError ("generator already executing")."""
    name = name if name is not None else getattr(function, "__name__", "call")
    key = object()                 # what `record` sends: no holder of `call` can send it
    running = _sealed_running(function, note, key)
    next(running)
    send = running.send
    stopped = (f"the notebook's code stopped {name}, the function the test handed it (through its generator's "
               "close() or throw()): leave it to run")
    made = _sealed_caller(send, stopped)     # its cells are its own: `record` shares none of them
    call = types.FunctionType(made.__code__, {}, name, None, made.__closure__)
    call.__qualname__ = name

    def record() -> list:
        try:
            return send(key)
        except StopIteration:
            raise AssertionError(stopped) from None
    return call, record


def _sealed_running(function, note, key):
    """The generator behind a sealed call: it runs `function` for each (args, kwargs) sent, and answers
    `key` with the entries noted so far.  Nothing it was sent or answered stays in its locals between calls."""
    entries, out = [], [None]
    while True:
        message = yield out.pop()              # popped: what it answers stays no longer in its locals
        if message is key:
            out.append(list(entries))
            continue
        if type(message) is not tuple or len(message) != 2 or type(message[1]) is not dict:
            message = None
            out.append((False, TypeError("a sealed call is sent (args, kwargs)")))
            continue
        args, kwargs = message
        message = None
        try:
            outcome = (True, function(*args, **kwargs))
        except BaseException as error:         # whatever it raised goes to the caller, KeyboardInterrupt included
            outcome = (False, BaseException.with_traceback(error, None))
        try:
            entries.append(None if note is None else note(args, kwargs, outcome[1]))
        except BaseException as error:
            outcome = (False, BaseException.with_traceback(error, None))
        out.append(outcome)
        args = kwargs = outcome = None


def _sealed_caller(send, stopped):
    """Only the code of `call` is used, with globals of its own: see `sealed_call`."""
    def call(*args, **kwargs):
        try:
            returned, value = send((args, kwargs))
        except StopIteration:
            raise RuntimeError(stopped) from None
        if returned:
            return value
        try:
            raise value
        finally:
            value = None                       # no cycle: the exception's traceback holds this frame
    return call




# -- a GC policy for a server: collector pauses, no full collection in a request, bounded garbage
# What a policy is judged on is what the server records in CPU time and counts (gc.callbacks,
# checked against CPython's own counters), not wall-clock latency: on a busy machine a process
# waiting for a core shows up in wall-clock time, not in the CPU time its collections take.
PAUSE_BUDGET = 0.75         # of the CPU time of one full collection of the server's heap before any policy
GARBAGE_FRACTION = 0.65     # of the responses served
BUSY_BASELINE_P99_MS = 40.0  # collector off, a quiet machine: about 10 ms; above this the machine was too busy
LOAD_BURST = 125            # requests: the graded load's 875 in seven bursts
LOAD_LULL = 0.05            # seconds of quiet after each burst's last answer
# the busier load: evenly spaced requests, one every 2.5 ms, each waiting 5 ms for the device, so that one is
# always in flight and the server is never idle: what a policy leaves to the collector's thresholds runs inside
BUSIER_RATE, BUSIER_DURATION = 400.0, 1.5
MIN_IDLE_MOMENTS = 3        # fewer idle moments than this while the load ran: no chance to collect when idle


@dataclass
class PolicyReport:
    """The policy's run of the load (and, when the first run failed in a way a busy machine can
    cause, a run with the collector off and a second run of the policy, in that order), judged on
    what the server recorded.

    A request is charged with the collections it waited behind: those that ran between its
    scheduled send time and its answer, each at the CPU time it took in the server.  The policy
    passes when every request was answered, the server vouches for its record, no full collection
    ran while a request was in flight (nor at the busier load, where one always is) but at least one
    ran between requests while the load was served, the P99 of those charges is at most `pause_budget` times the CPU time of one full
    collection of the server's heap (measured in the same server before the policy ran), and the
    cyclic garbage stayed under `garbage_fraction` of the responses."""
    runs: dict
    pause_budget: float = PAUSE_BUDGET
    garbage_fraction: float = GARBAGE_FRACTION
    oldest_generation: int = 2
    inconclusive_reason: str | None = None
    first_failures: list | None = None      # what a first run of the policy failed, when it ran twice
    acts_when_idle: bool = True             # has a hook that runs between requests (_acts_when_idle)

    @property
    def policy(self):
        return self.runs["your policy"]

    @property
    def baseline(self):
        return self.runs.get("collector off")

    # -- what the server recorded ------------------------------------------------------
    @property
    def full_collection_cpu(self) -> float:
        return self.policy.trace.info.get("full_collection_cpu") or 0.0

    @property
    def pause_limit(self) -> float:
        """The budget, in CPU seconds, for the collector time charged to a request (P99)."""
        return self.pause_budget * self.full_collection_cpu

    def _p99(self, what: str = "total") -> float:
        """P99 over the requests of one of `Trace.charges`: "total", "longest" or "count"."""
        import numpy as np
        charges = self.policy.trace.charges(self.policy.load)[what]
        return float(np.percentile(charges, 99)) if len(charges) else 0.0

    @property
    def pause_p99(self) -> float:
        """P99 over the requests of the collector CPU time each waited behind (every collection that
        ran between its scheduled send time and its answer, added up), in CPU seconds."""
        return self._p99("total")

    @property
    def full_collections_inside(self) -> list:
        return self.policy.trace.collections_inside_requests(self.oldest_generation)

    @property
    def busier(self):
        return self.runs.get("busier load")

    @property
    def busier_load_failures(self) -> list[str]:
        """What went wrong at the busier load (never idle), where it ran: a record the server could not vouch
        for, full collections inside requests (requests a busy machine left unanswered are not judged there)."""
        run = self.busier
        if run is None:
            return []
        if run.trace.info.get("unavailable"):
            return ["the server did not report its record: " + "; ".join(run.trace.errors[:1])]
        inside = run.trace.collections_inside_requests(self.oldest_generation)
        return [f"tampered: {text}" for text in run.trace.tampered[:2]] \
            + ([f"{len(inside)} full collection(s) ran inside requests, the longest "
                f"{max(c.duration for c in inside) * 1e3:.1f} ms ({max(c.cpu for c in inside) * 1e3:.1f} ms of CPU)"]
               if inside else [])

    @property
    def full_collections_while_serving(self) -> list:
        """Full collections while the load ran (outside requests, for a policy that passes): garbage
        that reached the oldest generation is freed by nothing else.  A policy that runs none has
        only postponed them (raised thresholds): the next comes when the thresholds say, in a request."""
        return self.policy.trace.collections_while_serving(self.oldest_generation)

    @property
    def garbage_bound(self) -> int:
        return int(self.garbage_fraction * len(self.policy.load.status))

    @property
    def peak_garbage(self) -> int:
        garbage = self.policy.trace.garbage
        return max(garbage.get("peak_uncollected", 0), garbage.get("uncollected", 0))

    @property
    def tampered(self) -> list:
        return self.policy.trace.tampered

    @property
    def failures(self) -> list:
        run = self.policy
        problems = [f"{run.load.failed} request(s) got no answer or an error"] if run.load.failed else []
        return problems + list(run.trace.errors)

    # -- wall clock, what users feel (shown, not judged) ---------------------------------
    @property
    def p99_ratio(self) -> float | None:
        return self.policy.p99 / max(self.baseline.p99, 1e-9) if self.baseline is not None else None

    # -- the verdict ---------------------------------------------------------------------
    @property
    def checks(self) -> dict:
        readable = not self.policy.trace.info.get("unavailable")
        return {
            "answers": not self.failures,
            "record vouched for": not self.tampered,
            "no full collection inside a request": readable and not self.full_collections_inside,
            "none at a busier load either": not self.busier_load_failures,
            "collector pauses within budget": readable and self.full_collection_cpu > 0
                                              and self.pause_p99 <= self.pause_limit,
            "full collections while serving": readable and bool(self.full_collections_while_serving),
            "garbage bounded": readable and self.peak_garbage <= self.garbage_bound,
            "garbage collectable": readable and self.garbage_never_freed <= self.garbage_bound // 20,
        }

    @property
    def garbage_never_freed(self) -> int:
        """Garbage still alive after the server's own full collection at the end: frozen while in
        use (gc.freeze()), it can never be collected."""
        return self.policy.trace.garbage.get("left_after_full_collection", 0)

    @property
    def freed_while_serving(self) -> int:
        """Responses' worth of cyclic garbage the collector freed while the load ran."""
        return self.policy.trace.freed_while_serving()

    def _why_over_budget(self) -> str:
        longest = self._p99("longest")
        if longest > self.pause_limit / 2:
            return ("Requests waited behind collections that walk the whole long-lived heap: make a full "
                    "collection cheap before it runs, and run it when it delays no one.")
        return (f"No one collection was that long (the longest a request waited behind: P99 {longest * 1e3:.1f} ms), "
                f"but requests waited behind many in a row (P99 {self._p99('count'):.0f}), each costing far more "
                "than a young collection should: something makes every collection slow, such as gc.set_debug's "
                "DEBUG_STATS, with which every collection counts the objects of every generation, frozen ones "
                "included, and writes them out.")

    def failed_by_facts(self) -> list:
        """Failed checks that a busy machine cannot cause: a tampered record, a full collection in a
        request, pauses as costly as a collection of the whole unfrozen heap, garbage never freed,
        not even in the idle time after the load.  (Unanswered requests, and pauses or garbage a little over budget, can
        come from a machine too busy to serve the load, and are measured again.)"""
        checks, facts = self.checks, []
        for name in ("record vouched for", "no full collection inside a request", "none at a busier load either",
                     "garbage collectable"):
            if not checks[name] and not self.policy.trace.info.get("unavailable"):
                facts.append(name)
        if not checks["collector pauses within budget"] and self.full_collection_cpu > 0 \
                and self.pause_p99 >= self.full_collection_cpu:
            facts.append("collector pauses within budget")
        if not checks["garbage bounded"] and not self.policy.trace.info.get("unavailable") \
                and self.policy.trace.freed_while_serving(until=float("inf")) == 0 \
                and self.policy.trace.garbage.get("uncollected", 0) > self.garbage_bound:
            facts.append("garbage bounded")     # never collected, not even when the server was idle after the load
        if not checks["full collections while serving"] and not self.acts_when_idle \
                and not self.policy.trace.info.get("unavailable"):
            # with no hook between requests, only the collector's own thresholds start a full collection
            # while serving: they count allocations, which a busy machine does not change
            facts.append("full collections while serving")
        return facts

    @property
    def inconclusive(self) -> bool:
        return self.inconclusive_reason is not None

    @property
    def ok(self) -> bool:
        return not self.inconclusive and all(self.checks.values())

    @property
    def verdict(self) -> str:
        return "inconclusive" if self.inconclusive else "pass" if self.ok else "fail"

    def explain(self) -> str:
        run, checks = self.policy, self.checks
        lines = []
        if self.inconclusive:
            lines.append(f"inconclusive: {self.inconclusive_reason}")
        if self.tampered:
            lines.append("tampered: the server cannot vouch for its record, because " + "; ".join(self.tampered[:4])
                         + ". A policy may change when and how the collector runs, not the server's instruments.")
        p = run.load.percentiles()
        wall = f"Wall-clock latency with your policy: P50 {p[50]:.1f} ms, P99 {p[99]:.1f} ms"
        if self.baseline is not None:
            wall += f" (collector off: P99 {self.baseline.p99:.1f} ms, {self.p99_ratio:.2f}x)"
        lines.append(wall + "; on a busy machine these grow whatever the policy, so the grade uses CPU time.")
        if run.trace.info.get("unavailable"):
            lines.append("The server did not report its record: " + "; ".join(run.trace.errors[:1]))
        else:
            full = self.full_collection_cpu * 1e3
            lines.append(
                f"Collector time charged to a request (the collections it waited behind, added up, in CPU time): "
                f"P99 {self.pause_p99 * 1e3:.1f} ms; budget {self.pause_budget:g} x one full collection of the "
                f"server's heap ({full:.1f} ms of CPU) = {self.pause_limit * 1e3:.1f} ms: "
                + ("within budget." if checks["collector pauses within budget"] else
                   "over budget. " + self._why_over_budget()))
            inside = self.full_collections_inside
            if inside:
                worst = max(c.duration for c in inside)
                lines.append(f"{len(inside)} full (generation {self.oldest_generation}) collection(s) ran while "
                             f"requests were in flight, the longest {worst * 1e3:.1f} ms: every request in flight "
                             "waited for it. Run full collections only when no request is in flight.")
            else:
                lines.append("No full collection ran inside a request.")
            if self.busier is not None:
                busier = self.busier_load_failures
                lines.append(
                    f"At a busier load ({len(self.busier.load.status)} requests, one every "
                    f"{1e3 / BUSIER_RATE:.1f} ms: never a moment without one in flight): "
                    + ("no full collection ran inside a request." if not busier else "; ".join(busier) + ". "
                       "Collecting when idle keeps full collections out of requests only while the server is idle "
                       "often enough; raise the third threshold (or pause the collector in requests) so that the "
                       "collector never starts one by itself."))
            if not checks["full collections while serving"]:
                lines.append(
                    f"No full (generation {self.oldest_generation}) collection ran while the load was served: the "
                    "policy postpones them rather than taking them out of requests. Garbage that reached the oldest "
                    "generation (a cached response that outlived two young collections before it was evicted) waits "
                    "for one, and under this policy the next comes when the collector's thresholds say, in the "
                    "middle of a request (raised thresholds only make it come later, over more objects), or never. "
                    "Run full collections while no request is in flight, made cheap by freezing the long-lived heap.")
            garbage = run.trace.garbage
            seen = (f"Cyclic garbage (responses' worth, uncollected): at most {self.peak_garbage} at any time, "
                    f"{garbage.get('uncollected', 0)} left at the end")
            if checks["garbage bounded"]:
                lines.append(f"{seen}; bound {self.garbage_bound}.")
            else:
                lines.append(f"{seen}, over the bound of {self.garbage_bound}: the cycles the server makes wait too "
                             "long for a collection (or never get one), so memory grows while the server is busy. "
                             "Switching the collector off, or collecting only once the load is over, is not a fix.")
            if not checks["garbage collectable"] and garbage.get("saved_in_gc_garbage"):
                lines.append(f"{self.garbage_never_freed} responses' worth of garbage were still alive after the "
                             "server's own full collection at the end, kept in gc.garbage: with gc.DEBUG_SAVEALL "
                             "set (gc.set_debug), the collector keeps everything it finds there and frees none of it, "
                             "so memory grows for as long as the server runs. Leave the debug flags off.")
            elif not checks["garbage collectable"]:
                lines.append(f"{self.garbage_never_freed} responses' worth of garbage were still alive after the "
                             "server's own full collection at the end: objects frozen (gc.freeze()) while in use are "
                             "never collected once they die, so memory grows for as long as the server runs. Freeze "
                             "once, after warm-up, what lives for good.")
        if self.failures:
            seen = Counter(self.failures)          # a hook that fails every time says so once
            lines.append("Errors: " + "; ".join(f"{text} ({n} times)" if n > 1 else text
                                                for text, n in list(seen.items())[:5]))
        if self.first_failures:
            lines.append("(A first run failed on " + ", ".join(self.first_failures) + "; a failure a busy machine "
                         "can cause is measured once more, after a run with the collector off: the figures above "
                         "are the second run's.)")
        return "\n".join(lines)


def _busy_machine(report: PolicyReport, baseline, policy_runs) -> str | None:
    """Why the runs say the machine was too busy to judge what failed, or None.  A policy with no
    hook between requests (`report.acts_when_idle` false) lost nothing when the server was never idle."""
    load, failing = baseline.load, {name for name, ok in report.checks.items() if not ok}
    if load.failed:
        return (f"with the collector off, the same server left {load.failed} of {len(load.status)} requests "
                "unanswered: the machine was too busy to judge a policy; grade again on a quieter machine")
    idle = [run.trace.idle_moments() for run in policy_runs]
    # a server idle a few times gave the policy chances: if it took none, the machine is not why it failed
    took_its_chances = max(idle) == 0 or any(_collected_between_requests(run.trace) for run in policy_runs)
    if (report.acts_when_idle and failing & {"garbage bounded", "full collections while serving"}
            and max(idle) < MIN_IDLE_MOMENTS and took_its_chances):
        return (f"the server found no request in flight only {max(idle)} time(s) while the load ran with your policy "
                "(the lulls between the load's bursts give the reference policy 20 or more on a quiet machine of "
                "two cores, 13 or more beside four CPU-bound processes): the machine was too busy for the server to "
                "keep up, so a policy that collects when the server is idle got no chance; grade again on a quieter "
                "machine")
    if failing & {"answers", "collector pauses within budget"} and baseline.p99 > BUSY_BASELINE_P99_MS:
        return (f"with the collector off, the same server's P99 was {baseline.p99:.0f} ms (a quiet machine: about "
                f"10 ms, expected at most {BUSY_BASELINE_P99_MS:g} ms): the machine was too busy to judge; grade "
                "again on a quieter machine")
    return None


def _collected_between_requests(trace) -> bool:
    """Did a full collection start while the load ran with no request in flight (as one on_idle runs)?"""
    served = [(start, end) for _, start, end in trace.requests]
    return any(not any(start <= c.start <= end for start, end in served)
               for c in trace.collections_while_serving(2))


def _acts_when_idle(policy) -> bool:
    """Does the policy file name a hook that runs between requests (on_idle, after_request)?  Read from
    its source: True when it cannot be read, so that a busy machine is blamed no less than before."""
    try:
        with open(policy) as f:
            source = f.read()
    except (OSError, UnicodeDecodeError):
        return True
    return "on_idle" in source or "after_request" in source


def run_policy_check(policy, rate: float = 250.0, duration: float = 3.5, heap_objects: int = 300_000,
                     pause_budget: float = PAUSE_BUDGET, garbage_fraction: float = GARBAGE_FRACTION,
                     settle: float = 0.5, device=None, seed: int = 0, baseline: bool = False,
                     progress=None, burst: int = LOAD_BURST, lull: float = LOAD_LULL) -> PolicyReport:
    """Serve the load with `policy` (a policy file) and judge it on what the server recorded
    (see PolicyReport).  The load comes in bursts of `burst` requests, each `lull` seconds after
    the last answer to the one before (serving.run_load): the server is idle between bursts
    however busy the machine, so a policy that collects when idle gets its chances on any
    machine.  One run decides when the policy passes, or when it fails on a fact a busy
    machine does not cause (`PolicyReport.failed_by_facts`).  Any other failure is measured again,
    after a run with the collector off (ABA): the second run of the policy decides, unless the
    collector-off run shows the machine was too busy to judge, and the report is then
    inconclusive.  `baseline=True` always adds the collector-off run (its wall-clock P99 is shown
    next to yours).  Once, the policy also serves a busier load (`BUSIER_RATE` evenly spaced requests
    a second, never a moment idle): no full collection may run inside a request there either.
    `progress`: a function called with a line before each run."""
    import os
    import tempfile

    from .serving import measure

    def serve(name, path):
        if progress:
            progress(f"serving the load: {name} ...")
        return measure(name, rate=rate, duration=duration, settle=settle, seed=seed, burst=burst, lull=lull,
                       policy=path, heap_objects=heap_objects, attribution="objects", device=device)

    acts_when_idle = _acts_when_idle(policy)

    def busier_load():
        if progress:
            progress("serving a busier load: your policy, never idle ...")
        return measure("your policy, busier load", rate=BUSIER_RATE, duration=BUSIER_DURATION, settle=0.05, seed=seed,
                       poisson=False, policy=policy, heap_objects=heap_objects, attribution="objects", device=device)

    def judged(runs, **extra):
        return PolicyReport(runs, pause_budget, garbage_fraction, acts_when_idle=acts_when_idle, **extra)

    with tempfile.TemporaryDirectory(prefix="gclab-policy-") as folder:
        off = os.path.join(folder, "collector_off.py")
        with open(off, "w") as f:
            f.write("import gc\n\ndef on_startup():\n    gc.disable()\n")
        first = {"your policy": serve("your policy", policy)}
        if baseline:
            first["collector off"] = serve("collector off", off)
        first["busier load"] = busier_load()
        report = judged(first)
        if report.ok or report.failed_by_facts():
            return report
        failed = [name for name, ok in report.checks.items() if not ok]
        off_run = first.get("collector off") or serve("collector off", off)
        again = serve("your policy", policy)
        runs = {"your policy": again, "collector off": off_run, "your policy (first run)": first["your policy"],
                "busier load": first["busier load"]}
        report = judged(runs, first_failures=failed)
        if report.ok or report.failed_by_facts():
            return report
        busy = _busy_machine(report, off_run, [first["your policy"], again])
        return judged(runs, first_failures=failed, inconclusive_reason=busy) if busy else report


def assert_policy(report: PolicyReport) -> None:
    """Fail with the report's explanation; an inconclusive report fails with a message that
    starts "inconclusive:" (the grader reports it as such, not as a wrong policy)."""
    if report.inconclusive:
        raise AssertionError(report.explain())
    assert report.ok, report.explain()


_OWN = types.MappingProxyType({name: globals()[name] for name in
                               ("run_flat_check", "assert_flat", "compare", "assert_matches", "plain",
                                "integrity_problems", "assert_untampered", "run_policy_check", "assert_policy",
                                "sealed_call")})
