"""Tiny nbgrader courses for the grading tests: one lesson, `double(x)` to write."""
import shutil
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent


def cell(source, grade_id=None, points=None, solution=False):
    """A code cell with nbgrader's metadata: locked unless an answer, a test when it has points."""
    code = nbformat.v4.new_code_cell(source)
    if grade_id:
        code.metadata["nbgrader"] = {"grade": points is not None, "grade_id": grade_id, "locked": not solution,
                                     "schema_version": 3, "solution": solution, **({"points": points} if points else {})}
    return code


def lesson(answer, tests, setup="import gc", timed=False):
    """A lesson notebook: set-up cell, answer cell, then `tests` as (grade_id, source, points)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    if timed:
        nb.metadata["gclab"] = {"timed": True}
    nb.cells = [cell(setup, "setup"), cell(answer, "answer", solution=True),
                *(cell(source, grade_id, points=points) for grade_id, source, points in tests)]
    return nb


def make_course(root: Path, lessons: dict) -> Path:
    """A course folder at `root` with the real course's nbgrader config and `lessons`
    (name -> notebook) as its sources."""
    (root / "autograder").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "autograder" / "nbgrader_config.py", root / "autograder")
    for name, nb in lessons.items():
        (root / "solutions" / name).mkdir(parents=True)
        nbformat.write(nb, root / "solutions" / name / f"{name}.ipynb")
    return root
