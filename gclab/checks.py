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
           "assert_matches", "integrity_problems", "assert_untampered", "PolicyReport",
           "run_policy_check", "assert_policy"]

# What the grading relies on, as it was when gclab.checks was first imported (the
# notebook's locked set-up cell imports it before any student code runs).
_ORIGINALS = {
    "gc.collect": gc.collect, "gc.disable": gc.disable, "gc.enable": gc.enable,
    "gc.isenabled": gc.isenabled, "gc.get_count": gc.get_count,
    "gc.get_threshold": gc.get_threshold, "gc.set_threshold": gc.set_threshold,
    "gc.set_debug": gc.set_debug, "gc.get_debug": gc.get_debug, "gc.garbage": gc.garbage,
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
    """What happened while `step` ran repeatedly: first with the automatic collector off, then
    (`collector_on` iterations) with it on, so that code which leaks only while the collector
    runs (or checks `gc.isenabled()`) is caught too."""
    device: torch.device
    iterations: int
    growth: list[int] = field(default_factory=list)          # bytes above baseline after each iteration
    collections: list[Collection] = field(default_factory=list)
    results: list = field(default_factory=list)
    reenabled_gc: bool = False
    error: BaseException | None = None
    collector_on: int = 0                                      # iterations asked for with the collector on
    growth_collector_on: list[int] = field(default_factory=list)
    results_collector_on: list = field(default_factory=list)

    @property
    def leaked(self) -> int:
        return max(self.growth + self.growth_collector_on, default=0)

    @property
    def _on_path_ok(self) -> bool:
        # collections may run on this path and free older garbage, so memory may end below its baseline
        return len(self.growth_collector_on) == self.collector_on and all(g <= 0 for g in self.growth_collector_on)

    @property
    def ok(self) -> bool:
        return (self.error is None and len(self.growth) == self.iterations
                and all(g == 0 for g in self.growth) and not self.collections and not self.reenabled_gc
                and self._on_path_ok)

    def explain(self) -> str:
        if self.ok:
            also = (f", and after each of {self.collector_on} more with the collector on"
                    if self.collector_on else "")
            return (f"memory was back at its baseline after each of {self.iterations} iterations "
                    f"on {self.device}, with the collector off and no collection{also}: reference counting "
                    "alone frees it.")
        lines = []
        if self.error is not None:
            where = (f"after {len(self.growth)} of {self.iterations} iterations"
                     if len(self.growth) < self.iterations else
                     f"after {len(self.growth_collector_on)} of {self.collector_on} iterations with the collector on")
            lines.append(f"the step raised {type(self.error).__name__}: {self.error} ({where})")
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
        held_on = [(i, g) for i, g in enumerate(self.growth_collector_on, 1) if g > 0]
        if held_on and not bad:
            i, g = held_on[0]
            lines.append(
                f"with the collector switched on, memory was {format_bytes(g)} above its baseline after "
                f"iteration {i} of {len(self.growth_collector_on)}: the code keeps tensors alive when the "
                "collector is on (does it behave differently depending on gc.isenabled()?). A fix must "
                "free memory by reference counting whether the collector is on or off.")
        return " ".join(lines)


def _plain(value):
    """A step's result as plain Python data, so keeping it keeps no tensor alive."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def run_flat_check(step, iterations: int = 20, device=None, warmup: int = 0,
                   collector_on: int | None = None) -> FlatReport:
    """Call `step(i)` for i in range(warmup + iterations) with the automatic collector off, then
    `collector_on` more times (default: a quarter of `iterations`, at least 2) with it on.

    The meter's baseline is taken after the warm-up iterations; after every measured
    iteration with the collector off memory must be back at that baseline, to the byte, and
    no collection (automatic or explicit) may run.  With the collector on, collections may
    run, but memory must still be back at (or below) its baseline after every iteration:
    a fix must not depend on the collector being off.  The collector's previous state is
    restored after.
    """
    if collector_on is None:
        collector_on = max(2, iterations // 4)
    meter = Meter(device)
    report = FlatReport(device=meter.device, iterations=iterations, collector_on=collector_on)
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
                report.collections = list(watch.collections)
                if report.ok or (not report.collections and not any(report.growth)):
                    _run_collector_on(step, meter, report, start=warmup + iterations)
            except Exception as exc:          # reported, not raised: the report says what happened
                report.error = exc.with_traceback(None)   # its frames would hold the step's tensors
    finally:
        report.collections = list(watch.collections)
        if was_enabled:
            gc.enable()
        else:
            gc.disable()
    return report


def _run_collector_on(step, meter, report: FlatReport, start: int) -> None:
    """The collector-on part of `run_flat_check`: growth after each iteration, collections allowed."""
    gc.collect()                 # garbage left from before must not be freed inside the measurement
    baseline = meter.allocated()
    gc.enable()
    try:
        for i in range(start, start + report.collector_on):
            report.results_collector_on.append(_plain(step(i)))
            report.growth_collector_on.append(meter.allocated() - baseline)
    finally:
        gc.disable()


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




# -- a GC policy for a server: latency budget, no full collection in a request, bounded garbage
@dataclass
class PolicyReport:
    """The same open-loop load against the same server, run with the policy under test, with
    the default collector and with the collector off, one after another in the same run."""
    runs: dict
    p99_ratio_budget: float
    garbage_fraction: float
    oldest_generation: int = 2
    first_p99_ratio: float | None = None    # an earlier attempt's ratio, when only its P99 failed

    @property
    def policy(self):
        return self.runs["your policy"]

    @property
    def baseline(self):
        return self.runs["collector off"]

    @property
    def p99_ratio(self) -> float:
        return self.policy.p99 / max(self.baseline.p99, 1e-9)

    @property
    def full_collections_inside(self) -> list:
        return self.policy.trace.collections_inside_requests(self.oldest_generation)

    @property
    def garbage_bound(self) -> int:
        return int(self.garbage_fraction * len(self.policy.load.status))

    @property
    def peak_garbage(self) -> int:
        garbage = self.policy.trace.garbage
        return max(garbage.get("peak_uncollected", 0), garbage.get("uncollected", 0))

    @property
    def failures(self) -> list:
        run = self.policy
        problems = [f"{run.load.failed} request(s) got no answer or an error"] if run.load.failed else []
        if not run.trace.info.get("recording_intact", True):
            problems.append("the server's record of collections was tampered with (its gc.callbacks hook "
                            "was removed, or it missed collections CPython counted)")
        return problems + list(run.trace.errors)

    @property
    def checks(self) -> dict:
        return {
            "answers": not self.failures,
            "p99": self.p99_ratio <= self.p99_ratio_budget,
            "no full collection inside a request": not self.full_collections_inside,
            "garbage bounded": self.peak_garbage <= self.garbage_bound,
        }

    @property
    def ok(self) -> bool:
        return all(self.checks.values())

    def explain(self) -> str:
        run, checks = self.policy, self.checks
        p99s = ", ".join(f"{name} {r.p99:.1f} ms" for name, r in self.runs.items())
        lines = [f"P99 latency: {p99s}; yours is {self.p99_ratio:.2f}x the collector-off baseline "
                 f"(budget {self.p99_ratio_budget:g}x): " + ("within budget." if checks["p99"] else "over budget.")]
        if self.first_p99_ratio is not None:
            lines.append(f"(A first pair of runs measured {self.first_p99_ratio:.2f}x with everything else in order; "
                         "a P99 over budget is measured once more, on a fresh pair, before it counts: "
                         "these figures are the second pair's.)")
        inside = self.full_collections_inside
        if inside:
            worst = max(c.duration for c in inside)
            lines.append(f"{len(inside)} full (generation {self.oldest_generation}) collection(s) ran while requests "
                         f"were in flight, the longest {worst * 1e3:.1f} ms: every request in flight waited for it. "
                         "Run full collections only when no request is in flight.")
        else:
            lines.append("No full collection ran inside a request.")
        garbage = run.trace.garbage
        seen = (f"Cyclic garbage (responses' worth, uncollected): at most {self.peak_garbage} at any time, "
                f"{garbage.get('uncollected', 0)} left at the end")
        if checks["garbage bounded"]:
            lines.append(f"{seen}; bound {self.garbage_bound}.")
        else:
            lines.append(f"{seen}, over the bound of {self.garbage_bound}: the cycles the server makes wait too "
                         "long for a collection (or never get one), so memory grows while the server is busy. "
                         "Switching the collector off, or collecting only once the load is over, is not a fix.")
        if self.failures:
            lines.append("Errors: " + "; ".join(self.failures[:5]))
        return "\n".join(lines)


def run_policy_check(policy, rate: float = 250.0, duration: float = 3.5, heap_objects: int = 300_000,
                     p99_ratio_budget: float = 3.0, garbage_fraction: float = 0.65, settle: float = 0.5,
                     device=None, seed: int = 0, include_default: bool = True,
                     confirm_below: float = 10.0) -> PolicyReport:
    """Serve the same load with `policy` (a policy file), with the collector off and (if asked)
    with the default collector, and judge the policy against the baseline of this same run.

    The policy passes when its P99 is at most `p99_ratio_budget` times the collector-off P99, no
    full collection ran while a request was in flight, and the cyclic garbage alive at any time
    (sampled while the server runs, and after `settle` idle seconds at the end) stayed at most
    `garbage_fraction` of the requests served.  When only the P99 failed, and by less than
    `confirm_below` times the baseline, the policy and the baseline are run once more and that
    second pair decides (a stall of the machine during one run is not the policy's doing).
    """
    import os
    import tempfile

    from .serving import measure

    def serve(name, path):
        return measure(name, rate=rate, duration=duration, settle=settle, seed=seed, policy=path,
                       heap_objects=heap_objects, attribution="objects", device=device)

    with tempfile.TemporaryDirectory(prefix="gclab-policy-") as folder:
        off = os.path.join(folder, "collector_off.py")
        with open(off, "w") as f:
            f.write("import gc\n\ndef on_startup():\n    gc.disable()\n")
        configs = {"your policy": policy, "collector off": off}
        if include_default:
            configs["default"] = None
        report = PolicyReport({name: serve(name, path) for name, path in configs.items()},
                              p99_ratio_budget, garbage_fraction)
        if _only_latency_failed(report, confirm_below):
            # A shared machine can stall one run; a latency failure must show up twice to count.
            again = {"your policy": serve("your policy", policy), "collector off": serve("collector off", off)}
            report = PolicyReport({**report.runs, **again}, p99_ratio_budget, garbage_fraction,
                                  first_p99_ratio=report.p99_ratio)
    return report


def _only_latency_failed(report: PolicyReport, confirm_below: float) -> bool:
    failed = {name for name, ok in report.checks.items() if not ok}
    return failed == {"p99"} and report.p99_ratio < confirm_below


def assert_policy(report: PolicyReport) -> None:
    assert report.ok, report.explain()


_OWN.update({name: globals()[name] for name in
             ("run_flat_check", "assert_flat", "compare", "assert_matches", "integrity_problems",
              "assert_untampered", "run_policy_check", "assert_policy")})
