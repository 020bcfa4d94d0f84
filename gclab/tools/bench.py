"""`gclab bench`: how long each lesson takes to run and to grade, and what the CPU meter costs.

Targets (checked here, not in timed unit tests, because a shared 2-core machine is noisy):
a lesson executes in under 60 s (or the `execute_budget_s` its notebook's metadata sets
under "gclab", for a lesson that runs a load test), grading costs under its execution
time plus 10 s, and the meter slows a forward+backward step by less than 2x.  Beside it the
bench times a dispatch mode that does nothing: torch's own cost of any such mode, most of the
meter's (the README has the figures).  Generating the assignment is timed apart: it happens
once per change of the lesson, and grading reuses it.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

from ..grader import _jsonschema  # noqa: F401  (before nbformat: see there)
import nbformat
import torch
from jupyter_client import KernelManager
from nbclient import NotebookClient
from torch.utils._python_dispatch import TorchDispatchMode

from ..grader import grading
from ..memory import Meter

EXECUTE_TARGET_S = 60.0
GRADE_MARGIN_S = 10.0
METER_OVERHEAD_TARGET = 2.0


def execute_seconds(path: Path, out: Path | None = None) -> float:
    """Run the notebook in a scratch folder (what it writes is thrown away); with `out`, the
    notebook as run, outputs included, is written there."""
    import tempfile
    nb = nbformat.read(path, 4)
    with tempfile.TemporaryDirectory(prefix="gclab-bench-") as folder:
        km = _kernel_manager(folder)
        start = time.perf_counter()
        client = NotebookClient(nb, km=km, timeout=600, resources={"metadata": {"path": folder}})
        try:
            client.execute()
            seconds = time.perf_counter() - start
        finally:
            # nbclient stops the client's channels, and shuts the kernel down, only for a kernel it
            # made itself: left running, each run's heartbeat thread keeps pinging a dead kernel,
            # taking heap that memory checks in this process would count, and the kernel would live
            # on until this process ends, and then go without running its atexit hooks
            if client.kc is not None:
                client.kc.stop_channels()
            if km.has_kernel:
                km.shutdown_kernel()
            km.context.destroy(linger=0)       # its I/O threads, one pair per run otherwise
    if out is not None:
        nbformat.write(nb, out)
    return seconds


def _kernel_manager(folder: str) -> KernelManager:
    """The notebooks' kernel, talking over Unix sockets in `folder` where the OS has them: over
    TCP, every kernel warns that its traffic is unencrypted.  The connection file's name is
    short because the sockets' paths (`kernel-ipc-1`...) must fit in about 100 characters."""
    if os.name != "posix":
        return KernelManager(kernel_name="python3")
    return KernelManager(kernel_name="python3", transport="ipc", connection_file=os.path.join(folder, "kernel.json"))


def execute_budget(path: Path) -> float:
    return float(nbformat.read(path, 4).metadata.get("gclab", {}).get("execute_budget_s", EXECUTE_TARGET_S))


def prepare_seconds(root: Path, lesson: str) -> float:
    """Generating the assignment (once per change of its sources; grading reuses it)."""
    start = time.perf_counter()
    grading.prepare(root, lesson)
    return time.perf_counter() - start


def grade_seconds(path: Path, root: Path) -> tuple[float, str]:
    start = time.perf_counter()
    [result] = grading.grade([path], root=root)
    return time.perf_counter() - start, f"{result.score:g}/{result.max_score:g}"


def meter_overhead(steps: int = 100, repeats: int = 15) -> tuple[float, float, float]:
    """Seconds per forward+backward step of a small MLP: untracked, inside a CPU Meter, and inside a
    dispatch mode that does nothing (torch's own cost of any such mode, the floor under the meter's).
    The best of `repeats` runs of `steps` steps each, the kinds of run taken in turns, so that a
    busy spell of the machine lands on all of them rather than on one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def step():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)

    def seconds_per_step(context) -> float:
        start = time.perf_counter()
        with context():
            for _ in range(steps):
                step()
        return (time.perf_counter() - start) / steps

    kinds = {"plain": contextlib.nullcontext, "tracked": lambda: Meter("cpu"), "floor": _DoNothingMode}
    step()
    best = dict.fromkeys(kinds, float("inf"))
    for _ in range(repeats):
        for kind, context in kinds.items():
            best[kind] = min(best[kind], seconds_per_step(context))
    return best["plain"], best["tracked"], best["floor"]


class _DoNothingMode(TorchDispatchMode):
    """Every op passed straight through: what a dispatch mode costs before it does any work."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False                     # as the meter's own mode: no torch._dynamo import

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def main(root: Path, names=()) -> int:
    names = list(names) or grading.lessons(root)
    print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"{'CUDA ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU only'}")
    print(f"{'lesson':<20} {'execute s':>10} {'generate s':>11} {'grade s':>9} {'score':>7}  targets")
    ok = True
    for name in names:
        [path] = sorted((root / "solutions" / name).glob("*.ipynb"))
        run = execute_seconds(path)
        generate = prepare_seconds(root, name)
        graded, score = grade_seconds(path, root)
        budget = execute_budget(path)
        met = run < budget and graded < run + GRADE_MARGIN_S
        ok &= met
        print(f"{name:<20} {run:>10.1f} {generate:>11.1f} {graded:>9.1f} {score:>7}  "
              f"{'met' if met else 'MISSED'} (execute < {budget:.0f} s, grade < execute + {GRADE_MARGIN_S:.0f} s)")
    plain, tracked, floor = meter_overhead()
    ratio = tracked / plain
    ok &= ratio < METER_OVERHEAD_TARGET
    print(f"CPU meter: forward+backward step {plain * 1e3:.2f} ms untracked, {tracked * 1e3:.2f} ms tracked: "
          f"{ratio:.2f}x ({'met' if ratio < METER_OVERHEAD_TARGET else 'MISSED'}, target < {METER_OVERHEAD_TARGET:.0f}x); "
          f"a dispatch mode that does nothing: {floor * 1e3:.2f} ms ({floor / plain:.2f}x, torch's part of it)")
    return 0 if ok else 1
