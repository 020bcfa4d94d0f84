"""The `gclab` command: release, grade and bench the course."""
from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path


def _size(text: str) -> int:
    units = {"k": 1024, "m": 1024**2, "g": 1024**3}
    text = text.strip().lower().rstrip("ib").rstrip("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _size_or_none(text: str):
    text = text.strip().lower()
    if text == "auto":
        return "auto"
    return None if text in ("none", "0", "off") else _size(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gclab", description=__doc__)
    parser.add_argument("--course", type=Path, help="the course folder (default: found from the notebooks or here)")
    sub = parser.add_subparsers(dest="command", required=True)

    r = sub.add_parser("release", help="regenerate notebooks/ from solutions/ with nbgrader, and README's Colab links")
    r.add_argument("--source", metavar="URL",
                   help="where the course lives, kept in autograder/course.toml: a GitHub repository "
                        "(https://github.com/OWNER/REPO@BRANCH: README gets an Open-in-Colab link per lesson) or "
                        "any address pip installs it from; every student notebook's first cell installs gclab "
                        "from it where gclab is missing (Colab). '' unsets it. Default: the one kept")

    g = sub.add_parser("grade", help="grade submitted notebooks, or a class in nbgrader's layout")
    g.add_argument("notebooks", nargs="*", type=Path,
                   help="notebooks to grade and print (default: the class under --submissions)")
    g.add_argument("--submissions", type=Path,
                   help="a class in nbgrader's layout, SUBMISSIONS/STUDENT/LESSON/*.ipynb (default with no "
                        "notebooks: the course's submitted/); scores go to the gradebook, feedback to "
                        "feedback/, the class report to reports/")
    g.add_argument("--out", type=Path, help="where autograded/, feedback/ and reports/ go (default: the course)")
    g.add_argument("--db-url", help="the gradebook (default: CourseDirectory.db_url of the course's nbgrader config)")
    g.add_argument("--scheduler", help="grade on a Dask cluster: its scheduler's address, or 'local' for "
                                       "one local worker with --jobs grading slots (see gclab.grader.cluster)")
    g.add_argument("--json", action="store_true", help="print the results as JSON")
    g.add_argument("--force", action="store_true",
                   help="a class: grade every submission again, also those that did not change (nor did their "
                        "lesson) since they were last graded, whose grades otherwise stand")
    g.add_argument("--timeout", type=int, default=900, help="seconds allowed per notebook (default 900)")
    g.add_argument("--cell-timeout", type=int, help="seconds allowed per cell (default: autograder/nbgrader_config.py)")
    g.add_argument("--jobs", type=int, default=1,
                   help="notebooks graded at once (default 1; more is faster on a machine with spare "
                        "cores, but disturbs lessons whose hidden tests time things)")
    g.add_argument("--memory-limit", type=_size_or_none, default="auto",
                   help="address-space limit for the grading kernel, e.g. 8G, or 'none' (default: "
                        "8G or 3/4 of the RAM on a machine without an NVIDIA GPU, none with one: "
                        "a CUDA kernel needs far more address space than memory)")

    b = sub.add_parser("bench", help="time the lessons, their grading and the meter's overhead")
    b.add_argument("lessons", nargs="*", help="lesson folders to bench (default: all)")

    c = sub.add_parser("gpu-check", help="on a CUDA GPU: run and grade every lesson on CUDA and on the CPU, "
                                         "compare, and run the device tests")
    c.add_argument("lessons", nargs="*", help="lesson folders to check (default: all)")
    c.add_argument("--jobs", type=int, default=3, help="lessons checked at once on each device (default 3)")
    c.add_argument("--json", type=Path, help="write everything measured (every cell's text output too) here")
    c.add_argument("--no-tests", action="store_true", help="skip the device tests")
    c.add_argument("--side", choices=["both", "cuda", "cpu"], default="both", help=argparse.SUPPRESS)

    args = parser.parse_args(argv)
    from .grader import grading

    if args.command == "release":
        from .grader import course
        root = args.course or grading.find_course_root()
        if args.source is not None:
            try:
                course.check_source(args.source)
            except ValueError as exc:
                parser.error(str(exc))
        for path in grading.release(root, source=args.source):
            print(f"released {path.relative_to(root)}")
        source = course.Source(course.read_source(root))
        if not source.given:
            print("course address: not set (gclab release --source URL): on Colab a learner must set GCLAB_SOURCE")
        else:
            print(f"course address: {source.given} (pip installs {source.requirement}); "
                  + ("README's Colab links updated" if source.github else "not on GitHub: no Colab links"))
        return 0
    if args.command == "grade":
        missing = [str(p) for p in args.notebooks if not p.is_file()]
        if missing:
            parser.error("no such notebook: " + ", ".join(missing))
        if argv is None:                # run as a command, not called (the tests)
            _in_a_user_scope_where_that_makes_memory_groups()
        a_class = not args.notebooks or args.submissions
        kept = ("the submissions graded so far are in the gradebook, autograded/ and feedback/ (reports/ holds no "
                "report of this run); the same command grades the rest" if a_class else "nothing was written")
        try:
            results = _grade_class(args, parser) if a_class else grading.grade(
                args.notebooks, root=args.course, timeout=args.timeout, memory_limit=args.memory_limit,
                cell_timeout=args.cell_timeout, jobs=max(1, args.jobs))
        except KeyboardInterrupt:
            print(f"\ninterrupted: {kept}", file=sys.stderr)
            return 130
        except _Stopped as stop:
            print(f"\nstopped by {stop.args[0]}: the gradings under way were ended and not recorded; {kept}",
                  file=sys.stderr)
            return 128 + stop.args[1]
        print(grading.results_json(results) if args.json else grading.format_results(results))
        return 0
    if args.command == "gpu-check":
        from .tools import gpucheck
        return gpucheck.main(args.course or grading.find_course_root(), args.lessons, side=args.side,
                             jobs=max(1, args.jobs), json_path=args.json, tests=not args.no_tests)
    from .tools import bench
    return bench.main(args.course or grading.find_course_root(), args.lessons)


def _in_a_user_scope_where_that_makes_memory_groups() -> None:
    """Run this command again in a scope of the user's systemd manager where the grader can make a memory
    cgroup for each verdict there and not here (gclab.grader.memory_group.in_a_user_scope); else go on."""
    import os
    from .grader import memory_group
    command = memory_group.in_a_user_scope([sys.executable, "-m", "gclab", *sys.argv[1:]])
    if command:
        print("grading in a scope of your systemd user manager (systemd-run --user --scope), where the grader "
              "can make a memory cgroup for each verdict, as it cannot here", file=sys.stderr, flush=True)
        os.execvpe(command[0], command, {**os.environ, memory_group.USER_SCOPE_ENV: "1"})


class _Stopped(Exception):
    """(signal name, number): the grading of a class was told to stop."""


def _grade_class(args, parser):
    from .grader import classroom, grading
    root = args.course or grading.find_course_root()
    submitted = args.submissions or root / "submitted"
    submissions = classroom.find_submissions(submitted, root)
    if not submissions:
        parser.error(f"no submission under {submitted} (expected {submitted}/STUDENT/LESSON/NOTEBOOK.ipynb)")
    settings = classroom.settings_for(root, out=args.out, db_url=args.db_url, timeout=args.timeout,
                                      memory_limit=args.memory_limit, cell_timeout=args.cell_timeout,
                                      force=args.force)
    progress = classroom.Progress(len(submissions))
    with _stopped_by_signals():
        if args.scheduler:
            from .grader import cluster
            return cluster.grade_on_cluster(submissions, settings, args.scheduler, jobs=max(1, args.jobs),
                                            progress=progress)
        return classroom.grade_class(submissions, settings, jobs=max(1, args.jobs), progress=progress)


@contextmanager
def _stopped_by_signals():
    """SIGTERM and SIGHUP (a `kill`, a closed terminal) stop a class's grading cleanly: the gradings
    under way end with their processes and record nothing, the run's temporary folders go, and
    the report of the last finished run stays set aside (gclab.grader.classroom.class_run)."""
    import signal
    from .grader import classroom
    from .grader._nbgrader_job import end_descendants

    received = []

    def stop(signum, frame):
        received.append((signal.Signals(signum).name, signum))
        classroom.STOP.set()
        end_descendants()           # verdict processes, nbgrader jobs, a local Dask cluster
        raise _Stopped(*received[0])
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    except classroom.Stopped as stopped:       # a grading thread saw the run stopped first
        raise _Stopped(*received[0]) from stopped
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        classroom.STOP.clear()


if __name__ == "__main__":
    sys.exit(main())
