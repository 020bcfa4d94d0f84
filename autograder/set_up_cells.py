"""Give every lesson source the course's install block and kernel.

    .venv/bin/python autograder/set_up_cells.py [solutions/NN_topic/NN_topic.ipynb ...]

For each notebook (default: solutions/*/*.ipynb) it replaces, in one read and one write,
only two things: the install block at the top of the set-up cell (grade_id "setup": from
its first line to the `subprocess.run([... "pip", "install" ...])` line and the
`importlib.invalidate_caches()` after it) with
`gclab.grader.course.SETUP_BLOCK`, and the notebook's kernelspec with `gclab.grader.course.KERNELSPEC`.
Every other cell, and the rest of the set-up cell, is left as it is. Running it again
changes nothing. Then `make release` regenerates notebooks/.
"""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from gclab.grader.course import KERNELSPEC, SETUP_BLOCK  # noqa: E402

FIRST_LINE = SETUP_BLOCK.splitlines()[0]
PIP_LINE_START = '    subprocess.run([sys.executable, "-m", "pip", "install"'
AFTER_PIP = "    importlib.invalidate_caches()"


def new_setup_source(source: str, where: str) -> str:
    """The set-up cell's text with its install block replaced by SETUP_BLOCK."""
    lines = source.splitlines(keepends=True)
    if not lines or lines[0].rstrip("\n") != FIRST_LINE:
        raise SystemExit(f"{where}: the set-up cell does not start with {FIRST_LINE!r}")
    pip = [i for i, line in enumerate(lines) if line.startswith(PIP_LINE_START)]
    if not pip:
        raise SystemExit(f"{where}: no pip install line ({PIP_LINE_START.strip()}...) in the set-up cell")
    end = pip[0] + 1
    if end < len(lines) and lines[end].rstrip("\n") == AFTER_PIP:
        end += 1
    return SETUP_BLOCK + "".join(lines[end:])


def update(path: Path) -> bool:
    nb = nbformat.read(path, 4)
    setup = [c for c in nb.cells if c.cell_type == "code"
             and c.metadata.get("nbgrader", {}).get("grade_id") == "setup"]
    if len(setup) != 1:
        raise SystemExit(f"{path}: expected one set-up cell (grade_id 'setup'), found {len(setup)}")
    source = new_setup_source(setup[0].source, str(path))
    if source == setup[0].source and nb.metadata.get("kernelspec") == KERNELSPEC:
        return False
    setup[0].source = source
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
