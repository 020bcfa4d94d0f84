"""Record every run of Python's cyclic garbage collector through `gc.callbacks`.

    with GCWatch() as watch:
        work()
    watch.collections          # [Collection(generation=0, start=..., duration=..., collected=...), ...]

Automatic and explicit (`gc.collect()`) collections are both recorded: the callback
cannot tell them apart, and for a grader both count as "the collector ran".

    with GCWatch(count_survivors=True) as watch:     # also: what each collection moved up
        work()
    watch.survivors                # objects each collection found alive and moved to an older generation
    watch.survived_into_oldest()   # since the last full collection: what a full one waits for

`collector_design()` says which collector this interpreter runs (generational,
incremental, free-threaded) and what decides when it runs a full collection.
"""
from __future__ import annotations

import gc
import sys
import sysconfig
import time
from dataclasses import dataclass

__all__ = ["Collection", "GCWatch", "gc_disabled", "CollectorDesign", "collector_design",
           "oldest_generation", "generation_size"]


def oldest_generation() -> int:
    """The number of the oldest generation (2 on CPython's three-generation collectors)."""
    return len(gc.get_threshold()) - 1


def generation_size(generation: int) -> int | None:
    """How many objects the collector tracks in `generation` right now (None where this
    interpreter cannot say: `gc.get_objects(generation=...)` refuses it)."""
    try:
        return len(gc.get_objects(generation=generation))
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class Collection:
    generation: int
    start: float          # seconds, time.perf_counter() clock
    duration: float       # seconds
    collected: int        # unreachable objects found
    uncollectable: int

    def overlaps(self, start: float, end: float) -> bool:
        """Did this collection run at any moment between `start` and `end`?"""
        return self.start < end and self.start + self.duration > start


class GCWatch:
    """A context manager that records each collection while it is active.

    With `count_survivors=True` it also counts, for each collection, the objects it found
    alive and moved to the next older generation (`survivors`, one entry per collection:
    the objects in the generations it examined when it started, less those it found
    unreachable; None where the interpreter cannot list a generation).  Counting lists the
    generations examined, which for a full collection is the whole heap: use it to study
    the collector, not while timing it.
    """

    def __init__(self, clock=time.perf_counter, count_survivors: bool = False):
        self.clock = clock
        self.count_survivors = count_survivors
        self.collections: list[Collection] = []
        self.survivors: list[int | None] = []
        self._pending: tuple[int, float, int | None] | None = None
        self.started: float | None = None

    def __enter__(self) -> "GCWatch":
        self.started = self.clock()
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc):
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        return False

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            examined = _objects_up_to(info["generation"]) if self.count_survivors else None
            self._pending = (info["generation"], self.clock(), examined)
        elif phase == "stop" and self._pending is not None:
            generation, start, examined = self._pending
            end = self.clock()
            self._pending = None
            collected = info.get("collected", 0)
            self.collections.append(Collection(
                generation=generation, start=start, duration=end - start,
                collected=collected, uncollectable=info.get("uncollectable", 0)))
            if self.count_survivors:
                self.survivors.append(None if examined is None else max(0, examined - collected))

    # -- summaries -------------------------------------------------------------------
    def count(self, generation: int | None = None) -> int:
        """How many collections ran (of one generation, if given)."""
        return sum(1 for c in self.collections if generation is None or c.generation == generation)

    def total_pause(self) -> float:
        """Seconds spent inside the collector."""
        return sum(c.duration for c in self.collections)

    def longest_pause(self) -> float:
        return max((c.duration for c in self.collections), default=0.0)

    def survived_into_oldest(self) -> int | None:
        """Objects moved into the oldest generation since the last full collection this watch
        saw (or since it started): the survivors of the collections of the generation just
        below the oldest.  CPython's generational collector keeps this count
        (`long_lived_pending`) and holds a full collection back until it reaches a quarter
        of what the last full collection left in the oldest generation.  Needs
        `count_survivors=True`; None when a count is missing."""
        if not self.count_survivors:
            raise ValueError("create the watch with GCWatch(count_survivors=True) to count survivors")
        oldest = oldest_generation()
        moved = 0
        for collection, survivors in zip(self.collections, self.survivors):
            if collection.generation >= oldest:
                moved = 0
            elif collection.generation == oldest - 1:
                if survivors is None:
                    return None
                moved += survivors
        return moved

    def summary(self) -> str:
        if not self.collections:
            return "no collections"
        by_gen = ", ".join(f"gen {g}: {self.count(g)}"
                           for g in sorted({c.generation for c in self.collections}))
        return (f"{len(self.collections)} collections ({by_gen}); "
                f"{self.total_pause() * 1e3:.1f} ms in total, longest {self.longest_pause() * 1e3:.2f} ms; "
                f"{sum(c.collected for c in self.collections)} objects freed")


class gc_disabled:
    """Turn the automatic collector off inside the block, and restore its state after."""

    def __enter__(self):
        self._was_enabled = gc.isenabled()
        gc.disable()
        return self

    def __exit__(self, *exc):
        if self._was_enabled:
            gc.enable()
        return False


def _objects_up_to(generation: int) -> int | None:
    total = 0
    for g in range(generation + 1):
        size = generation_size(g)
        if size is None:
            return None
        total += size
    return total


# -- which collector this interpreter runs ---------------------------------------------
@dataclass(frozen=True)
class CollectorDesign:
    """What decides when this interpreter's cyclic collector runs (`collector_design()`)."""
    implementation: str     # "cpython", "pypy", ...
    version: str            # "3.11.7"
    design: str             # "generational", "incremental", "free-threaded" or "other"
    thresholds: tuple

    @property
    def quarter_rule(self) -> bool:
        """Does a full collection wait until the objects that survived into the oldest
        generation since the last one are a quarter of it?"""
        return self.design == "generational"

    def describe(self) -> str:
        head = f"{self.implementation} {self.version}, thresholds {self.thresholds}: "
        if self.design == "generational":
            return head + (
                "the generational collector. Generation 0 is collected when allocations minus "
                f"deallocations of tracked objects pass {self.thresholds[0]}; each older generation when "
                "the collections of the one below it since its own last collection pass its threshold; "
                "and a full collection (the oldest generation) also waits until the objects that "
                "survived into the oldest generation since the last full collection are a quarter of it.")
        if self.design == "incremental":
            return head + (
                "the incremental collector of 3.14.0 to 3.14.4: a young generation and an old one that is "
                "collected a slice at a time, with no quarter rule for full collections (3.14.5 went back "
                "to the generational collector).")
        if self.design == "free-threaded":
            return head + (
                "a free-threaded build: every collection examines every tracked object (no generations "
                "for garbage to be left behind in), and one runs only when the heap has grown enough.")
        return head + "not CPython: its collector follows rules of its own."


def collector_design(version=None, implementation=None, gil_enabled=None) -> CollectorDesign:
    """Which cyclic collector this interpreter runs, read from the interpreter itself (the
    arguments say what another interpreter would be: a version tuple, "cpython", ...).

    `gil_enabled=False` stands for a free-threaded build.  The build decides the collector, not
    whether the GIL is on now: a free-threaded build run with PYTHON_GIL=1 (sys._is_gil_enabled()
    True) still runs the free-threaded collector, so this reads how the interpreter was built
    (sysconfig's Py_GIL_DISABLED)."""
    version = tuple(version or sys.version_info)
    implementation = implementation or sys.implementation.name
    if gil_enabled is None:
        gil_enabled = not sysconfig.get_config_var("Py_GIL_DISABLED")
    if implementation != "cpython":
        design = "other"
    elif not gil_enabled:
        design = "free-threaded"
    elif (3, 14, 0) <= version[:3] < (3, 14, 5):
        design = "incremental"
    else:
        design = "generational"
    return CollectorDesign(implementation, ".".join(map(str, version[:3])), design, gc.get_threshold())
