"""Grading a class as an instructor does: nbgrader's layout in, gradebook, feedback and a
report out, and nothing of a hidden test handed back."""
import contextlib
import csv
import io
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from gclab.grader import classroom, feedback, gradebook, grading, report
from lesson_support import handed_back_text, leaked_lines
from toy_course import lesson, make_course

ROOT = Path(__file__).resolve().parent.parent
NBGRADER = Path(sys.executable).parent / "nbgrader"
HIDDEN_LINE = "assert checks.observe('double(5)', double(5)) or double(5) == 10, 'double(5) is not 10'"


def _lesson(answer):
    return lesson(answer, [("test_double", "from gclab import checks\nchecks.observe('double(2)', double(2))\n"
                                           "print('self-check: double(2) =', double(2))\n"
                                           "assert double(2) == 4, 'double(2) is not 4'\n"
                                           f"### BEGIN HIDDEN TESTS\n{HIDDEN_LINE}\n### END HIDDEN TESTS", 2)])


RIGHT = "def double(x):\n    return 2 * x"
ENDLESS = "while True:\n    pass\n" + RIGHT
ANSWERS = {"ada": RIGHT, "bob": "def double(x):\n    return x + 2 if x == 2 else x",
           "cy": "raise NotImplementedError()", "dan": ENDLESS}
CELL_TIMEOUT = 8            # the course's own setting (c.Execute.timeout), so that dan's loop is stopped soon


def _toy_course(folder: Path) -> Path:
    root = make_course(folder, {"toy": _lesson(f"### BEGIN SOLUTION\n{RIGHT}\n### END SOLUTION")})
    with open(root / "autograder" / "nbgrader_config.py", "a") as config:
        config.write(f"\nc.Execute.timeout = {CELL_TIMEOUT}\n")
    return root


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    root = _toy_course(tmp_path_factory.mktemp("course"))
    for student, answer in ANSWERS.items():
        (root / "submitted" / student / "toy").mkdir(parents=True)
        nbformat.write(_lesson(answer), root / "submitted" / student / "toy" / "toy.ipynb")
    _stray_files(root / "submitted")
    return root


def _stray_files(submitted: Path) -> None:
    """What students leave in their folders: an empty Untitled.ipynb and an untouched backup beside
    the lesson's notebook (dee), or only the browser's second download of it (eve)."""
    dee, eve = submitted / "dee" / "toy", submitted / "eve" / "toy"
    for folder in (dee, eve):
        folder.mkdir(parents=True)
    nbformat.write(_lesson(ANSWERS["ada"]), dee / "toy.ipynb")
    (dee / "Untitled.ipynb").write_text("")
    nbformat.write(_lesson(ANSWERS["cy"]), dee / "zz_backup.ipynb")
    nbformat.write(_lesson(ANSWERS["ada"]), eve / "toy (1).ipynb")


@pytest.fixture(scope="module")
def graded(course):
    from gclab.__main__ import main
    told = io.StringIO()
    with contextlib.redirect_stderr(told):
        assert main(["--course", str(course), "grade", "--jobs", "2"]) == 0
    first = gradebook.scores(gradebook.db_url(course))
    told_again = io.StringIO()
    with contextlib.redirect_stderr(told_again):
        assert main(["--course", str(course), "grade"]) == 0
    return {"first": first, "second": gradebook.scores(gradebook.db_url(course)), "told": told.getvalue(),
            "told_again": told_again.getvalue()}


def test_every_submission_is_graded_into_the_gradebook(graded):
    assert graded["second"] == {("ada", "toy"): 2.0, ("bob", "toy"): 0.0, ("cy", "toy"): 0.0, ("dan", "toy"): 0.0,
                                ("dee", "toy"): 2.0, ("eve", "toy"): 2.0}


def test_stray_notebooks_are_skipped_and_a_lone_renamed_one_is_graded_as_the_lessons(course):
    told = []
    found = classroom.find_submissions(course / "submitted", course, warn=told.append)
    assert [(s.student, s.path.name, s.notebook) for s in found if s.student in ("dee", "eve")] == [
        ("dee", "toy.ipynb", ""), ("eve", "toy (1).ipynb", "toy")]
    assert any("skipped" in line and "Untitled.ipynb" in line and "in the same folder" in line for line in told), told
    assert any("skipped" in line and "zz_backup.ipynb" in line for line in told), told
    assert any("graded" in line and "toy (1).ipynb" in line and "toy.ipynb" in line for line in told), told


def test_submissions_placed_by_hand_are_named_with_what_nbgrader_cannot_do_for_them(tmp_path):
    root = _toy_course(tmp_path)
    for student in ("ada", "bob"):
        (root / "submitted" / student / "toy").mkdir(parents=True)
        nbformat.write(_lesson(RIGHT), root / "submitted" / student / "toy" / "toy.ipynb")
    (root / "submitted" / "ada" / "toy" / "timestamp.txt").write_text("2026-11-29 14:05:00.000000 UTC")
    told = []
    found = classroom.find_submissions(root / "submitted", root, warn=told.append)
    assert [s.student for s in found] == ["ada", "bob"]
    [line] = told
    assert line.startswith("placed by hand, not by nbgrader collect (no timestamp.txt beside them): bob toy."), line
    assert "no time of submission" in line and "--CourseDirectory.student_id_exclude=bob" in line, line


def test_the_instructor_is_told_each_submission_as_it_is_graded(graded):
    lines = [line for line in graded["told"].splitlines() if line.startswith("[")]
    assert sorted(line.split("] ")[1] for line in lines) == [
        "ada toy: 2/2", "bob toy: 0/2", "cy toy: 0/2", "dan toy: 0/2", "dee toy: 2/2", "eve toy: 2/2"], graded["told"]
    assert [line.split("]")[0] for line in lines] == [f"[{k}/6" for k in range(1, 7)]


def test_an_answer_cell_that_never_ends_is_said_to_have_been_stopped(course, graded):
    text = (course / "feedback" / "dan" / "toy" / "toy.md").read_text()
    assert f"your answer cell answer ran past {CELL_TIMEOUT} seconds and was stopped" in text, text
    causes = {row["cause"]: row["students"] for row in csv.DictReader((course / "reports" / "causes.csv").open())}
    assert causes[report.ANSWER_STOPPED] == "dan", causes


def test_an_interrupted_class_says_what_was_kept_and_sets_the_last_report_aside(course, graded, tmp_path,
                                                                                 monkeypatch, capsys):
    from gclab.__main__ import main
    copy = tmp_path / "course"
    shutil.copytree(course, copy)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(classroom, "grade_submission", interrupted)
    assert main(["--course", str(copy), "grade"]) == 130
    told = capsys.readouterr().err
    assert "interrupted: the submissions graded so far are in the gradebook" in told and "Traceback" not in told
    assert report.unfinished(copy / "reports") and "Class report: not written yet" in (
        copy / "reports" / "report.html").read_text()
    assert (copy / "reports" / "previous" / "report.html").read_text() == (course / "reports" / "report.html").read_text()
    assert not (copy / "reports" / "scores.csv").exists()


def test_regrading_gives_the_same_gradebook(graded):
    assert graded["first"] == graded["second"]


def test_a_regrade_grades_again_only_what_changed(graded):
    """The second run found every submission and its lesson as they were: no submission was graded again."""
    lines = [line for line in graded["told_again"].splitlines() if line.startswith("[")]
    assert len(lines) == 6 and all(line.endswith("(unchanged since it was last graded: that grade stands)")
                                   for line in lines), graded["told_again"]


def test_nbgrader_export_sees_the_scores(course, graded):
    done = subprocess.run([str(NBGRADER), "export"], cwd=course / "autograder", capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows = (course / "autograder" / "grades.csv").read_text().splitlines()
    assert any(row.startswith("toy,") and ",ada," in row and ",2.0," in row for row in rows), rows


def test_feedback_gives_the_score_the_message_and_what_the_self_check_printed(course, graded):
    text = (course / "feedback" / "bob" / "toy" / "toy.md").read_text()
    assert "**Score: 0 / 2**" in text
    assert "test_double: 0 / 2 (failed)" in text and "double(5) is not 10" in text
    assert "self-check: double(2) = 4" in text


def test_the_graded_notebook_shows_each_test_result(course, graded):
    nb = nbformat.read(course / "autograded" / "bob" / "toy" / "toy.ipynb", 4)
    test = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "test_double")
    assert "[failed] test_double: 0 / 2" in test.outputs[0].text


def test_no_handed_back_file_holds_a_line_of_a_hidden_test(course, graded):
    release = classroom.released(course, "toy", "toy")
    assert "print('self-check: double(2) =', double(2))" in release.read_text()
    for folder in ("autograded", "feedback", "reports"):
        assert not leaked_lines(course / folder, course / "solutions" / "toy" / "toy.ipynb", release)


def test_the_leak_search_finds_a_planted_line(course, graded, tmp_path):
    shutil.copytree(course / "feedback", tmp_path / "feedback")
    (tmp_path / "feedback" / "ada" / "toy" / "toy.md").write_text(f"oops: {HIDDEN_LINE}\n")
    release = classroom.released(course, "toy", "toy")
    assert leaked_lines(tmp_path / "feedback", course / "solutions" / "toy" / "toy.ipynb", release) == [
        ("ada/toy/toy.md", HIDDEN_LINE)]


NAMED_AS_THE_LESSON = ("ada", "bob", "cy", "dan", "dee")      # eve's notebook is "toy (1).ipynb"


def _what_grade_class_wrote(course: Path) -> dict:
    return {student: {"notebook": nbformat.read(course / "autograded" / student / "toy" / "toy.ipynb", 4),
                      "page": (course / "feedback" / student / "toy" / "toy.html").read_text(),
                      "markdown": (course / "feedback" / student / "toy" / "toy.md").read_text()}
            for student in NAMED_AS_THE_LESSON}


@pytest.fixture(scope="module")
def autograded_by_nbgrader(course, graded):
    """The same submissions graded again by nbgrader's own `nbgrader autograde` (run from autograder/, as the
    README says), after `make grade-class` graded them."""
    before = {"scores": gradebook.scores(gradebook.db_url(course)), "written": _what_grade_class_wrote(course)}
    done = subprocess.run([str(NBGRADER), "autograde", "toy", "--force"], cwd=course / "autograder",
                          capture_output=True, text=True)
    return {"before": before, "done": done, "scores": gradebook.scores(gradebook.db_url(course)),
            "written": _what_grade_class_wrote(course)}


def test_nbgraders_autograde_grades_with_the_course_as_grade_class_does(autograded_by_nbgrader):
    after, before = autograded_by_nbgrader, autograded_by_nbgrader["before"]
    for student in NAMED_AS_THE_LESSON:
        assert after["scores"][(student, "toy")] == before["scores"][(student, "toy")], student
        assert after["written"][student] == before["written"][student], student
    log = after["done"].stderr
    assert "bob toy: 0 / 2, graded by the course's grader" in log and "dan toy: 0 / 2" in log, log


def test_nbgraders_autograde_skips_a_notebook_not_named_as_the_lessons(autograded_by_nbgrader):
    """nbgrader's own rule, which its converter applies before any step of the course's: eve's "toy (1).ipynb"
    is not graded (make grade-class grades a lone renamed notebook as the lesson's)."""
    assert "Skipping unknown notebook" in autograded_by_nbgrader["done"].stderr
    assert "There was an error processing assignment 'toy' for student 'eve'" in autograded_by_nbgrader["done"].stderr
    assert autograded_by_nbgrader["scores"][("eve", "toy")] == 2.0


def test_the_formgraders_autograde_button_grades_with_the_course(course, autograded_by_nbgrader):
    """The button calls NbGraderAPI.autograde (force=True) in the Formgrader's own process."""
    from nbgrader.apps import NbGraderAPI
    from traitlets.config.loader import PyFileConfigLoader
    config = PyFileConfigLoader("nbgrader_config.py", path=str(course / "autograder")).load_config()
    api = NbGraderAPI(config=config)
    done = api.autograde("toy", "ada")
    assert done["success"], done.get("error")
    shown = api.get_submission("toy", "ada")
    assert shown["autograded"] and shown["score"] == shown["max_score"] == 2.0, shown
    assert (course / "autograded" / "ada" / "toy" / "toy.ipynb").is_file()
    assert "ada toy: 2 / 2, graded by the course's grader" in done["log"]


def test_nbgraders_generate_feedback_writes_the_courses_own_pages(course, autograded_by_nbgrader):
    done = subprocess.run([str(NBGRADER), "generate_feedback", "toy", "--force"], cwd=course / "autograder",
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    written = _what_grade_class_wrote(course)
    for student in NAMED_AS_THE_LESSON:
        for kind in ("page", "markdown"):
            assert written[student][kind] == autograded_by_nbgrader["written"][student][kind], (student, kind)
    assert not list((course / "feedback").rglob("*.json")), "nothing but the pages goes into feedback/"


def test_the_class_report_is_written(course, graded):
    assert (course / "reports" / "report.html").is_file()
    assert "bob" in (course / "reports" / "causes.csv").read_text()


def test_student_data_folders_are_ignored_by_git():
    names = ["submitted/a/b/c.ipynb", "autograded/x", "feedback/x", "reports/x", "exchange/x", "autograder/gradebook.db"]
    done = subprocess.run(["git", "check-ignore", *names], cwd=ROOT, capture_output=True, text=True)
    assert done.stdout.split() == names


def test_feedback_escapes_what_it_shows():
    result = grading.NotebookResult("x.ipynb", 0, 1, [grading.TestResult("t", 0, 1, "failed", "<script>", "<b>")],
                                    "toy", student="<i>", lesson_notebook="toy")
    page = feedback.page(result, nbformat.v4.new_notebook())
    assert "<script>" not in page and "&lt;script&gt;" in page and "<i>" not in page


def test_a_grade_is_given_for_the_submissions_and_the_lessons_content(tmp_path):
    root = _toy_course(tmp_path / "course")
    _submit(root, "ada", RIGHT)
    [submission] = classroom.find_submissions(root / "submitted", root)
    settings = classroom.settings_for(root)
    first = classroom.grading_key(submission, settings)
    assert classroom.grading_key(submission, settings) == first
    source = root / "solutions" / "toy" / "toy.ipynb"
    lesson_changed = nbformat.read(source, 4)
    lesson_changed.cells.append(nbformat.v4.new_markdown_cell("One more word."))
    nbformat.write(lesson_changed, source)
    assert classroom.grading_key(submission, settings) != first
    after_lesson = classroom.grading_key(submission, settings)
    _submit(root, "ada", RIGHT + "\n# resubmitted")
    assert classroom.grading_key(submission, settings) not in (first, after_lesson)


def test_a_kept_grade_comes_back_as_it_was_given(tmp_path):
    test = grading.TestResult("t", 1, 2, "failed", "leak", "printed", measured={"cpu_s": 0.5, "calls": [0.1, 0.2]})
    result = grading.NotebookResult("x.ipynb", 1, 2, [test], "toy", student="ada", lesson_notebook="toy",
                                    review=["gc.isenabled()"], disagreements=["t: refuted"])
    classroom.keep_grade(tmp_path / "toy.json", "key", result)
    again = classroom.last_grade(tmp_path / "toy.json", "key")
    assert again == result and again.as_dict() == result.as_dict()
    assert classroom.last_grade(tmp_path / "toy.json", "another key") is None


def test_the_feedback_page_wraps_long_self_check_lines():
    printed = "self-check: " + "memory grew by 512.00 KiB at step 7; " * 20
    result = grading.NotebookResult("x.ipynb", 0, 1, [grading.TestResult("t", 0, 1, "failed", "leak", printed)],
                                    "toy", lesson_notebook="toy")
    page = feedback.page(result, nbformat.v4.new_notebook())
    style = page.split("<style>")[1].split("</style>")[0]
    assert "pre{" in style and "white-space:pre-wrap" in style.split("pre{")[1].split("}")[0]
    assert printed.rstrip() in page


def test_the_graded_notebook_keeps_every_copy_of_an_answer_cell():
    """A copied answer cell keeps its grade_id and every copy is graded: the learner gets back each."""
    release = _lesson("raise NotImplementedError()")
    submitted = _lesson("def twice(x):\n    return x + x")
    copy = nbformat.v4.new_code_cell("def double(x):\n    return twice(x)", metadata=dict(submitted.cells[1].metadata))
    submitted.cells.insert(2, copy)
    result = grading.NotebookResult("toy.ipynb", 2, 2, [grading.TestResult("test_double", 2, 2, "passed")], "toy",
                                    lesson_notebook="toy")
    graded = feedback.graded_notebook(release, submitted, result)
    assert [c.source for c in graded.cells] == [release.cells[0].source, submitted.cells[1].source, copy.source,
                                                release.cells[2].source]
    assert "[passed] test_double: 2 / 2" in graded.cells[3].outputs[0].text


def test_nbgraders_own_feedback_keeps_no_hidden_line(course, graded, tmp_path):
    """As nbgrader's own autograde (not the course's) leaves a notebook: hidden tests in the test cell and a
    traceback quoting them.  generate_feedback, run from autograder/, hides both.  (Last: it overwrites bob's.)"""
    nb = nbformat.read(course / "solutions" / "toy" / "toy.ipynb", 4)
    test = nb.cells[2]
    test.outputs = [nbformat.v4.new_output("error", ename="AssertionError", evalue="double(5) is not 10",
                                           traceback=[f"----> 4 {HIDDEN_LINE}", "AssertionError: double(5) is not 10"])]
    nbformat.write(nb, course / "autograded" / "bob" / "toy" / "toy.ipynb")
    done = subprocess.run([str(NBGRADER), "generate_feedback", "toy", "--force"], cwd=course / "autograder",
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    page = handed_back_text(course / "feedback" / "bob" / "toy" / "toy.html")
    assert "double(5) is not 10" in page and HIDDEN_LINE not in page


# -- a regrade after a resubmission, with scores set by hand in the Formgrader ---------------------------
WRONG = ANSWERS["bob"]


def _submit(root: Path, student: str, answer: str) -> None:
    (root / "submitted" / student / "toy").mkdir(parents=True, exist_ok=True)
    nbformat.write(_lesson(answer), root / "submitted" / student / "toy" / "toy.ipynb")


def _set_by_hand(db_url: str, student: str, score: float) -> None:
    """What the Formgrader does when an instructor types a score into a test cell."""
    with gradebook.opened(db_url) as book:
        book.find_grade("test_double", "toy", "toy", student).manual_score = score
        book.db.commit()


def _grade(root: Path, *options) -> str:
    from gclab.__main__ import main
    told = io.StringIO()
    with contextlib.redirect_stderr(told), contextlib.redirect_stdout(io.StringIO()):
        assert main(["--course", str(root), "grade", *options]) == 0
    return told.getvalue()


@pytest.fixture(scope="module")
def resubmitted(tmp_path_factory):
    """ada and bob graded; the instructor sets 1 of 2 by hand on each; bob resubmits a right answer; the
    class is graded again."""
    root = _toy_course(tmp_path_factory.mktemp("resubmitted"))
    _submit(root, "ada", RIGHT)
    _submit(root, "bob", WRONG)
    _grade(root)
    db_url = gradebook.db_url(root)
    for student in ("ada", "bob"):
        _set_by_hand(db_url, student, 1.0)
    _submit(root, "bob", RIGHT)
    told = _grade(root)
    return {"root": root, "told": told, "scores": gradebook.scores(db_url)}


def _told_lines(told: str) -> dict:
    return {line.split("] ")[1].split(" toy")[0]: line for line in told.splitlines() if line.startswith("[")}


def test_a_resubmission_is_the_only_submission_graded_again(resubmitted):
    lines = _told_lines(resubmitted["told"])
    assert "unchanged since it was last graded" in lines["ada"], resubmitted["told"]
    assert lines["bob"].endswith("bob toy: 2/2"), resubmitted["told"]


def test_a_score_set_by_hand_stands_where_the_automatic_score_is_the_same(resubmitted):
    root = resubmitted["root"]
    assert resubmitted["scores"][("ada", "toy")] == 1.0
    assert "by hand: test_double: 1 / 2 set by hand stands over the automatic 2" in resubmitted["told"]
    page = (root / "feedback" / "ada" / "toy" / "toy.md").read_text()
    assert "**Score: 1 / 2**" in page and "scored by your instructor: 1 / 2; the automatic score was 2" in page
    done = subprocess.run([str(NBGRADER), "export"], cwd=root / "autograder", capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    exported = {row["student_id"]: float(row["score"])
                for row in csv.DictReader((root / "autograder" / "grades.csv").open())}
    assert exported == {"ada": 1.0, "bob": 2.0}


def test_a_score_set_by_hand_is_cleared_and_said_when_a_regrade_changes_the_automatic_score(resubmitted):
    root = resubmitted["root"]
    assert resubmitted["scores"][("bob", "toy")] == 2.0
    said = ("by hand: test_double: the score set by hand (1 / 2) was cleared, since the automatic score under it "
            "changed from 0 to 2")
    assert said in resubmitted["told"], resubmitted["told"]
    assert "**Score: 2 / 2**" in (root / "feedback" / "bob" / "toy" / "toy.md").read_text()
    page = (root / "reports" / "report.html").read_text()
    assert "<h2>Scores set by hand</h2>" in page and "was cleared" in page and "stands over" in page
    review = list(csv.DictReader((root / "reports" / "review.csv").open()))
    assert {row["student"] for row in review if row["line"].startswith("by hand: ")} == {"ada", "bob"}


def test_nbgraders_generate_feedback_shows_a_score_set_by_hand_after_grading(resubmitted):
    """The nbgrader way: autograde, then a score by hand in the Formgrader, then Generate Feedback."""
    root = resubmitted["root"]
    _set_by_hand(gradebook.db_url(root), "bob", 0.5)
    done = subprocess.run([str(NBGRADER), "generate_feedback", "toy", "--force"], cwd=root / "autograder",
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    page = (root / "feedback" / "bob" / "toy" / "toy.md").read_text()
    assert "**Score: 0.5 / 2**" in page and "scored by your instructor: 0.5 / 2" in page
    assert "scored by your instructor: 0.5 / 2" in handed_back_text(root / "feedback" / "bob" / "toy" / "toy.html")


def test_force_grades_every_submission_again(resubmitted):
    lines = _told_lines(_grade(resubmitted["root"], "--force"))
    assert len(lines) == 2 and not any("unchanged" in line for line in lines.values()), lines


# -- a grading run stopped before its end ------------------------------------------------------------------
SLOW = "import time\ntime.sleep(60)\n" + RIGHT       # stopped at the course's cell timeout


def _start_grading(root: Path, scratch: Path) -> subprocess.Popen:
    """`gclab grade` on the class in a process of its own, its temporary folders under `scratch`."""
    env = dict(os.environ, TMPDIR=str(scratch))
    return subprocess.Popen([sys.executable, "-m", "gclab", "--course", str(root), "grade"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _when_grading(scratch: Path, process: subprocess.Popen) -> None:
    """Wait until a submission is being graded: its grading folder (named as the lesson's) exists."""
    while not list(scratch.glob("*/*/toy")):
        assert process.poll() is None, process.communicate()
        time.sleep(0.2)


def _grading_folders(scratch: Path) -> list[Path]:
    """The temporary folders of gradings (not torch's own caches, which any run of torch keeps there)."""
    return sorted(path for path in scratch.iterdir() if path.name.startswith("tmp"))


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A class graded once; then ada resubmits an answer that sleeps, and the run grading it is stopped
    with SIGTERM, a second with SIGKILL; then a run is left to finish."""
    root = _toy_course(tmp_path_factory.mktemp("stopped"))
    scratch = tmp_path_factory.mktemp("scratch")
    _submit(root, "ada", RIGHT)
    _grade(root)
    finished = (root / "reports" / "report.html").read_text()
    _submit(root, "ada", SLOW)
    runs = {}
    for signal_number in (signal.SIGTERM, signal.SIGKILL):
        process = _start_grading(root, scratch)
        _when_grading(scratch, process)
        process.send_signal(signal_number)
        out, err = process.communicate(timeout=60)
        runs[signal_number] = {"code": process.returncode, "err": err, "left": _grading_folders(scratch),
                               "page": (root / "reports" / "report.html").read_text()}
    process = _start_grading(root, scratch)
    process.communicate(timeout=300)
    return {"root": root, "finished": finished, "runs": runs, "left_after": _grading_folders(scratch),
            "scores": gradebook.scores(gradebook.db_url(root))}


def test_a_run_stopped_by_sigterm_says_so_and_leaves_no_temporary_folder(stopped):
    run = stopped["runs"][signal.SIGTERM]
    assert run["code"] == 128 + signal.SIGTERM, run["err"]
    assert "stopped by SIGTERM: the gradings under way were ended and not recorded" in run["err"]
    assert run["left"] == []


def test_a_stopped_run_leaves_no_report_that_looks_current(stopped):
    for run in stopped["runs"].values():
        assert "Class report: not written yet" in run["page"] and "previous/report.html" in run["page"]
    assert (stopped["root"] / "reports" / "report.html").read_text() != stopped["finished"]


def test_a_killed_runs_temporary_folder_is_removed_by_the_next_run(stopped):
    assert stopped["runs"][signal.SIGKILL]["left"], "SIGKILL leaves the folder of the grading under way"
    assert stopped["left_after"] == []
    assert not list((stopped["root"] / classroom.RUNS).iterdir())
    assert not report.unfinished(stopped["root"] / "reports")
    assert not (stopped["root"] / "reports" / "previous").exists()


def test_a_stopped_grading_is_not_recorded_and_the_next_run_grades_it(stopped):
    page = (stopped["root"] / "feedback" / "ada" / "toy" / "toy.md").read_text()
    assert f"ran past {CELL_TIMEOUT} seconds and was stopped" in page
    assert stopped["scores"] == {("ada", "toy"): 0.0}
