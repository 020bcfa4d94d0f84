"""A census of allocations: the bytes torch's allocators hand out while it runs and do not take back.

`AllocationCensus` reads torch's profiler's allocation events (and, on CUDA, the caching allocator's own
history), which the allocators send whatever made the tensor: it sees what `gclab.memory.Meter`'s dispatch
mode cannot (tensors made with torch's dispatch turned off).

What it cannot see: memory allocated before it started, or its release (so freeing memory reserved
beforehand cannot offset what is kept), except what an earlier census carried; allocations of other
threads than the one that runs it (autograd's excepted); memory that is not a tensor's.  Where a
profiler or CUDA's memory history was already running, or something stopped this one, it says so
(`error`) and counts nothing.
"""
from __future__ import annotations

import contextlib
import os
import types

import torch

from .process_memory import _close, _open, _stderr_into

__all__ = ["AllocationCensus"]


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
