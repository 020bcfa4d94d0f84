"""What the lessons' end-to-end tests share: student variants of a released notebook,
one grading run for all of them, and reading the notebooks as the grader ran them."""
from pathlib import Path

import nbformat

from gclab import grading

ROOT = Path(__file__).resolve().parent.parent


def is_answer(cell) -> bool:
    return bool(cell.metadata.get("nbgrader", {}).get("solution"))


def student_variant(release: Path, answers) -> nbformat.NotebookNode:
    """The released notebook with its answer cells filled in (`answers`: one source, or one per
    answer cell in order) and the unlocked demo cells deleted, as a student may do; the graded
    cells are all still there."""
    nb = nbformat.read(release, 4)
    sources = iter([answers] if isinstance(answers, str) else answers)
    for cell in nb.cells:
        if is_answer(cell):
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


def problems(path) -> list:
    """Errors and stderr output in a notebook's cells, as (cell index, what)."""
    return [(i, o.get("ename") or o.get("text", "")[:200]) for i, o in code_outputs(path)
            if o.output_type == "error" or (o.output_type == "stream" and o.name == "stderr")]


def printed_text(path) -> str:
    return "".join(o.get("text", "") for _, o in code_outputs(path))


def draws_a_plot(path) -> bool:
    return any(o.output_type == "display_data" and "image/png" in o.get("data", {}) for _, o in code_outputs(path))


def cell_result(result, test_id):
    return next(t for t in result.tests if t.id == test_id)
