"""Where the course lives, for Colab: one address in autograder/course.toml, followed by the
first cell of every student notebook and README's Colab links; the first cell with and
without one.  (autograder/colab_check.py runs whole lessons in a Colab-like environment.)"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from gclab.grader import course, grading
from toy_course import cell, make_course

ROOT = Path(__file__).resolve().parent.parent
REPO = "https://github.com/acme/gc-course@spring"


def _setup_cell(path):
    nb = nbformat.read(path, 4)
    [setup] = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "setup"]
    return nb, setup


# -- the first cell, run where gclab is missing ------------------------------------------
def run_first_cell(source_line_value, env_source=None, tmp_path=None):
    """Run the set-up block in a fresh Python that cannot find gclab; pip is not really run:
    the command it would run is printed."""
    block = course.with_source(course.SETUP_BLOCK, source_line_value)
    harness = (
        "import importlib.util, subprocess, sys\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'gclab' else real(name, *a)\n"
        "subprocess.run = lambda cmd, check: print('PIP', cmd[1:])\n"
        + block)
    env = {k: v for k, v in os.environ.items() if k != "GCLAB_SOURCE"}
    if env_source is not None:
        env["GCLAB_SOURCE"] = env_source
    return subprocess.run([sys.executable, "-c", harness], capture_output=True, text=True, env=env, timeout=60)


def test_first_cell_without_a_source_says_how_to_set_one():
    done = run_first_cell("")
    assert done.returncode != 0 and "PIP" not in done.stdout
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("RuntimeError: The course's helper package gclab is not installed here")
    for hint in ("does not say where the course lives",
                 "os.environ['GCLAB_SOURCE'] = 'git+https://github.com/OWNER/REPO'", "make lab"):
        assert hint in message


def test_first_cell_installs_from_the_released_source():
    done = run_first_cell(REPO)
    assert done.returncode == 0, done.stderr
    assert "Installing gclab from git+https://github.com/acme/gc-course.git@spring" in done.stdout
    assert "PIP ['-m', 'pip', 'install', '-q', 'git+https://github.com/acme/gc-course.git@spring']" in done.stdout


def test_gclab_source_in_the_environment_wins():
    for released in ("", REPO):
        done = run_first_cell(released, env_source="git+https://example.org/mine.git@x")
        assert done.returncode == 0, done.stderr
        assert "PIP ['-m', 'pip', 'install', '-q', 'git+https://example.org/mine.git@x']" in done.stdout


def test_first_cell_does_nothing_where_gclab_is_installed():
    block = course.with_source(course.SETUP_BLOCK, REPO)
    done = subprocess.run([sys.executable, "-c", "import subprocess\nsubprocess.run = None\n" + block],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done.stderr


# -- the address and what follows from it ---------------------------------------------------
@pytest.mark.parametrize("given, github, requirement", [
    ("https://github.com/acme/gc-course", ("acme", "gc-course", "main"), "git+https://github.com/acme/gc-course.git"),
    ("https://github.com/acme/gc-course@spring", ("acme", "gc-course", "spring"),
     "git+https://github.com/acme/gc-course.git@spring"),
    ("https://github.com/acme/gc-course/tree/spring", ("acme", "gc-course", "spring"),
     "git+https://github.com/acme/gc-course.git@spring"),
    ("git+https://github.com/acme/gc-course.git@v1.0", ("acme", "gc-course", "v1.0"),
     "git+https://github.com/acme/gc-course.git@v1.0"),
    ("git+https://gitlab.example.org/acme/course.git@main", None, "git+https://gitlab.example.org/acme/course.git@main"),
    ("https://example.org/course.tar.gz", None, "https://example.org/course.tar.gz"),
])
def test_source_gives_pip_requirement_and_colab_repository(given, github, requirement):
    source = course.Source(given)
    assert source.github == github and source.requirement == requirement
    url = source.colab_url("notebooks/a/a.ipynb")
    assert url == (None if github is None else
                   f"https://colab.research.google.com/github/{github[0]}/{github[1]}/blob/{github[2]}/notebooks/a/a.ipynb")


def test_course_file_keeps_its_comments(tmp_path):
    (tmp_path / "autograder").mkdir()
    assert course.read_source(tmp_path) == ""
    course.write_source(tmp_path, REPO)
    assert course.read_source(tmp_path) == REPO
    text = (tmp_path / course.COURSE_FILE).read_text()
    course.write_source(tmp_path, "")
    assert course.read_source(tmp_path) == ""
    assert (tmp_path / course.COURSE_FILE).read_text() == text.replace(json.dumps(REPO), '""')
    with pytest.raises(ValueError):
        course.write_source(tmp_path, "git+https://x y")


# -- the release writes it --------------------------------------------------------------------
def toy(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = dict(course.KERNELSPEC)
    nb.cells = [nbformat.v4.new_markdown_cell("# 00 · A toy lesson\n\nText."),
                cell(course.SETUP_BLOCK + "\nimport gc\n", "setup"),
                cell("### BEGIN SOLUTION\ndef double(x):\n    return 2 * x\n### END SOLUTION", "answer", solution=True),
                cell("assert double(2) == 4", "test_double", points=1)]
    root = make_course(tmp_path / "course", {"00_toy": nb})
    (root / "README.md").write_text(f"# Toy\n\n{course.README_START}\nold\n{course.README_END}\n\nThe end.\n")
    return root


def test_release_writes_the_source_into_the_first_cell_and_readme(tmp_path):
    root = toy(tmp_path)
    done = subprocess.run([sys.executable, "-m", "gclab", "--course", str(root), "release", "--source", REPO],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "course address: " + REPO in done.stdout
    assert course.read_source(root) == REPO
    released, setup = _setup_cell(root / "notebooks" / "00_toy" / "00_toy.ipynb")
    assert setup.source.startswith(course.with_source(course.SETUP_BLOCK, REPO))
    assert 'os.environ.get("GCLAB_SOURCE") or "git+https://github.com/acme/gc-course.git@spring"' in setup.source
    assert released.metadata["kernelspec"] == course.KERNELSPEC
    # nbgrader locked the cell as released, with the address in it
    from nbgrader.utils import compute_checksum
    assert setup.metadata["nbgrader"]["checksum"] == compute_checksum(setup)
    # the source stays as authored
    _, authored = _setup_cell(root / "solutions" / "00_toy" / "00_toy.ipynb")
    assert course.SETUP_BLOCK in authored.source
    readme = (root / "README.md").read_text()
    assert ("- [00 · A toy lesson](https://colab.research.google.com/github/acme/gc-course/blob/spring/"
            "notebooks/00_toy/00_toy.ipynb)") in readme
    assert readme.startswith("# Toy\n\n") and readme.endswith("\n\nThe end.\n") and "old" not in readme

    # a later release keeps it; --source '' unsets it, and the first cell says so again
    grading.release(root)
    assert course.read_source(root) == REPO
    grading.release(root, source="")
    _, setup = _setup_cell(root / "notebooks" / "00_toy" / "00_toy.ipynb")
    assert setup.source.startswith(course.SETUP_BLOCK)
    assert "No course address is set yet" in (root / "README.md").read_text()


# -- the course as committed --------------------------------------------------------------------
def test_every_lesson_opens_with_the_install_block_and_names_the_course_kernel():
    source = course.read_source(ROOT)
    for folder, block in (("solutions", course.SETUP_BLOCK), ("notebooks", course.with_source(course.SETUP_BLOCK, source))):
        for path in sorted(ROOT.glob(f"{folder}/*/*.ipynb")):
            nb, setup = _setup_cell(path)
            rel = path.relative_to(ROOT)
            assert setup.source.startswith(block), (
                f"{rel}: its set-up cell does not open with the course's install block: run "
                "`.venv/bin/python autograder/set_up_cells.py` (then `make release`)")
            assert nb.metadata.get("kernelspec") == course.KERNELSPEC, f"{rel}: kernelspec is not {course.KERNELSPEC}"


def test_the_first_cell_a_learner_runs_is_the_install_block_alone():
    """The set-up cell is a few lines (the install block, nothing else); the lesson's imports follow in a
    locked cell of their own, so that a learner who deletes cells cannot lose them."""
    assert len(course.SETUP_BLOCK.splitlines()) <= 12
    for path in sorted(ROOT.glob("solutions/*/*.ipynb")):
        nb, setup = _setup_cell(path)
        rel = path.relative_to(ROOT)
        assert setup.source.strip("\n") == course.SETUP_BLOCK.strip("\n"), f"{rel}: the set-up cell holds more than the install block"
        first_code = next(c for c in nb.cells if c.cell_type == "code")
        assert first_code is setup, f"{rel}: the set-up cell is not the first code cell"
        imports = nb.cells[nb.cells.index(setup) + 1]
        assert imports.metadata.get("nbgrader", {}).get("grade_id") == "imports", f"{rel}: no imports cell after set-up"
        assert imports.metadata["nbgrader"]["locked"] and not imports.metadata["nbgrader"]["grade"]


def test_readme_colab_links_follow_the_course_file():
    readme = (ROOT / "README.md").read_text()
    block = re.search(re.escape(course.README_START) + r".*?" + re.escape(course.README_END), readme, re.S)
    assert block, "README.md has no Colab block"
    assert block.group(0) == course.readme_block(ROOT), "README's Colab links are stale: run `make release`"


def test_readme_has_one_colab_link_per_lesson_once_the_course_is_on_github():
    notebooks = sorted(ROOT.glob("notebooks/*/*.ipynb"))
    links = re.findall(r"\]\((\S+)\)", course.readme_block(ROOT, source=REPO))
    assert len(links) == len(notebooks) == len(grading.lessons(ROOT))
    for url, nb in zip(links, notebooks):
        rel = nb.relative_to(ROOT).as_posix()
        assert url == f"https://colab.research.google.com/github/acme/gc-course/blob/spring/{rel}"
    elsewhere = course.readme_block(ROOT, source="git+https://gitlab.example.org/acme/course.git@main")
    assert "not on GitHub" in elsewhere and "colab.research.google.com" not in elsewhere
