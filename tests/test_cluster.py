"""A class graded on a local Dask cluster, its gradebook in a real PostgreSQL server:
scores, feedback, idempotent regrading, and timed lessons alone on their worker."""
import contextlib
import csv
import io
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest
from distributed import Client, WorkerPlugin
from postgres import running
import toy_course

from gclab.grader import classroom, cluster, gradebook, grading
from gclab.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
RIGHT, WRONG = "def double(x):\n    return 2 * x", "def double(x):\n    return x + 2"
ANSWERS = {"alice": {"toy": RIGHT, "clock": RIGHT},        # lesson "clock" is timed
           "bob": {"toy": WRONG, "clock": WRONG},
           "carol": {"toy": RIGHT, "clock": WRONG}}


def _lesson(answer, timed=False):
    return toy_course.lesson(answer, [("test_double", "from gclab import checks\nchecks.observe('double(2)', double(2))\n"
                                           "assert double(2) == 4\n### BEGIN HIDDEN TESTS\n"
                                           "checks.observe('double(5)', double(5))\nassert double(5) == 10\n"
                                           "### END HIDDEN TESTS", 2)], timed=timed)


class Spans(WorkerPlugin):
    """When each task held its worker's slots, as the worker saw it: (start, end) by key."""
    name = "gclab-test-spans"

    def setup(self, worker):
        self.spans = {}

    def transition(self, key, start, finish, **kwargs):
        if finish == "executing":
            self.spans[key] = (time.time(), None)
        elif start == "executing":
            self.spans[key] = (self.spans[key][0], time.time())


@pytest.fixture(scope="module")
def postgres():
    with running() as server:
        yield server


@pytest.fixture(scope="module")
def graded(tmp_path_factory, postgres):
    """The class graded on a cluster of two workers of two slots, then again by `gclab grade
    --scheduler local --jobs 2`, into one PostgreSQL gradebook."""
    tmp = tmp_path_factory.mktemp("class")
    course, out, submitted = tmp / "course", tmp / "out", tmp / "submitted"
    toy_course.make_course(course, {name: _lesson(f"### BEGIN SOLUTION\n{RIGHT}\n### END SOLUTION", timed=name == "clock")
                         for name in ("toy", "clock")})
    for student, answers in ANSWERS.items():
        for name, answer in answers.items():
            (submitted / student / name).mkdir(parents=True)
            nbformat.write(_lesson(answer), submitted / student / name / f"{name}.ipynb")
    with ThreadPoolExecutor(2) as pool:     # nbgrader generates each lesson in seconds: both at once
        list(pool.map(lambda name: grading.prepare(course, name), ("toy", "clock")))
    db_url = postgres.create_database("gradebook")
    settings = classroom.settings_for(course, out=out, db_url=db_url, memory_limit=None)
    submissions = classroom.find_submissions(submitted, course)

    with cluster.local_cluster(threads=2, workers=2) as local, Client(local) as client:
        client.register_plugin(Spans())
        results = cluster.grade_on_cluster(submissions, settings, local.scheduler_address)
        spans = client.run(lambda dask_worker: dask_worker.plugins[Spans.name].spans)
    first = {"results": results, "scores": gradebook.scores(db_url), "counts": _counts(db_url)}

    printed, told = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(told):
        assert main(["--course", str(course), "grade", "--submissions", str(submitted), "--out", str(out),
                     "--db-url", db_url, "--scheduler", "local", "--jobs", "2", "--memory-limit", "none",
                     "--json"]) == 0
    again = {"results": json.loads(printed.getvalue()), "scores": gradebook.scores(db_url), "counts": _counts(db_url),
             "told": told.getvalue()}
    return {"first": first, "again": again, "spans": spans, "submissions": submissions, "out": out}


def _counts(db_url):
    with gradebook.opened(db_url) as book:
        return {a.name: (len(a.submissions), sum(len(s.notebooks) for s in a.submissions)) for a in book.assignments}


def test_gradebook_holds_what_the_results_say(graded):
    results, scores = graded["first"]["results"], graded["first"]["scores"]
    assert [(r.student, r.assignment) for r in results] == [(s.student, s.assignment) for s in graded["submissions"]]
    assert scores == {(r.student, r.assignment): r.score for r in results}
    for r in results:
        right = ANSWERS[r.student][r.assignment] == RIGHT
        assert (r.score == r.max_score == 2) if right else r.score < r.max_score, (r.student, r.assignment, r.tests)


def test_regrading_is_idempotent(graded):
    first, again = graded["first"], graded["again"]
    assert again["scores"] == first["scores"]
    assert [(r["student"], r["assignment"], r["score"]) for r in again["results"]] == [
        (r.student, r.assignment, r.score) for r in first["results"]]
    assert again["counts"] == first["counts"] == {"toy": (3, 3), "clock": (3, 3)}


def test_the_instructor_is_told_each_submission_as_the_cluster_grades_it(graded):
    """The second run on the cluster found every submission unchanged: each is told, with its grade kept."""
    lines = [line for line in graded["again"]["told"].splitlines() if line.startswith("[")]
    assert sorted(line.split("] ")[1] for line in lines) == sorted(
        f"{r.student} {r.assignment}: {r.score:g}/{r.max_score:g} (unchanged since it was last graded: that grade "
        "stands)" for r in graded["first"]["results"]), lines
    assert [line.split("]")[0] for line in lines] == [f"[{k}/6" for k in range(1, 7)]


def test_feedback_and_report_are_written(graded):
    out = graded["out"]
    for student, answers in ANSWERS.items():
        for lesson in answers:
            assert any((out / "feedback" / student / lesson).iterdir()), (student, lesson)
    assert (out / "reports" / "report.html").is_file()


def test_a_timed_unit_shares_its_worker_with_no_other_unit(graded):
    spans = {key: (worker, start, end) for worker, tasks in graded["spans"].items()
             for key, (start, end) in tasks.items()}
    timed = [key for key in spans if "-clock-" in key]
    assert len(spans) == 6 and len(timed) == 3, spans
    for key in timed:
        worker, start, end = spans[key]
        beside = [other for other, (w, s, e) in spans.items() if other != key and w == worker and s < end and start < e]
        assert not beside, f"{key} ran beside {beside} on {worker}"
    intervals = sorted((s, e) for _, s, e in spans.values())
    assert any(b[0] < a[1] for a, b in itertools.pairwise(intervals)), "the cluster never ran two units at once"


# -- a PostgreSQL gradebook named in the course's configuration, as the README says ----------------------
@pytest.fixture(scope="module")
def configured(tmp_path_factory, postgres):
    """A class graded by `gclab grade` (make grade-class), then by `nbgrader autograde`, with the gradebook
    PostgreSQL set by `c.CourseDirectory.db_url` in autograder/nbgrader_config.py and no --db-url anywhere."""
    course = tmp_path_factory.mktemp("configured") / "course"
    toy_course.make_course(course, {"toy": _lesson(f"### BEGIN SOLUTION\n{RIGHT}\n### END SOLUTION")})
    db_url = postgres.create_database("configured")
    with open(course / "autograder" / "nbgrader_config.py", "a") as config:
        config.write(f"\nc.CourseDirectory.db_url = {db_url!r}\n")
    for student, answers in ANSWERS.items():
        (course / "submitted" / student / "toy").mkdir(parents=True)
        nbformat.write(_lesson(answers["toy"]), course / "submitted" / student / "toy" / "toy.ipynb")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["--course", str(course), "grade", "--memory-limit", "none"]) == 0
    graded = gradebook.scores(db_url)
    nbgrader = Path(sys.executable).parent / "nbgrader"
    autograde = subprocess.run([str(nbgrader), "autograde", "toy", "--force"], cwd=course / "autograder",
                               capture_output=True, text=True)
    export = subprocess.run([str(nbgrader), "export"], cwd=course / "autograder", capture_output=True, text=True)
    return {"course": course, "db_url": db_url, "graded": graded, "autograded": gradebook.scores(db_url),
            "autograde": autograde, "export": export}


def test_a_postgresql_gradebook_set_in_the_configuration_is_the_one_graded_into(configured):
    assert configured["graded"] == {(student, "toy"): 2.0 if answers["toy"] == RIGHT else 0.0
                                    for student, answers in ANSWERS.items()}
    assert not (configured["course"] / "autograder" / "gradebook.db").exists()


def test_nbgraders_autograde_and_export_use_it_too(configured):
    assert configured["autograde"].returncode == 0, configured["autograde"].stderr[-3000:]
    assert configured["autograded"] == configured["graded"]
    assert configured["export"].returncode == 0, configured["export"].stderr[-3000:]
    rows = list(csv.DictReader((configured["course"] / "autograder" / "grades.csv").open()))
    assert {(r["student_id"], float(r["score"])) for r in rows} == {(s, v) for (s, _), v in configured["graded"].items()}


# -- a worker killed midway -------------------------------------------------------------------------------
SLOW = "import time\ntime.sleep(12)\n" + RIGHT


def _kill_the_worker_grading_zed(tmp: Path, db_url: str) -> dict:
    """Six submissions on two workers of one slot; the worker grading the slow one (zed's, last) is killed
    once zed's grading has started, after others finished."""
    course, out, submitted = tmp / "course", tmp / "out", tmp / "submitted"
    toy_course.make_course(course, {"toy": _lesson(f"### BEGIN SOLUTION\n{RIGHT}\n### END SOLUTION")})
    answers = {"amy": RIGHT, "ben": WRONG, "cat": RIGHT, "dov": WRONG, "eli": RIGHT, "zed": SLOW}
    for student, answer in answers.items():
        (submitted / student / "toy").mkdir(parents=True)
        nbformat.write(_lesson(answer), submitted / student / "toy" / "toy.ipynb")
    grading.prepare(course, "toy")
    settings = classroom.settings_for(course, out=out, db_url=db_url, memory_limit=None)
    told = io.StringIO()
    progress = classroom.Progress(len(answers), out=told)
    with cluster.local_cluster(threads=1, workers=2) as local, Client(local) as client, ThreadPoolExecutor(1) as pool:
        client.register_plugin(Spans())          # on every worker, those started after the kill too
        grading_run = pool.submit(cluster.grade_on_cluster, classroom.find_submissions(submitted, course), settings,
                                  local.scheduler_address, progress=progress)
        worker = _worker_running(client, "-zed-", grading_run)
        _told_of_one(told)
        finished_before, killed_at = _told_students(told.getvalue()), time.time()
        os.kill(client.run(os.getpid, workers=[worker])[worker], signal.SIGKILL)
        results = grading_run.result(timeout=300)
        spans = client.run(lambda dask_worker: dask_worker.plugins[Spans.name].spans)
    started_after = [str(key).split("-")[1] for tasks in spans.values() for key, (start, _) in tasks.items()
                     if start > killed_at]
    return {"results": results, "told": told.getvalue(), "finished_before": finished_before,
            "started_after": started_after, "out": out}


@pytest.fixture(scope="module")
def worker_lost(tmp_path_factory, postgres):
    return _kill_the_worker_grading_zed(tmp_path_factory.mktemp("lost"), postgres.create_database("lost"))


@pytest.fixture(scope="module")
def given_up(tmp_path_factory, postgres):
    """The same, on a cluster that gives a task up the first time a worker dies while running it (Dask's
    allowed-failures, 3 by default, set to 0)."""
    import dask
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        return _kill_the_worker_grading_zed(tmp_path_factory.mktemp("given_up"), postgres.create_database("given_up"))


def _told_students(told: str) -> list[str]:
    return [line.split("] ")[1].split()[0] for line in told.splitlines() if line.startswith("[")]


def _told_of_one(told: io.StringIO, wait_s: float = 6.0) -> None:
    """Wait until the progress told of a finished grading: the client hears of one a moment after its worker took
    the next task, and on a busy machine zed's could start first (a CI run beside a virtual machine told of none).
    Zed's answer sleeps 12 s, so it is still running after the wait."""
    deadline = time.monotonic() + wait_s
    while not _told_students(told.getvalue()) and time.monotonic() < deadline:
        time.sleep(0.05)


def _worker_running(client, name: str, grading_run) -> str:
    """The address of the worker executing the task whose key holds `name`, once it does."""
    while True:
        assert not grading_run.done(), grading_run.result()
        executing = client.run(lambda dask_worker: [str(ts.key) for ts in dask_worker.state.executing])
        for worker, keys in executing.items():
            if any(name in key for key in keys):
                return worker
        time.sleep(0.1)


def test_a_lost_worker_is_said_with_the_grading_it_lost_and_that_grading_runs_again(worker_lost):
    told = worker_lost["told"]
    assert "left the cluster unexpectedly" in told, told
    lost = next(line for line in told.splitlines() if "lost the gradings it was running" in line)
    assert "which run again on another worker" in lost and "zed toy" in lost, told
    assert "lost the finished grades it held" not in told, told
    assert "zed" in worker_lost["started_after"]
    assert sorted(_told_students(told)) == ["amy", "ben", "cat", "dov", "eli", "zed"], told
    assert next(r for r in worker_lost["results"] if r.student == "zed").score == 2.0


def test_a_lost_worker_costs_no_finished_grading(worker_lost):
    assert worker_lost["finished_before"], "the kill came after some submissions were graded"
    assert not set(worker_lost["finished_before"]) & set(worker_lost["started_after"]), worker_lost


def test_a_submission_the_cluster_gives_up_on_is_said_and_left_out(given_up):
    """zed's grading, and any the lost worker held queued, each given up: said, and out of the results and report."""
    told = given_up["told"]
    said = next(line for line in told.splitlines() if line.startswith("not graded ("))
    assert "run the same command again to grade them" in said and "zed toy: KilledWorker" in said, told
    left_out = {name for name in ("amy", "ben", "cat", "dov", "eli", "zed") if f"{name} toy: KilledWorker" in said}
    graded = sorted(r.student for r in given_up["results"])
    assert graded == sorted({"amy", "ben", "cat", "dov", "eli", "zed"} - left_out)
    scores = list(csv.DictReader((given_up["out"] / "reports" / "scores.csv").open()))
    assert sorted(row["student"] for row in scores) == graded
