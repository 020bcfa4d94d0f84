"""What the lessons' end-to-end tests share: student variants of a released notebook,
one grading run for all of them, and reading the notebooks as the grader ran them."""
from pathlib import Path

import nbformat

from gclab import grading

ROOT = Path(__file__).resolve().parent.parent


def is_answer(cell) -> bool:
    return bool(cell.metadata.get("nbgrader", {}).get("solution"))


def student_variant(release: Path, answers) -> nbformat.NotebookNode:
    """The released notebook with its answer cells filled in and the unlocked demo cells
    deleted, as a student may do; the graded cells are all still there.  `answers` is one
    source, a list of sources (one per answer cell, in order), or a dict keyed by the answer
    cells' grade_id with or without its "answer_" prefix."""
    nb = nbformat.read(release, 4)
    sources = iter([answers] if isinstance(answers, str) else [] if isinstance(answers, dict) else answers)
    for cell in nb.cells:
        if is_answer(cell):
            grade_id = cell.metadata["nbgrader"]["grade_id"]
            if isinstance(answers, dict):
                cell.source = answers.get(grade_id, answers.get(grade_id.removeprefix("answer_")))
            else:
                cell.source = next(sources)
    nb.cells = [c for c in nb.cells if c.cell_type == "markdown" or "nbgrader" in c.metadata]
    return nb


def grade_all(paths: dict, folder: Path) -> dict:
    """Grade every notebook in one run (two at a time); each result's `executed` is the notebook
    as the grader ran it, outputs and hidden tests included."""
    names = list(paths)
    results = grading.grade([paths[n] for n in names], root=ROOT, jobs=2, keep_executed=folder / "graded")
    return dict(zip(names, results))


def write_variants(release: Path, variants: dict, folder: Path) -> dict:
    """Write each variant (name -> answers) next to the others; returns name -> path."""
    paths = {}
    for name, answers in variants.items():
        paths[name] = folder / f"{name}-{release.name}"
        nbformat.write(student_variant(release, answers), paths[name])
    return paths


def code_outputs(path):
    nb = nbformat.read(path, 4)
    return [(i, o) for i, c in enumerate(nb.cells) if c.cell_type == "code" for o in c.outputs]


def problems(path, expected_error=None) -> list:
    """Errors and stderr output in a notebook's cells, as (cell index, what); an error whose
    message contains `expected_error` is one the lesson shows on purpose."""
    return [(i, o.get("ename") or o.get("text", "")[:200]) for i, o in code_outputs(path)
            if (o.output_type == "error" and not (expected_error and expected_error in o.get("evalue", "")))
            or (o.output_type == "stream" and o.name == "stderr")]


def shows_error(path, message) -> bool:
    return any(o.output_type == "error" and message in o.get("evalue", "") for _, o in code_outputs(path))


def printed_text(path) -> str:
    return "".join(o.get("text", "") for _, o in code_outputs(path))


def plots_drawn(path) -> int:
    return sum(o.output_type == "display_data" and "image/png" in o.get("data", {}) for _, o in code_outputs(path))


def cell_result(result, test_id):
    return next(t for t in result.tests if t.id == test_id)


def assert_full_marks(result, max_score):
    assert result.max_score == max_score, grading.format_results([result])
    assert result.score == max_score, grading.format_results([result])


def assert_no_marks_until_answered(result, max_score):
    """The untouched release: 0 points, every test failing because the answer is not written yet."""
    assert result.max_score == max_score and result.score == 0, grading.format_results([result])
    assert all(t.status == "failed" and "is not defined yet" in t.message for t in result.tests), (
        grading.format_results([result]))


def assert_less_than_full_marks(result, max_score):
    """A wrong fix: some points lost, and a reason for every point lost."""
    assert result.max_score == max_score, grading.format_results([result])
    assert result.score < max_score, grading.format_results([result])
    assert all(t.message for t in result.tests if t.status != "passed"), "every lost point needs a reason"


def write_locked_cells_edited(release: Path, answers, folder: Path) -> Path:
    """A student variant whose locked test cells were replaced by `pass` (the grader must
    restore them); returns its path."""
    edited = student_variant(release, answers)
    for cell in edited.cells:
        if cell.metadata.get("nbgrader", {}).get("grade"):
            cell.source = "pass"
    path = folder / f"edits_locked_cells-{release.name}"
    nbformat.write(edited, path)
    return path
