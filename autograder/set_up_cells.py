"""Give every lesson source the course's install block and kernel.

    .venv/bin/python autograder/set_up_cells.py [solutions/NN_topic/NN_topic.ipynb ...]

For each notebook (default: solutions/*/*.ipynb), in one read and one write:

- the set-up cell (grade_id "setup", the first cell a learner runs) becomes
  `gclab.grader.course.SETUP_BLOCK` alone: its old install block (up to the
  `subprocess.run([... "pip", "install" ...])` line and the `importlib.invalidate_caches()`
  after it) is replaced, and whatever followed it (the lesson's imports) moves to the top of
  the locked cell just below (grade_id "imports"), which is created when missing;
- the notebook's kernelspec becomes `gclab.grader.course.KERNELSPEC`.

Every other cell is left as it is. Running it again changes nothing. Then `make release`
regenerates notebooks/.
"""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from gclab.grader.course import KERNELSPEC, SETUP_BLOCK  # noqa: E402

PIP_LINE_START = '    subprocess.run([sys.executable, "-m", "pip", "install"'
AFTER_PIP = "    importlib.invalidate_caches()"
IMPORTS = "imports"


def split_setup_source(source: str, where: str) -> tuple[str, str]:
    """(the install block, what follows it) of a set-up cell's text."""
    lines = source.splitlines(keepends=True)
    pip = [i for i, line in enumerate(lines) if line.startswith(PIP_LINE_START)]
    if not pip:
        raise SystemExit(f"{where}: no pip install line ({PIP_LINE_START.strip()}...) in the set-up cell")
    end = pip[0] + 1
    if end < len(lines) and lines[end].rstrip("\n") == AFTER_PIP:
        end += 1
    return "".join(lines[:end]), "".join(lines[end:]).strip("\n")


def imports_cell(source: str) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source)
    cell.id = IMPORTS
    cell.metadata["nbgrader"] = {"grade": False, "grade_id": IMPORTS, "locked": True,
                                 "schema_version": 3, "solution": False}
    return cell


def update(path: Path) -> bool:
    nb = nbformat.read(path, 4)
    index = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
             and c.metadata.get("nbgrader", {}).get("grade_id") == "setup"]
    if len(index) != 1:
        raise SystemExit(f"{path}: expected one set-up cell (grade_id 'setup'), found {len(index)}")
    setup = nb.cells[index[0]]
    _, rest = split_setup_source(setup.source, str(path))
    if setup.source == SETUP_BLOCK and nb.metadata.get("kernelspec") == KERNELSPEC:
        return False
    setup.source = SETUP_BLOCK
    if rest:
        following = nb.cells[index[0] + 1] if index[0] + 1 < len(nb.cells) else None
        if following is not None and following.metadata.get("nbgrader", {}).get("grade_id") == IMPORTS:
            following.source = rest + "\n" + following.source
        else:
            nb.cells.insert(index[0] + 1, imports_cell(rest))
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nbformat.write(nb, path)
    return True


def main(argv: list[str]) -> int:
    paths = [Path(p) for p in argv] or sorted(ROOT.glob("solutions/*/*.ipynb"))
    for path in paths:
        print(("updated   " if update(path) else "unchanged ") + str(path))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
