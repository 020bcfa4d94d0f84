"""Grading a class: every submission in nbgrader's layout, scores into the gradebook,
feedback for each student, and a report for the instructor.

    submitted/STUDENT/ASSIGNMENT/NOTEBOOK.ipynb        what nbgrader collect leaves
    autograded/STUDENT/ASSIGNMENT/NOTEBOOK.ipynb       the notebook as graded (no hidden test)
    feedback/STUDENT/ASSIGNMENT/NOTEBOOK.html, .md     what the student gets back
    reports/report.html, scores.csv, causes.csv        what the instructor reads

The unit of work is `grade_submission`: one submission graded in a verdict process of its
own (`grading.grade_one`), its feedback written and its scores recorded.  `grade_class`
runs the units `jobs` at a time here; `gclab.grader.cluster` hands the same units to a Dask
cluster; nbgrader's own autograde runs one through `gclab.grader.preprocessors.GradeWithTheCourse`.
A lesson whose hidden tests time things (`grading.timed_lesson`) is graded with no other
unit beside it.

A submission is graded again only when it changed, or its lesson did, since it was last graded
(`grading_key`: the submission's bytes, the lesson's sources and config, the limits): otherwise
its last grade, kept in autograded/.gclab/STUDENT/ASSIGNMENT.json (a folder nbgrader's commands do
not list, nor copy into feedback/), stands, and its feedback and gradebook entry are written again
from it.  `Settings.force` grades every one again.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from . import _jsonschema  # noqa: F401  (before nbformat: see there)
import nbformat

from . import feedback, gradebook, grading

KEPT_GRADES = ".gclab"          # in autograded/: each submission's last grade and what it was given for

@dataclass(frozen=True)
class Submission:
    student: str
    assignment: str
    path: Path
    notebook: str = ""              # the lesson's notebook it is graded as ("": the one its name says)


@dataclass(frozen=True)
class Settings:
    """Where a class's grades go and the limits of each grading process."""
    root: Path                      # the course (solutions/, autograder/nbgrader_config.py)
    out: Path                       # where autograded/, feedback/ and reports/ are written
    db_url: str                     # the gradebook
    timeout: int = 900
    memory_limit: int | None | str = "auto"
    cell_timeout: int | None = None
    force: bool = False             # grade again even what did not change since it was last graded


@dataclass
class GradedSubmission(grading.NotebookResult):
    """A submission's grade as the class's gradebook holds it: the grader's, with the scores set by
    hand that stand in place of the automatic ones."""
    by_hand: list = field(default_factory=list)    # gradebook.ManualScore found on its test cells (kept or cleared)
    regraded: bool = True                           # False: unchanged since last graded, that grade stands


def settings_for(root: Path, out: Path | None = None, db_url: str | None = None, **limits) -> Settings:
    return Settings(root=root, out=out or root, db_url=db_url or gradebook.db_url(root), **limits)


def find_submissions(submitted: Path, root: Path, warn=None) -> list[Submission]:
    """Every notebook under submitted/STUDENT/ASSIGNMENT/, in order of student then lesson.

    In a lesson's folder the notebook named as the lesson's is graded; a lone notebook with another
    name (a browser's "NAME (1).ipynb") is graded as the lesson's; other notebooks beside the
    lesson's (an Untitled.ipynb, a backup copy) are skipped, and so is a notebook of no lesson.
    `warn` (default: print to stderr) is told each notebook skipped or renamed, so that one stray
    file neither stops the class nor replaces a student's grade."""
    warn = warn or (lambda line: print(line, file=sys.stderr))
    known = set(grading.lessons(root))
    found = []
    folders: dict[Path, list[Path]] = {}
    for path in sorted(submitted.glob("*/*/*.ipynb")):
        if ".ipynb_checkpoints" not in path.parts:
            folders.setdefault(path.parent, []).append(path)
    for folder, paths in folders.items():
        student = folder.parent.name
        if folder.name in known:
            found += _lesson_folder(student, folder.name, paths, root, warn)
            continue
        for path in paths:
            try:
                assignment = grading.assignment_of(path, root)[0]
            except SystemExit as why:
                warn(f"skipped {path}: {why}")
                continue
            found.append(Submission(student=student, assignment=assignment, path=path))
    _tell_of_submissions_placed_by_hand(found, warn)
    return found


def _tell_of_submissions_placed_by_hand(found: list[Submission], warn) -> None:
    """One line naming the submissions that `nbgrader collect` did not place (no timestamp.txt beside
    them): they are graded, but have no time of submission, and nbgrader's release_feedback stops at
    their feedback, which it cannot address to a student."""
    by_hand = [s for s in found if not (s.path.parent / "timestamp.txt").is_file()]
    if not by_hand:
        return
    students = sorted({s.student for s in by_hand})
    warn(f"placed by hand, not by nbgrader collect (no timestamp.txt beside them): "
         f"{', '.join(f'{s.student} {s.assignment}' for s in by_hand)}. They are graded, with no time of "
         f"submission in the gradebook; nbgrader release_feedback cannot hand back their feedback and "
         f"stops at it: send feedback/STUDENT/LESSON/ to them yourself, and release the others' with "
         f"--CourseDirectory.student_id_exclude={','.join(students)}")


def _lesson_folder(student: str, assignment: str, paths: list[Path], root: Path, warn) -> list[Submission]:
    stems = sorted(nb.stem for nb in (root / "solutions" / assignment).glob("*.ipynb"))
    named = [path for path in paths if path.stem in stems]
    if not named and len(paths) == 1 and len(stems) == 1:
        warn(f"graded {paths[0]} as {assignment}'s notebook {stems[0]}.ipynb (the only notebook in its folder)")
        return [Submission(student, assignment, paths[0], notebook=stems[0])]
    for path in paths:
        if path not in named:
            warn(f"skipped {path}: not a notebook of {assignment} ({', '.join(s + '.ipynb' for s in stems)})"
                 + (", which is in the same folder" if named else ""))
    return [Submission(student, assignment, path) for path in named]


class Stopped(Exception):
    """The grading run was told to stop (SIGTERM, a closed terminal): nothing more is recorded."""


STOP = threading.Event()        # set when the run is stopped: a grade that ends after it is not recorded


def grade_submission(submission: Submission, settings: Settings) -> GradedSubmission:
    """Grade one submission (unless it and its lesson are unchanged since it was last graded), record
    it in the gradebook, and write what its student gets back."""
    if STOP.is_set():
        raise Stopped(f"{submission.student} {submission.assignment}: not graded, the run was stopped")
    where = Path(submission.student) / submission.assignment
    autograded = settings.out / "autograded" / where
    kept = settings.out / "autograded" / KEPT_GRADES / submission.student / f"{submission.assignment}.json"
    key = grading_key(submission, settings)
    result = None if settings.force else last_grade(kept, key)
    regraded = result is None
    if regraded:
        result = grading.grade_one(submission.path, settings.root, student=submission.student,
                                   timeout=settings.timeout, memory_limit=settings.memory_limit,
                                   cell_timeout=settings.cell_timeout,
                                   lesson=(submission.assignment, submission.notebook) if submission.notebook else None)
    if STOP.is_set():
        raise Stopped(f"{submission.student} {submission.assignment}: not recorded, the run was stopped")
    by_hand = gradebook.record(settings.db_url, settings.root, result, timestamp=_timestamp(submission.path.parent))
    release_nb = nbformat.read(released(settings.root, result.assignment, result.lesson_notebook), 4)
    try:
        submitted_nb = nbformat.read(submission.path, 4)
    except Exception:
        submitted_nb = release_nb
    feedback.write(result, release_nb, submitted_nb, autograded, settings.out / "feedback" / where, by_hand)
    if regraded:
        keep_grade(kept, key, result)
    for folder in ("autograded", "feedback"):
        _copy_submission_records(submission.path.parent, settings.out / folder / where)
    return as_recorded(result, by_hand, regraded)


def as_recorded(result: grading.NotebookResult, by_hand, regraded: bool) -> GradedSubmission:
    """`result` as the gradebook holds it: standing scores set by hand in place of the automatic ones."""
    scored = feedback.scored_by_hand(result, by_hand)
    return GradedSubmission(**{f: getattr(scored, f) for f in grading.NotebookResult.__dataclass_fields__},
                            by_hand=list(by_hand), regraded=regraded)


def grading_key(submission: Submission, settings: Settings) -> str:
    """What a grade depends on: the submission's bytes, the lesson's sources and the course's config
    (`grading._source_key`), the notebook it is graded as, and the limits it is graded under."""
    digest = hashlib.sha256(submission.path.read_bytes() if submission.path.is_file() else b"")
    digest.update(grading._source_key(settings.root, submission.assignment).encode())
    digest.update(repr((submission.notebook, settings.timeout, settings.memory_limit, settings.cell_timeout)).encode())
    return digest.hexdigest()


def keep_grade(path: Path, key: str, result: grading.NotebookResult) -> None:
    """Keep `result` at `path` as given for `key`: every field (what the tests observed, for the grader's
    comparison alone, excepted), so that `last_grade` gives back the same result."""
    kept = dataclasses.asdict(result)
    for test in kept["tests"]:
        test.pop("observed", None)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "result": kept}))


def last_grade(path: Path, key: str) -> grading.NotebookResult | None:
    """The grade kept at `path` if it was given for `key`, else None."""
    try:
        kept = json.loads(path.read_text())
        if kept["key"] != key:
            return None
        fields = {name: value for name, value in kept["result"].items() if name != "tests"}
        return grading.NotebookResult(**fields, tests=[grading.TestResult(**t) for t in kept["result"]["tests"]])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# what nbgrader collect leaves beside a submission, and its release_feedback reads beside the feedback
_SUBMISSION_RECORDS = ("timestamp.txt", "submission_secret.txt")


def _copy_submission_records(submitted: Path, folder: Path) -> None:
    for name in _SUBMISSION_RECORDS:
        if (submitted / name).is_file():
            shutil.copy(submitted / name, folder / name)


def _timestamp(submitted: Path) -> str | None:
    path = submitted / "timestamp.txt"
    return path.read_text().strip() if path.is_file() else None


def released(root: Path, assignment: str, notebook: str) -> Path:
    """The student release of a lesson's notebook (generated again if the sources changed)."""
    return grading.prepare(root, assignment) / "notebooks" / assignment / f"{notebook}.ipynb"


def prepare_gradebook(settings: Settings, assignments) -> None:
    """Mirror each lesson into the gradebook once, before any unit records a score."""
    with gradebook.opened(settings.db_url) as book:
        for assignment in sorted(set(assignments)):
            gradebook.mirror_assignment(book, settings.root, assignment)


def exclusive_first(submissions, root: Path) -> tuple[list[Submission], list[Submission]]:
    """(the submissions of timed lessons, the others)."""
    timed = {a for a in {s.assignment for s in submissions} if grading.timed_lesson(root, a)}
    return [s for s in submissions if s.assignment in timed], [s for s in submissions if s.assignment not in timed]


class Progress:
    """One line per submission graded, as it is: `[3/40] ada 03_node_leak: 6/6`, and why
    where the notebook as a whole scored what it did, whether it was graded again, and what
    the scores set by hand did. Called from the grading threads."""

    def __init__(self, total: int, out=None):
        self.total, self.done, self.out, self.lock = total, 0, out, threading.Lock()

    def __call__(self, result: grading.NotebookResult) -> None:
        with self.lock:
            self.done += 1
            self.say(f"[{self.done}/{self.total}] {progress_line(result)}")

    def say(self, line: str) -> None:
        print(line, file=self.out or sys.stderr, flush=True)


def progress_line(result: grading.NotebookResult) -> str:
    why = f" ({result.reason})" if result.reason else ""
    kept = " (unchanged since it was last graded: that grade stands)" if getattr(result, "regraded", True) is False else ""
    lines = [f"{result.student} {result.assignment}: {result.score:g}/{result.max_score:g}{why}{kept}"]
    return "\n".join(lines + [f"    by hand: {m.describe()}" for m in getattr(result, "by_hand", [])])


def grade_class(submissions, settings: Settings, jobs: int = 1, report: bool = True,
                progress=None) -> list[GradedSubmission]:
    """Grade every submission here, `jobs` at a time (timed lessons one at a time, first),
    then write the class report into out/reports/; the results in submission order.
    `progress` (a `Progress`) is told each result as it comes."""
    submissions = list(submissions)
    with class_run(settings, report=report):
        prepare_gradebook(settings, [s.assignment for s in submissions])
        timed = set(exclusive_first(submissions, settings.root)[0])

        def grade(submission):
            result = grade_submission(submission, settings)
            if progress is not None:
                progress(result)
            return result
        results = grading.schedule(submissions, grade, jobs, alone=timed.__contains__)
        if report:
            write_report(results, settings.out / "reports")
    return results


def write_report(results, folder: Path) -> dict:
    from . import report
    return report.class_report(results, folder)


@contextmanager
def class_run(settings: Settings, report: bool = True):
    """What a class's grading run leaves behind only while it runs: the last run's report set aside
    (a run stopped before its end leaves none that looks current), and the gradings' temporary
    folders inside one of the run's own, removed at its end."""
    if report:
        from .report import set_aside
        set_aside(settings.out / "reports")
    with scratch_folder(settings.root):
        yield


RUNS = Path("autograder") / "work" / "runs"      # one file per running grader: its pid, naming its scratch folder


@contextmanager
def scratch_folder(root: Path):
    """A temporary folder that holds every temporary folder this process makes while in it (a grading's
    `tempfile.TemporaryDirectory()`), removed at the end, or, when the process was killed (SIGKILL: no
    clean-up runs), at the start of the next run in the same course."""
    runs = root / RUNS
    system_tmp = Path(tempfile.gettempdir())
    remove_abandoned(runs, system_tmp)
    folder = Path(tempfile.mkdtemp())
    entry = runs / str(os.getpid())
    try:
        runs.mkdir(parents=True, exist_ok=True)
        entry.write_text(str(folder))
    except OSError:
        entry = None                # a course folder that cannot be written: cleaned at the end only
    before, tempfile.tempdir = tempfile.tempdir, str(folder)
    try:
        yield folder
    finally:
        tempfile.tempdir = before
        shutil.rmtree(folder, ignore_errors=True)
        if entry is not None:
            entry.unlink(missing_ok=True)


def remove_abandoned(runs: Path, system_tmp: Path) -> list[Path]:
    """Remove the scratch folders of runs whose process is gone; the folders removed."""
    removed = []
    for entry in runs.glob("*") if runs.is_dir() else ():
        if not entry.name.isdigit() or _alive(int(entry.name)):
            continue
        folder = Path(entry.read_text().strip())
        if folder.parent == system_tmp and folder.name.startswith("tmp"):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        entry.unlink(missing_ok=True)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
