"""What the model server recorded, read from the notebook: requests, collections, idle calls, garbage.

A `Trace` holds each request's (id, start, end) and every collection with the CPU time it took
(`ServedCollection`), on the clock the load generator uses too, so that a request's latency can be
charged to the collections that ran while it waited (`Trace.charges`).  It cannot tell a pause the
collector caused from one the machine caused beyond what CPU time says, and it trusts the server's
record only as far as the server vouches for it (`Trace.tampered`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..gcwatch import Collection

if TYPE_CHECKING:
    import numpy as np

    from .load import LoadResult

class ServedCollection(Collection):
    """A collection the server recorded, with the CPU time it took (`cpu`, seconds of the
    server thread's CPU time: unlike `duration`, not inflated when the machine is busy and
    the server waits for a core)."""
    cpu: float = 0.0
    explicit: bool = False      # started by the program's gc.collect(), not by the collector's thresholds


ServedCollection = dataclass(frozen=True)(ServedCollection)


@dataclass
class Trace:
    """What the server recorded: each request's (id, start, end), the collections, the
    policy's idle calls (start, end) and the cyclic garbage still alive at the end; `info`
    adds the collector's settings, what one full collection of the server's heap costs in CPU
    time (`full_collection_cpu`), the server's CPU time over the record (`server_cpu`) and
    `tampered`: why the server cannot vouch for its record (empty when it can)."""
    requests: list
    collections: list[Collection]
    idle_calls: list = field(default_factory=list)
    garbage: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)

    @classmethod
    def from_json(cls, data: dict) -> "Trace":
        collections = [ServedCollection(int(g), s, d, int(c), int(u), cpu) for g, s, d, cpu, c, u in data["collections"]]
        info = {k: data[k] for k in ("gc_enabled", "threshold", "frozen", "count", "python", "recording_intact",
                                     "idle_call_count", "tampered", "full_collection_cpu", "server_cpu", "counted",
                                     "guarded", "idle_call_times", "freed_times", "page_faults", "rss_mib") if k in data}
        return cls([tuple(r) for r in data["requests"]], collections, [tuple(c) for c in data["idle_calls"]],
                   data["garbage"], info, data["errors"])

    @classmethod
    def unavailable(cls, reason: str) -> "Trace":
        return cls([], [], info={"recording_intact": False, "unavailable": True}, errors=[reason])

    @property
    def tampered(self) -> list[str]:
        """Why the server cannot vouch for this record (empty: it can)."""
        if self.info.get("unavailable"):
            return []
        found = list(self.info.get("tampered", []))
        if not found and not self.info.get("recording_intact", True):
            found.append("the server's record of collections does not match CPython's own count")
        return found

    def serving_window(self) -> tuple[float, float] | None:
        """When the load ran: from the first request's start to the last one's end (None: no request)."""
        if not self.requests:
            return None
        return min(start for _, start, _ in self.requests), max(end for _, _, end in self.requests)

    def idle_moments(self) -> int:
        """How many times, while the load ran, the server found no request in flight and called
        the policy's on_idle."""
        window = self.serving_window()
        if window is None:
            return 0
        return sum(1 for t in self.info.get("idle_call_times", []) if window[0] < t < window[1])

    def collections_while_serving(self, generation: int) -> list[Collection]:
        """Collections of `generation` that started while the load ran, inside requests or between them."""
        window = self.serving_window()
        if window is None:
            return []
        return [c for c in self.collections if c.generation == generation and window[0] <= c.start <= window[1]]

    def freed_while_serving(self, until: float | None = None) -> int:
        """How many responses' cyclic garbage the collector freed before `until` (default: the end
        of the last request)."""
        if until is None:
            until = (self.serving_window() or (0.0, float("inf")))[1]
        return sum(1 for t in self.info.get("freed_times", []) if t < until)

    def collector_cpu(self, generation: int | None = None) -> float:
        """CPU seconds the collector took over the record (of one generation, if given)."""
        return sum(getattr(c, "cpu", c.duration) for c in self.collections
                   if generation is None or c.generation == generation)

    def charges(self, load: "LoadResult") -> "dict[str, np.ndarray]":
        """For each answered request of `load`, the collections it waited behind: those that ran
        at any moment between the request's scheduled send time and its answer (the server's
        clock and the load generator's are the same monotonic clock).  Returns per request, in
        CPU seconds of the collector, "longest": the longest such collection, and "total": all
        of them added up; and "count": how many."""
        import numpy as np
        answered = [(s, d) for s, d in zip(load.scheduled, load.done) if d is not None]
        if not answered or not self.collections:
            zeros = np.zeros(len(answered))
            return {"longest": zeros, "total": zeros.copy(), "count": zeros.copy()}
        due, done = np.array(answered).T
        starts = np.array([c.start for c in self.collections])
        ends = starts + np.array([c.duration for c in self.collections])
        cpu = np.array([getattr(c, "cpu", c.duration) for c in self.collections])
        overlap = (starts[None, :] < done[:, None]) & (ends[None, :] > due[:, None])
        charged = np.where(overlap, cpu[None, :], 0.0)
        return {"longest": charged.max(axis=1), "total": charged.sum(axis=1), "count": overlap.sum(axis=1)}

    def collections_inside_requests(self, generation: int | None = None) -> list[Collection]:
        """Collections that ran while at least one request was being handled."""
        import numpy as np
        if not self.requests:
            return []
        _, starts, ends = np.array(self.requests).T
        return [c for c in self.collections if (generation is None or c.generation == generation)
                and bool(np.any((starts < c.start + c.duration) & (ends > c.start)))]
