"""Where the course lives, for learners who do not clone it (Google Colab), and its kernel.

The instructor says it once: `gclab release --source URL` (`make release SOURCE=URL`) keeps
the address in `autograder/course.toml`.  From there the release writes it into the set-up
cell of every student notebook (the line `GCLAB_SOURCE = os.environ.get("GCLAB_SOURCE", ...)`
of `SETUP_BLOCK`), and into README's "Open in Colab" links, one per lesson, between
`README_START` and `README_END`.  Nothing here knows a particular lesson.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

COURSE_FILE = Path("autograder") / "course.toml"

# The kernel every notebook names, and the one `make lab` registers inside the checkout's
# .venv (ipykernel install --sys-prefix): per checkout, and "python3" so that Colab, nbclient
# and nbgrader, which know that name, run the notebooks with no "unrecognized runtime".
KERNEL_NAME = "python3"
KERNEL_DISPLAY_NAME = "Python 3 (gclab)"
KERNELSPEC = {"display_name": KERNEL_DISPLAY_NAME, "language": "python", "name": KERNEL_NAME}

# Every lesson's set-up cell (grade_id "setup"), the first cell a learner runs: this block alone
# (the lesson's imports follow in a cell of their own, grade_id "imports").  The release replaces
# the "" of the GCLAB_SOURCE line with the course's address; the environment variable of
# the same name, set in a cell above, wins over it.
SOURCE_LINE = re.compile(r'^GCLAB_SOURCE = os\.environ\.get\("GCLAB_SOURCE"\) or (?P<literal>".*")$', re.M)
SETUP_BLOCK = '''\
# Set-up: run this cell first. Where the course's helper package gclab is missing (Colab), it installs it.
import importlib.util, os, subprocess, sys
GCLAB_SOURCE = os.environ.get("GCLAB_SOURCE") or ""
if importlib.util.find_spec("gclab") is None:
    if not GCLAB_SOURCE:
        raise RuntimeError("The course's helper package gclab is not installed here, and this notebook does "
                           "not say where the course lives. On Colab, run `import os; os.environ['GCLAB_SOURCE'] "
                           "= 'git+https://github.com/OWNER/REPO'` (the repository you were given) in a cell above, "
                           "then this cell again; on your own machine, run `make lab` in the course folder.")
    print(f"Installing gclab from {GCLAB_SOURCE} (this runtime's torch is kept) ...", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", GCLAB_SOURCE], check=True)
    importlib.invalidate_caches()
'''

README_START = "<!-- colab: written by `gclab release` from autograder/course.toml; do not edit -->"
README_END = "<!-- /colab -->"
COLAB = "https://colab.research.google.com/github"
DEFAULT_BRANCH = "main"

_GITHUB = re.compile(r"^(?:git\+)?https://github\.com/(?P<owner>[A-Za-z0-9_.-]+)/(?P<repo>[A-Za-z0-9_.-]+?)"
                     r"(?:\.git)?(?:/tree/(?P<tree>[^@#\s]+?))?/?(?:@(?P<ref>[^#\s]+))?$")


@dataclass(frozen=True)
class Source:
    """The course's address as the instructor gave it, and what follows from it."""
    given: str

    @property
    def _github(self):
        return _GITHUB.match(self.given.strip())

    @property
    def github(self) -> tuple[str, str, str] | None:
        """(owner, repository, branch) when the course is on GitHub, where Colab opens notebooks by link."""
        m = self._github
        if not m:
            return None
        return m["owner"], m["repo"], m["ref"] or m["tree"] or DEFAULT_BRANCH

    @property
    def requirement(self) -> str:
        """What the set-up cell hands to `pip install`: a GitHub address becomes git+https://...git@BRANCH;
        anything else (git+https://HOST/..., an archive's URL, a path) is passed as given."""
        m = self._github
        if not m:
            return self.given.strip()
        ref = m["ref"] or m["tree"]
        return f"git+https://github.com/{m['owner']}/{m['repo']}.git" + (f"@{ref}" if ref else "")

    def colab_url(self, notebook: str) -> str | None:
        """The "Open in Colab" address of a notebook (a path in the repository), or None off GitHub."""
        if not self.github:
            return None
        owner, repo, branch = self.github
        return f"{COLAB}/{owner}/{repo}/blob/{branch}/{notebook}"


def check_source(text: str) -> str:
    """The address, stripped; refused when pip could not take it as one requirement."""
    text = text.strip()
    if any(c.isspace() for c in text) or '"' in text or "\\" in text:
        raise ValueError(f"not a course address pip can install: {text!r} (no spaces or quotes)")
    return text


# -- autograder/course.toml ------------------------------------------------------------
_HEADER = """\
# The course's own settings (nbgrader's are in nbgrader_config.py beside this file).
#
# source: where this course lives, for learners without a clone (Google Colab): a GitHub
#   repository, https://github.com/OWNER/REPO@BRANCH (README then gets an "Open in Colab" link
#   per lesson), or any address pip installs the course from (git+https://HOST/REPO@BRANCH).
#   Set it with `make release SOURCE=...` (gclab release --source ...), which writes it here,
#   into the set-up cell of every student notebook, and into README's Colab links.
#   Empty: a learner without gclab is told how to set GCLAB_SOURCE themselves.
"""


def read_source(root: Path) -> str:
    """The `source` of the course's autograder/course.toml ("" when unset or absent)."""
    path = Path(root) / COURSE_FILE
    if not path.is_file():
        return ""
    text = path.read_text()
    try:
        import tomllib
        return str(tomllib.loads(text).get("source", "")).strip()
    except ImportError:                                  # Python 3.10: the one line gclab writes
        m = re.search(r'^source\s*=\s*(".*")\s*$', text, re.M)
        return json.loads(m.group(1)).strip() if m else ""


def write_source(root: Path, source: str) -> Path:
    """Keep `source` in autograder/course.toml (the rest of the file as it is)."""
    path = Path(root) / COURSE_FILE
    line = f"source = {json.dumps(check_source(source) if source.strip() else '')}"
    text = path.read_text() if path.is_file() else _HEADER
    if re.search(r"^source\s*=.*$", text, re.M):
        text = re.sub(r"^source\s*=.*$", lambda _: line, text, count=1, flags=re.M)
    else:
        text = text.rstrip("\n") + "\n" + line + "\n"
    path.write_text(text)
    return path


# -- the set-up cell -------------------------------------------------------------------
def with_source(cell_source: str, source: str) -> str:
    """A set-up cell's text with the course's address in its GCLAB_SOURCE line."""
    literal = json.dumps(Source(source).requirement if source else "")
    return SOURCE_LINE.sub(lambda m: m.group(0).replace(m["literal"], literal), cell_source)


def write_source_into(notebook: Path, source: str) -> bool:
    """Write the address into each code cell of `notebook` that has the GCLAB_SOURCE line."""
    from . import _jsonschema  # noqa: F401  (before nbformat: see there)
    import nbformat
    nb = nbformat.read(notebook, 4)
    changed = False
    for cell in nb.cells:
        if cell.cell_type == "code" and SOURCE_LINE.search(cell.source):
            new = with_source(cell.source, source)
            changed |= new != cell.source
            cell.source = new
    if changed:
        nbformat.write(nb, notebook)
    return changed


# -- README ----------------------------------------------------------------------------
def _title(notebook: Path) -> str:
    """The first heading of the notebook's first markdown cell."""
    nb = json.loads(notebook.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return notebook.stem


def readme_block(root: Path, notebooks: list[Path] | None = None, source: str | None = None) -> str:
    """README's Colab links for the released notebooks (notebooks/*/*.ipynb), from the course's
    address (`source`, default: the one in autograder/course.toml)."""
    root = Path(root)
    source = Source(read_source(root) if source is None else source)
    notebooks = sorted(notebooks if notebooks is not None else (root / "notebooks").glob("*/*.ipynb"))
    if not source.given:
        body = ("No course address is set yet, so there are no Colab links: the instructor sets it with "
                "`make release SOURCE=https://github.com/OWNER/REPO@BRANCH` (below).")
    elif not source.github:
        body = (f"The course lives at `{source.given}`, not on GitHub, so Colab cannot open its lessons by "
                "link: upload a lesson's notebook to Colab (File, Upload notebook); its first cell installs "
                "gclab from that address.")
    else:
        owner, repo, branch = source.github
        lines = [f"Open a lesson in Colab (from `{owner}/{repo}`, branch `{branch}`):", ""]
        for nb in notebooks:
            rel = nb.relative_to(root).as_posix()
            lines.append(f"- [{_title(nb)}]({source.colab_url(rel)})")
        body = "\n".join(lines)
    return f"{README_START}\n{body}\n{README_END}"


def update_readme(root: Path) -> bool:
    """Rewrite README.md's Colab block (between its markers) from the config; False when README has none."""
    path = Path(root) / "README.md"
    if not path.is_file():
        return False
    text = path.read_text()
    pattern = re.compile(re.escape(README_START) + r".*?" + re.escape(README_END), re.S)
    if not pattern.search(text):
        return False
    new = pattern.sub(lambda _: readme_block(root), text, count=1)
    if new != text:
        path.write_text(new)
    return True
