"""What a learner gets back: their notebook as graded, and a feedback page.

Both are built from the released notebook (which holds no hidden test) and the grade's
results: each test cell's score, what its visible self-checks printed, and the failure
message (what was wrong, and by how much).  No line of a hidden test reaches either:
the verdict process never prints them, and nothing here reads the lesson's source.
"""
from __future__ import annotations

import html
from pathlib import Path

from . import _jsonschema  # noqa: F401  (before nbformat: see there)
import nbformat

from .grading import NotebookResult, TestResult, answer_cells


def _meta(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


def graded_notebook(release_nb, submitted_nb, result: NotebookResult):
    """The learner's notebook as graded: their answer cells as submitted (outputs kept; every
    copy of one, as graded), the locked cells as released, and each test cell showing its score
    and result."""
    answers = {grade_id: [nbformat.from_dict(c) for c in cells]
               for grade_id, cells in answer_cells(submitted_nb).items()}
    tests = {t.id: t for t in result.tests}
    nb = nbformat.from_dict(release_nb)
    cells = []
    for cell in nb.cells:
        grade_id = _meta(cell).get("grade_id")
        if _meta(cell).get("solution") and grade_id in answers:
            cells += answers[grade_id]
            continue
        if grade_id in tests:
            cell.outputs = [_test_output(tests[grade_id])]
        cells.append(cell)
    nb.cells = cells
    nb.metadata["gclab"] = {**nb.metadata.get("gclab", {}), "score": result.score, "max_score": result.max_score}
    return nb


def _test_output(test: TestResult):
    text = f"{_verdict(test)}\n" + (f"\n{test.output.rstrip()}\n" if test.output.strip() else "")
    return nbformat.v4.new_output("stream", name="stdout", text=text)


def _verdict(test: TestResult) -> str:
    head = f"[{test.status}] {test.id}: {test.score:g} / {test.max_score:g}"
    return head + (f"\n{test.message}" if test.message and test.status != "passed" else "")


def markdown(result: NotebookResult, release_nb) -> str:
    lines = [f"# Feedback: {result.assignment}" + (f" ({result.student})" if result.student else ""), "",
             f"**Score: {result.score:g} / {result.max_score:g}**", ""]
    if result.reason:
        lines += [f"> {result.reason}", ""]
    for test, visible in _tests_with_sources(result, release_nb):
        lines += [f"## {test.id}: {test.score:g} / {test.max_score:g} ({test.status})", ""]
        if test.message and test.status != "passed":
            lines += [test.message, ""]
        lines += ["What the test runs (its visible part):", "", "```python", visible, "```", ""]
        if test.output.strip():
            lines += ["What its self-checks printed:", "", "```", test.output.rstrip(), "```", ""]
    return "\n".join(lines)


def page(result: NotebookResult, release_nb) -> str:
    e = html.escape
    title = f"Feedback: {result.assignment}" + (f" ({result.student})" if result.student else "")
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>",
             "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}pre{background:#f4f4f4;"
             "padding:.6em;overflow-x:auto}.passed{color:#185c18}.failed,.error,.timeout,.tampered{color:#9a1c1c}"
             "</style></head><body>",
             f"<h1>{e(title)}</h1><p><strong>Score: {result.score:g} / {result.max_score:g}</strong></p>"]
    if result.reason:
        parts.append(f"<blockquote>{e(result.reason)}</blockquote>")
    for test, visible in _tests_with_sources(result, release_nb):
        parts.append(f"<h2 class='{e(test.status)}'>{e(test.id)}: {test.score:g} / {test.max_score:g} "
                     f"({e(test.status)})</h2>")
        if test.message and test.status != "passed":
            parts.append(f"<p>{e(test.message)}</p>")
        parts.append(f"<p>What the test runs (its visible part):</p><pre>{e(visible)}</pre>")
        if test.output.strip():
            parts.append(f"<p>What its self-checks printed:</p><pre>{e(test.output.rstrip())}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _tests_with_sources(result: NotebookResult, release_nb):
    visible = {_meta(c).get("grade_id"): c.source for c in release_nb.cells if c.cell_type == "code"}
    return [(t, visible.get(t.id, "")) for t in result.tests]


def write(result: NotebookResult, release_nb, submitted_nb, autograded: Path, feedback: Path) -> dict[str, Path]:
    """Write the graded notebook into `autograded` and the feedback page (HTML and Markdown)
    into `feedback`; returns their paths."""
    autograded.mkdir(parents=True, exist_ok=True)
    feedback.mkdir(parents=True, exist_ok=True)
    name = result.lesson_notebook
    paths = {"notebook": autograded / f"{name}.ipynb", "html": feedback / f"{name}.html",
             "markdown": feedback / f"{name}.md"}
    nbformat.write(graded_notebook(release_nb, submitted_nb, result), paths["notebook"])
    paths["html"].write_text(page(result, release_nb))
    paths["markdown"].write_text(markdown(result, release_nb))
    return paths
