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
