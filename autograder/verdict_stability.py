"""How stable is lesson 06's verdict on this machine, quiet and busy?  Run it on your course server.

    .venv/bin/python autograder/verdict_stability.py [--repeats N] [--hogs K] [POLICY.py=pass|fail ...]

Grades the reference solution's GC policy and each wrong policy (the ones the tests use) with
`gclab.checks.run_policy_check`, as lesson 06's hidden test does, N times on the machine as it
is ("quiet") and N times with K CPU-bound processes running beside it ("contended"; the script
starts and stops them itself), interleaved: one round of every policy quiet, then one contended,
and so on.  Extra policy files may be given with their expected verdict.  It prints a line per
grading as it goes, then a table: per policy and condition, how many gradings passed, failed and
were inconclusive, how many flipped against the expected verdict (a pass of a wrong policy or a
fail of a right one; an inconclusive verdict is not a flip, it is counted on its own), and the
seconds one grading took (median, and the longest).

`autograder/policy_stability.py` is the older, quiet-only version of this script.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gclab import checks

REFERENCE = """import gc


def on_startup():
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, 10**9)


def on_idle(idle_seconds):
    if gc.get_count()[2] > 0:
        gc.collect()
"""

# name -> (policy source, expected verdict)
POLICIES = {
    "reference solution": (REFERENCE, "pass"),
    "default collector (empty policy)": ("import gc\n", "fail"),
    "collector off for good": ("import gc\ndef on_startup():\n    gc.disable()\n", "fail"),
    "thresholds raised alone": ("import gc\ndef on_startup():\n    gc.set_threshold(50_000)\n", "fail"),
    "young collections only": ("import gc\ndef on_startup():\n    gc.set_threshold(100_000, 10**9, 10**9)\n", "fail"),
    "collect after every request": ("import gc\ndef after_request(in_flight):\n    gc.collect()\n", "fail"),
    "thresholds so high nothing is collected": (
        "import gc\ndef on_startup():\n    gc.set_threshold(1_000_000, 1000, 1000)\n", "fail"),
    "collect only when the load is over": (
        "import gc\ndef on_startup():\n    gc.freeze()\n    gc.set_threshold(700, 10, 10**9)\n"
        "def on_idle(idle_seconds):\n    if idle_seconds > 0.2:\n        gc.collect()\n", "fail"),
    "collect when idle, no freeze": (
        "import gc\ndef on_startup():\n    gc.set_threshold(700, 10, 10**9)\n"
        "def on_idle(idle_seconds):\n    if gc.get_count()[2] > 0:\n        gc.collect()\n", "fail"),
    "collector statistics left on": (
        REFERENCE.replace("def on_startup():\n", "def on_startup():\n    gc.set_debug(gc.DEBUG_STATS)\n"), "fail"),
    "unhooks the recording": ("import gc\ndef before_request(in_flight):\n    gc.callbacks.clear()\n", "fail"),
    "rewrites the server's garbage count": (
        "import gc, sys\n"
        "def on_startup():\n"
        "    for server in (sys.modules['__main__'], __import__('gclab.serving').serving):\n"
        "        try:\n"
        "            server.ServerState.garbage = lambda self: {'uncollected': 0, 'peak_uncollected': 0}\n"
        "        except Exception:\n"
        "            pass\n"
        "    gc.disable()\n", "fail"),
}


class Hogs:
    """K CPU-bound processes, started on entry and killed on exit."""

    def __init__(self, count: int):
        self.count, self.procs = count, []

    def __enter__(self):
        # each hog exits when this script does, even if it is killed (it watches its parent)
        hog = ("import os, time\nparent, t = os.getppid(), time.time()\nwhile os.getppid() == parent:\n"
               "    while time.time() - t < 0.5:\n        pass\n    t = time.time()\n")
        self.procs = [subprocess.Popen([sys.executable, "-c", hog]) for _ in range(self.count)]
        return self

    def __exit__(self, *exc):
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()
        return False


def grade(path: Path) -> tuple[str, float, str]:
    start = time.perf_counter()
    try:
        report = checks.run_policy_check(str(path))
    except Exception as exc:            # a policy that stops the server from starting fails
        return "fail", time.perf_counter() - start, f"error: {str(exc).splitlines()[-1][:100]}"
    took = time.perf_counter() - start
    mine = report.policy
    detail = (f"pause P99 {report.pause_p99 * 1e3:6.1f}/{report.pause_limit * 1e3:5.1f} ms CPU, "
              f"garbage {report.peak_garbage:3d}/{report.garbage_bound}, freed while serving "
              f"{report.freed_while_serving:3d}, full inside {len(report.full_collections_inside):2d}, "
              f"wall P99 {mine.p99:7.1f} ms, runs {len([n for n in report.runs if n.startswith('your policy')])}"
              + (f", tampered: {mine.trace.tampered[0][:60]}" if mine.trace.tampered else "")
              + (f", inconclusive: {report.inconclusive_reason[:70]}" if report.inconclusive else ""))
    return report.verdict, took, detail


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="gradings per policy and condition (default 20)")
    parser.add_argument("--hogs", type=int, default=2, help="CPU-bound processes in the contended condition")
    parser.add_argument("--conditions", default="quiet,contended")
    parser.add_argument("--only", default="", help="comma-separated names of the built-in policies to grade")
    parser.add_argument("extra", nargs="*", help="more policy files, as PATH=pass or PATH=fail")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="gclab-verdicts-") as folder:
        return _run(args, Path(folder))


def _run(args, folder: Path) -> int:
    """Grade every policy (the built-in ones written into `folder`) `args.repeats` times per condition."""
    policies = {}
    wanted = [n.strip() for n in args.only.split(",") if n.strip()]
    for k, (name, (source, expected)) in enumerate(POLICIES.items()):
        if wanted and name not in wanted:
            continue
        path = folder / f"policy_{k}.py"
        path.write_text(source)
        policies[name] = (path, expected)
    for item in args.extra:
        path, _, expected = item.rpartition("=")
        policies[Path(path).name] = (Path(path).resolve(), expected)

    conditions = [c for c in args.conditions.split(",") if c]
    results = {(name, c): [] for name in policies for c in conditions}
    print(f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.2f} at the start; "
          f"{args.repeats} repeats; contended = {args.hogs} CPU-bound processes beside the grading", flush=True)
    for k in range(args.repeats):
        for condition in conditions:
            with Hogs(args.hogs if condition == "contended" else 0):
                for name, (path, expected) in policies.items():
                    verdict, took, detail = grade(path)
                    results[(name, condition)].append((verdict, took))
                    flip = " FLIP" if verdict in ("pass", "fail") and verdict != expected else ""
                    print(f"{k:2d} {condition:<9} {name:<40} {verdict:<12}{took:5.1f} s  {detail}{flip}", flush=True)

    print()
    print(f"{'policy':<40} {'condition':<10} {'expected':<8} {'passes':>6} {'fails':>6} {'inconcl.':>8} "
          f"{'flips':>6} {'s/grading (median, max)':>24}")
    flips_total = 0
    for (name, condition), seen in results.items():
        expected = policies[name][1]
        verdicts = [v for v, _ in seen]
        flips = sum(v in ("pass", "fail") and v != expected for v in verdicts)
        flips_total += flips
        times = [t for _, t in seen]
        print(f"{name:<40} {condition:<10} {expected:<8} {verdicts.count('pass'):>6} {verdicts.count('fail'):>6} "
              f"{verdicts.count('inconclusive'):>8} {flips:>6} "
              f"{statistics.median(times):>15.1f}, {max(times):5.1f}")
    print(f"\n{flips_total} flip(s) in {sum(len(s) for s in results.values())} gradings; "
          f"load average {os.getloadavg()[0]:.2f} at the end")
    return 1 if flips_total else 0


if __name__ == "__main__":
    sys.exit(main())
