"""Checks that self-check cells and hidden tests share.

Each check returns a report that can say, in a sentence, what went wrong and by how
much; the `assert_*` helpers turn a failed report into an AssertionError with that
sentence, which is what a learner (and nbgrader's feedback) sees.
"""
from __future__ import annotations

import gc
import math
import time
import weakref
from dataclasses import dataclass, field

import torch

from .gcwatch import Collection, GCWatch
from .memory import Meter, format_bytes

__all__ = ["FlatReport", "run_flat_check", "assert_flat", "Comparison", "compare",
           "assert_matches", "integrity_problems", "assert_untampered"]

# What the grading relies on, as it was when gclab.checks was first imported (the
# notebook's locked set-up cell imports it before any student code runs).
_ORIGINALS = {
    "gc.collect": gc.collect, "gc.disable": gc.disable, "gc.enable": gc.enable,
    "gc.isenabled": gc.isenabled, "gc.get_count": gc.get_count,
    "gc.get_threshold": gc.get_threshold, "gc.set_threshold": gc.set_threshold,
    "gc.callbacks": gc.callbacks, "time.perf_counter": time.perf_counter,
    "weakref.finalize": weakref.finalize, "torch.OutOfMemoryError": torch.OutOfMemoryError,
}
_OWN = {}   # filled at the end of the module: this module's own functions


def _current(name):
    module, attr = name.split(".", 1)
    return getattr({"gc": gc, "time": time, "weakref": weakref, "torch": torch}[module], attr)


def integrity_problems() -> list[str]:
    """Names of the functions the checks rely on that no longer are what they were."""
    problems = [name for name, original in _ORIGINALS.items() if _current(name) is not original]
    problems += [f"gclab.checks.{name}" for name, fn in _OWN.items() if globals().get(name) is not fn]
    return problems


def assert_untampered() -> None:
    problems = integrity_problems()
    assert not problems, ("the grader's tools were replaced by the notebook's code: "
                          + ", ".join(problems) + ". Restore them (restart the kernel) and run again.")


# -- memory flat ---------------------------------------------------------------------
@dataclass
class FlatReport:
    """What happened while `step` ran repeatedly with the automatic collector off."""
    device: torch.device
    iterations: int
    growth: list[int] = field(default_factory=list)          # bytes above baseline after each iteration
    collections: list[Collection] = field(default_factory=list)
    results: list = field(default_factory=list)
    reenabled_gc: bool = False
    error: BaseException | None = None

    @property
    def leaked(self) -> int:
        return max(self.growth, default=0)

    @property
    def ok(self) -> bool:
        return (self.error is None and len(self.growth) == self.iterations
                and all(g == 0 for g in self.growth) and not self.collections and not self.reenabled_gc)

    def explain(self) -> str:
        if self.ok:
            return (f"memory was back at its baseline after each of {self.iterations} iterations "
                    f"on {self.device}, with the collector off and no collection: reference counting alone frees it.")
        lines = []
        if self.error is not None:
            lines.append(f"the step raised {type(self.error).__name__}: {self.error} "
                         f"(after {len(self.growth)} of {self.iterations} iterations)")
        bad = [(i, g) for i, g in enumerate(self.growth, 1) if g != 0]
        if bad:
            first_i, first_g = bad[0]
            last_i, last_g = len(self.growth), self.growth[-1]
            per_iter = last_g / last_i
            lines.append(
                f"memory did not return to its baseline: {format_bytes(first_g)} above it after "
                f"iteration {first_i}, {format_bytes(last_g)} after iteration {last_i} "
                f"(about {format_bytes(per_iter)} per iteration). Something still refers to "
                "the tensors each step creates.")
        if self.collections:
            gens = sorted({c.generation for c in self.collections})
            lines.append(
                f"the collector ran {len(self.collections)} time(s) during the check "
                f"(generation {', '.join(map(str, gens))}): a fix must free memory by reference "
                "counting alone, without gc.collect() or the automatic collector.")
        if self.reenabled_gc:
            lines.append("the step switched the automatic collector back on (gc.enable()).")
        return " ".join(lines)


def _plain(value):
    """A step's result as plain Python data, so keeping it keeps no tensor alive."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def run_flat_check(step, iterations: int = 20, device=None, warmup: int = 0) -> FlatReport:
    """Call `step(i)` for i in range(warmup + iterations) with the automatic collector off.

    The meter's baseline is taken after the warm-up iterations; after every measured
    iteration memory must be back at that baseline, to the byte, and no collection
    (automatic or explicit) may run.  The collector's previous state is restored after.
    """
    meter = Meter(device)
    report = FlatReport(device=meter.device, iterations=iterations)
    watch = GCWatch()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with meter:
            try:
                for i in range(warmup):
                    _plain(step(i))
                baseline = meter.allocated()
                with watch:
                    for i in range(warmup, warmup + iterations):
                        report.results.append(_plain(step(i)))
                        report.growth.append(meter.allocated() - baseline)
                        if gc.isenabled():
                            report.reenabled_gc = True
                            gc.disable()
            except Exception as exc:          # reported, not raised: the report says what happened
                report.error = exc.with_traceback(None)   # its frames would hold the step's tensors
    finally:
        report.collections = list(watch.collections)
        if was_enabled:
            gc.enable()
    return report


def assert_flat(report: FlatReport) -> None:
    assert report.ok, report.explain()


# -- results equal the reference -----------------------------------------------------
@dataclass
class Comparison:
    name: str
    ok: bool
    text: str

    def __str__(self):
        return self.text


def _flatten(value):
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist()
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            out.extend(_flatten(v))
        return out
    return [value]


def compare(name: str, got, expected, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> Comparison:
    """Compare two results element by element and say what matched and by how much it did not."""
    got_flat, exp_flat = _flatten(got), _flatten(expected)
    if len(got_flat) != len(exp_flat):
        return Comparison(name, False, f"{name}: expected {len(exp_flat)} values, got {len(got_flat)}")
    bad = []
    for i, (g, e) in enumerate(zip(got_flat, exp_flat)):
        try:
            same = math.isclose(g, e, rel_tol=rel_tol, abs_tol=abs_tol)
        except TypeError:
            same = g == e
        if not same:
            bad.append((i, g, e))
    if not bad:
        return Comparison(name, True, f"{name}: all {len(exp_flat)} values match the reference")
    i, g, e = bad[0]
    try:
        off = abs(g - e)
        diff = f" (off by {off})" if isinstance(off, int) else f" (off by {off:.6g})"
    except TypeError:
        diff = ""
    return Comparison(name, False, f"{name}: {len(bad)} of {len(exp_flat)} values differ from the "
                      f"reference; first at position {i}: got {g!r}, expected {e!r}{diff}")


def assert_matches(name: str, got, expected, **tolerances) -> None:
    result = compare(name, got, expected, **tolerances)
    assert result.ok, result.text


_OWN.update({name: globals()[name] for name in
             ("run_flat_check", "assert_flat", "compare", "assert_matches", "integrity_problems",
              "assert_untampered")})
