"""Judge GC policy files repeatedly, as lesson 06's hidden test does, on the machine as it is.

    .venv/bin/python autograder/policy_stability.py REPEATS POLICY.py [POLICY.py ...]

Each repeat runs `gclab.checks.run_policy_check` on every policy and prints one line per grading:
the verdict (pass, fail or inconclusive), the collector time charged to a request against its
budget (CPU time), the peak garbage, the full collections inside requests and the wall-clock P99.
The last lines count, per policy, how often the verdict differed from the first one.

`autograder/verdict_stability.py` does this for the reference solution and every wrong policy the
tests use, quiet and with CPU-bound processes running beside the grading, and prints a flip table:
prefer it to check a course server.
"""
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verdict_stability import grade  # noqa: E402


def main(repeats: int, policies: list[str]) -> int:
    verdicts = defaultdict(list)
    for k in range(repeats):
        for policy in policies:
            verdict, took, detail = grade(Path(policy))
            verdicts[policy].append(verdict)
            print(f"run {k:2d} {Path(policy).name:<40} {verdict:<12} {took:5.1f} s  {detail}", flush=True)
    for policy, seen in verdicts.items():
        flips = sum(v != seen[0] for v in seen)
        print(f"{Path(policy).name}: {seen[0]} in {len(seen) - flips} of {len(seen)} runs, differed {flips} times")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2:]))
