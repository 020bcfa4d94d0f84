"""Do a lesson's grades hold on a busy machine?  Grades notebooks again and again, quiet and contended.

    .venv/bin/python autograder/grade_stability.py [--repeats N] [--hogs K] NOTEBOOK.ipynb ...

Each round grades every notebook with `gclab.grader.grading.grade` once on the machine as it is
("quiet") and once with K CPU-bound processes beside it ("contended"; `Hogs` from
verdict_stability.py).  It prints each grading, then per notebook the scores seen in each
condition: a notebook whose scores differ flips, and the script exits 1.  For lesson 06's
served-latency verdict, verdict_stability.py grades the policies alone, more cheaply.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verdict_stability import Hogs  # noqa: E402

from gclab.grader import grading  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="grade_stability.py")
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hogs", type=int, default=2, help="CPU-bound processes in the contended condition")
    args = parser.parse_args(argv)
    seen = defaultdict(lambda: defaultdict(list))       # notebook -> condition -> [score, ...]
    for k in range(args.repeats):
        for condition, hogs in (("quiet", 0), ("contended", args.hogs)):
            with Hogs(hogs):
                started = time.perf_counter()
                results = grading.grade(args.notebooks, ROOT)
            for path, result in zip(args.notebooks, results):
                seen[path.name][condition].append(result.score)
            print(f"round {k + 1} {condition:<9} {time.perf_counter() - started:6.1f} s  "
                  + "  ".join(f"{r.score:g}" for r in results), flush=True)
            for path, result in zip(args.notebooks, results):      # why a grading lost points, to tell noise from a fault
                for test in result.tests:
                    if test.score < test.max_score:
                        print(f"    {path.name} {test.id}: {test.status}: {(test.message or result.reason)[:300]}")
    flips = 0
    print(f"\n{'notebook':<48}{'quiet':>20}{'contended':>20}")
    for name, by_condition in seen.items():
        scores = {s for values in by_condition.values() for s in values}
        flips += len(scores) > 1
        print(f"{name:<48}{str(by_condition['quiet']):>20}{str(by_condition['contended']):>20}"
              + ("  FLIPS" if len(scores) > 1 else ""))
    return 1 if flips else 0


if __name__ == "__main__":
    sys.exit(main())
