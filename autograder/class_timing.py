"""Seconds to grade a class on this machine, one way after another.

    .venv/bin/python autograder/class_timing.py [--students 20] [--lesson 03_node_leak]
        [--db-url postgresql://...] [MODE ...]

A class of --students students in nbgrader's layout (submitted/STUDENT/LESSON/LESSON.ipynb, in
a temporary folder), every other one handing in the reference solution, the others the
untouched release; graded by each MODE (default: all) into a gradebook of its own (a temporary
SQLite file, or --db-url for all of them: regrading overwrites), the lesson generated once
before any timing starts:

    sequential   classroom.grade_class, one at a time
    threads      classroom.grade_class --jobs 2
    local        cluster.grade_on_cluster "local" --jobs 2 (one worker, two slots)
    2-workers    cluster.grade_on_cluster on a local cluster of two workers of one slot

Prints one line per mode: seconds, and the scores seen (solution and release submissions).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from gclab.grader import classroom, cluster, grading

ROOT = Path(__file__).resolve().parent.parent
MODES = ("sequential", "threads", "local", "2-workers")


def make_class(folder: Path, lesson: str, students: int) -> Path:
    submitted = folder / "submitted"
    for n in range(students):
        source = ("solutions" if n % 2 == 0 else "notebooks") + f"/{lesson}/{lesson}.ipynb"
        target = submitted / f"student{n:02d}" / lesson / f"{lesson}.ipynb"
        target.parent.mkdir(parents=True)
        shutil.copy(ROOT / source, target)
    return submitted


def grade(mode: str, submissions, settings):
    if mode == "sequential":
        return classroom.grade_class(submissions, settings, jobs=1)
    if mode == "threads":
        return classroom.grade_class(submissions, settings, jobs=2)
    if mode == "local":
        return cluster.grade_on_cluster(submissions, settings, "local", jobs=2)
    with cluster.local_cluster(threads=1, workers=2) as local:
        return cluster.grade_on_cluster(submissions, settings, local.scheduler_address)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modes", nargs="*", metavar="MODE", help=f"any of {', '.join(MODES)} (default: all)")
    parser.add_argument("--students", type=int, default=20)
    parser.add_argument("--lesson", default="03_node_leak")
    parser.add_argument("--db-url", help="one gradebook for every mode (default: a temporary SQLite file each)")
    args = parser.parse_args()
    if set(args.modes) - set(MODES):
        parser.error(f"unknown mode {sorted(set(args.modes) - set(MODES))}: choose from {', '.join(MODES)}")
    with tempfile.TemporaryDirectory(prefix="gclab-class-timing-") as tmp:
        tmp = Path(tmp)
        submissions = classroom.find_submissions(make_class(tmp, args.lesson, args.students), ROOT)
        grading.prepare(ROOT, args.lesson)
        print(f"{len(submissions)} submissions of {args.lesson}, {os.cpu_count()} cores, "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
        for mode in args.modes or MODES:
            settings = classroom.settings_for(ROOT, out=tmp / mode,
                                              db_url=args.db_url or f"sqlite:///{tmp / mode}.db")
            started = time.monotonic()
            results = grade(mode, submissions, settings)
            seconds = time.monotonic() - started
            scores = [r.score for r in results]
            print(f"{mode:>10}: {seconds:6.1f} s   solution scores {sorted(set(scores[0::2]))}, "
                  f"release scores {sorted(set(scores[1::2]))}, load average {os.getloadavg()[0]:.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
