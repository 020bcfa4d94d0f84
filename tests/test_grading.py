"""`gclab grade` on hostile or broken submissions, with a tiny course of its own."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from gclab import grading

ROOT = Path(__file__).resolve().parent.parent


def _cell(source, grade_id=None, points=None, solution=False):
    cell = nbformat.v4.new_code_cell(source)
    if grade_id:
        cell.metadata["nbgrader"] = {"grade": points is not None, "grade_id": grade_id, "locked": not solution,
                                     "schema_version": 3, "solution": solution, **({"points": points} if points else {})}
    return cell


def _lesson(answer):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        _cell("import gc\nfrom gclab import checks", "setup"),
        _cell(answer, "answer", solution=True),
        _cell("assert double(2) == 4\n### BEGIN HIDDEN TESTS\nassert double(5) == 10\n### END HIDDEN TESTS",
              "test_double", points=1),
        _cell("checks.assert_untampered()\nassert double(0) == 0", "test_zero", points=1),
    ]
    return nb


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    root = tmp_path_factory.mktemp("course")
    (root / "autograder").mkdir()
    shutil.copy(ROOT / "autograder" / "nbgrader_config.py", root / "autograder")
    (root / "solutions" / "toy").mkdir(parents=True)
    nbformat.write(_lesson("### BEGIN SOLUTION\ndef double(x):\n    return 2 * x\n### END SOLUTION"),
                   root / "solutions" / "toy" / "toy.ipynb")
    return root


def _submit(course, tmp_path, name, answer):
    path = tmp_path / f"{name}-toy.ipynb"
    nbformat.write(_lesson(answer), path)
    return path


def test_hostile_submissions_get_a_score_and_a_reason(course, tmp_path):
    subs = {
        "right": "def double(x):\n    return 2 * x",
        "loops_forever": "def double(x):\n    return 2 * x\nwhile True:\n    pass",
        "kills_its_kernel": "import os\nos._exit(1)",
        "wrong": "def double(x):\n    return x + 2",
        "allocates_without_end": "def double(x):\n    return 2 * x\nblocks = [bytearray(256 * 2**20) for _ in range(64)]",
        "warns": "import warnings\ndef double(x):\n    warnings.warn('a library warning')\n    return 2 * x",
    }
    paths = [_submit(course, tmp_path, name, src) for name, src in subs.items()]
    results = dict(zip(subs, grading.grade(paths, root=course, cell_timeout=10, memory_limit=6 * 1024**3, jobs=2)))
    assert results["right"].score == 2
    # the runaway cell is interrupted; the tests after it still run (double was defined first)
    assert results["loops_forever"].max_score == 2
    assert results["loops_forever"].score == 2
    killed = results["kills_its_kernel"]
    assert killed.score == 0 and "kernel died" in killed.reason
    assert all(t.status == "error" for t in killed.tests)
    # the allocation fails inside its own cell (MemoryError) and the tests still run
    assert results["allocates_without_end"].score == 2
    assert results["warns"].score == 2, "a Python warning on stderr must not zero a test cell"
    wrong = results["wrong"]
    assert wrong.score == 0 and wrong.tests[0].status == "failed"


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"                   # a zombie has stopped; only its exit status is left


def _stopped_in_time(pid: int, seconds: float = 5) -> bool:
    deadline = time.monotonic() + seconds
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _running(pid)


def test_a_notebook_that_times_out_as_a_whole_is_stopped_with_its_kernel(course, tmp_path):
    pid_file = tmp_path / "kernel.pid"
    path = _submit(course, tmp_path, "slow", f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                                             "time.sleep(600)")
    [result] = grading.grade([path], root=course, timeout=15)
    assert result.score == 0
    assert all(t.status == "timeout" for t in result.tests)
    assert "longer than 15 s" in result.reason
    assert _stopped_in_time(int(pid_file.read_text())), "the kernel of a stopped grading job is still running"


def test_a_job_run_as_a_subprocess_is_stopped_with_what_it_started(tmp_path, monkeypatch):
    """Without the fork server (GCLAB_GRADE_FORK=0, or no fork server on the platform) a job
    is a subprocess; a timeout stops it and the processes it started (its kernel)."""
    monkeypatch.setenv("GCLAB_GRADE_FORK", "0")
    assert grading._fork_server() is None
    pid_file = tmp_path / "child.pid"
    job = ("import subprocess, sys, time\n"
           "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
           f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
           "time.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        grading._run([sys.executable, "-c", job], tmp_path, timeout=3)
    assert _stopped_in_time(int(pid_file.read_text())), "the job's child is still running"


def test_unreadable_file_is_reported_not_crashed(course, tmp_path):
    path = tmp_path / "broken-toy.ipynb"
    path.write_text("{ not json")
    [result] = grading.grade([path], root=course)
    assert result.score == 0 and "not a readable notebook" in result.tests[0].message


@pytest.mark.parametrize("source", [
    "gc.collect = lambda *a: 0",
    "import gclab.checks as c\nc.assert_flat = print",
    "from gclab import checks\nchecks.run_flat_check = None",
    "setattr(gc, 'isenabled', lambda: False)",
    "gc.callbacks.clear()",
    "import torch\ntorch.cuda.memory_allocated = lambda *a: 0",
    "del gc.callbacks[:]",
    "%%writefile policy.py\nimport gc\ndef before_request(n):\n    gc.callbacks.clear()",
    "%xdel x\nimport gclab.serving as s\ns.ServerState.garbage = lambda self: {}",
])
def test_tampering_is_detected(source):
    assert grading.tampering(source)


@pytest.mark.parametrize("source", [
    "gc.collect()\nx = gc.get_count()",
    "import weakref\nself_ref = weakref.ref(obj)",
    "node.prev = weakref.ref(head)",
    "torch.zeros(3).add_(1)",
    "torch.backends.cudnn.benchmark = True",
    "sys.last_traceback = None",
    "del sys.last_value",
    "%%writefile policy.py\nimport gc\ndef on_startup():\n    gc.freeze()",
    "%reset -f out\n!ls\nx = 1",
    "def f(:\n",
])
def test_ordinary_code_is_not_flagged(source):
    assert grading.tampering(source) == []


def test_submission_is_matched_to_its_lesson(course, tmp_path):
    path = _submit(course, tmp_path, "alice", "")
    assert grading.assignment_of(path, course) == ("toy", "toy")
    renamed = tmp_path / "homework.ipynb"
    shutil.copy(path, renamed)
    assert grading.assignment_of(renamed, course) == ("toy", "toy")


def test_tampering_through_a_name_imported_in_another_cell_is_detected():
    setup = "from gclab import checks"
    assert grading.tampering("checks.assert_flat = lambda r: None", context=(setup,))


SETUP = "import gc, torch\nfrom gclab import checks\nfrom gclab.memory import Meter, format_bytes as fb"


@pytest.mark.parametrize("source", [
    "checks = None",
    "class Meter:\n    pass",
    "def fb(n):\n    return ''",
    "import fake_checks as checks",
    "from gclab.memory import describe_device as Meter",
    "for gc in range(3):\n    pass",
    "with open('x') as checks:\n    pass",
])
def test_rebinding_a_tool_the_locked_cells_imported_is_detected(source):
    tools = grading.imported_tools([SETUP])
    assert grading.tampering(source, tools=tools)


def test_a_line_caught_by_two_rules_is_listed_once():
    tools = grading.imported_tools([SETUP])
    line = "checks.assert_flat = lambda report: None"
    assert grading.tampering(line, context=("from gclab import checks", line), tools=tools) == [
        "checks.assert_flat = lambda report: None"]


@pytest.mark.parametrize("source", [
    "import gc\nimport torch",
    "from gclab import checks",
    "from gclab.memory import Meter, format_bytes as fb",
    "meter = Meter('cpu')\nreport = checks.run_flat_check(lambda i: i)",
])
def test_importing_or_using_the_tools_again_is_fine(source):
    tools = grading.imported_tools([SETUP])
    assert grading.tampering(source, tools=tools) == []


def test_grade_command_prints_json_per_notebook_in_order(course, tmp_path):
    import json
    right = _submit(course, tmp_path, "cli", "def double(x):\n    return 2 * x")
    wrong = _submit(course, tmp_path, "cli2", "def double(x):\n    return x")
    # each job a subprocess of its own, as where there is no fork server: grading needs neither
    done = subprocess.run([sys.executable, "-m", "gclab", "--course", str(course), "grade", str(right), str(wrong),
                           "--json", "--jobs", "2"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, GCLAB_GRADE_FORK="0"))
    assert done.returncode == 0, done.stderr
    first, second = json.loads(done.stdout)
    assert first["notebook"] == str(right) and second["notebook"] == str(wrong)
    assert first["score"] == first["max_score"] == 2
    assert [t["status"] for t in first["tests"]] == ["passed", "passed"]
    assert second["score"] == 1


def test_a_script_without_a_main_guard_grades_right(course, tmp_path):
    """multiprocessing would run such a script again in every forked job; grading must not."""
    path = _submit(course, tmp_path, "script", "def double(x):\n    return 2 * x")
    script = tmp_path / "grade_my_class.py"
    script.write_text("from pathlib import Path\nfrom gclab import grading\nprint('top level ran')\n"
                      f"[result] = grading.grade([Path({str(path)!r})], root=Path({str(course)!r}))\n"
                      "print('score', result.score)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["top level ran", "score 2.0"]


def test_grade_command_rejects_a_missing_file(tmp_path):
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "gclab", "grade", str(tmp_path / "nope.ipynb")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no such notebook" in done.stderr


@pytest.mark.parametrize("text, value", [("8G", 8 * 1024**3), ("512m", 512 * 1024**2), ("none", None),
                                         ("auto", "auto"), ("1048576", 1024**2)])
def test_memory_limit_option_is_parsed(text, value):
    from gclab.__main__ import _size_or_none
    assert _size_or_none(text) == value


def test_generated_course_is_cached_until_the_sources_change(course, tmp_path):
    course = Path(shutil.copytree(course, tmp_path / "copy"))
    first = grading.prepare(course, "toy")
    assert grading.prepare(course, "toy") == first
    source = course / "solutions" / "toy" / "toy.ipynb"
    nb = nbformat.read(source, 4)
    nb.cells.append(nbformat.v4.new_markdown_cell("one more line"))
    nbformat.write(nb, source)
    assert grading.prepare(course, "toy") != first


def test_files_the_config_ignores_are_not_released_and_do_not_change_the_cache_key(course, tmp_path):
    course = Path(shutil.copytree(course, tmp_path / "copy"))
    key = grading._source_key(course, "toy")
    (course / "solutions" / "toy" / "my_policy.py").write_text("import gc\n")   # what a lesson writes as it runs
    assert "my_policy.py" in grading.ignored_patterns(course)
    assert grading._source_key(course, "toy") == key
    released = grading.build_release(course, tmp_path / "release")
    assert not (released / "toy" / "my_policy.py").exists()
