"""The grader's own figures, per lesson and test: do they tell a lying process from the reference?

    .venv/bin/python autograder/grader_figures.py [--lessons 03 07 ...] [--out figures.md]

For each lesson it grades, with `gclab.grader.grading.grade`:
- the reference solution (its figures are the ones every submission is compared with);
- the untouched release;
- two plausible wrong fixes from the lesson's tests (the first two of `WRONG` in tests/test_lesson_NN.py),
  each twice: as it is, and with every `assert` of the process removed (`GCLAB_GRADE_STRIP_ASSERTS=1`, so each
  test runs to its end and reports "passed" whatever failed: what the grader sees of a process that
  rewrote its results).

and prints, per test, each grading's score and the grader's figures (CPU seconds on the verdict
process, growth of its resident memory and of its peak over the test), then what the grader made of
a lying process: which tests its figures refuted, and why.  Lesson 06 and lesson 08's serving test
judge latency inside the process (see the note printed with them).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from gclab.grader import grading  # noqa: E402


def _figures(test) -> str:
    m = test.measured
    if not m:
        return f"{test.score:g}/{test.max_score:g} (no figures)"
    charged = m.get("charged_peak_growth")
    charged = f" · {charged / 2**20:+.1f}" if charged is not None else ""
    return (f"{test.score:g}/{test.max_score:g} · {m['cpu_s']:.2f} s · {m['rss_growth'] / 2**20:+.1f} · "
            f"{m['peak_growth'] / 2**20:+.1f}{charged} MiB")


def _grade(path: Path, lying: bool = False):
    saved = {"GCLAB_GRADE_STRIP_ASSERTS": os.environ.get("GCLAB_GRADE_STRIP_ASSERTS")}
    if lying:       # verdicts forked from a zygote of their own, started with -O (and the reference's too)
        os.environ.update(GCLAB_GRADE_STRIP_ASSERTS="1")
    try:
        started = time.perf_counter()
        result, = grading.grade([path], ROOT)
        return result, time.perf_counter() - started
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


CALLS_INTRO = [
    "## Calls the grader times, per test", "",
    "Each call a test makes through `serving.serve_inline`, `checks.run_flat_check` or a hidden test's "
    "`gclab.outside.marked` is timed by the grader from outside (the process's CPU time read at every call's end); "
    "lesson 06's loads are sent by the grader itself. Read from the reference solution's graded run above: the calls "
    "its whole test cell made (self-check and hidden test), the longest of them in CPU time, the requests of each "
    "load the grader sent, and the price: what one full collection cost the reference's verdict process after its "
    "answer cells (the median of its timed collections), which sets how much longer than the reference's a call "
    "may take.", "",
    "| lesson | test | calls graded | longest call (ms of CPU) | loads graded (requests) | price (ms) |",
    "|---|---|---|---|---|---|"]


def calls_rows(lesson: str, reference) -> list[str]:
    """The rows of the calls table for one lesson, from its reference's graded run."""
    price = reference.measured.get("full_collection_cpu_s")
    price = f"{price * 1e3:.1f}" if price else "-"
    rows = []
    for test in reference.tests:
        calls = test.measured.get("calls") or []
        loads = " + ".join(str(load["requests"]) for load in test.measured.get("loads") or []) or "-"
        longest = f"{max(calls) * 1e3:.1f}" if calls else "-"
        rows.append(f"| {lesson} | {test.id} | {len(calls):,} | {longest} | {loads} | {price} |")
    return rows


def lesson_table(lesson: str, folder: Path, references: dict | None = None) -> list[str]:
    from lesson_support import write_variants
    module = importlib.import_module(f"test_lesson_{lesson[:2]}")
    wrong = dict(list(getattr(module, "WRONG", {}).items())[:2])
    paths = {"reference": module.SOLUTION, "untouched": module.RELEASE,
             **write_variants(module.RELEASE, wrong, folder)}
    runs = {}
    for name, path in paths.items():
        runs[name] = _grade(path)
        if name == "reference" and references is not None:
            references[lesson] = runs[name][0]
        if name in wrong:
            runs[f"{name}, lying"] = _grade(path, lying=True)
    names = list(runs)
    lines = [f"### {lesson}", "", "| test | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for i, test in enumerate(runs["reference"][0].tests):
        lines.append(f"| {test.id} | " + " | ".join(_figures(runs[n][0].tests[i]) for n in names) + " |")
    lines.append("| whole run | " + " | ".join(f"{runs[n][0].score:g}/{runs[n][0].max_score:g} in {runs[n][1]:.1f} s"
                                               for n in names) + " |")
    lines.append("")
    for name in names:
        if name.endswith("lying"):
            refuted = runs[name][0].disagreements
            lines.append(f"- {name}: " + ("; ".join(refuted) if refuted else "nothing refuted by the grader's figures"))
    lines.append("")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="grader_figures.py")
    parser.add_argument("--lessons", nargs="*", default=None, help="lesson numbers (default: all)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    lessons = [name for name in grading.lessons(ROOT)
               if args.lessons is None or name[:2] in args.lessons]
    out = ["Cells: score · CPU seconds of the verdict process over the test · growth of its resident memory · "
           "growth of its peak (MiB), as the grader read them from /proc · growth of the peak of what the kernel "
           "charged to the verdict's memory cgroup (MiB; where the grader can make one).", ""]
    references = {}
    with tempfile.TemporaryDirectory() as folder:
        for lesson in lessons:
            out += lesson_table(lesson, Path(folder), references)
            print("\n".join(out[-12:]), flush=True)
    out += CALLS_INTRO + [row for lesson, reference in references.items() for row in calls_rows(lesson, reference)]
    print("\n".join(out[-len(references) * 4:]), flush=True)
    if args.out:
        args.out.write_text("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
