"""Device memory traces: record a workload on a CUDA GPU, keep what a plot needs, draw it anywhere.

`record(workload)` runs `workload(mark)` with PyTorch's allocator history on
(`torch.cuda.memory._record_memory_history`), calls `mark(label)` where the workload says,
and keeps for each mark the bytes allocated and reserved (both above their values at the
start), the collections that ran (`gc.callbacks`), the allocator's segment events
(`segment_alloc`, `segment_free`, `oom`) and, from the final `torch.cuda.memory._snapshot()`,
each segment with its live blocks and the source line that allocated each.  An
out-of-memory error ends the run and is kept with its message.  `save` writes traces as
gzip'd JSON with a provenance line (GPU, driver, CUDA, torch, Python, command, date);
`load` reads one back on any machine, GPU or not.

A recorded run has the attributes of a `gclab.memory.Meter` that the course's plots read
(`timeline`, `budget`, `baseline`, `started`, `simulated`), and its `collections` are
`gclab.gcwatch.Collection`s, so `plot_timeline(run, run.collections)` draws it like a live
one.  On a machine without CUDA `record` still works (the meter's exact tensor count, with
reserved equal to allocated), so the format is tested everywhere; the files in `data/` are
recorded on GPUs and say so.
"""
from __future__ import annotations

import datetime
import gc
import gzip
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .gcwatch import Collection, GCWatch
from .memory import Meter, MeterPoint, default_device

__all__ = ["RecordedRun", "Trace", "data_file", "load", "load_recorded", "provenance", "record", "save"]

FORMAT = 1
SEGMENT_ACTIONS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap", "oom", "empty_cache")


@dataclass
class RecordedRun:
    """One recorded workload: marks, collections, segment events and the final segments."""
    name: str
    device: str
    budget: int | None
    labels: list[str]
    seconds: list[float]
    allocated: list[int]             # bytes above the start, at each mark
    reserved: list[int]              # bytes above the start, at each mark
    collections: list[Collection] = field(default_factory=list)
    segment_events: list[dict] = field(default_factory=list)
    segments: list[dict] = field(default_factory=list)
    event_counts: dict = field(default_factory=dict)
    oom: str | None = None           # the out-of-memory message's first line, when the run ended in one
    note: str = ""

    # -- what the course's plots read from a Meter -------------------------------------
    simulated = False
    started = 0.0
    baseline = 0

    @property
    def timeline(self) -> list[MeterPoint]:
        return [MeterPoint(label, s, a) for label, s, a in zip(self.labels, self.seconds, self.allocated)]

    @property
    def oom_mark(self) -> int | None:
        """The index of the mark the out-of-memory error ended the run at (None: it did not)."""
        return self.labels.index("OOM") if "OOM" in self.labels else None

    def to_json(self) -> dict:
        data = {k: getattr(self, k) for k in ("name", "device", "budget", "labels", "seconds", "allocated",
                                              "reserved", "segment_events", "segments", "event_counts",
                                              "oom", "note")}
        data["collections"] = [[c.generation, c.start, c.duration, c.collected] for c in self.collections]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "RecordedRun":
        data = dict(data)
        data["collections"] = [Collection(g, start, duration, collected, 0)
                               for g, start, duration, collected in data.get("collections", [])]
        return cls(**data)


@dataclass
class Trace:
    provenance: dict
    runs: dict[str, RecordedRun]

    @property
    def recorded_on_gpu(self) -> bool:
        return self.provenance.get("device_type") == "cuda"

    def line(self) -> str:
        """The provenance line, as data/README.md lists it."""
        p = self.provenance
        return (f"{p['gpu']}, driver {p['driver']}, CUDA {p['cuda']}, torch {p['torch']}, Python {p['python']}; "
                f"`{p['command']}`; {p['date']}")

    def label(self) -> str:
        """A plot title's note that says where and when the trace was recorded."""
        return f"recorded on {self.provenance['gpu']}, torch {self.provenance['torch']}, {self.provenance['date'][:10]}"


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        return out.splitlines()[0] if out else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance(device=None, command: str | None = None) -> dict:
    """Where and how a trace is being recorded: GPU, driver, CUDA, torch, Python, command, date."""
    device = torch.device(device) if device is not None else default_device()
    cuda = device.type == "cuda"
    return {
        "format": FORMAT,
        "device_type": device.type,
        "gpu": torch.cuda.get_device_name(device) if cuda else f"no GPU (CPU: {platform.processor() or platform.machine()})",
        "driver": _driver_version() if cuda else "none",
        "cuda": torch.version.cuda or "none",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _user_frame(frames) -> str:
    """The innermost frame outside torch and gclab: the line that asked for the memory."""
    for frame in frames or ():
        filename = frame.get("filename", "")
        if "/torch/" in filename or "/gclab/" in filename or filename.startswith("??"):
            continue
        return f"{Path(filename).name}:{frame.get('line')} {frame.get('name')}"
    return ""


def _segments(snapshot, device_index) -> list[dict]:
    kept = []
    for segment in snapshot.get("segments", []):
        if segment.get("device", device_index) != device_index:
            continue
        blocks = [[b["size"], _user_frame(b.get("frames"))] for b in segment.get("blocks", [])
                  if b.get("state") == "active_allocated"]
        kept.append({"total_size": segment["total_size"], "allocated_size": segment.get("allocated_size", 0),
                     "segment_type": segment.get("segment_type", ""), "blocks": blocks})
    return kept


def _events(snapshot, device_index, since_us: float):
    traces = snapshot.get("device_traces", [])
    events = traces[device_index] if device_index < len(traces) else []
    counts: dict[str, int] = {}
    kept = []
    for event in events:
        action = event.get("action", "")
        counts[action] = counts.get(action, 0) + 1
        if action in SEGMENT_ACTIONS:
            at = event.get("time_us")
            kept.append({"action": action, "size": event.get("size", 0),
                         "seconds": None if at is None else round((at - since_us) / 1e6, 6)})
    return kept, counts


def record(workload, name: str = "run", device=None, budget: int | None = None, note: str = "",
           max_entries: int = 1_000_000) -> RecordedRun:
    """Run `workload(mark)` under a `Meter` (with `budget`, if given) and record it.

    `mark(label)` keeps the bytes allocated and reserved at that moment; the run ends when the
    workload returns or raises `torch.OutOfMemoryError` (kept, marked "OOM")."""
    device = torch.device(device) if device is not None else default_device()
    cuda = device.type == "cuda"
    labels, seconds, allocated, reserved = [], [], [], []
    oom = None
    if cuda:
        torch.cuda.memory._record_memory_history(enabled="all", context="state", stacks="python",
                                                 max_entries=max_entries, device=device)
    gc.collect()
    start_us = time.time() * 1e6
    try:
        with Meter(device, budget=budget) as meter, GCWatch() as watch:
            start_allocated, start_reserved = meter.allocated(), meter.reserved()

            def mark(label: str = "") -> None:
                labels.append(label)
                seconds.append(round(time.perf_counter() - meter.started, 6))
                allocated.append(meter.allocated() - start_allocated)
                reserved.append(meter.reserved() - start_reserved)
            try:
                workload(mark)
            except torch.OutOfMemoryError as error:
                oom = str(error).strip().splitlines()[0]
                mark("OOM")
            collections = [Collection(c.generation, round(c.start - meter.started, 6), c.duration, c.collected,
                                      c.uncollectable) for c in watch.collections]
        snapshot = torch.cuda.memory._snapshot(device) if cuda else {}
    finally:
        if cuda:
            torch.cuda.memory._record_memory_history(enabled=None, device=device)
    index = device.index if device.index is not None else (torch.cuda.current_device() if cuda else 0)
    segment_events, counts = _events(snapshot, index, start_us)
    return RecordedRun(name=name, device=str(device), budget=budget, labels=labels, seconds=seconds,
                       allocated=allocated, reserved=reserved, collections=collections,
                       segment_events=segment_events, segments=_segments(snapshot, index),
                       event_counts=counts, oom=oom, note=note)


def save(runs, path, device=None, command: str | None = None) -> Trace:
    """Write `runs` (RecordedRuns) with their provenance to `path` (gzip'd JSON); the Trace."""
    trace = Trace(provenance(device, command), {run.name: run for run in runs})
    payload = {"provenance": trace.provenance, "runs": {name: run.to_json() for name, run in trace.runs.items()}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(payload, f, separators=(",", ":"))
    return trace


def load(path) -> Trace:
    """Read a trace written by `save`; a clear error for a file that is not one."""
    path = Path(path)
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            payload = json.load(f)
        runs = {name: RecordedRun.from_json(run) for name, run in payload["runs"].items()}
        prov = payload["provenance"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a gclab trace ({error})") from error
    if prov.get("format") != FORMAT:
        raise ValueError(f"{path} is a trace of format {prov.get('format')}; this gclab reads format {FORMAT}")
    return Trace(prov, runs)


def data_file(name: str) -> Path:
    """A recorded trace of the course's data/ folder, which gclab installs as `gclab.data` (so that
    a pip-installed gclab, on Colab, has the traces too)."""
    from importlib.resources import files
    path = Path(str(files("gclab.data") / name))
    if not path.is_file():
        raise FileNotFoundError(f"no recorded trace {name!r} in {path.parent} (the course's data/ folder)")
    return path


def load_recorded(name: str) -> Trace:
    """`load(data_file(name))`: a trace the course recorded on a GPU, for a lesson to draw."""
    return load(data_file(name))
