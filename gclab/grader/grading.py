"""Release and grade the course's notebooks with nbgrader.

`release` regenerates the student notebooks from the nbgrader source (`solutions/`);
`grade` scores submitted notebooks with nbgrader's autograder (a fresh kernel per
notebook, hidden tests restored) and always returns a score and a reason per test,
also when a submission loops forever, kills its kernel, edits locked cells or patches
the grader's tools.
"""
from __future__ import annotations

import ast
import fnmatch
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import _jsonschema  # noqa: F401  (before nbformat: see there)
import nbformat

from . import measured, review
from .verdict import apply_limits

CONFIG = Path("autograder") / "nbgrader_config.py"


# -- the course and its lessons -----------------------------------------------------
def find_course_root(*starts) -> Path:
    """The nearest folder, from each start upwards, that holds autograder/nbgrader_config.py and solutions/."""
    for start in [*starts, Path.cwd()]:
        path = Path(start).resolve()
        for folder in [path, *path.parents]:
            if (folder / CONFIG).is_file() and (folder / "solutions").is_dir():
                return folder
    raise SystemExit("cannot find the course: no folder with autograder/nbgrader_config.py and "
                     "solutions/ above the given notebooks or the current folder (use --course DIR)")


def lessons(root: Path) -> list[str]:
    """Assignment names: the folders of solutions/ that hold a notebook, in order."""
    return sorted(p.name for p in (root / "solutions").iterdir()
                  if p.is_dir() and any(p.glob("*.ipynb")))


def _run(cmd, cwd, timeout=None) -> subprocess.CompletedProcess:
    """Run a command; on timeout kill it and every process it started, then raise TimeoutExpired."""
    # a session of its own, so that a timeout can stop nbgrader and the kernel it started
    with subprocess.Popen(cmd, cwd=cwd, env=dict(os.environ, **_job_environment()), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_session(proc.pid)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _job_environment() -> dict:
    """What a grading job's environment changes: this Python's bin folder first on PATH
    (nbgrader and the kernel), Python warnings off."""
    return {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
            "PYTHONWARNINGS": "ignore"}


def _kill_session(pid: int) -> None:
    """Kill a job and every process it started: its supervisor first ends the processes that
    left the job's session (see _nbgrader_job.supervised), then the session goes."""
    import time
    try:
        os.kill(pid, signal.SIGTERM)
        for _ in range(50):
            time.sleep(0.05)
            os.kill(pid, 0)
            if _is_zombie(pid):
                break
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _generate_assignment(course: Path, assignment: str, timeout=None) -> subprocess.CompletedProcess:
    """nbgrader generate_assignment in a process of its own (it runs no learner code)."""
    return _run([sys.executable, "-m", "gclab.grader._nbgrader_job", str(course), assignment], course, timeout)


def _course_config(root: Path):
    """The course's nbgrader configuration (autograder/nbgrader_config.py), as traitlets loads it."""
    from traitlets.config.loader import PyFileConfigLoader
    return PyFileConfigLoader(CONFIG.name, path=str(root / CONFIG.parent)).load_config()


def ignored_patterns(root: Path) -> list[str]:
    """The file patterns the course's nbgrader config never releases (CourseDirectory.ignore)."""
    return list(_course_config(root).CourseDirectory.get("ignore", [".ipynb_checkpoints", "__pycache__"]))


def _scratch_course(root: Path, assignments, workdir: Path) -> Path:
    """A throw-away nbgrader course in `workdir` with the given lessons' sources, the course's
    address (autograder/course.toml) written into their set-up cells before nbgrader locks them."""
    from . import course
    (workdir / "autograder").mkdir(parents=True, exist_ok=True)
    shutil.copy(root / CONFIG, workdir / CONFIG)
    source = course.read_source(root)
    for name in assignments:
        shutil.copytree(root / "solutions" / name, workdir / "solutions" / name,
                        ignore=shutil.ignore_patterns(*ignored_patterns(root)))
        for path in (workdir / "solutions" / name).glob("*.ipynb"):
            _strip_hidden_tests(path)
            course.write_source_into(path, source)
    return workdir


def _strip_hidden_tests(path: Path) -> None:
    """The kernel that runs a submission for the notebook handed back never sees a hidden test
    (the verdict process runs them): neither the gradebook nor the graded notebook holds one."""
    nb = nbformat.read(path, 4)
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("grade"):
            cell.source = without_hidden_tests(cell.source)
    nbformat.write(nb, path)


def build_release(root: Path, out: Path, assignments=None) -> Path:
    """Copy the student release of `assignments` (default: every lesson) into `out`."""
    root = Path(root).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name in assignments or lessons(root):
        shutil.rmtree(out / name, ignore_errors=True)
        shutil.copytree(prepare(root, name) / "notebooks" / name, out / name)
    return out


def release(root: Path, source: str | None = None) -> list[Path]:
    """Regenerate notebooks/ from solutions/ (stale lesson folders are removed), and README's
    Colab links.  With `source`, first keep it as the course's address (autograder/course.toml)."""
    from . import course
    if source is not None:
        course.write_source(root, source)
    target = root / "notebooks"
    for stale in target.glob("*/"):
        if stale.name not in lessons(root):
            shutil.rmtree(stale)
    build_release(root, target)
    course.update_readme(root)
    return sorted(target.glob("*/*.ipynb"))


# -- a submission's tampering with the grader ---------------------------------------
_GUARDED = {"gc", "gclab", "torch", "numpy", "sys", "builtins", "time", "weakref", "nbgrader", "importlib"}
_SETTINGS = ("torch.backends.", "sys.last_")   # what ordinary code sets or clears; not the grader's tools
_MUTATORS = {"append", "clear", "remove", "pop", "extend", "insert", "__setitem__", "__delitem__"}


def _root_name(node):
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


_AST_LOCK = threading.Lock()     # CPython 3.11's ast.parse is not safe in two threads at once


def _parse(source):
    for text in (source, _without_magics(source)):
        try:
            with _AST_LOCK:
                return ast.parse(text)
        except SyntaxError:
            pass
    return None


def _without_magics(source: str) -> str:
    """A cell's Python as IPython runs it: a cell magic's body (`%%writefile f.py`, `%%time`)
    is read as Python; line magics and shell escapes (`%xdel x`, `!pip ...`) become `pass`."""
    lines = source.splitlines()
    if lines and lines[0].lstrip().startswith("%%"):
        lines = lines[1:]
    return "\n".join(re.sub(r"^(\s*)[%!].*$", r"\1pass", line) for line in lines)


def imported_tools(sources) -> dict[str, str]:
    """Names that `sources` (the lesson's locked cells) import from the guarded modules,
    each with where it comes from: {"checks": "gclab.checks", "Meter": "gclab.memory.Meter"}."""
    names = {}
    for source in sources:
        names.update(_tools_imported_by(source))
    return names


@functools.lru_cache(maxsize=4096)
def _tools_imported_by(source: str) -> tuple[tuple[str, str], ...]:
    """imported_tools of one source, kept: a submission's every cell is the context of each of its cells."""
    names = []
    tree = _parse(source)
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in _GUARDED:
                    names.append((a.asname or a.name.split(".")[0], a.name if a.asname else a.name.split(".")[0]))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _GUARDED:
            names += [(a.asname or a.name, f"{node.module}.{a.name}") for a in node.names]
    return tuple(names)


def _rebindings(tree, tools: dict[str, str]):
    """Statements of `tree` that bind one of `tools`' names to something else."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            again = imported_tools([ast.unparse(node)])
            if any(name in tools and again.get(name) != tools[name]
                   for name in (a.asname or a.name.split(".")[0] for a in node.names)):
                yield node
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, (ast.Assign, ast.Delete)):
            names = [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor, ast.NamedExpr)):
            names = [n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)]
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            names = [n.id for n in ast.walk(node.optional_vars) if isinstance(n, ast.Name)]
        else:
            continue
        if any(name in tools for name in names):
            yield node


def tampering(source: str, context: tuple[str, ...] = (), tools: dict[str, str] | None = None) -> list[str]:
    """Lines of `source` that replace or mutate the tools the grader relies on.

    Flagged: assigning to an attribute of gc, torch, gclab, sys, builtins, time, weakref
    (or of anything imported from them, here or in the notebook's other cells given as
    `context`), setattr/delattr on them, mutating gc.callbacks, and binding a name that
    the lesson's locked cells imported from them (`tools`, see `imported_tools`) to
    anything else. Calling them, or importing them again, is fine.
    """
    tree = _parse(source)
    if tree is None:
        return []           # a syntax error scores itself
    guarded = _GUARDED | set(imported_tools([source, *context]))
    found = [ast.unparse(node).splitlines()[0] for node in _rebindings(tree, tools or {})]
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            if (isinstance(target, (ast.Attribute, ast.Subscript)) and _root_name(target) in guarded
                    and not ast.unparse(target).startswith(_SETTINGS)):
                found.append(ast.unparse(node).splitlines()[0])
        if isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Name) and func.id in ("setattr", "delattr")
                    and node.args and _root_name(node.args[0]) in guarded):
                found.append(ast.unparse(node))
            elif (isinstance(func, ast.Attribute) and func.attr in _MUTATORS
                  and isinstance(func.value, ast.Attribute) and func.value.attr == "callbacks"
                  and _root_name(func.value) in guarded):
                found.append(ast.unparse(node))
    return list(dict.fromkeys(found))   # a line caught by two rules is listed once


def _student_sources(nb) -> list[str]:
    """Code the student wrote or could edit: answer cells and cells nbgrader does not know."""
    return [cell.source for cell in nb.cells if cell.cell_type == "code"
            and (cell.metadata.get("nbgrader", {}).get("solution")
                 or not cell.metadata.get("nbgrader", {}).get("locked"))]


# -- results -------------------------------------------------------------------------
@dataclass
class TestResult:
    id: str
    score: float
    max_score: float
    status: str           # passed, failed, error, timeout, tampered
    message: str = ""     # what was wrong, and by how much (never a line of a hidden test)
    output: str = ""      # what the test's visible self-checks printed
    measured: dict = field(default_factory=dict)   # the grader's own figures of the test (gclab.grader.measured)
    observed: list = field(default_factory=list, repr=False)   # what the test observed, for the grader alone


@dataclass
class NotebookResult:
    notebook: str
    score: float = 0.0
    max_score: float = 0.0
    tests: list[TestResult] = field(default_factory=list)
    assignment: str = ""
    reason: str = ""      # why the whole notebook scored what it did, when not the tests' own doing
    student: str = ""
    lesson_notebook: str = ""     # the lesson's notebook name (the submission's file may be named otherwise)
    # lines of the answers that read what tells a grading run from the learner's own (gclab.grader.review): for the
    # instructor's class report, never the score or the learner's feedback
    review: list[str] = field(default_factory=list)
    measured: dict = field(default_factory=dict)    # the grader's figures of the whole run
    # tests the learner's process said passed and the grader's own figures refuted: for the instructor's review
    disagreements: list[str] = field(default_factory=list)

    def as_dict(self):
        data = asdict(self)
        for test in data["tests"]:
            test.pop("observed", None)     # what hidden tests saw: the grader's, never handed back
            calls = test["measured"].pop("calls", None)
            if calls:
                test["measured"].update(calls=len(calls), longest_call_cpu_s=max(calls))
        return data


def _grade_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"
            and c.metadata.get("nbgrader", {}).get("grade")
            and not c.metadata.get("nbgrader", {}).get("solution")]


def _score(result: NotebookResult) -> NotebookResult:
    result.score = sum(t.score for t in result.tests)
    result.max_score = sum(t.max_score for t in result.tests)
    return result


def _all_tests(source_nb, status, message) -> list[TestResult]:
    return [TestResult(c.metadata["nbgrader"]["grade_id"], 0.0,
                       float(c.metadata["nbgrader"].get("points", 0)), status, message)
            for c in _grade_cells(source_nb)]


# -- the verdict: a process the grader starts and reads ---------------------------------
def _split_hidden(source: str) -> tuple[list[str], list[str]]:
    """(visible lines, hidden lines) of a test cell, cut at its hidden-test markers as nbgrader's
    ClearHiddenTests cuts it (so the release is the same either way)."""
    parts, hidden = ([], []), False
    for line in source.splitlines():
        if "### BEGIN HIDDEN TESTS" in line:
            hidden = True
        elif "### END HIDDEN TESTS" in line:
            hidden = False
        else:
            parts[hidden].append(line)
    return parts


def without_hidden_tests(source: str) -> str:
    """A test cell as a learner may see it: its hidden part removed."""
    return "\n".join(_split_hidden(source)[0])


def hidden_tests(source: str) -> str:
    """The hidden parts of a test cell: what `without_hidden_tests` removes."""
    return "\n".join(_split_hidden(source)[1])


def _meta(cell) -> dict:
    return cell.metadata.get("nbgrader", {}) if cell.cell_type == "code" else {}


def answer_cells(submitted) -> dict[str, list]:
    """The learner's answer cells, by grade_id (a cell whose metadata was stripped is not one):
    every copy of one, in order (a cell copied in JupyterLab keeps its metadata)."""
    answers = {}
    for c in submitted.cells:
        if _meta(c).get("solution") and _meta(c).get("grade_id"):
            answers.setdefault(_meta(c)["grade_id"], []).append(c)
    return answers


def _answers_of(submitted) -> dict[str, list[str]]:
    return {grade_id: [c.source for c in cells] for grade_id, cells in answer_cells(submitted).items()}


def top_level_names(source: str) -> set[str]:
    """Names a cell binds at its top level (definitions, imports, assignments)."""
    tree = _parse(source)
    names = set()
    for node in tree.body if tree is not None else ():
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def verdict_job(source_nb, submitted_nb, workdir: Path, hidden=(), notebook: str = "") -> dict:
    """What the verdict process runs: the source's set-up and given cells and its test cells
    (hidden parts included), with the submission's answer cells in their places.

    `tools`: the names the locked cells import from the grader's modules; `answer_names`: the
    names the reference answers define (a lesson may give a program the answer replaces).  Every
    other name a locked cell binds reaches the tests as that cell left it."""
    import secrets
    answers = _answers_of(submitted_nb)
    locked = [c.source for c in source_nb.cells if _meta(c).get("locked") and not _meta(c).get("grade")]
    answer_names = set().union(*(top_level_names(c.source) for c in source_nb.cells if _meta(c).get("solution")))
    graded = set().union(answer_names, *(top_level_names(source) for source in locked))
    demo_names = set().union(*(top_level_names(c.source) for c in source_nb.cells
                               if c.cell_type == "code" and not _meta(c))) - graded
    cells, tests, missing = [], [], []
    for cell in source_nb.cells:
        meta = _meta(cell)
        if meta.get("solution"):
            grade_id = meta["grade_id"]
            if grade_id not in answers:
                missing.append(grade_id)
            cells += [{"kind": "answer", "id": grade_id, "source": source}   # every copy, as Run All runs them
                      for source in answers.get(grade_id, ["raise NotImplementedError()"])]
        elif meta.get("grade"):
            tests.append({"id": meta["grade_id"], "source": cell.source, "points": float(meta.get("points", 0))})
        elif meta.get("locked"):
            cells.append({"kind": "given", "id": meta.get("grade_id", "given"), "source": cell.source})
    return {"token": secrets.token_hex(16), "workdir": str(workdir), "notebook": notebook, "cells": cells, "tests": tests,
            "missing_answers": missing, "hidden": [str(h) for h in hidden],
            "copied_answers": {grade_id: len(copies) for grade_id, copies in answers.items() if len(copies) > 1},
            "tools": sorted(imported_tools(locked)), "answer_names": sorted(answer_names),
            "demo_names": sorted(demo_names)}


class _Started:
    """A verdict process started as a subprocess (a fresh Python)."""

    def __init__(self, job_bytes: bytes, workdir: str, channel: int, memory_limit):
        self.proc = subprocess.Popen([sys.executable, "-m", "gclab.grader.verdict", str(channel)], cwd=workdir,
                                     env=dict(os.environ, **_job_environment()), stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(channel,),
                                     start_new_session=True, preexec_fn=lambda: apply_limits(memory_limit))
        self.pid = self.proc.pid
        _write_job(self.proc.stdin, job_bytes)

    def end(self) -> None:
        _kill_session(self.pid)
        self.proc.wait()


def _write_job(pipe, job_bytes: bytes) -> None:
    """Hand the job over in a thread: a verdict that dies before reading it all must not
    block the grader."""
    import threading

    def write():
        try:
            pipe.write(job_bytes)
        except (BrokenPipeError, OSError):
            pass
        finally:
            try:
                pipe.close()
            except OSError:
                pass
    threading.Thread(target=write, daemon=True).start()


class _Forked:
    """A verdict process forked from the grader's zygote server (gclab.zygote), which has
    imported the instruments once: about 2 s saved per submission."""

    def __init__(self, zygote, job_bytes: bytes, channel: int, memory_limit):
        job_read, job_write = os.pipe()
        try:
            self.pid, pidfd = zygote.fork({"memory_limit": memory_limit}, [job_read, channel])
        finally:
            os.close(job_read)
        if pidfd is not None:
            os.close(pidfd)           # the session is what is killed (see end)
        _write_job(os.fdopen(job_write, "wb"), job_bytes)

    def end(self) -> None:
        _kill_session(self.pid)       # the zygote reaps it


_ZYGOTE: list = []
_ZYGOTE_LOCK = threading.Lock()


def _zygote():
    """The zygote server of this grader, or None when GCLAB_GRADE_FORK=0 or there is none."""
    from .. import zygote
    if os.environ.get("GCLAB_GRADE_FORK") == "0" or not zygote.available():
        return None
    with _ZYGOTE_LOCK:
        if not _ZYGOTE or not _ZYGOTE[0].alive():
            _ZYGOTE[:] = [zygote.Zygote("gclab.grader.verdict", env=dict(os.environ, **_job_environment()))]
        return _ZYGOTE[0]


def _start_verdict(job: dict, channel: int, memory_limit):
    job_bytes = json.dumps(job).encode()
    zygote = _zygote()
    if zygote is not None:
        try:
            return _Forked(zygote, job_bytes, channel, memory_limit)
        except OSError:
            pass                     # the server died: a fresh Python does the same work
    return _Started(job_bytes, job["workdir"], channel, memory_limit)


class _Channel:
    """The verdict process's JSON lines, read with deadlines; lines without the job's token
    (the learner's code writing to the channel) are counted as forged."""

    LIMIT = 1 << 20

    def __init__(self, fd: int, token: str):
        self.fd, self.token, self.buffer, self.forged, self.closed = fd, token, b"", 0, False

    def next(self, deadline: float):
        import select
        import time
        while True:
            line, sep, rest = self.buffer.partition(b"\n")
            if sep:
                self.buffer = rest
                try:
                    message = json.loads(line)
                except ValueError:
                    message = None
                if not isinstance(message, dict) or message.get("token") != self.token:
                    self.forged += 1
                    continue
                return message
            if self.closed or len(self.buffer) > self.LIMIT:
                return None
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return "timeout"
            try:
                chunk = os.read(self.fd, 65536)
            except ConnectionResetError:      # the verdict process died with bytes of ours unread
                chunk = b""
            if not chunk:
                self.closed = True
            self.buffer += chunk


def run_verdict(job: dict, cell_timeout: float = 180, memory_limit=None, timeout: float = 900,
                whole: list | None = None) -> dict:
    """Run the verdict process (again after a test that timed out or killed it, for the tests
    left) and return {test id: TestResult}; `timeout` bounds it all.  The grader's figures of each
    process's whole run are appended to `whole`."""
    import time
    results, remaining, end = {}, list(job["tests"]), time.monotonic() + timeout
    whole = [] if whole is None else whole
    while remaining:
        outcome = _run_verdict_once({**job, "tests": remaining}, cell_timeout, memory_limit, end, timeout, whole)
        results.update(outcome)
        done = [t for t in remaining if t["id"] in outcome]
        if not done:
            break
        remaining = [t for t in remaining if t["id"] not in outcome]
    return results


def _run_verdict_once(job, cell_timeout, memory_limit, end, timeout, whole: list) -> dict:
    """One verdict process: a runaway answer cell or test is interrupted (SIGINT, as nbgrader
    does) and the next one runs; one that does not stop is killed with the process."""
    import time
    import socket
    points = {t["id"]: t["points"] for t in job["tests"]}
    ours, theirs = socket.socketpair()      # lines from the verdict; a byte back once the grader has read
    read_end = ours.detach()
    try:
        proc = _start_verdict(job, theirs.fileno(), memory_limit)
    finally:
        theirs.close()
    channel = _Channel(read_end, job["token"])
    watch = measured.Watch(proc.pid)      # the verdict process leads a session of its own
    results = {}

    def result(test_id, status, message, output="", figures=None, observed=None):
        results[test_id] = TestResult(test_id, points[test_id] if status == "passed" else 0.0,
                                      points[test_id], status, message, output, figures or {}, observed or [])
    try:
        running, deadline, interrupted = None, time.monotonic() + 120 + cell_timeout, False
        stopped = []                # answer cells interrupted for running past the cell timeout
        while len(results) < len(job["tests"]):
            message = channel.next(min(deadline, end))
            if message == "timeout" and time.monotonic() >= end:
                for test in job["tests"]:
                    if test["id"] not in results:
                        result(test["id"], "timeout", f"not graded: grading took longer than {timeout:g} s and was stopped")
                break
            if message == "timeout" and running is not None and not interrupted:
                os.kill(proc.pid, signal.SIGINT)        # as nbgrader interrupts a runaway cell
                deadline, interrupted = time.monotonic() + 10, True
                stopped += [running[1]] if running[0] == "answer" else []
                continue
            if message == "timeout" or message is None:
                _report_stop(result, job, running, message == "timeout", cell_timeout)
                break
            event = message.get("event")
            figures = {}
            if event == "ready":
                watch.ready()
            elif event == "start":
                watch.start()
            elif event == "result":
                figures = watch.result(message.get("test"))
            elif event == "mark":
                watch.mark()
            elif event == "price":
                watch.price()
            elif event == "load":
                _reply(read_end, _send_load(watch, message.get("argv"), message.get("server")))
            if event in ("ready", "start", "result", "mark", "price", "done"):
                _go_on(read_end)     # the verdict waits for this byte: the readings above saw it stopped
            if event in ("answer", "start"):
                running = (event, message.get("cell") or message.get("test"))
                deadline, interrupted = time.monotonic() + cell_timeout, False
            elif event == "result" and message.get("test") in points:
                status = message["status"]
                text = _with_demo_names(_with_answer_errors(message), job.get("demo_names", ()))
                if status == "timeout":
                    text = f"the test ran past the time limit ({cell_timeout:g} s) and was interrupted"
                elif stopped and status != "passed":
                    text = _after_stopped_answers(stopped, cell_timeout, str(message.get("message", "")))
                observed = message.get("observations")
                result(message["test"], status, text, str(message.get("output", "")), figures,
                       observed if isinstance(observed, list) else [])
                running = None
        whole.append(watch.end())
    finally:
        proc.end()
        os.close(read_end)
    if channel.forged:
        for test_id in results:
            result(test_id, "tampered", "the submission wrote to the grader's result channel", results[test_id].output)
    return results


def _send_load(watch: measured.Watch, argv, server) -> list:
    """The load a verdict process asked for, sent by the grader from a process of its own (outside the
    verdict's session), reading the server's CPU time at every request sent and answered; its figures
    go with the test's.  [] (refused) unless the arguments are a load's and the server is the verdict's."""
    from .. import procfs, serving
    try:
        args = serving.main_parser().parse_args([str(a) for a in argv])
        server = int(server)
    except (SystemExit, TypeError, ValueError):
        return []
    if (args.command != "load" or not re.fullmatch(r"http://127\.0\.0\.1:\d+", args.url) or not 0 < args.count <= 20_000
            or not 0 < args.rate <= 10_000 or not 0 < args.timeout <= 300 or not 0 <= args.lull <= 5
            or args.burst < 0 or server not in procfs.session_members(watch.sid)):
        return []
    load = ["load", args.url, "--rate", str(args.rate), "--count", str(args.count), "--seed", str(args.seed),
            "--timeout", str(args.timeout), "--burst", str(args.burst), "--lull", str(args.lull),
            "--watch-cpu", str(server)] + (["--poisson"] if args.poisson else [])
    try:
        rows = serving.load_rows(load)
    except RuntimeError:
        return []
    watch.load(f"{args.count} requests at {args.rate:g}/s, seed {args.seed}, bursts of {args.burst} "
               f"{args.lull:g} s apart" + (", Poisson" if args.poisson else ""), rows)
    return rows


def _reply(channel: int, rows: list) -> None:
    data = json.dumps(rows).encode() if rows else b""
    data = len(data).to_bytes(8, "big") + data
    try:
        while data:
            data = data[os.write(channel, data):]
    except OSError:
        pass


def _go_on(channel: int) -> None:
    try:
        os.write(channel, b"\0")
    except OSError:
        pass                # the verdict process is gone: its results so far stand as read


def _report_stop(result, job, running, timed_out, cell_timeout):
    """The verdict process stopped answering: say which cell it was running, and why."""
    how = (f"ran past the time limit ({cell_timeout:g} s) and did not stop when interrupted" if timed_out
           else "ended the process that ran it (it crashed, exited, was killed or ran out of memory)")
    if running is not None and running[0] == "start":
        result(running[1], "timeout" if timed_out else "error", f"the test {how}")
        return
    if running is not None and timed_out:
        why = _answer_stopped(running[1], cell_timeout) + ": it did not stop when interrupted, so its process was ended"
    else:
        why = (f"your answer cell {running[1]}" if running else "starting the grader") + f" {how}"
    for test in job["tests"]:
        result(test["id"], "timeout" if timed_out else "error", f"not graded: {why}")


def _answer_stopped(cell: str, cell_timeout: float) -> str:
    return f"your answer cell {cell} ran past {cell_timeout:g} seconds and was stopped (does it loop forever?)"


def _after_stopped_answers(cells, cell_timeout: float, said: str) -> str:
    """A failed test's message after answer cells were stopped for running past the cell timeout: that
    first, since what the test says (a name "not defined yet") follows from it."""
    stopped = " and ".join(_answer_stopped(cell, cell_timeout) for cell in dict.fromkeys(cells))
    return f"{stopped}, so what it defines after that point was never run; then the test said: {said}"


_UNDEFINED = re.compile(r"name '(\w+)' is not defined")


def _with_demo_names(text: str, demo_names) -> str:
    """`text`, and where it says a name is not defined that one of the lesson's example cells defines, why."""
    missing = [name for name in dict.fromkeys(_UNDEFINED.findall(text)) if name in demo_names]
    if not missing:
        return text
    names = ", ".join(f"'{name}'" for name in missing)
    return (f"{text} ({names} is defined in one of the lesson's example cells, which grading does not run: only the "
            "set-up and given cells, your answers and the tests run. Define what your answer uses in your answer cell.)")


def _with_answer_errors(message: dict) -> str:
    text = message.get("message", "")
    errors = message.get("answer_errors") or {}
    if message.get("status") != "passed" and errors and "is not defined yet" not in text:
        text += " (your answer cell raised " + "; ".join(f"{k}: {v}" for k, v in errors.items())[:300] + ")"
    return text


# -- grading -------------------------------------------------------------------------
def assignment_of(path: Path, root: Path) -> tuple[str, str]:
    """(assignment, notebook name) of a submission: by file name, else by its grade cells."""
    sources = {nb.stem: nb.parent.name for nb in (root / "solutions").glob("*/*.ipynb")}
    for stem, assignment in sources.items():
        if path.stem == stem or path.stem.endswith("_" + stem) or path.stem.endswith("-" + stem):
            return assignment, stem
    try:
        ids = {c.metadata.get("nbgrader", {}).get("grade_id") for c in nbformat.read(path, 4).cells} - {None}
    except Exception:
        ids = set()
    for nb_path in (root / "solutions").glob("*/*.ipynb"):
        source_ids = {c.metadata.get("nbgrader", {}).get("grade_id")
                      for c in nbformat.read(nb_path, 4).cells} - {None}
        if ids and ids <= source_ids:
            return nb_path.parent.name, nb_path.stem
    raise SystemExit(f"{path}: not a notebook of this course (no lesson named {path.stem!r} "
                     "and its cells match no lesson)")


def default_memory_limit() -> int | None:
    """Address-space limit for a grading kernel: none on a machine with an NVIDIA GPU (CUDA
    reserves far more address space than memory), else 8 GiB or 3/4 of the RAM, the lower."""
    if os.path.exists("/dev/nvidiactl"):
        return None
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(8 * 1024**3, ram * 3 // 4)


def grade(paths, root: Path | None = None, timeout: int = 900, memory_limit: int | None | str = "auto",
          cell_timeout: int | None = None, jobs: int = 1, students=None) -> list[NotebookResult]:
    """Grade each submitted notebook (see `grade_one`), `jobs` at a time; a lesson whose
    hidden tests time things (`timed_lesson`) is graded alone, before the others; the
    results in the order of `paths`.
    `students` names the student of each notebook (default: none)."""
    paths = [Path(p) for p in paths]
    root = root or find_course_root(*[p.parent for p in paths])
    students = list(students) if students is not None else [""] * len(paths)
    assignments = [assignment_of(p, root)[0] for p in paths]
    timed = {a for a in set(assignments) if timed_lesson(root, a)}
    return schedule(list(zip(paths, students, assignments)),
                    lambda unit: grade_one(unit[0], root, student=unit[1], timeout=timeout,
                                           memory_limit=memory_limit, cell_timeout=cell_timeout),
                    jobs, alone=lambda unit: unit[2] in timed)


def schedule(units, work, jobs: int, alone=lambda unit: False) -> list:
    """[work(unit) for unit in units], in that order: the units `alone` picks first, one at
    a time, then the others `jobs` at a time (each grading job is a process of its own;
    these threads only wait for them)."""
    results = [None] * len(units)

    def run(index):
        results[index] = work(units[index])
    first = [i for i, unit in enumerate(units) if alone(unit)]
    rest = [i for i in range(len(units)) if i not in first]
    for index in first:
        run(index)
    if jobs > 1 and len(rest) > 1:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(run, rest))
    else:
        for index in rest:
            run(index)
    return results


def timed_lesson(root: Path, assignment: str) -> bool:
    """Does the lesson's notebook say its hidden tests time things (metadata gclab.timed)?
    Such a lesson is graded with no other grading job beside it."""
    return any(nbformat.read(path, 4).metadata.get("gclab", {}).get("timed", False)
               for path in (root / "solutions" / assignment).glob("*.ipynb"))


def grade_one(path, root: Path, student: str = "", timeout: int = 900, memory_limit: int | None | str = "auto",
              cell_timeout: int | None = None, lesson: tuple[str, str] | None = None) -> NotebookResult:
    """Grade one submitted notebook: the unit of work of every grading command.

    The score comes from a verdict process started for it (`gclab.grader.verdict`): the lesson's
    own set-up, given and test cells with the learner's answer cells, the grader's tools
    loaded and guarded before the learner's code runs.  The learner's code runs nowhere
    else.  `memory_limit` caps that process's address space, so that a submission that
    allocates without end gets a MemoryError (and a score) instead of taking the machine
    down; "auto" is `default_memory_limit()`, None no limit.  `timeout` bounds it all.
    `lesson`: the (assignment, notebook name) it is graded as where the caller knows it (a
    class's folders); by default `assignment_of` the file.
    """
    path = Path(path)
    if memory_limit == "auto":
        memory_limit = default_memory_limit()
    assignment, stem = lesson or assignment_of(path, root)
    result = NotebookResult(notebook=str(path), assignment=assignment, student=student, lesson_notebook=stem)
    source_nb = nbformat.read(root / "solutions" / assignment / f"{stem}.ipynb", 4)
    # a folder named as the lesson's own, as a learner's is: nothing in the path tells a grading run apart
    with tempfile.TemporaryDirectory() as folder:
        workdir = Path(folder) / assignment
        workdir.mkdir()
        _grade_submission(root, workdir, source_nb, path, result, timeout, memory_limit,
                          cell_timeout or _cell_timeout(root))
    return _score(result)


def _source_key(root: Path, assignment: str) -> str:
    """A hash of everything generation depends on: the config, the lesson's files, nbgrader."""
    import hashlib
    from importlib.metadata import version
    digest = hashlib.sha256(version("nbgrader").encode() + b"hidden tests stripped line by line")
    digest.update((root / CONFIG).read_bytes())
    from . import course
    if course.read_source(root):        # the address goes into the set-up cells
        digest.update(b"\0source\0" + course.read_source(root).encode())
    ignored = ignored_patterns(root)
    for path in sorted((root / "solutions" / assignment).rglob("*")):
        parts = path.relative_to(root / "solutions" / assignment).parts
        if path.is_file() and not any(fnmatch.fnmatch(part, p) for part in parts for p in ignored):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def prepare(root: Path, assignment: str) -> Path:
    """A generated nbgrader course for `assignment` (its gradebook holds the hidden tests).

    Generation costs seconds (nbgrader runs a database migration in a subprocess), so the
    result is kept in autograder/work/cache/, keyed by a hash of the sources and config,
    and reused until they change.  Where that folder cannot be written, a temporary one
    is used and nothing is kept.
    """
    cache_root = root / "autograder" / "work" / "cache"
    target = cache_root / f"{assignment}-{_source_key(root, assignment)}"
    if (target / "autograder" / "gradebook.db").is_file():
        return target
    try:
        cache_root.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=f".{assignment}-", dir=cache_root))
    except OSError:
        building = Path(tempfile.mkdtemp(prefix="gclab-course-"))
        target = building
    course = _scratch_course(root, [assignment], building / "course" if building != target else building)
    done = _generate_assignment(course, assignment, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"nbgrader generate_assignment {assignment} failed:\n{done.stdout}")
    if building != target:
        try:
            course.rename(target)       # atomic: a concurrent grader sees all of it or none
        except OSError:
            pass                        # another grader got there first; theirs is the same
        shutil.rmtree(building, ignore_errors=True)
    return target


def _grade_submission(root, workdir, source_nb, path, result, timeout, memory_limit, cell_timeout):
    try:
        submitted = nbformat.read(path, 4)
    except Exception as exc:
        result.tests = _all_tests(source_nb, "error", f"not graded: the file is not a readable notebook ({exc})")
        result.reason = "unreadable notebook"
        return
    every_cell = tuple(c.source for c in submitted.cells if c.cell_type == "code")
    tools = imported_tools(c.source for c in source_nb.cells if c.cell_type == "code"
                           and c.metadata.get("nbgrader", {}).get("locked"))
    patched = [line for src in _student_sources(submitted) for line in tampering(src, every_cell, tools)]
    result.review = list(dict.fromkeys(line for cell in submitted.cells if cell.cell_type == "code"
                                       and cell.metadata.get("nbgrader", {}).get("solution")
                                       for line in review.environment_reads(cell.source)))
    if patched:
        result.reason = "the submission modifies the grader's tools: " + "; ".join(list(dict.fromkeys(patched))[:3])
        result.tests = _all_tests(source_nb, "error", "not graded: " + result.reason)
        return
    _judge(root, workdir, source_nb, submitted, result, cell_timeout, memory_limit, timeout)


def _cell_timeout(root: Path) -> int:
    return int(_course_config(root).Execute.get("timeout", 180))


def _judge(root, workdir, source_nb, submitted, result, cell_timeout, memory_limit, timeout) -> None:
    """Score every test cell: the verdict process's results, each "passed" confirmed by the grader's
    own figures against the reference solution's (gclab.grader.measured)."""
    conditions = {"cell_timeout": cell_timeout, "memory_limit": memory_limit, "timeout": timeout}
    reference = reference_figures(root, result.assignment, result.lesson_notebook, source_nb, conditions)
    job = verdict_job(source_nb, submitted, workdir, hidden=[root], notebook=result.lesson_notebook)
    whole = []
    verdicts = run_verdict(job, cell_timeout=cell_timeout, memory_limit=memory_limit, timeout=timeout, whole=whole)
    result.tests = [verdicts.get(t.id, TestResult(t.id, 0.0, t.max_score, "error",
                                                 "not graded: the grading process ended before this test"))
                    for t in _all_tests(source_nb, "", "")]
    result.measured = whole[0] if len(whole) == 1 else {}
    _confirm(result, reference)
    _decide_reason(result, job)
    _redact(result, source_nb)


def reference_of(root: Path, assignment: str, timeout: int = 900, memory_limit: int | None | str = "auto",
                 cell_timeout: int | None = None) -> dict:
    """The reference solution's figures for `assignment`, under the conditions `grade_one` grades with."""
    source = next((root / "solutions" / assignment).glob("*.ipynb"))
    conditions = {"cell_timeout": cell_timeout or _cell_timeout(root), "timeout": timeout,
                  "memory_limit": default_memory_limit() if memory_limit == "auto" else memory_limit}
    return reference_figures(root, assignment, source.stem, nbformat.read(source, 4), conditions)


def reference_figures(root: Path, assignment: str, notebook: str, source_nb, conditions: dict) -> dict:
    """The reference solution's run of the lesson's tests on this machine (see gclab.grader.measured): kept in
    autograder/work/cache/ per lesson, source and machine; run in a folder named as the lesson."""
    def compute():
        with tempfile.TemporaryDirectory() as folder:
            workdir = Path(folder) / assignment
            workdir.mkdir()
            job = verdict_job(source_nb, source_nb, workdir, hidden=[root], notebook=notebook)
            whole = []
            verdicts = run_verdict(job, whole=whole, **conditions)
        return {"tests": {test_id: {"status": t.status, "message": t.message, "observed": t.observed,
                                    "measured": t.measured} for test_id, t in verdicts.items()},
                "run": whole[0] if len(whole) == 1 else {}}
    cache = root / "autograder" / "work" / "cache" / (
        f"reference-{assignment}-{_source_key(root, assignment)}-{measured.machine_key(conditions)}.json")
    try:
        return measured.reference(cache, compute)
    except OSError:                   # a course folder that cannot be written: computed, not kept
        return measured.reference(None, compute)


def _confirm(result: NotebookResult, reference: dict) -> None:
    """A test the learner's process says passed keeps its point only where the grader's figures agree;
    where they do not, the test fails saying so, and the submission is flagged for review."""
    price = (reference.get("run") or {}).get("full_collection_cpu_s")
    for test in result.tests:
        why = measured.confirm(test.status, test.observed, test.measured, reference["tests"].get(test.id), price)
        if why:
            test.status, test.score, test.message = "failed", 0.0, why
            result.disagreements.append(f"{test.id}: {why}")
    ref_tests = [t.get("measured") or {} for t in reference["tests"].values()]
    between = measured.outside_the_tests(result.measured, [t.measured for t in result.tests])
    why = measured.whole_run_disagrees(between, measured.outside_the_tests(reference.get("run") or {}, ref_tests))
    if why:
        for test in result.tests:
            if test.status == "passed":
                test.status, test.score, test.message = "failed", 0.0, why
        result.disagreements.append(f"the whole run: {why}")


def _redact(result: NotebookResult, source_nb) -> None:
    """Nothing of a hidden test in anything handed back: messages, outputs, the notebook's reason."""
    hidden = [hidden_tests(c.source) for c in _grade_cells(source_nb)]
    visible = "\n".join(without_hidden_tests(c.source) if c.cell_type == "code" else c.source for c in source_nb.cells)
    redact = measured.Redactor(hidden, visible)
    for test in result.tests:
        test.message, test.output = redact(test.message), redact(test.output)
    result.reason = redact(result.reason)
    result.disagreements = [redact(line) for line in result.disagreements]


def _decide_reason(result: NotebookResult, job: dict) -> None:
    """Why the whole notebook scored what it did, where that is not the tests' own doing."""
    tampered = [t.message for t in result.tests if t.status == "tampered"]
    if tampered:
        result.reason = "the submission tampers with grading: " + tampered[0]
        for t in result.tests:
            t.status, t.score, t.message = "error", 0.0, "not graded: " + result.reason
    elif job["missing_answers"]:
        result.reason = ("the submission has no answer cell " + ", ".join(job["missing_answers"])
                         + " (deleted, or its cell metadata removed): a fresh copy of the lesson keeps them")
    elif result.tests and len({t.message for t in result.tests}) == 1 and result.tests[0].message.startswith("not graded: "):
        result.reason = result.tests[0].message.removeprefix("not graded: ")
    elif job["copied_answers"]:
        result.reason = "; ".join(f"answer cell {grade_id} is in the notebook {count} times" for grade_id, count
                                  in job["copied_answers"].items()) + (
            " (a copied cell keeps the answer's metadata): every copy was run, in order, as Run All runs them; "
            "keep one")


def format_results(results) -> str:
    out = []
    for r in results:
        out.append(f"{r.notebook} [{r.assignment}]: {r.score:g} / {r.max_score:g}")
        if r.reason:
            out.append(f"  reason: {r.reason}")
        for t in r.tests:
            line = f"  {t.status:<8} {t.id:<32} {t.score:g}/{t.max_score:g}"
            out.append(line + (f"  {t.message}" if t.message and t.status != "passed" else ""))
    total = sum(r.score for r in results), sum(r.max_score for r in results)
    out.append(f"total: {total[0]:g} / {total[1]:g}")
    return "\n".join(out)


def results_json(results) -> str:
    return json.dumps([r.as_dict() for r in results], indent=2)
