"""What a learner gets back: their notebook as graded, and a feedback page.

Both are built from the released notebook (which holds no hidden test) and the grade's
results: each test cell's score, what its visible self-checks printed, and the failure
message (what was wrong, and by how much).  No line of a hidden test reaches either:
the verdict process never prints them, and nothing here reads the lesson's source.

A score the instructor set by hand that stands (`gradebook.ManualScore`) is shown, and counted,
in place of the automatic one, so that the feedback says what the gradebook says.  The graded
notebook keeps the grade as the grader gave it in its metadata (`gclab.result`: what the learner
may read of it), from which nbgrader's own "Generate Feedback" writes this same page
(`gclab.grader.preprocessors.CourseFeedback`).
"""
from __future__ import annotations

import dataclasses
import html
from pathlib import Path

from . import _jsonschema  # noqa: F401  (before nbformat: see there)
import nbformat

from .grading import NotebookResult, TestResult, answer_cells

# what a learner may read of a grade: no figures of the grader's, no review lines for the instructor
_LEARNER_FIELDS = ("notebook", "assignment", "student", "lesson_notebook", "score", "max_score", "reason")
_LEARNER_TEST_FIELDS = ("id", "score", "max_score", "status", "message", "output")


def learner_view(result: NotebookResult) -> dict:
    """The grade as the learner may read it, as JSON."""
    return {**{name: getattr(result, name) for name in _LEARNER_FIELDS},
            "tests": [{name: getattr(test, name) for name in _LEARNER_TEST_FIELDS} for test in result.tests]}


def from_learner_view(view: dict) -> NotebookResult:
    return NotebookResult(**{name: view[name] for name in _LEARNER_FIELDS},
                          tests=[TestResult(**test) for test in view["tests"]])


def scored_by_hand(result: NotebookResult, by_hand=()) -> NotebookResult:
    """A copy of `result` in which each standing score set by hand replaces its test's automatic score."""
    manual = {m.test: m.score for m in by_hand if not m.cleared}
    tests = [dataclasses.replace(t, score=manual[t.id]) if t.id in manual else t for t in result.tests]
    return dataclasses.replace(result, tests=tests, score=sum(t.score for t in tests))


def _meta(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


def graded_notebook(release_nb, submitted_nb, result: NotebookResult, by_hand=()):
    """The learner's notebook as graded: their answer cells as submitted (outputs kept; every
    copy of one, as graded), the locked cells as released, and each test cell showing its score
    (set by hand where one stands) and result."""
    graded, result = result, scored_by_hand(result, by_hand)
    manual = _standing(by_hand)
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
            cell.outputs = [_test_output(tests[grade_id], manual.get(grade_id))]
        cells.append(cell)
    nb.cells = cells
    nb.metadata["gclab"] = {**nb.metadata.get("gclab", {}), "score": result.score, "max_score": result.max_score,
                            "result": learner_view(graded)}
    return nb


def graded_result(graded_nb) -> NotebookResult | None:
    """The grade a graded notebook keeps (as the grader gave it, before any score by hand); None where it
    keeps none (a notebook nbgrader's own autograde wrote)."""
    view = graded_nb.metadata.get("gclab", {}).get("result")
    return from_learner_view(view) if view else None


def _standing(by_hand) -> dict:
    return {m.test: m for m in by_hand if not m.cleared}


def _test_output(test: TestResult, manual=None):
    text = f"{_verdict(test, manual)}\n" + (f"\n{test.output.rstrip()}\n" if test.output.strip() else "")
    return nbformat.v4.new_output("stream", name="stdout", text=text)


def _verdict(test: TestResult, manual=None) -> str:
    head = f"[{test.status}] {test.id}: {test.score:g} / {test.max_score:g}"
    lines = [head] + ([_by_hand(manual)] if manual else [])
    return "\n".join(lines + ([test.message] if test.message and test.status != "passed" else []))


def _by_hand(manual) -> str:
    return f"(scored by your instructor: {manual.score:g} / {manual.max_score:g}; the automatic score was {manual.auto_now:g})"


def markdown(result: NotebookResult, release_nb, by_hand=()) -> str:
    result, manual = scored_by_hand(result, by_hand), _standing(by_hand)
    lines = [f"# Feedback: {result.assignment}" + (f" ({result.student})" if result.student else ""), "",
             f"**Score: {result.score:g} / {result.max_score:g}**", ""]
    if result.reason:
        lines += [f"> {result.reason}", ""]
    for test, visible in _tests_with_sources(result, release_nb):
        lines += [f"## {test.id}: {test.score:g} / {test.max_score:g} ({test.status})", ""]
        if test.id in manual:
            lines += [_by_hand(manual[test.id]), ""]
        if test.message and test.status != "passed":
            lines += [test.message, ""]
        lines += ["What the test runs (its visible part):", "", "```python", visible, "```", ""]
        if test.output.strip():
            lines += ["What its self-checks printed:", "", "```", test.output.rstrip(), "```", ""]
    return "\n".join(lines)


def page(result: NotebookResult, release_nb, by_hand=()) -> str:
    result, manual = scored_by_hand(result, by_hand), _standing(by_hand)
    e = html.escape
    title = f"Feedback: {result.assignment}" + (f" ({result.student})" if result.student else "")
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>",
             "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}pre{background:#f4f4f4;"
             "padding:.6em;white-space:pre-wrap;overflow-wrap:anywhere}.passed{color:#185c18}.failed,.error,.timeout,.tampered{color:#9a1c1c}"
             "</style></head><body>",
             f"<h1>{e(title)}</h1><p><strong>Score: {result.score:g} / {result.max_score:g}</strong></p>"]
    if result.reason:
        parts.append(f"<blockquote>{e(result.reason)}</blockquote>")
    for test, visible in _tests_with_sources(result, release_nb):
        parts.append(f"<h2 class='{e(test.status)}'>{e(test.id)}: {test.score:g} / {test.max_score:g} "
                     f"({e(test.status)})</h2>")
        if test.id in manual:
            parts.append(f"<p>{e(_by_hand(manual[test.id]))}</p>")
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


def write(result: NotebookResult, release_nb, submitted_nb, autograded: Path, feedback: Path,
          by_hand=()) -> dict[str, Path]:
    """Write the graded notebook into `autograded` and the feedback page (HTML and Markdown)
    into `feedback`, each showing the scores set by hand that stand (`by_hand`); returns their paths.
    A file there is replaced, not written over: nbgrader leaves what it writes read-only."""
    autograded.mkdir(parents=True, exist_ok=True)
    feedback.mkdir(parents=True, exist_ok=True)
    name = result.lesson_notebook
    paths = {"notebook": autograded / f"{name}.ipynb", "html": feedback / f"{name}.html",
             "markdown": feedback / f"{name}.md"}
    for path in paths.values():
        path.unlink(missing_ok=True)
    nbformat.write(graded_notebook(release_nb, submitted_nb, result, by_hand), paths["notebook"])
    paths["html"].write_text(page(result, release_nb, by_hand))
    paths["markdown"].write_text(markdown(result, release_nb, by_hand))
    return paths
