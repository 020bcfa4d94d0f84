"""notebooks/ is nbgrader's release of solutions/, committed without outputs."""
import json
from pathlib import Path

from gclab.grader import grading

ROOT = Path(__file__).resolve().parent.parent


def _cells(path):
    nb = json.loads(Path(path).read_text())
    return [(c["cell_type"], "".join(c["source"]), c.get("metadata", {}).get("nbgrader")) for c in nb["cells"]]


def test_release_is_up_to_date_with_solutions(tmp_path):
    fresh = grading.build_release(ROOT, tmp_path / "release")
    generated = sorted(p.relative_to(fresh) for p in fresh.glob("*/*.ipynb"))
    committed = sorted(p.relative_to(ROOT / "notebooks") for p in (ROOT / "notebooks").glob("*/*.ipynb"))
    assert generated == committed, "notebooks/ does not hold one release per lesson: run `make release`"
    for rel in generated:
        assert _cells(fresh / rel) == _cells(ROOT / "notebooks" / rel), f"notebooks/{rel} is stale: run `make release`"


def test_every_lesson_is_released():
    assert grading.lessons(ROOT) == sorted(p.name for p in (ROOT / "notebooks").iterdir() if p.is_dir())


def test_notebooks_are_committed_without_outputs():
    for path in [*ROOT.glob("solutions/*/*.ipynb"), *ROOT.glob("notebooks/*/*.ipynb")]:
        nb = json.loads(path.read_text())
        dirty = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count"))]
        assert not dirty, f"{path.relative_to(ROOT)} has outputs in cells {dirty}: clear them before committing"


def test_release_hides_solutions_and_hidden_tests():
    for path in ROOT.glob("notebooks/*/*.ipynb"):
        text = path.read_text()
        assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text
        assert "raise NotImplementedError()" in text


def test_every_lesson_keeps_torch_to_one_thread_on_a_cpu():
    """On a shared CPU, torch's intra-op threads wait for each other: lesson 03 took 303 s beside two
    busy processes with them, 32 s without (28.7 s alone). A given, locked cell turns them off."""
    for path in ROOT.glob("notebooks/*/*.ipynb"):
        locked = [src for kind, src, grading_meta in _cells(path)
                  if kind == "code" and (grading_meta or {}).get("locked") and not (grading_meta or {}).get("solution")]
        assert any('if DEVICE.type == "cpu":\n    torch.set_num_threads(1)' in src for src in locked), \
            f"{path.relative_to(ROOT)}: no locked cell sets torch.set_num_threads(1) on a CPU"


def test_no_test_cell_ends_in_an_expression():
    """nbgrader reads the value a graded cell displays as a partial score (`nbgrader validate`, the Validate
    button: "Partial credit; passed some but not all of the tests"): no test cell's last statement, hidden
    tests included, may be an expression but a print()."""
    import ast
    import nbformat
    ending = []
    for path in sorted((ROOT / "solutions").glob("*/*.ipynb")):
        for cell in nbformat.read(path, 4).cells:
            meta = cell.metadata.get("nbgrader", {})
            if cell.cell_type != "code" or not meta.get("grade") or meta.get("solution"):
                continue
            body = ast.parse("\n".join(line for line in cell.source.splitlines()
                                       if not line.lstrip().startswith(("%", "!")))).body
            last = body[-1] if body else None
            if isinstance(last, ast.Expr) and not (isinstance(last.value, ast.Call)
                                                   and getattr(last.value.func, "id", "") == "print"):
                ending.append(f"{path.name} {meta['grade_id']}: {ast.unparse(last)[:60]}")
    assert not ending, ending


# Cells a learner reads (issue 37, section 4): each code cell of notebooks/ shows one idea in at most
# MAX_CELL_LINES lines; drawing lives in gclab.plots and gclab.widgets.  Allowed to stay longer, by
# (lesson, grade_id), with the most lines each may have:
LONG_CELLS = {
    # the given programs whose reading is the exercise (the learner finds the bug in them)
    ("02_cycles_and_the_collector", "given_tree"): 60,        # the tree with back-references to fix
    ("04_awaitable_callback_oom", "given_batch"): 31,         # the awaitable batch with the callback to fix
    ("05_training_loop_leaks", "given_trainer"): 37,          # the trainer with the leaks to find
    ("07_weakref_caches", "given_cache"): 45,                 # the leaky cache to start from
    ("08_capstone", "given_program"): 127,                    # the capstone's whole program
    # visible self-checks as strict as the hidden tests (issue 37, section 3): each checks one exercise
    # against every rule its hidden test applies, so that a wrong fix fails here, not only in the grade
}
MAX_CELL_LINES = 25
SETUP_CELL_LINES = 12


def test_every_code_cell_a_learner_reads_is_short():
    """Every code cell of the release has at most MAX_CELL_LINES lines, the set-up cell a learner runs
    first at most SETUP_CELL_LINES; the cells of LONG_CELLS at most the lines they are allowed, and each
    of them still exists and still needs its place on the list."""
    too_long, stale = [], dict(LONG_CELLS)
    for path in sorted((ROOT / "notebooks").glob("*/*.ipynb")):
        lesson = path.parent.name
        for index, (kind, source, meta) in enumerate(_cells(path)):
            if kind != "code":
                continue
            grade_id = (meta or {}).get("grade_id")
            lines = len(source.splitlines())
            allowed = stale.pop((lesson, grade_id), None)
            limit = SETUP_CELL_LINES if grade_id == "setup" else allowed or MAX_CELL_LINES
            if lines > limit:
                too_long.append(f"{lesson} cell {index} ({grade_id or 'demo'}): {lines} lines, at most {limit}")
            elif allowed is not None and lines <= MAX_CELL_LINES:
                too_long.append(f"{lesson} {grade_id}: {lines} lines now: take it off LONG_CELLS")
    assert not too_long, "cells too long for a learner to read (split them, or draw through gclab.plots):\n" + \
        "\n".join(too_long)
    assert not stale, f"LONG_CELLS names cells that no longer exist: {sorted(stale)}"


# Colab's code cells do not wrap long lines (JupyterLab's do, with lab/'s settings); a JupyterLab code
# cell in a 1400-pixel-wide window with the file browser open shows 120 characters (headless Chromium,
# autograder/browser_run.py). Markdown and outputs wrap everywhere.
MAX_LINE_CHARS = 120


def test_every_line_a_learner_reads_fits_a_colab_cell():
    """No line of a code cell of the release is longer than MAX_LINE_CHARS characters."""
    wide = [f"{path.parent.name} cell {index}: {len(line)} characters: {line[:60]}..."
            for path in sorted((ROOT / "notebooks").glob("*/*.ipynb"))
            for index, (kind, source, _) in enumerate(_cells(path)) if kind == "code"
            for line in source.splitlines() if len(line) > MAX_LINE_CHARS]
    assert not wide, f"lines too wide for a learner's cell (at most {MAX_LINE_CHARS}):\n" + "\n".join(wide)


def test_every_section_starts_a_cell_of_its_own():
    """JupyterLab and Colab fold a section, and list it in their table of contents as a place to
    jump to, only where a markdown cell starts with its heading: no heading may sit inside a cell
    below other text (the lesson's front page, its first cell, excepted)."""
    buried = [f"{path.parent.name} cell {index}: {line}"
              for path in sorted((ROOT / "notebooks").glob("*/*.ipynb"))
              for index, (kind, source, _) in enumerate(_cells(path)) if kind == "markdown" and index > 0
              for line in source.splitlines()[1:] if line.startswith("#")]
    assert not buried, "headings inside a cell (start a markdown cell with each):\n" + "\n".join(buried)
