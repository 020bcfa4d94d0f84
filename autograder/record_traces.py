"""Record the course's real GPU traces into data/ (run on a CUDA machine), and measure what the
lessons say about the budget on CUDA and about torch's own cycle detector.

    python autograder/record_traces.py --out data/          # the three traces, data/*.json.gz
    python autograder/record_traces.py --out data/ --facts facts.json

The workloads are the lessons' scenarios, the same sizes: lesson 00's allocated-versus-reserved
steps, with and without `empty_cache()`; lesson 03's node-pair leak beside a large long-lived
heap (the ratchet), run into the out-of-memory error under the lesson's budget; lesson 04's
awaitable-callback leak run into it.  `--facts` also writes, as JSON: the out-of-memory step of
lessons 03 and 04 under the same budget on CUDA (a real allocator, capped by
`set_per_process_memory_fraction`) and on the CPU meter, and what `torch.utils.viz._cycles` and
`gclab.cycles.watch_tensor_cycles` report on lesson 04's leak.  On a machine without CUDA it
records on the CPU (for trying the script); data/ keeps GPU recordings only.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from gclab import cycles, traces
from gclab.gcwatch import GCWatch, gc_disabled
from gclab.memory import MiB, Meter, default_device

PAIR_TENSOR = 256 * 1024               # lesson 03 and 04: 256 KiB float32 tensors
SIDE = 512                             # lesson 00: 512 x 512 float32 = 1 MiB


# -- lesson 00: allocated versus reserved -------------------------------------------------
def line_by_line(device):
    def workload(mark):
        mark("start")
        a = torch.randn(SIDE, SIDE, device=device); mark("a = randn")
        b = torch.randn(SIDE, SIDE, device=device); mark("b = randn")
        c = a + b; mark("c = a + b")
        del a; mark("del a")
        del b; mark("del b")
        again = torch.randn(SIDE, SIDE, device=device); mark("again = randn")
        del again; mark("del again")
        torch.cuda.empty_cache(); mark("empty_cache()")
        del c; mark("del result")
        torch.cuda.empty_cache(); mark("empty_cache() again")
    return workload


def steps_of_make_and_drop(device, empty_every_step, steps=20):
    def workload(mark):
        mark("start")
        for i in range(steps):
            a = torch.randn(SIDE, SIDE, device=device)
            b = torch.randn(SIDE, SIDE, device=device)
            c = a + b
            mark(f"step {i}: three tensors alive")
            del a, b, c
            mark(f"step {i}: deleted")
            if empty_every_step:
                torch.cuda.empty_cache()
                mark(f"step {i}: empty_cache()")
    return workload


# -- lesson 03: a pair of nodes in a cycle per step -------------------------------------------
class Node:
    def __init__(self, tensor):
        self.tensor = tensor
        self.other = None


def leaky_step(device):
    def step():
        a = Node(torch.zeros(PAIR_TENSOR // 4, device=device))
        b = Node(torch.zeros(PAIR_TENSOR // 4, device=device))
        a.other, b.other = b, a
        total = a.tensor[:8].sum()
        for part in (a.other.tensor[:8], a.tensor[-8:], a.other.tensor[-8:]):
            total = total + part.sum()
        return total
    return step


def stepping(step, iterations):
    def workload(mark):
        for i in range(iterations):
            step()
            mark(f"step {i}")
    return workload


def ratchet_plan(device):
    """Lesson 03's numbers on this Python: steps per generation-0 collection, the ratchet's
    length, and its budget (the first stretch's peak plus 4 pairs), from an unbudgeted run."""
    step = leaky_step(device)
    with gc_disabled():
        gc.collect()
        for _ in range(100):
            step()
        per_step = gc.get_count()[0] / 100
    gc.collect()
    steps_per_collection = gc.get_threshold()[0] / per_step
    ratchet_steps = int(14 * (gc.get_threshold()[1] + 1) * steps_per_collection)
    with Meter(device) as meter, GCWatch() as watch:
        peak = 0
        for i in range(ratchet_steps):
            step()
            if any(c.generation >= 1 for c in watch.collections):
                break
            peak = max(peak, meter.growth())
    gc.collect()
    return {"steps_per_collection": steps_per_collection, "ratchet_steps": ratchet_steps,
            "budget": peak + 4 * 2 * PAIR_TENSOR, "crash_budget": 48 * MiB}


# -- lesson 04: the awaitable whose callback closes over self -----------------------------------
class AwaitableTensor:
    def __init__(self, numel, device):
        self._numel, self._device, self._tensor = numel, device, None

    def wait(self):
        self._tensor = torch.zeros(self._numel, device=self._device)
        return self._tensor


class AwaitableTensorWithViewCallback:
    def __init__(self, tensor_awaitable, view_dim):
        self._tensor_awaitable = tensor_awaitable
        self._view_dim = view_dim
        self._callback = lambda ret: ret.view(-1, self._view_dim)

    def wait(self):
        return self._callback(self._tensor_awaitable.wait())


def wait_once(device, numel=PAIR_TENSOR // 4):
    return tuple(AwaitableTensorWithViewCallback(AwaitableTensor(numel, device), 4).wait().shape)


# -- recording ---------------------------------------------------------------------------------
def with_heap(objects, work):
    """Run `work()` beside `objects` long-lived tracked lists (lesson 03's model metadata)."""
    heap = [[f"layer{i}", i, i + 1] for i in range(objects)]
    try:
        return work()
    finally:
        del heap
        gc.collect()


def oom_runs(device, plan) -> list:
    """Lesson 03's crash and ratchet and lesson 04's leak, each run into the out-of-memory error under
    the plan's budgets, on `device`'s meter."""
    crash = traces.record(stepping(leaky_step(device), 4 * int(plan["steps_per_collection"])), "crash",
                          device, budget=plan["crash_budget"], note="section 3: no long-lived heap")
    ratchet = with_heap(150_000, lambda: traces.record(
        stepping(leaky_step(device), plan["ratchet_steps"]), "ratchet", device, budget=plan["budget"],
        note=f"beside 150,000 long-lived lists; budget = first stretch's peak + 4 pairs; plan {plan}"))
    leak = traces.record(stepping(lambda: wait_once(device), 2000), "awaitable", device, budget=24 * MiB,
                         note="256 KiB per call under a 24 MiB budget")
    return [crash, ratchet, leak]


def record_all(device, plan, out: Path, command: str) -> dict:
    written = {}
    runs00 = [traces.record(line_by_line(device), "line_by_line", device),
              traces.record(steps_of_make_and_drop(device, False), "without_empty_cache", device),
              traces.record(steps_of_make_and_drop(device, True), "with_empty_cache", device)]
    written["00"] = traces.save(runs00, out / "00_allocated_vs_reserved.json.gz", device, command)
    crash, ratchet, leak = oom_runs(device, plan)
    written["03"] = traces.save([crash, ratchet], out / "03_node_leak_oom.json.gz", device, command)
    written["04"] = traces.save([leak], out / "04_awaitable_oom.json.gz", device, command)
    return written


# -- facts: the budget on both meters, and the two detectors -------------------------------------
def oom_steps(runs) -> dict:
    """The out-of-memory step of each run, with what was allocated and reserved just before it."""
    result = {}
    for run in runs:
        at = run.oom_mark
        result[run.name] = {"oom_step": at, "budget": run.budget,
                            "allocated_at_oom": run.allocated[at - 1] if at else None,
                            "reserved_at_oom": run.reserved[at - 1] if at else None,
                            "collections": len(run.collections), "message": run.oom,
                            "segment_allocs": run.event_counts.get("segment_alloc", 0)}
    return result


def detectors(device) -> dict:
    """What torch.utils.viz._cycles and the course's detector report on one leaked call of lesson 04."""
    try:
        torch_report = torch_detector(device)
    except Exception as error:              # on a machine without CUDA it cannot start
        torch_report = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    gc.collect()
    with cycles.watch_tensor_cycles() as found:
        with gc_disabled():
            wait_once(device)
        gc.collect()
    course = {"reports": len(found.reports), "summary": found.summary()}
    return {"device": str(device), "torch": torch_report, "course": course}


def torch_detector(device) -> dict:
    from torch.utils.viz import _cycles
    found_html = []
    gc.collect()
    with gc_disabled():
        wait_once(device)
    handle = _cycles.observe_tensor_cycles(found_html.append)
    try:
        gc.collect()
    finally:
        handle()                                   # observe_garbage returns its remover
        torch.cuda.memory._record_memory_history(enabled=None) if torch.cuda.is_available() else None
    html = found_html[0] if found_html else ""
    torch_report = {"reports": len(found_html), "html_bytes": len(html),
                    "names_AwaitableTensorWithViewCallback": "AwaitableTensorWithViewCallback" in html,
                    "names_lambda": "lambda" in html, "loads_from_cdn": "https://" in html}

    # warn_tensor_cycles: the warning names a file; does it exist afterwards?
    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())
    logger = logging.getLogger(_cycles.__name__)
    keep = Keep()
    logger.addHandler(keep)
    gc.collect()
    with gc_disabled():
        wait_once(device)
    handle = _cycles.warn_tensor_cycles()
    try:
        gc.collect()
    finally:
        handle()
        logger.removeHandler(keep)
        torch.cuda.memory._record_memory_history(enabled=None) if torch.cuda.is_available() else None
    named = [m.rsplit(" ", 1)[-1] for m in messages if m.endswith(".html")]
    torch_report["warning"] = messages[-1] if messages else ""
    torch_report["warned_file_exists_after"] = [os.path.exists(p) for p in named]
    return torch_report


def reading_cost(device, calls=100) -> dict:
    """Objects the collector finds after `calls` reads of the allocator, the flat way and gclab's."""
    from gclab.memory import cuda_bytes
    x = torch.ones(1024, device=device)          # CUDA initialised, statistics non-empty
    found = {}
    with gc_disabled():
        for name, read in (("torch.cuda.memory_allocated", torch.cuda.memory_allocated),
                           ("gclab.memory.cuda_bytes", cuda_bytes)):
            gc.collect()
            for _ in range(calls):
                read()
            found[name] = gc.collect() / calls
    del x
    return {"objects_per_call": found, "threshold0": gc.get_threshold()[0]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("data"))
    parser.add_argument("--facts", type=Path)
    args = parser.parse_args(argv)
    device = default_device()
    command = "python autograder/record_traces.py " + " ".join(argv if argv is not None else sys.argv[1:])
    start = time.perf_counter()
    plan = ratchet_plan(device)
    written = record_all(device, plan, args.out, command)
    for lesson, trace in written.items():
        for name, run in trace.runs.items():
            print(f"{lesson} {name}: {len(run.labels)} marks, OOM at mark {run.oom_mark}, "
                  f"{len(run.collections)} collections, events {run.event_counts}")
    print(f"recorded in {time.perf_counter() - start:.1f} s on {trace.provenance['gpu']}", flush=True)
    if args.facts:
        recorded = [run for lesson in ("03", "04") for run in written[lesson].runs.values()]
        facts = {"plan": plan, "reading_cost": reading_cost(device), "oom": {str(device): oom_steps(recorded)}}
        if device.type == "cuda":
            facts["oom"]["cpu"] = oom_steps(oom_runs(torch.device("cpu"), plan))
        facts["detectors"] = [detectors(device)]
        if device.type == "cuda":
            facts["detectors"].append(detectors(torch.device("cpu")))
        args.facts.write_text(json.dumps(facts, indent=1, default=str))
        print(json.dumps(facts, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
