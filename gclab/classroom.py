"""Grading a class: every submission in nbgrader's layout, scores into the gradebook,
feedback for each student, and a report for the instructor.

    submitted/STUDENT/ASSIGNMENT/NOTEBOOK.ipynb        what nbgrader collect leaves
    autograded/STUDENT/ASSIGNMENT/NOTEBOOK.ipynb       the notebook as graded (no hidden test)
    feedback/STUDENT/ASSIGNMENT/NOTEBOOK.html, .md     what the student gets back
    reports/report.html, scores.csv, causes.csv        what the instructor reads

The unit of work is `grade_submission`: one submission graded in a verdict process of its
own (`grading.grade_one`), its feedback written and its scores recorded.  `grade_class`
runs the units `jobs` at a time here; `gclab.cluster` hands the same units to a Dask
cluster.  A lesson whose hidden tests time things (`grading.timed_lesson`) is graded with
no other unit beside it.
"""
from __future__ import annotations

import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from . import _jsonschema  # noqa: F401  (before nbformat: see there)
import nbformat

from . import feedback, gradebook, grading

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
    return found


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


def grade_submission(submission: Submission, settings: Settings) -> grading.NotebookResult:
    """Grade one submission, write what its student gets back, record it in the gradebook."""
    result = grading.grade_one(submission.path, settings.root, student=submission.student,
                               timeout=settings.timeout, memory_limit=settings.memory_limit,
                               cell_timeout=settings.cell_timeout,
                               lesson=(submission.assignment, submission.notebook) if submission.notebook else None)
    release_nb = nbformat.read(released(settings.root, result.assignment, result.lesson_notebook), 4)
    try:
        submitted_nb = nbformat.read(submission.path, 4)
    except Exception:
        submitted_nb = release_nb
    where = Path(submission.student) / result.assignment
    feedback.write(result, release_nb, submitted_nb, settings.out / "autograded" / where,
                   settings.out / "feedback" / where)
    for folder in ("autograded", "feedback"):
        _copy_submission_records(submission.path.parent, settings.out / folder / where)
    gradebook.record(settings.db_url, settings.root, result, timestamp=_timestamp(submission.path.parent))
    return result


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
    where the notebook as a whole scored what it did. Called from the grading threads."""

    def __init__(self, total: int, out=None):
        self.total, self.done, self.out, self.lock = total, 0, out, threading.Lock()

    def __call__(self, result: grading.NotebookResult) -> None:
        with self.lock:
            self.done += 1
            why = f" ({result.reason})" if result.reason else ""
            print(f"[{self.done}/{self.total}] {result.student} {result.assignment}: "
                  f"{result.score:g}/{result.max_score:g}{why}", file=self.out or sys.stderr, flush=True)


def grade_class(submissions, settings: Settings, jobs: int = 1, report: bool = True,
                progress=None) -> list[grading.NotebookResult]:
    """Grade every submission here, `jobs` at a time (timed lessons one at a time, first),
    then write the class report into out/reports/; the results in submission order.
    `progress` (a `Progress`) is told each result as it comes."""
    submissions = list(submissions)
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
