"""On a CUDA GPU: what the process's memory (`gclab.memory.process_memory`: heap, mappings) does
the first time a step runs each kind of CUDA work, which the flat check's heap reading would take
for the step's.  Run once per module-loading mode, each in a fresh process:

    CUDA_MODULE_LOADING=LAZY python autograder/gpu/heap_probe.py
    CUDA_MODULE_LOADING=EAGER python autograder/gpu/heap_probe.py
"""
from __future__ import annotations

import copy
import os
import threading
import time

import torch

from gclab.memory import AllocationCensus, format_bytes, process_memory


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def measured(label, work) -> None:
    before, n = process_memory(), threads()
    start = time.perf_counter()
    work()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    after = process_memory()
    print(f"{label:<36} heap {format_bytes(after.heap - before.heap):>11}  mapped "
          f"{format_bytes(after.mapped - before.mapped):>11}  blocks {after.blocks - before.blocks:>7}  "
          f"threads {threads() - n:+d}  {seconds * 1000:.1f} ms", flush=True)


def census():
    with AllocationCensus() as c:
        c.mark()
        kept = torch.ones(1024, device="cuda")
        c.mark()
    print("    census held:", c.held(), c.error)
    del kept


def main() -> None:
    print("CUDA_MODULE_LOADING =", os.environ.get("CUDA_MODULE_LOADING", "(unset)"))
    measured("CUDA init", lambda: torch.zeros(1, device="cuda"))
    x = torch.randn(256, 64, device="cuda")
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8)).cuda()
    y = torch.randint(0, 8, (256,), device="cuda")
    measured("first clamp + sum + item", lambda: x.clamp(-4, 4).sum().item())
    measured("second clamp + sum + item", lambda: x.clamp(-4, 4).sum().item())
    measured("first isfinite", lambda: bool(torch.isfinite(x.sum())))
    measured("first forward + backward (cuBLAS)",
             lambda: torch.nn.functional.cross_entropy(model(x), y).backward())
    measured("second forward + backward",
             lambda: torch.nn.functional.cross_entropy(model(x), y).backward())
    measured("first deepcopy of the model", lambda: copy.deepcopy(model))
    measured("first census (profiler + history)", census)
    measured("second census", census)
    measured("a thread that makes a CUDA tensor",
             lambda: (lambda t: (t.start(), t.join()))(threading.Thread(target=lambda: torch.ones(4, device="cuda"))))


if __name__ == "__main__":
    main()
