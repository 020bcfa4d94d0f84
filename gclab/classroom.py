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
from dataclasses import dataclass
from pathlib import Path

import nbformat

from . import feedback, gradebook, grading

@dataclass(frozen=True)
class Submission:
    student: str
    assignment: str
    path: Path


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


def find_submissions(submitted: Path, root: Path) -> list[Submission]:
    """Every notebook under submitted/STUDENT/ASSIGNMENT/, in order of student then lesson."""
    known = set(grading.lessons(root))
    found = []
    for path in sorted(submitted.glob("*/*/*.ipynb")):
        if ".ipynb_checkpoints" in path.parts:
            continue
        assignment = path.parent.name if path.parent.name in known else grading.assignment_of(path, root)[0]
        found.append(Submission(student=path.parent.parent.name, assignment=assignment, path=path))
    return found


def grade_submission(submission: Submission, settings: Settings) -> grading.NotebookResult:
    """Grade one submission, write what its student gets back, record it in the gradebook."""
    result = grading.grade_one(submission.path, settings.root, student=submission.student,
                               timeout=settings.timeout, memory_limit=settings.memory_limit,
                               cell_timeout=settings.cell_timeout)
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


def grade_class(submissions, settings: Settings, jobs: int = 1, report: bool = True) -> list[grading.NotebookResult]:
    """Grade every submission here, `jobs` at a time (timed lessons one at a time, first),
    then write the class report into out/reports/; the results in submission order."""
    submissions = list(submissions)
    prepare_gradebook(settings, [s.assignment for s in submissions])
    timed = set(exclusive_first(submissions, settings.root)[0])
    results = grading.schedule(submissions, lambda s: grade_submission(s, settings), jobs, alone=timed.__contains__)
    if report:
        write_report(results, settings.out / "reports")
    return results


def write_report(results, folder: Path) -> dict:
    from . import report
    return report.class_report(results, folder)
