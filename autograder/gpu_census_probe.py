"""On a CUDA GPU: does the allocation census see the step's CUDA allocations, and does the flat
check pass a step that replaces what it keeps?

Found by `gclab gpu-check` on an H100 (torch 2.11, 2026-11-26): torch's profiler, tracing the CPU
only, reports no CUDA allocation at all, so lessons 05, 07 and 08 failed their own flat check there
(what a step replaced was not subtracted).  The census now reads CUDA's side from the caching
allocator's own history (`gclab.census._CudaHistory`).  This probe prints, for a step that replaces
what it keeps (an LRU of two 1 MiB tensors), on each device: what the census held at each mark,
whether the places it recorded match the storages' own (device, data_ptr), and the flat check's
verdict.  One call, about 20 s:

    python autograder/gpu_census_probe.py
"""
from __future__ import annotations

import collections

import torch

from gclab import checks
from gclab.held import StorageCensus
from gclab.memory import AllocationCensus


def replacing_step(device):
    kept = collections.deque(maxlen=2)

    def step(i):
        kept.append(torch.full((256 * 1024,), float(i), device=device))   # 1 MiB, the oldest one dropped
        return float(kept[-1][0])
    return step, kept


def probe(device) -> None:
    print(f"== {device}")
    step, kept = replacing_step(device)
    step(0)
    with AllocationCensus() as census:
        census.mark()
        for i in range(1, 4):
            step(i)
            census.mark()
    places = {(str(t.untyped_storage().device), t.untyped_storage().data_ptr()) for t in kept}
    print("census error:", census.error, "| held at each mark:", census.held())
    print("census alive (device, ptr) -> bytes:", dict(list(census.alive.items())[:6]))
    print("the kept storages' places:", places, "| all in the census:", places <= set(census.alive))
    before = StorageCensus()
    for i in range(4, 8):
        step(i)
    after = StorageCensus()
    print("StorageCensus new bytes, none carried:", after.new_bytes(before, set()),
          "| carried from the census:", after.new_bytes(before, set(census.alive)))
    before.close(), after.close()
    report = checks.run_flat_check(replacing_step(device)[0], iterations=6, warmup=2, device=device)
    print("flat check:", "OK" if report.ok else "NOT OK", "|", report.explain()[:600])


if __name__ == "__main__":
    probe(torch.device("cpu"))
    if torch.cuda.is_available():
        probe(torch.device("cuda"))
