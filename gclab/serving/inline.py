"""Serving in this process, one request after another, with the collector's CPU time charged to each.

`serve_inline(handle, requests)` calls the program's own handler for each request and records when each
ran, the CPU time it took, and every collection (`gc.callbacks`, with this thread's CPU time: not
inflated when the machine is busy), then counts, with one full collection, the cyclic garbage the run
left behind.  With a pause budget it serves the requests once more with no hook in `gc.callbacks`, so
that a program which behaves only while it is watched is told apart.

What it cannot see: concurrency (one request at a time, in this thread), time the program spends in
other threads, and collections in other processes; its counts of full collections come from the
collector's own statistics, which a program cannot rewrite but can make noisy by collecting itself.
"""
from __future__ import annotations

import copy
import gc
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import outside
from .trace import ServedCollection, Trace

if TYPE_CHECKING:
    import numpy as np

@dataclass
class InlineRun:
    """Requests a program served one after another in this process (`serve_inline`): for each,
    (id, start, end) on the perf_counter clock and the CPU seconds it took; every collection
    with its CPU time; what each request returned (or the error it raised); `left`: the
    unreachable objects a full collection found right after the last request (cyclic garbage
    the program's collector settings had not freed yet).

    `full_inside`: full collections that ran inside the requests, by the collector's own count
    (`gc.get_stats`, which needs no hook); `full_inside_unwatched`: the same count for as many
    requests served after them with no hook of `serve_inline`'s in `gc.callbacks` (None when
    that second pass did not run), so that a program which looks for the hook and behaves only
    while it is there is told apart (`differs_unwatched`).

    `frozen`: objects the requests moved out of the collector's sight (`gc.freeze()`, by its own count):
    whatever garbage was among them is never collected, and no count of what is left sees it."""
    requests: list
    cpu: list
    collections: list
    results: list
    left: int = 0
    stopped_early: bool = False
    full_inside: int = 0
    full_inside_unwatched: int | None = None
    frozen: int = 0

    @property
    def trace(self) -> Trace:
        """The same record as a `Trace`, for `gclab.plots.plot_requests`."""
        return Trace(self.requests, self.collections)

    def charges(self) -> "np.ndarray":
        """Per request, the CPU seconds of the collections that ran inside it, added up."""
        import numpy as np
        charged = np.zeros(len(self.requests))
        for c in self.collections:
            for k, (_, start, end) in enumerate(self.requests):
                if start <= c.start < end:
                    charged[k] += c.cpu
                    break
        return charged

    def pause_p99(self) -> float:
        """P99 over the requests of the collector CPU time each one ran (its collections, added up), in CPU seconds."""
        import numpy as np
        return float(np.percentile(self.charges(), 99)) if self.requests else 0.0

    def explicit_full_inside(self) -> int:
        """Full collections the program itself started (gc.collect()) inside the requests, however rarely;
        the collector's own are not counted."""
        return sum(1 for c in self.collections if c.generation == 2 and c.explicit
                   and any(start <= c.start < end for _, start, end in self.requests))

    def collected(self) -> int:
        """Unreachable objects the collections during the run freed."""
        return sum(c.collected for c in self.collections)

    def garbage_left(self) -> float:
        """Of the cyclic garbage the run made, the fraction still waiting after the last request."""
        made = self.collected() + self.left
        return self.left / made if made else 0.0

    def summary(self) -> str:
        gens = ", ".join(f"gen {g}: {sum(c.generation == g for c in self.collections)}" for g in range(3))
        return (f"{len(self.requests)} requests; collections {gens}; collector CPU inside a request: at most "
                f"{self.charges().max(initial=0) * 1e3:.2f} ms, P99 {self.pause_p99() * 1e3:.2f} ms; "
                f"cyclic garbage left after the last request: {self.left} objects "
                f"({self.garbage_left():.0%} of what the run made)"
                + (" (stopped early: over the pause budget whatever the rest would do)" if self.stopped_early else "")
                + (f"; {self.frozen:,} objects frozen while serving (gc.freeze()): never collected, garbage or not"
                   if self.frozen > 0 else "")
                + (f"; {self.differs_unwatched()}" if self.differs_unwatched() else ""))

    def unwatched_margin(self) -> int:
        """Full collections the unwatched pass may run beyond the watched one: the hook's own
        records are allocations, which move the automatic collections a little."""
        return 2 + self.full_inside // 10

    def differs_unwatched(self) -> str:
        """"" when the requests ran about as many full collections unwatched as watched; else a
        sentence saying how many more they ran once nothing was watching."""
        if self.full_inside_unwatched is None or \
                self.full_inside_unwatched <= self.full_inside + self.unwatched_margin():
            return ""
        # the unwatched pass stops as soon as it passes the margin: its count is a lower bound
        return (f"served as many requests again with no hook of the measurement's in gc.callbacks, the requests "
                f"ran at least {self.full_inside_unwatched} full collections, against {self.full_inside} while "
                "watched: a program must do the same whether or not it is measured")


def assert_served(run: InlineRun, pause_budget: float, garbage: str = "the cyclic garbage",
                  garbage_left_at_most: float = 0.5) -> None:
    """A served run (`serve_inline`) held to what a GC policy must do, or an AssertionError that names the
    first rule it broke, what was measured and the limit: every request answered without raising; the P99
    of the collector's CPU time inside a request at most `pause_budget` (CPU seconds); the same number of
    full collections unwatched as watched (`InlineRun.differs_unwatched`); no full collection the program
    started itself inside a request (gc.collect()); nothing frozen while serving (gc.freeze()); the
    automatic collector on at the end, and at most `garbage_left_at_most` of the run's cyclic garbage
    (`garbage`, as the message names it) left unfreed."""
    raised = [result for result in run.results if isinstance(result, Exception)]
    assert not raised, (f"{len(raised)} of {len(run.results)} requests raised an error, the first "
                        f"{type(raised[0]).__name__}: {raised[0]}" if raised else "")
    assert run.pause_p99() <= pause_budget, (
        f"collector pauses over budget: P99 {run.pause_p99() * 1e3:.2f} ms of collector CPU inside a request, "
        f"budget {pause_budget * 1e3:.2f} ms")
    assert not run.differs_unwatched(), run.differs_unwatched()
    assert not run.explicit_full_inside(), (
        f"the program itself started {run.explicit_full_inside()} full collection(s) inside the requests "
        "(gc.collect()): however rarely, a collection the program calls in a request is the band-aid, not the fix; "
        "leave collecting to the collector")
    assert run.frozen <= 0, (
        f"the program froze {run.frozen:,} objects while it served (gc.freeze()): {garbage} among them is never "
        "collected, and no count of the garbage left sees it. Freeze once, before serving, if at all")
    assert gc.isenabled() and run.garbage_left() <= garbage_left_at_most, (
        ("" if gc.isenabled() else "the collector is off after serving; ")
        + f"the collector left {run.garbage_left():.0%} of {garbage} unfreed (at most {garbage_left_at_most:.0%}): "
        "it must stay on and keep collecting, and its collections must reach the older generations, where "
        "long-lived garbage has usually moved by the time it is let go")


def serve_inline(handle, requests, pause_budget: float | None = None, unwatched_requests=None,
                 thread_time=time.thread_time, clock=time.perf_counter) -> InlineRun:
    """Call `handle(request)` for each of `requests` in turn, recording when each ran, the CPU it
    took and every collection (`gc.callbacks`, with the CPU time of this thread: not inflated when
    the machine is busy).  An exception a request raises is kept as its result, without frames.
    Garbage made before the run is collected first; after it, one full collection counts what the
    run left behind.  The collector is left as the program set it.

    With `pause_budget` (CPU seconds), the run stops as soon as so many requests ran a
    collection longer than that that the P99 is over budget whatever the rest would do
    (`stopped_early`): a program that collects in every request is judged in a few requests.
    A run that did not stop early then serves requests once more, unwatched (no hook in
    `gc.callbacks`, the collector's own counts only; their results are dropped), and records
    the full collections inside them (`full_inside_unwatched`, see `InlineRun.differs_unwatched`):
    `unwatched_requests` when given (requests the program has not seen: it cannot tell the
    second pass by them), else copies of the requests served (not the same objects).

    Each request served, in either pass, is marked for a reader outside the process (`gclab.outside`)."""
    record = InlineRun([], [], [], [])
    planned = len(requests)
    over = 0
    pending = {}

    def on_gc(phase, info):
        if phase == "start":
            # the collector starts one by itself once the young generation's count passes its threshold
            # (that count, not yet reset, is over it); a gc.collect() call finds it at or under
            young = gc.get_threshold()[0]
            pending["start"] = (clock(), thread_time(), not (young and gc.get_count()[0] > young))
        elif "start" in pending:
            (start, cpu, explicit), end, cpu_end = pending.pop("start"), clock(), thread_time()
            record.collections.append(ServedCollection(info["generation"], start, end - start,
                                                       info.get("collected", 0), info.get("uncollectable", 0),
                                                       cpu_end - cpu, explicit))

    gc.collect()
    frozen = gc.get_freeze_count()
    gc.callbacks.append(on_gc)
    try:
        outside.mark()
        for k, request in enumerate(requests):
            first, start, cpu, full = len(record.collections), clock(), thread_time(), _full_collections()
            try:
                result = handle(request)
            except Exception as exc:
                result = exc.with_traceback(None)
            record.requests.append((k, start, clock()))
            record.cpu.append(thread_time() - cpu)
            record.full_inside += _full_collections() - full
            record.results.append(result)
            outside.mark()
            if pause_budget is not None:
                over += sum(c.cpu for c in record.collections[first:]) > pause_budget
                if over > planned // 100 + 1:
                    record.stopped_early = True
                    break
    finally:
        gc.callbacks.remove(on_gc)
    record.frozen = gc.get_freeze_count() - frozen
    record.left = gc.collect()
    if pause_budget is not None and not record.stopped_early:
        again = copy.deepcopy(requests[:len(record.requests)]) if unwatched_requests is None else unwatched_requests
        record.full_inside_unwatched = _full_collections_unwatched(
            handle, again, record.full_inside + record.unwatched_margin())
    return record


def _full_collections() -> int:
    """Full collections this process has run, by the collector's own count (no hook needed)."""
    return gc.get_stats()[-1]["collections"]


def _full_collections_unwatched(handle, requests, enough: int) -> int:
    """Full collections inside `handle(request)` for each request, read from the collector's own
    counts with nothing added to gc.callbacks; stops once the count passes `enough`."""
    count = 0
    outside.mark()
    for request in requests:
        before = _full_collections()
        try:
            handle(request)
        except Exception:
            pass
        count += _full_collections() - before
        outside.mark()
        if count > enough:
            break
    return count
