"""A GC policy for a model server: collector pauses within budget, no full collection inside a request,
bounded garbage (`run_policy_check`, `assert_policy`).

What it measures: the server's own record of every collection (gc.callbacks, with the CPU time each
took) and of every request, checked against CPython's counters, over the lesson's load and a busier
one. What it cannot see: a policy that behaves only under other loads than these.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


__all__ = ["PolicyReport", "run_policy_check", "assert_policy", "PAUSE_BUDGET", "GARBAGE_FRACTION", "LOAD_BURST",
           "LOAD_LULL", "MIN_IDLE_MOMENTS"]


# -- a GC policy for a server: collector pauses, no full collection in a request, bounded garbage
# What a policy is judged on is what the server records in CPU time and counts (gc.callbacks,
# checked against CPython's own counters), not wall-clock latency: on a busy machine a process
# waiting for a core shows up in wall-clock time, not in the CPU time its collections take.
PAUSE_BUDGET = 0.75         # of the CPU time of one full collection of the server's heap before any policy
GARBAGE_FRACTION = 0.65     # of the responses served
BUSY_BASELINE_P99_MS = 40.0  # collector off, a quiet machine: about 10 ms; above this the machine was too busy
LOAD_BURST = 125            # requests: the graded load's 875 in seven bursts
LOAD_LULL = 0.05            # seconds of quiet after each burst's last answer
# the busier load: evenly spaced requests, one every 2.5 ms, each waiting 5 ms for the device, so that one is
# always in flight and the server is never idle: what a policy leaves to the collector's thresholds runs inside.
# on_idle is not called during it at all: a load generator that waits 10 ms for a core on a busy machine would
# otherwise leave the server idle now and then, and a collection there may or may not postpone the full one
# (the hidden test's busier load, 750 requests, caught one the self-check's 600 missed in one of three runs of
# the test suite)
BUSIER_RATE, BUSIER_DURATION, BUSIER_IDLE_AFTER = 400.0, 1.875, 3600.0
MIN_IDLE_MOMENTS = 3        # fewer idle moments than this while the load ran: no chance to collect when idle


@dataclass
class PolicyReport:
    """The policy's run of the load (and, when the first run failed in a way a busy machine can
    cause, a run with the collector off and a second run of the policy, in that order), judged on
    what the server recorded.

    A request is charged with the collections it waited behind: those that ran between its
    scheduled send time and its answer, each at the CPU time it took in the server.  The policy
    passes when every request was answered, the server vouches for its record, no full collection
    ran while a request was in flight (nor at the busier load, where one always is) but at least one
    ran between requests while the load was served, the P99 of those charges is at most `pause_budget` times the CPU time of one full
    collection of the server's heap (measured in the same server before the policy ran), and the
    cyclic garbage stayed under `garbage_fraction` of the responses."""
    runs: dict
    pause_budget: float = PAUSE_BUDGET
    garbage_fraction: float = GARBAGE_FRACTION
    oldest_generation: int = 2
    inconclusive_reason: str | None = None
    first_failures: list | None = None      # what a first run of the policy failed, when it ran twice
    acts_when_idle: bool = True             # has a hook that runs between requests (_acts_when_idle)

    @property
    def policy(self):
        return self.runs["your policy"]

    @property
    def baseline(self):
        return self.runs.get("collector off")

    # -- what the server recorded ------------------------------------------------------
    @property
    def full_collection_cpu(self) -> float:
        return self.policy.trace.info.get("full_collection_cpu") or 0.0

    @property
    def pause_limit(self) -> float:
        """The budget, in CPU seconds, for the collector time charged to a request (P99)."""
        return self.pause_budget * self.full_collection_cpu

    def _p99(self, what: str = "total") -> float:
        """P99 over the requests of one of `Trace.charges`: "total", "longest" or "count"."""
        import numpy as np
        charges = self.policy.trace.charges(self.policy.load)[what]
        return float(np.percentile(charges, 99)) if len(charges) else 0.0

    @property
    def pause_p99(self) -> float:
        """P99 over the requests of the collector CPU time each waited behind (every collection that
        ran between its scheduled send time and its answer, added up), in CPU seconds."""
        return self._p99("total")

    @property
    def full_collections_inside(self) -> list:
        return self.policy.trace.collections_inside_requests(self.oldest_generation)

    @property
    def busier(self):
        return self.runs.get("busier load")

    @property
    def busier_load_failures(self) -> list[str]:
        """What went wrong at the busier load (never idle), where it ran: a record the server could not vouch
        for, full collections inside requests (requests a busy machine left unanswered are not judged there)."""
        run = self.busier
        if run is None:
            return []
        if run.trace.info.get("unavailable"):
            return ["the server did not report its record: " + "; ".join(run.trace.errors[:1])]
        inside = run.trace.collections_inside_requests(self.oldest_generation)
        return [f"tampered: {text}" for text in run.trace.tampered[:2]] \
            + ([f"{len(inside)} full collection(s) ran inside requests, the longest "
                f"{max(c.duration for c in inside) * 1e3:.1f} ms ({max(c.cpu for c in inside) * 1e3:.1f} ms of CPU)"]
               if inside else [])

    @property
    def full_collections_while_serving(self) -> list:
        """Full collections while the load ran (outside requests, for a policy that passes): garbage
        that reached the oldest generation is freed by nothing else.  A policy that runs none has
        only postponed them (raised thresholds): the next comes when the thresholds say, in a request."""
        return self.policy.trace.collections_while_serving(self.oldest_generation)

    @property
    def garbage_bound(self) -> int:
        return int(self.garbage_fraction * len(self.policy.load.status))

    @property
    def peak_garbage(self) -> int:
        garbage = self.policy.trace.garbage
        return max(garbage.get("peak_uncollected", 0), garbage.get("uncollected", 0))

    @property
    def tampered(self) -> list:
        return self.policy.trace.tampered

    @property
    def failures(self) -> list:
        run = self.policy
        problems = [f"{run.load.failed} request(s) got no answer or an error"] if run.load.failed else []
        return problems + list(run.trace.errors)

    # -- wall clock, what users feel (shown, not judged) ---------------------------------
    @property
    def p99_ratio(self) -> float | None:
        return self.policy.p99 / max(self.baseline.p99, 1e-9) if self.baseline is not None else None

    # -- the verdict ---------------------------------------------------------------------
    @property
    def checks(self) -> dict:
        readable = not self.policy.trace.info.get("unavailable")
        return {
            "answers": not self.failures,
            "record vouched for": not self.tampered,
            "no full collection inside a request": readable and not self.full_collections_inside,
            "none at a busier load either": not self.busier_load_failures,
            "collector pauses within budget": readable and self.full_collection_cpu > 0
                                              and self.pause_p99 <= self.pause_limit,
            "full collections while serving": readable and bool(self.full_collections_while_serving),
            "garbage bounded": readable and self.peak_garbage <= self.garbage_bound,
            "garbage collectable": readable and self.garbage_never_freed <= self.garbage_bound // 20,
        }

    @property
    def garbage_never_freed(self) -> int:
        """Garbage still alive after the server's own full collection at the end: frozen while in
        use (gc.freeze()), it can never be collected."""
        return self.policy.trace.garbage.get("left_after_full_collection", 0)

    @property
    def freed_while_serving(self) -> int:
        """Responses' worth of cyclic garbage the collector freed while the load ran."""
        return self.policy.trace.freed_while_serving()

    def _why_over_budget(self) -> str:
        longest = self._p99("longest")
        if longest > self.pause_limit / 2:
            return ("Requests waited behind collections that walk the whole long-lived heap: make a full "
                    "collection cheap before it runs, and run it when it delays no one.")
        return (f"No one collection was that long (the longest a request waited behind: P99 {longest * 1e3:.1f} ms), "
                f"but requests waited behind many in a row (P99 {self._p99('count'):.0f}), each costing far more "
                "than a young collection should: something makes every collection slow, such as gc.set_debug's "
                "DEBUG_STATS, with which every collection counts the objects of every generation, frozen ones "
                "included, and writes them out.")

    def failed_by_facts(self) -> list:
        """Failed checks that a busy machine cannot cause: a tampered record, a full collection in a
        request, pauses as costly as a collection of the whole unfrozen heap, garbage never freed,
        not even in the idle time after the load.  (Unanswered requests, and pauses or garbage a little over budget, can
        come from a machine too busy to serve the load, and are measured again.)"""
        checks, facts = self.checks, []
        for name in ("record vouched for", "no full collection inside a request", "none at a busier load either",
                     "garbage collectable"):
            if not checks[name] and not self.policy.trace.info.get("unavailable"):
                facts.append(name)
        if not checks["collector pauses within budget"] and self.full_collection_cpu > 0 \
                and self.pause_p99 >= self.full_collection_cpu:
            facts.append("collector pauses within budget")
        if not checks["garbage bounded"] and not self.policy.trace.info.get("unavailable") \
                and self.policy.trace.freed_while_serving(until=float("inf")) == 0 \
                and self.policy.trace.garbage.get("uncollected", 0) > self.garbage_bound:
            facts.append("garbage bounded")     # never collected, not even when the server was idle after the load
        if not checks["full collections while serving"] and not self.acts_when_idle \
                and not self.policy.trace.info.get("unavailable"):
            # with no hook between requests, only the collector's own thresholds start a full collection
            # while serving: they count allocations, which a busy machine does not change
            facts.append("full collections while serving")
        return facts

    @property
    def inconclusive(self) -> bool:
        return self.inconclusive_reason is not None

    @property
    def ok(self) -> bool:
        return not self.inconclusive and all(self.checks.values())

    @property
    def verdict(self) -> str:
        return "inconclusive" if self.inconclusive else "pass" if self.ok else "fail"

    def explain(self) -> str:
        run, checks = self.policy, self.checks
        lines = []
        if self.inconclusive:
            lines.append(f"inconclusive: {self.inconclusive_reason}")
        if self.tampered:
            lines.append("tampered: the server cannot vouch for its record, because " + "; ".join(self.tampered[:4])
                         + ". A policy may change when and how the collector runs, not the server's instruments.")
        p = run.load.percentiles()
        wall = f"Wall-clock latency with your policy: P50 {p[50]:.1f} ms, P99 {p[99]:.1f} ms"
        if self.baseline is not None:
            wall += f" (collector off: P99 {self.baseline.p99:.1f} ms, {self.p99_ratio:.2f}x)"
        lines.append(wall + "; on a busy machine these grow whatever the policy, so the grade uses CPU time.")
        if run.trace.info.get("unavailable"):
            lines.append("The server did not report its record: " + "; ".join(run.trace.errors[:1]))
        else:
            full = self.full_collection_cpu * 1e3
            lines.append(
                f"Collector time charged to a request (the collections it waited behind, added up, in CPU time): "
                f"P99 {self.pause_p99 * 1e3:.1f} ms; budget {self.pause_budget:g} x one full collection of the "
                f"server's heap ({full:.1f} ms of CPU) = {self.pause_limit * 1e3:.1f} ms: "
                + ("within budget." if checks["collector pauses within budget"] else
                   "over budget. " + self._why_over_budget()))
            inside = self.full_collections_inside
            if inside:
                worst = max(c.duration for c in inside)
                lines.append(f"{len(inside)} full (generation {self.oldest_generation}) collection(s) ran while "
                             f"requests were in flight, the longest {worst * 1e3:.1f} ms: every request in flight "
                             "waited for it. Run full collections only when no request is in flight.")
            else:
                lines.append("No full collection ran inside a request.")
            if self.busier is not None:
                busier = self.busier_load_failures
                lines.append(
                    f"At a busier load ({len(self.busier.load.status)} requests, one every "
                    f"{1e3 / BUSIER_RATE:.1f} ms: never a moment without one in flight): "
                    + ("no full collection ran inside a request." if not busier else "; ".join(busier) + ". "
                       "Collecting when idle keeps full collections out of requests only while the server is idle "
                       "often enough; raise the third threshold (or pause the collector in requests) so that the "
                       "collector never starts one by itself."))
            if not checks["full collections while serving"]:
                lines.append(
                    f"No full (generation {self.oldest_generation}) collection ran while the load was served: the "
                    "policy postpones them rather than taking them out of requests. Garbage that reached the oldest "
                    "generation (a cached response that outlived two young collections before it was evicted) waits "
                    "for one, and under this policy the next comes when the collector's thresholds say, in the "
                    "middle of a request (raised thresholds only make it come later, over more objects), or never. "
                    "Run full collections while no request is in flight, made cheap by freezing the long-lived heap.")
            garbage = run.trace.garbage
            seen = (f"Cyclic garbage (responses' worth, uncollected): at most {self.peak_garbage} at any time, "
                    f"{garbage.get('uncollected', 0)} left at the end")
            if checks["garbage bounded"]:
                lines.append(f"{seen}; bound {self.garbage_bound}.")
            else:
                lines.append(f"{seen}, over the bound of {self.garbage_bound}: the cycles the server makes wait too "
                             "long for a collection (or never get one), so memory grows while the server is busy. "
                             "Switching the collector off, or collecting only once the load is over, is not a fix.")
            if not checks["garbage collectable"] and garbage.get("saved_in_gc_garbage"):
                lines.append(f"{self.garbage_never_freed} responses' worth of garbage were still alive after the "
                             "server's own full collection at the end, kept in gc.garbage: with gc.DEBUG_SAVEALL "
                             "set (gc.set_debug), the collector keeps everything it finds there and frees none of it, "
                             "so memory grows for as long as the server runs. Leave the debug flags off.")
            elif not checks["garbage collectable"]:
                lines.append(f"{self.garbage_never_freed} responses' worth of garbage were still alive after the "
                             "server's own full collection at the end: objects frozen (gc.freeze()) while in use are "
                             "never collected once they die, so memory grows for as long as the server runs. Freeze "
                             "once, after warm-up, what lives for good.")
        if self.failures:
            seen = Counter(self.failures)          # a hook that fails every time says so once
            lines.append("Errors: " + "; ".join(f"{text} ({n} times)" if n > 1 else text
                                                for text, n in list(seen.items())[:5]))
        if self.first_failures:
            lines.append("(A first run failed on " + ", ".join(self.first_failures) + "; a failure a busy machine "
                         "can cause is measured once more, after a run with the collector off: the figures above "
                         "are the second run's.)")
        return "\n".join(lines)


def _busy_machine(report: PolicyReport, baseline, policy_runs) -> str | None:
    """Why the runs say the machine was too busy to judge what failed, or None.  A policy with no
    hook between requests (`report.acts_when_idle` false) lost nothing when the server was never idle."""
    load, failing = baseline.load, {name for name, ok in report.checks.items() if not ok}
    if load.failed:
        return (f"with the collector off, the same server left {load.failed} of {len(load.status)} requests "
                "unanswered: the machine was too busy to judge a policy; grade again on a quieter machine")
    idle = [run.trace.idle_moments() for run in policy_runs]
    # a server idle a few times gave the policy chances: if it took none, the machine is not why it failed
    took_its_chances = max(idle) == 0 or any(_collected_between_requests(run.trace) for run in policy_runs)
    if (report.acts_when_idle and failing & {"garbage bounded", "full collections while serving"}
            and max(idle) < MIN_IDLE_MOMENTS and took_its_chances):
        return (f"the server found no request in flight only {max(idle)} time(s) while the load ran with your policy "
                "(the lulls between the load's bursts give the reference policy 20 or more on a quiet machine of "
                "two cores, 13 or more beside four CPU-bound processes): the machine was too busy for the server to "
                "keep up, so a policy that collects when the server is idle got no chance; grade again on a quieter "
                "machine")
    if failing & {"answers", "collector pauses within budget"} and baseline.p99 > BUSY_BASELINE_P99_MS:
        return (f"with the collector off, the same server's P99 was {baseline.p99:.0f} ms (a quiet machine: about "
                f"10 ms, expected at most {BUSY_BASELINE_P99_MS:g} ms): the machine was too busy to judge; grade "
                "again on a quieter machine")
    return None


def _collected_between_requests(trace) -> bool:
    """Did a full collection start while the load ran with no request in flight (as one on_idle runs)?"""
    served = [(start, end) for _, start, end in trace.requests]
    return any(not any(start <= c.start <= end for start, end in served)
               for c in trace.collections_while_serving(2))


def _acts_when_idle(policy) -> bool:
    """Does the policy file name a hook that runs between requests (on_idle, after_request)?  Read from
    its source: True when it cannot be read, so that a busy machine is blamed no less than before."""
    try:
        with open(policy) as f:
            source = f.read()
    except (OSError, UnicodeDecodeError):
        return True
    return "on_idle" in source or "after_request" in source


def run_policy_check(policy, rate: float = 250.0, duration: float = 3.5, heap_objects: int = 300_000,
                     pause_budget: float = PAUSE_BUDGET, garbage_fraction: float = GARBAGE_FRACTION,
                     settle: float = 0.5, device=None, seed: int = 0, baseline: bool = False,
                     progress=None, burst: int = LOAD_BURST, lull: float = LOAD_LULL) -> PolicyReport:
    """Serve the load with `policy` (a policy file) and judge it on what the server recorded
    (see PolicyReport).  The load comes in bursts of `burst` requests, each `lull` seconds after
    the last answer to the one before (serving.run_load): the server is idle between bursts
    however busy the machine, so a policy that collects when idle gets its chances on any
    machine.  One run decides when the policy passes, or when it fails on a fact a busy
    machine does not cause (`PolicyReport.failed_by_facts`).  Any other failure is measured again,
    after a run with the collector off (ABA): the second run of the policy decides, unless the
    collector-off run shows the machine was too busy to judge, and the report is then
    inconclusive.  `baseline=True` always adds the collector-off run (its wall-clock P99 is shown
    next to yours).  Once, the policy also serves a busier load (`BUSIER_RATE` evenly spaced requests
    a second, never a moment idle): no full collection may run inside a request there either.
    `progress`: a function called with a line before each run."""
    import os
    import tempfile

    from .serving import measure

    def serve(name, path):
        if progress:
            progress(f"serving the load: {name} ...")
        return measure(name, rate=rate, duration=duration, settle=settle, seed=seed, burst=burst, lull=lull,
                       policy=path, heap_objects=heap_objects, attribution="objects", device=device)

    acts_when_idle = _acts_when_idle(policy)

    def busier_load():
        if progress:
            progress("serving a busier load: your policy, never idle ...")
        return measure("your policy, busier load", rate=BUSIER_RATE, duration=BUSIER_DURATION, settle=0.05, seed=seed,
                       poisson=False, policy=policy, heap_objects=heap_objects, attribution="objects", device=device,
                       idle_after=BUSIER_IDLE_AFTER)

    def judged(runs, **extra):
        return PolicyReport(runs, pause_budget, garbage_fraction, acts_when_idle=acts_when_idle, **extra)

    with tempfile.TemporaryDirectory(prefix="gclab-policy-") as folder:
        off = os.path.join(folder, "collector_off.py")
        with open(off, "w") as f:
            f.write("import gc\n\ndef on_startup():\n    gc.disable()\n")
        first = {"your policy": serve("your policy", policy)}
        if baseline:
            first["collector off"] = serve("collector off", off)
        first["busier load"] = busier_load()
        report = judged(first)
        if report.ok or report.failed_by_facts():
            return report
        failed = [name for name, ok in report.checks.items() if not ok]
        off_run = first.get("collector off") or serve("collector off", off)
        again = serve("your policy", policy)
        runs = {"your policy": again, "collector off": off_run, "your policy (first run)": first["your policy"],
                "busier load": first["busier load"]}
        report = judged(runs, first_failures=failed)
        if report.ok or report.failed_by_facts():
            return report
        busy = _busy_machine(report, off_run, [first["your policy"], again])
        return judged(runs, first_failures=failed, inconclusive_reason=busy) if busy else report


def assert_policy(report: PolicyReport) -> None:
    """Fail with the report's explanation; an inconclusive report fails with a message that
    starts "inconclusive:" (the grader reports it as such, not as a wrong policy)."""
    if report.inconclusive:
        raise AssertionError(report.explain())
    assert report.ok, report.explain()

