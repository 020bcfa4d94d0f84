"""How stable is lesson 06's verdict? Judge GC policy files repeatedly, as the hidden test does.

    .venv/bin/python autograder/policy_stability.py REPEATS POLICY.py [POLICY.py ...]

Each repeat runs `gclab.checks.run_policy_check` on every policy (your policy, the collector
off and the default, one after another) and prints one line per run: the verdict, the P99
ratio, the peak garbage and the full collections inside requests.  The last lines count, per
policy, how often the verdict differed from the first one.  Run it once on a quiet machine
and once with another CPU-heavy process running.
"""
import sys
from collections import defaultdict
from pathlib import Path

from gclab import checks


def main(repeats: int, policies: list[str]) -> int:
    verdicts = defaultdict(list)
    for k in range(repeats):
        for policy in policies:
            report = checks.run_policy_check(policy)
            verdicts[policy].append(report.ok)
            print(f"run {k:2d} {Path(policy).name:<44} ok={report.ok!s:<5} P99 ratio {report.p99_ratio:6.2f} "
                  f"(yours {report.policy.p99:7.1f} ms, off {report.baseline.p99:5.1f} ms, default "
                  f"{report.runs['default'].p99:6.1f} ms)  peak garbage {report.peak_garbage:4d}/{report.garbage_bound}  "
                  f"full inside {len(report.full_collections_inside)}", flush=True)
    for policy, seen in verdicts.items():
        flips = sum(v != seen[0] for v in seen)
        print(f"{Path(policy).name}: verdict {seen[0]} in {len(seen) - flips} of {len(seen)} runs, flipped {flips} times")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2:]))
