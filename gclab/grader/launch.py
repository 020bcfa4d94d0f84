"""A verdict process: the job the grader hands it, how it is started, and how its channel is read.

`verdict_job` builds the job from the lesson's source and the submission (set-up and given cells,
answer cells in their places, test cells with their hidden parts).  `run_verdict` starts the process
forked from the grader's zygote server (`gclab.zygote`, which imported the instruments once), or as a
fresh Python (`python -m gclab.grader.verdict`), in a session of its own; hands it the job; reads its
JSON lines (each with the job's token) under deadlines, interrupting a runaway cell as nbgrader does;
and takes its own readings of the process at each step (`gclab.grader.measured.Watch`), sending a
lesson's HTTP load from a process of its own.  What the process says is a report, not a grade:
`gclab.grader.grading` confirms it against the reference solution's figures.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from .. import zygote
from . import measured, memory_group, sandbox
from .cells import _answers_of, _meta, top_level_names
from .results import TestResult
from .tampering import imported_tools
from . import verdict
from .verdict import apply_limits


# -- processes the grader starts: nbgrader's jobs and verdicts, each in a session of its own ---------
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



# -- the verdict process -------------------------------------------------------------
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
    return {"token": secrets.token_hex(16), "workdir": str(workdir),
            "walls": os.environ.get("GCLAB_GRADE_WALLS") != "0", "notebook": notebook, "cells": cells, "tests": tests,
            "missing_answers": missing, "hidden": [str(h) for h in hidden],
            "copied_answers": {grade_id: len(copies) for grade_id, copies in answers.items() if len(copies) > 1},
            "tools": sorted(imported_tools(locked)), "answer_names": sorted(answer_names),
            "demo_names": sorted(demo_names)}


class _Started:
    """A verdict process started as a subprocess (a fresh Python)."""

    def __init__(self, job_bytes: bytes, workdir: str, channel: int, memory_limit):
        argv = zygote.with_room([sys.executable, *_python_flags(), "-m", "gclab.grader.verdict", str(channel)],
                                _room(workdir))
        self.proc = subprocess.Popen(argv, cwd=workdir, env=_verdict_environment(), stdin=subprocess.PIPE,
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

    def __init__(self, server, job_bytes: bytes, channel: int, memory_limit):
        job_read, job_write = os.pipe()
        try:
            self.pid, pidfd = server.fork({"memory_limit": memory_limit}, [job_read, channel])
        finally:
            os.close(job_read)
        if pidfd is not None:
            os.close(pidfd)           # the session is what is killed (see end)
        self.server = server
        _write_job(os.fdopen(job_write, "wb"), job_bytes)

    def end(self) -> None:
        _kill_session(self.pid)       # the zygote reaps it
        _release(self.server)


_ZYGOTE: list = []                # the zygote servers running, one for each room and Python flags
_FORKED: dict = {}                # zygote server -> its verdicts still running, or about to be forked
_ZYGOTE_LOCK = threading.Lock()


def _room(workdir: str) -> int:
    """The length of the kernel's command line a verdict in `workdir` shows (`verdict.kernel_command_line`:
    the connection file's path holds the folder above the grading folder, the verdict's home)."""
    return verdict.command_line_room(len(os.fsencode(os.path.dirname(os.path.abspath(workdir)))))


def _verdict_environment() -> dict:
    """No variable only the grader has: the system shows a process's starting environment to it
    (/proc/self/environ), whatever it deletes."""
    kept = {name: value for name, value in os.environ.items() if not name.startswith(verdict.GRADER_ONLY_VARIABLES)}
    return {**kept, "PATH": _job_environment()["PATH"]}


def _python_flags() -> tuple:
    """-O where the grader is asked to strip the tests' asserts (GCLAB_GRADE_STRIP_ASSERTS=1): each test then
    runs to its end and says "passed" whatever failed, as a process that rewrote its results would, and only
    the grader's own figures decide (autograder/grader_figures.py)."""
    return ("-O",) if os.environ.get("GCLAB_GRADE_STRIP_ASSERTS") == "1" else ()


def _forks() -> bool:
    return os.environ.get("GCLAB_GRADE_FORK") != "0" and zygote.available()


def verdict_conditions() -> dict:
    """How this grader starts a verdict process, which the figures of a run depend on, so that a reference
    is compared only with runs started alike: forked from the zygote or a fresh Python (which imports, in
    the tests' time, what the zygote loaded once: lesson 04's reference spent 1.63 s of CPU in a test where
    a forked one spends 0.09 s), walled or not, in a memory cgroup of its own or not, with the tests' asserts
    stripped or not, and the interpreter's own variables that reach the verdict."""
    return {"forked": _forks(), "walls": os.environ.get("GCLAB_GRADE_WALLS") != "0", "flags": list(_python_flags()),
            "memory_group": memory_group.available() is None,
            "python": sorted((name, value) for name, value in _verdict_environment().items()
                             if name.startswith("PYTHON"))}


def _zygote(room: int):
    """A zygote server of this grader whose children have `room` for a kernel's command line and this
    grader's Python flags (it runs isolated from PYTHON* variables), or None when GCLAB_GRADE_FORK=0 or
    there is none.  A verdict whose command line did not fit kept the zygote's, which names gclab (a grading folder deeper than the one the server was
    started for: `grade`, then `grade-class` in one process); a server no verdict uses is ended when
    another is needed.  The server returned is held for one verdict until `_release`."""
    if not _forks():
        return None
    flags = _python_flags()
    with _ZYGOTE_LOCK:
        _ZYGOTE[:] = [server for server in _ZYGOTE if server.alive()]
        fitting = next((server for server in _ZYGOTE if server.room == room and server.flags == flags), None)
        if fitting is None:
            for idle in [server for server in _ZYGOTE if not _FORKED.get(server)]:
                _ZYGOTE.remove(idle)
                _FORKED.pop(idle, None)
                idle.close()
            fitting = zygote.Zygote("gclab.grader.verdict", env=_verdict_environment(), room=room, flags=flags)
            _ZYGOTE.append(fitting)
        _FORKED[fitting] = _FORKED.get(fitting, 0) + 1
        return fitting


def _release(server) -> None:
    with _ZYGOTE_LOCK:
        _FORKED[server] -= 1


def _start_verdict(job: dict, channel: int, memory_limit):
    job_bytes = json.dumps(job).encode()
    server = _zygote(_room(job["workdir"]))
    if server is not None:
        try:
            return _Forked(server, job_bytes, channel, memory_limit)
        except OSError:
            _release(server)         # the server died: a fresh Python does the same work
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
    sandbox.shield()          # the learner's code, walled in, may neither trace the grader nor open its memory
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
    group = memory_group.MemoryGroup.made()      # the verdict joins it before the learner's code runs
    unguarded = []                               # what this machine leaves out of the grader's reach
    if group is None:
        unguarded.append(_say_once_ungrouped())
    try:
        proc = _start_verdict({**job, "memory_group": group and group.path}, theirs.fileno(), memory_limit)
    except BaseException:
        if group is not None:
            group.remove()
        raise
    finally:
        theirs.close()
    channel = _Channel(read_end, job["token"])
    watch = measured.Watch(proc.pid, group)      # the verdict process leads a session of its own
    results, walled_in = {}, None      # the user namespace it runs the learner's code in

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
                walled_in = sandbox.hold(proc.pid)
                if not sandbox.walled(proc.pid):
                    unguarded.append(_say_once_unwalled(message.get("walls")))
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
        whole.append({**watch.end(), "unguarded": unguarded})
    finally:
        proc.end()
        sandbox.end_within(walled_in)     # what the learner's code started and left, in a session of its own too
        os.close(read_end)
        if group is not None:
            group.remove()
    if channel.forged:
        for test_id in results:
            result(test_id, "tampered", "the submission wrote to the grader's result channel", results[test_id].output)
    return results


_SAID: set = set()


def _say_once(what: str, text: str) -> None:
    """Tell whoever grades, once per grader, what this machine leaves out of the grader's reach."""
    if what not in _SAID:
        _SAID.add(what)
        print(f"gclab grade: {text} (README: What decides a grade).", file=sys.stderr, flush=True)


def _say_once_unwalled(why) -> str:
    """Say once that the learner's code runs without the kernel's walls here; in a few words, for the result."""
    why = str(why or "the verdict process is not walled in")[:300]
    _say_once("walls", f"the learner's code runs without the kernel's walls on this machine ({why}): only the "
              "guard inside its process refuses it the course's files, and such code can get around that (ctypes, "
              "torch.save). On Ubuntu 24.04, `sudo sysctl kernel.apparmor_restrict_unprivileged_userns=0` lets the "
              "grader build them")
    return f"without the kernel's walls ({why})"


def _say_once_ungrouped() -> str:
    """Say once that the grader makes no memory cgroup for its verdicts here; in a few words, for the result."""
    why = memory_group.available() or "a group could not be made"
    _say_once("memory group", f"the grader makes no memory cgroup for its verdicts on this machine ({why}): "
              "memory a submission moves into shared memory or a file it maps, and drops from its own pages, is "
              "out of the grader's sight; a grader run as root, or in a delegated cgroup (a systemd user service "
              "with Delegate=yes; a user without root on a machine with systemd: `loginctl enable-linger`, and "
              "`gclab grade` runs itself in a scope of that user's own systemd manager, which has one), counts it")
    return f"without a memory cgroup ({why})"


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
            or args.burst < 0):
        return []
    server = procfs.member_numbered(watch.sid, server)      # as the grader numbers it
    if server is None:
        return []
    load = ["load", args.url, "--rate", str(args.rate), "--count", str(args.count), "--seed", str(args.seed),
            "--timeout", str(args.timeout), "--burst", str(args.burst), "--lull", str(args.lull),
            "--watch-cpu", str(server), "--network-of", str(server)] + (["--poisson"] if args.poisson else [])
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
