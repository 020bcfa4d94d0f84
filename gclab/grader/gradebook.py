"""Scores in nbgrader's own gradebook, so that `nbgrader export` and the formgrader see them.

The gradebook is the one the course's nbgrader config names (`CourseDirectory.db_url`:
SQLite in autograder/gradebook.db by default, PostgreSQL or any SQLAlchemy URL when
configured).  A lesson's assignment, notebooks and cells are mirrored from the gradebook
nbgrader wrote when it generated the release (`grading.prepare`), where no hidden test
was ever recorded; each graded submission then sets the automatic score of every test
cell and a comment on every answer cell.  Recording the same submission again
overwrites it: regrading is idempotent.

A score an instructor set by hand (nbgrader's manual score, in the Formgrader) outranks the
automatic one in the gradebook and its export.  It stands while the automatic score under it
stays the same; where a regrade changes that automatic score, the score by hand judged another
answer and is cleared.  `record` returns both kinds (`ManualScore`), for the command's output,
the feedback and the class report to say so.
"""
from __future__ import annotations

import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import grading

_CELL_FIELDS = {
    "grade_cells": ("update_or_create_grade_cell", ("max_score", "cell_type")),
    "solution_cells": ("update_or_create_solution_cell", ()),
    "task_cells": ("update_or_create_task_cell", ("max_score", "cell_type")),
}


def db_url(root: Path) -> str:
    """The gradebook the course's nbgrader config names."""
    return grading._course_config(root).CourseDirectory.db_url


# nbgrader's add_submission trips SQLAlchemy's autoflush notice about its own new rows; it is
# harmless.  Filtered for the process, once: `warnings.catch_warnings` around each write is not
# thread-safe, and `gclab grade --jobs` records from several threads.
_AUTOFLUSH_NOTICE = r"Object of type <Submitted\w+> not in session"


@contextmanager
def opened(url: str):
    from nbgrader.api import Gradebook
    _prepare_nbgrader()
    with Gradebook(url) as book:
        yield book


def _prepare_nbgrader() -> None:
    from sqlalchemy.exc import SAWarning
    warnings.filterwarnings("ignore", message=_AUTOFLUSH_NOTICE, category=SAWarning)
    _alembic_on_path()


def _alembic_on_path() -> None:
    """nbgrader creates a new gradebook by running `alembic` from PATH: this Python's bin
    folder must be on it (it is not when .venv/bin/python runs without activating .venv)."""
    import os
    import sys
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def mirror_assignment(book, root: Path, assignment: str) -> None:
    """Create or update `assignment` in `book` as nbgrader recorded it at generation."""
    from nbgrader.api import Gradebook
    _prepare_nbgrader()
    generated = grading.prepare(root, assignment) / "autograder" / "gradebook.db"
    with Gradebook(f"sqlite:///{generated}") as source:
        original = source.find_assignment(assignment)
        book.update_or_create_assignment(assignment, duedate=original.duedate)
        for notebook in original.notebooks:
            book.update_or_create_notebook(notebook.name, assignment)
            for kind, (method, fields) in _CELL_FIELDS.items():
                for cell in getattr(notebook, kind):
                    getattr(book, method)(cell.name, notebook.name, assignment,
                                          **{f: getattr(cell, f) for f in fields})
            for cell in notebook.source_cells:
                book.update_or_create_source_cell(cell.name, notebook.name, assignment, cell_type=cell.cell_type,
                                                  locked=cell.locked, source=cell.source, checksum=cell.checksum)


@dataclass(frozen=True)
class ManualScore:
    """A score set by hand on a test cell, as a grading found it in the gradebook."""
    test: str
    score: float                    # the instructor's
    max_score: float
    auto_before: float | None       # the automatic score it was set over
    auto_now: float                 # the automatic score of this grading

    @property
    def cleared(self) -> bool:
        """Set over an automatic score this grading changed: it judged another answer, and goes."""
        return self.auto_before is not None and self.auto_before != self.auto_now

    def describe(self) -> str:
        if self.cleared:
            return (f"{self.test}: the score set by hand ({self.score:g} / {self.max_score:g}) was cleared, since the "
                    f"automatic score under it changed from {self.auto_before:g} to {self.auto_now:g} (a new "
                    "answer): set it again in the Formgrader if it still holds")
        return (f"{self.test}: {self.score:g} / {self.max_score:g} set by hand stands over the automatic "
                f"{self.auto_now:g}")


def record(url: str, root: Path, result: grading.NotebookResult, timestamp: str | None = None,
           attempts: int = 5) -> list[ManualScore]:
    """Record one graded submission (its student and assignment are created when new), with
    the time it was submitted (nbgrader's timestamp.txt) when known; return the scores set by
    hand that it found on its test cells (those cleared, and those that stand).
    Several graders may write to one gradebook at once (PostgreSQL): a write that lost a
    race to create the same row is tried again."""
    from nbgrader.api import InvalidEntry
    for attempt in range(attempts):
        try:
            with opened(url) as book:
                return _record(book, root, result, timestamp)
        except InvalidEntry:
            if attempt == attempts - 1:
                raise
            time.sleep(0.2 * (attempt + 1))


def _record(book, root: Path, result: grading.NotebookResult, timestamp: str | None) -> list[ManualScore]:
    from nbgrader.api import MissingEntry
    try:
        book.find_notebook(result.lesson_notebook, result.assignment)
    except MissingEntry:
        mirror_assignment(book, root, result.assignment)
    book.update_or_create_student(result.student)
    book.update_or_create_submission(result.assignment, result.student,
                                     **({"timestamp": timestamp} if timestamp else {}))
    found = []
    for test in result.tests:
        grade = book.find_grade(test.id, result.lesson_notebook, result.assignment, result.student)
        if grade.manual_score is not None:
            found.append(ManualScore(test.id, grade.manual_score, test.max_score, grade.auto_score, test.score))
            if found[-1].cleared:
                grade.manual_score = None
        grade.auto_score = test.score
        grade.needs_manual_grade = False
    notebook = book.find_notebook(result.lesson_notebook, result.assignment)
    summary = _comment(result)
    for cell in notebook.solution_cells:
        book.find_comment(cell.name, result.lesson_notebook, result.assignment, result.student).auto_comment = summary
    book.db.commit()
    return found


def standing_manual_scores(url: str, student: str, assignment: str, notebook: str) -> list[ManualScore]:
    """The scores set by hand on a submission's test cells, as the gradebook holds them now."""
    from nbgrader.api import MissingEntry
    with opened(url) as book:
        try:
            graded = book.find_submission_notebook(notebook, assignment, student)
        except MissingEntry:
            return []
        return [ManualScore(g.name, g.manual_score, g.max_score, g.auto_score, g.auto_score)
                for g in graded.grades if g.manual_score is not None and g.auto_score is not None]


def _comment(result: grading.NotebookResult) -> str:
    lines = [f"{result.score:g} / {result.max_score:g}"] + ([result.reason] if result.reason else [])
    lines += [f"{t.id}: {t.message}" for t in result.tests if t.status != "passed" and t.message]
    return "\n".join(lines)


def scores(url: str) -> dict[tuple[str, str], float]:
    """{(student, assignment): score} as the gradebook holds them."""
    with opened(url) as book:
        return {(s.student.id, s.assignment.name): s.score for a in book.assignments for s in a.submissions}
