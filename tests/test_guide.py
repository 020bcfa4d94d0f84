"""README's instructor guide, run as written in a scratch copy of the course: the roster imported,
release, a student fetches and submits, collect, grade the class, the student submits again,
collect --update, grade again, export, hand back feedback."""
import csv
import json
import os
import re
import shlex
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


NBGRADER = ROOT / ".venv" / "bin" / "nbgrader"
NAMES = ("Ada", "Lovelace")


def student_submits(lesson: str, exchange: Path, home: Path, answer: Path) -> str:
    """Shell commands: a student (this machine's user, as nbgrader names them) fetches the
    lesson, replaces it with `answer`, and submits."""
    (home / ".jupyter").mkdir(parents=True)
    (home / ".jupyter" / "nbgrader_config.py").write_text(f"c.Exchange.root = {str(exchange)!r}\n")
    return (f"(cd {home} && {_as_student(home)} {NBGRADER} fetch_assignment {lesson} --course gc-gpu-memory)"
            f" && {student_submits_again(lesson, home, answer)}")


def student_submits_again(lesson: str, home: Path, answer: Path) -> str:
    """Shell commands: the student replaces their copy of the lesson with `answer` and submits (again)."""
    return (f"(cd {home} && cp {answer} {lesson}/{lesson}.ipynb && sleep 1"
            f" && {_as_student(home)} {NBGRADER} submit {lesson} --course gc-gpu-memory)")


def _as_student(home: Path) -> str:
    return f"JUPYTER_CONFIG_DIR={home / '.jupyter'}"


def write_roster(course: Path, student: str) -> None:
    """The instructor's autograder/students.csv, in nbgrader's columns, as the README shows it."""
    (course / "autograder" / "students.csv").write_text(
        f"id,first_name,last_name,email\n{student},{NAMES[0]},{NAMES[1]},{student}@example.org\n")


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("guide") / "course"
    shutil.copytree(ROOT, scratch, ignore=COPY_IGNORE)
    (scratch / ".venv").symlink_to(ROOT / ".venv")
    if (ROOT / "autograder" / "work" / "cache").is_dir():     # generated releases, keyed by their sources
        shutil.copytree(ROOT / "autograder" / "work" / "cache", scratch / "autograder" / "work" / "cache")
    lesson = "03_node_leak"
    from nbgrader.utils import get_username
    write_roster(scratch, get_username())
    home = scratch.parent / "student"
    lines = []
    for command in guide_commands():
        if "collect --update" in command:     # first the untouched release, now the solution
            lines.append(student_submits_again(lesson, home, ROOT / "solutions" / lesson / f"{lesson}.ipynb"))
        # the stamp of the shared .venv: `make` installs nothing in the copy
        lines.append(command.replace("make ", "make -o .venv/.installed ", 1) if command.startswith("make ") else command)
        if "release_assignment" in command:
            lines.append(student_submits(lesson, scratch / "exchange", home, ROOT / "notebooks" / lesson / f"{lesson}.ipynb"))
        if "clean-grades" in command:
            lines.insert(-1, f"{ROOT / '.venv' / 'bin' / 'python'} -c {shlex.quote(_FORMGRADER_LISTS)} {lesson} > formgrader.json")
    script = "set -euo pipefail\n" + "\n".join(lines) + "\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "JUPYTER"))}
    done = subprocess.run(["bash", "-c", script], cwd=scratch, capture_output=True, text=True, env=env, timeout=900)
    return {"done": done, "course": scratch, "lesson": lesson, "student": get_username()}


# What the Formgrader's "Manage Submissions" page lists, read through nbgrader's API with the course's config.
_FORMGRADER_LISTS = """
import json, sys
from nbgrader.apps import NbGraderAPI
from traitlets.config.loader import PyFileConfigLoader
config = PyFileConfigLoader("nbgrader_config.py", path="autograder").load_config()
print(json.dumps(NbGraderAPI(config=config).get_submissions(sys.argv[1]), default=str))
"""


def test_every_command_of_the_guide_runs(ran):
    assert ran["done"].returncode == 0, ran["done"].stdout[-3000:] + ran["done"].stderr[-3000:]


def test_the_roster_gives_the_formgrader_the_students_names(ran):
    listed = json.loads((ran["course"] / "formgrader.json").read_text())
    [row] = [r for r in listed if r["student"] == ran["student"]]
    assert (row["first_name"], row["last_name"]) == NAMES and row["autograded"], row


def test_a_resubmission_collected_with_update_is_graded_again(ran):
    told = ran["done"].stderr
    first, again = [line for line in told.splitlines() if line.startswith("[1/1] ")]
    assert first.endswith(f"{ran['student']} {ran['lesson']}: 0/6"), told[-3000:]
    assert f"{ran['student']} {ran['lesson']}: 6/6" in again and "unchanged" not in again, told[-3000:]


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
