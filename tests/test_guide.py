"""README's instructor guide, run as written in a scratch copy of the course: release,
a student fetches and submits, collect, grade the class, export, hand back feedback."""
import csv
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from lesson_support import handed_back_text

ROOT = Path(__file__).resolve().parent.parent
MARK = "<!-- guide: a class -->"
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "work", "submitted", "autograded", "feedback", "reports",
                                     "exchange", "gradebook.db", "grades.csv", "__pycache__", ".pytest_cache")


def guide_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(re.escape(MARK) + r"\s*```sh\n(.*?)```", text, re.S).group(1)
    return [line.strip() for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]


def student_submits(lesson: str, exchange: Path, home: Path, answer: Path) -> str:
    """Shell commands: a student (this machine's user, as nbgrader names them) fetches the
    lesson, replaces it with `answer`, and submits."""
    (home / ".jupyter").mkdir(parents=True)
    (home / ".jupyter" / "nbgrader_config.py").write_text(f"c.Exchange.root = {str(exchange)!r}\n")
    nbgrader = ROOT / ".venv" / "bin" / "nbgrader"
    env = f"JUPYTER_CONFIG_DIR={home / '.jupyter'}"
    return (f"(cd {home} && {env} {nbgrader} fetch_assignment {lesson} --course gc-gpu-memory"
            f" && cp {answer} {lesson}/{lesson}.ipynb"
            f" && {env} {nbgrader} submit {lesson} --course gc-gpu-memory)")


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("guide") / "course"
    shutil.copytree(ROOT, scratch, ignore=COPY_IGNORE)
    (scratch / ".venv").symlink_to(ROOT / ".venv")
    if (ROOT / "autograder" / "work" / "cache").is_dir():     # generated releases, keyed by their sources
        shutil.copytree(ROOT / "autograder" / "work" / "cache", scratch / "autograder" / "work" / "cache")
    lesson = "03_node_leak"
    lines = []
    for command in guide_commands():
        # the stamp of the shared .venv: `make` installs nothing in the copy
        lines.append(command.replace("make ", "make -o .venv/.installed ", 1) if command.startswith("make ") else command)
        if "release_assignment" in command:
            lines.append(student_submits(lesson, scratch / "exchange", scratch.parent / "student",
                                         ROOT / "solutions" / lesson / f"{lesson}.ipynb"))
    script = "set -euo pipefail\n" + "\n".join(lines) + "\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "JUPYTER"))}
    done = subprocess.run(["bash", "-c", script], cwd=scratch, capture_output=True, text=True, env=env, timeout=600)
    from nbgrader.utils import get_username
    return {"done": done, "course": scratch, "lesson": lesson, "student": get_username()}


def test_every_command_of_the_guide_runs(ran):
    assert ran["done"].returncode == 0, ran["done"].stdout[-3000:] + ran["done"].stderr[-3000:]


def test_the_class_is_graded_and_exported(ran):
    rows = list(csv.DictReader((ran["course"] / "autograder" / "grades.csv").open()))
    [row] = [r for r in rows if r["student_id"] == ran["student"]]
    assert row["assignment"] == ran["lesson"] and float(row["score"]) == float(row["max_score"]) > 0


def test_feedback_reaches_the_exchange_without_a_hidden_test(ran):
    pages = list((ran["course"] / "exchange" / "gc-gpu-memory" / "feedback").glob("*.html"))
    assert len(pages) == 1
    text = handed_back_text(pages[0])
    assert "Score:" in text and "### BEGIN HIDDEN TESTS" not in text


def test_clean_grades_keeps_submissions_and_gradebook(ran):
    course = ran["course"]
    assert not any((course / name).exists() for name in ("autograded", "feedback", "reports"))
    assert (course / "submitted" / ran["student"] / ran["lesson"] / f"{ran['lesson']}.ipynb").is_file()
    assert (course / "autograder" / "gradebook.db").is_file()
