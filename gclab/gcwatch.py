"""Record every run of Python's cyclic garbage collector through `gc.callbacks`.

    with GCWatch() as watch:
        work()
    watch.collections          # [Collection(generation=0, start=..., duration=..., collected=...), ...]

Automatic and explicit (`gc.collect()`) collections are both recorded: the callback
cannot tell them apart, and for a grader both count as "the collector ran".
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass

__all__ = ["Collection", "GCWatch", "gc_disabled"]


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
    """A context manager that records each collection while it is active."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.collections: list[Collection] = []
        self._pending: tuple[int, float] | None = None
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
            self._pending = (info["generation"], self.clock())
        elif phase == "stop" and self._pending is not None:
            generation, start = self._pending
            self._pending = None
            self.collections.append(Collection(
                generation=generation, start=start, duration=self.clock() - start,
                collected=info.get("collected", 0), uncollectable=info.get("uncollectable", 0)))

    # -- summaries -------------------------------------------------------------------
    def count(self, generation: int | None = None) -> int:
        """How many collections ran (of one generation, if given)."""
        return sum(1 for c in self.collections if generation is None or c.generation == generation)

    def total_pause(self) -> float:
        """Seconds spent inside the collector."""
        return sum(c.duration for c in self.collections)

    def longest_pause(self) -> float:
        return max((c.duration for c in self.collections), default=0.0)

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
