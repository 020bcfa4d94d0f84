"""The process that decides a submission's grade, out of reach of the learner's code.

    python -m gclab.grader.verdict CHANNEL_FD      (started by gclab.grader.launch; the job arrives on stdin)

The grader starts it in a folder of its own and writes the job to its stdin: the lesson's
locked set-up and "given" cells and its test cells (hidden tests included) from the
course's source notebook, the learner's answer cells from the submission, and a random
token.  The process reads the job, loads the grader's instruments, installs
`gclab.guard` (which takes their manifest and refuses the learner's code what reaches past
them), and only then runs the learner's answer cells, in an IPython shell (magics such as
`%%writefile` work).  Each test cell runs next as code the grader compiled itself, in a
namespace of its own (what its visible self-checks print is kept for the learner's
feedback; what its hidden parts print is dropped), and its outcome goes back on the channel file descriptor as one
JSON line carrying the token, which the learner's code never sees.  Output of the
learner's code goes nowhere: nothing of a hidden test is printed, and gigabytes of output
cost time, not memory.
"""
from __future__ import annotations

import builtins
import gc
import io
import json
import os
import sys
import tempfile
import types
from json.encoder import encode_basestring_ascii as _quoted     # in C

from . import memory_group

_write, _read = os.write, os.read


class _Token:
    """The result channel's token, out of every summary of the verdict's frames: a library that
    lists frames with their locals for the learner (traceback's `capture_locals`, cgitb) shows
    each local's repr, and the frames below the learner's code are the verdict's."""

    __slots__ = ("_value",)

    def __init__(self, value: str):
        self._value = value

    def __repr__(self) -> str:
        return "<the result channel's token>"


class _Sealed(dict):
    """A part of the job (its cells, the hidden tests' sources), shown by no summary of the frames."""

    def __repr__(self) -> str:
        return "<a part of the grading job>"


def _read_job(data: bytes) -> dict:
    return json.loads(data, object_hook=_Sealed)


def _send(channel: int, token: _Token, **message) -> None:
    data = (_json({"token": token._value, **message}) + "\n").encode()
    while data:
        data = data[_write(channel, data):]


def _send_and_wait(channel: int, token: _Token, **message) -> None:
    """Send, then wait until the grader has taken its own readings of this process (gclab.measured),
    which it does as the message arrives: a byte back on the channel (a socket) says it has."""
    _send(channel, token, **message)
    _read(channel, 1)


def _load_by_the_grader(channel: int, token: _Token, argv, server_pid) -> list | None:
    """A load the grader sends itself (gclab.outside.load): its rows come back on the channel, their
    length first; None where the grader refused it (then the program sends its own, which no figure of
    the grader's confirms)."""
    _send(channel, token, event="load", argv=[str(a) for a in argv], server=int(server_pid))
    size = int.from_bytes(_read_exactly(channel, 8), "big")
    return json.loads(_read_exactly(channel, size)) if size else None


def _read_exactly(channel: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = _read(channel, size - len(data))
        if not chunk:
            raise EOFError("the grader closed the result channel")
        data += chunk
    return data


def _json(value) -> str:
    """`value` (dicts, lists, strs, numbers, None) as JSON, by code of this module and functions in C
    alone: json.dumps, like any library function, would run whatever the learner's code rebound in its
    module, and it sees the token."""
    kind = type(value)
    if value is None or value is True or value is False:
        return {None: "null", True: "true", False: "false"}[value]
    if kind is int or kind is float:
        return repr(value)
    if issubclass(kind, dict):
        return "{" + ",".join(f"{_quoted(_plain_text(k))}:{_json(v)}" for k, v in dict.items(value)) + "}"
    if issubclass(kind, (list, tuple)):
        return "[" + ",".join(_json(v) for v in value) + "]"
    return _quoted(_plain_text(value))


def _plain_text(value) -> str:
    return str.__str__(value) if issubclass(type(value), str) else f"<{type.__dict__['__name__'].__get__(type(value))}>"


# Characters of one message a result carries: a learner's error can say megabytes, and every test's result
# carries the answer cells' errors, where the channel takes a line of at most 1 MiB
MESSAGE_LIMIT = 4000


def _cut(text: str) -> str:
    if len(text) <= MESSAGE_LIMIT:
        return text
    return f"{text[:MESSAGE_LIMIT]} [... {len(text) - MESSAGE_LIMIT:,} more characters]"


def _message_of(error: BaseException) -> str:
    """What `error` says, as a plain str cut to MESSAGE_LIMIT; where saying it raises (an error of the
    learner's whose __str__ fails), that."""
    try:
        text = str.strip(str.__str__(str(error)))
    except BaseException:
        return "(its message could not be read: turning it into text raised an error)"
    return _cut(text)


def _describe(error: BaseException) -> str:
    name, text = type.__dict__["__name__"].__get__(type(error)), _message_of(error)
    return f"{name}: {text}" if text else name


# Variables only a grader's environment has (nbgrader's, gclab grade's own settings, its warnings filter)
# PYTHONOPTIMIZE too: a verdict never drops the tests' asserts, whatever the grader's environment says
# (`GCLAB_GRADE_STRIP_ASSERTS=1` asks for it, to see what the grader's own figures leave standing)
GRADER_ONLY_VARIABLES = ("NBGRADER", "GCLAB_GRADE", "PYTHONWARNINGS", "PYTHONOPTIMIZE")


def _quiet_and_local(workdir: str, notebook: str = "") -> None:
    """Settings of a plain run: a working folder of its own (named as the lesson's), output nowhere,
    and what a learner's own kernel in JupyterLab sees: its environment variables, its arguments, no
    variable only the grader sets."""
    os.chdir(workdir)
    for name in [n for n in os.environ if n.startswith(GRADER_ONLY_VARIABLES)]:
        del os.environ[name]
    tmp = os.path.join(workdir, ".tmp")
    os.makedirs(tmp, exist_ok=True)
    home = os.path.dirname(workdir)
    os.environ.update(HOME=home, TMPDIR=tmp, MPLCONFIGDIR=tmp, XDG_CACHE_HOME=os.path.join(tmp, "cache"),
                      MPLBACKEND="module://matplotlib_inline.backend_inline", JPY_PARENT_PID=str(os.getppid()),
                      JPY_SESSION_NAME=os.path.join(workdir, notebook + ".ipynb"), CLICOLOR="1", PAGER="cat",
                      GIT_PAGER="cat", PYDEVD_IPYTHON_COMPATIBLE_DEBUGGING="1")
    import uuid
    connection = os.path.join(home, ".local", "share", "jupyter", "runtime", f"kernel-{uuid.uuid4()}.json")
    sys.argv = [_ipykernel_launcher(), "-f", connection]
    sys.orig_argv = kernel_command_line(connection)
    from gclab import zygote
    zygote.show_as(sys.orig_argv, name=os.path.basename(sys.executable))
    # and tempfile's own choice, which it makes once: the zygote's import of torch._dynamo made it (/tmp)
    tempfile.tempdir = tmp
    # where torch writes on its own, wherever the grader's environment pointed them: torch._dynamo and
    # inductor write their caches there (a write the guard refuses outside the folder)
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        os.environ[name] = os.path.join(tmp, name.lower())
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    sys.dont_write_bytecode = True


def kernel_command_line(connection: str) -> list[str]:
    """The command line JupyterLab starts a learner's kernel with."""
    return [sys.executable, "-m", "ipykernel_launcher", "-f", connection]


def command_line_room(home_length: int) -> int:
    """How long a verdict's command line is (`kernel_command_line`), with its home folder's name (the
    parent of the grading folder) `home_length` characters long: the room its zygote leaves for it."""
    connection = "h" * home_length + "/.local/share/jupyter/runtime/kernel-" + "0" * 36 + ".json"
    return sum(len(os.fsencode(arg)) + 1 for arg in kernel_command_line(connection))


def _ipykernel_launcher() -> str:
    import importlib.util
    spec = importlib.util.find_spec("ipykernel_launcher")
    return spec.origin if spec and spec.origin else "ipykernel_launcher.py"


def apply_limits(memory_limit) -> None:
    """Resource limits of a verdict process (set in it before the learner's code runs)."""
    import resource
    if memory_limit:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 * 1024**3, 2 * 1024**3))


def preload() -> None:
    """Import what every verdict needs, and pin gclab's names (`guard.pin_gclab`, which `guard.install`
    would do in each verdict otherwise): gclab.zygote forks verdicts after this."""
    _load_instruments()
    from gclab import zygote
    from gclab import guard
    guard.pin_gclab()
    # the verdicts' parent, as a learner's kernel has JupyterLab's server (`make lab`)
    zygote.show_as([sys.executable, os.path.join(os.path.dirname(sys.executable), "jupyter-lab")], name="jupyter-lab")
    # what is loaded so far is the grader's and lives as long as the process: frozen (gc.freeze()), no
    # collection walks it again, nor does a census of tensors (gc.get_objects() lists nothing frozen), in any
    # verdict forked after (a check finds out whether the learner's code froze anything: held.Unfrozen)
    gc.collect()
    gc.freeze()


def forked(request: dict, fds: list) -> None:
    """In a child of the grader's zygote server: become the verdict process of the job read
    from the pipe `fds[0]`, reporting on the channel `fds[1]`, in a session of its own and
    within its resource limits, exactly as a freshly started verdict process does."""
    os.setsid()
    apply_limits(request.get("memory_limit"))
    job_fd, channel = fds
    with os.fdopen(job_fd, "rb") as job_file:
        job = _read_job(job_file.read())
    run(job, channel)


def _load_instruments():
    import warnings
    warnings.simplefilter("ignore")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401
    import numpy  # noqa: F401
    import torch  # noqa: F401
    # an optimizer's first step imports torch._dynamo (3.4 s on 2 shared cores): once here, not in
    # every verdict of a lesson that trains
    import torch.optim, torch._dynamo  # noqa: F401,E401
    import gclab.checks, gclab.cycles, gclab.gcwatch, gclab.held, gclab.memory, gclab.plots, gclab.refs, gclab.serving  # noqa: F401,E401
    # what lessons import from gclab besides (a hidden test's grading.tampering: nbformat, 3.8 s per verdict
    # here); imported now, they are pinned with the rest of gclab (guard.pin_gclab)
    import gclab.grader.tampering, gclab.traces, gclab.widgets  # noqa: F401,E401
    import gclab.grader.sandbox  # noqa: F401  (_wall_in)
    import resource  # noqa: F401  (apply_limits)
    import sqlite3  # noqa: F401  (IPython's history)
    # what InteractiveShell.instance() imports (tests/test_grading.py names any it would import after the fork)
    import IPython.core.application, IPython.core.completer, IPython.core.completerlib  # noqa: F401,E401
    import IPython.core.magics, IPython.core.oinspect, IPython.utils.wildcard  # noqa: F401,E401
    from IPython.core.interactiveshell import InteractiveShell
    return InteractiveShell


def run(job: dict, channel: int) -> None:
    token = _Token(job.pop("token"))
    memory_group.join(job.get("memory_group"))      # first: all it and what it starts take is counted there
    job["walls"] = _wall_in(job)
    _quiet_and_local(job["workdir"], job.get("notebook", ""))
    shell_class = _load_instruments()
    from gclab import guard
    shell = shell_class.instance()
    shell.display_pub.publish = lambda *args, **kwargs: None     # plots and displays go nowhere
    # and so would an answer cell's traceback: IPython's, which hands the frames of the cell's error to the
    # functions of inspect, executing and stack_data (any of them rebound by the cell), and calls the repr
    # of each frame's locals (code of the learner's), is never drawn (the cell's error is described from
    # the result: `_describe`)
    shell.showtraceback = shell.showsyntaxerror = shell.showindentationerror = lambda *args, **kwargs: None
    _initialise_cuda()
    # the grader reads this process's CPU time at every mark of a run of calls (gclab.outside)
    from gclab import outside
    outside.read_by(lambda: _send_and_wait(channel, token, event="mark"))
    outside.loads_by(lambda argv, server_pid: _load_by_the_grader(channel, token, argv, server_pid))
    keeper = guard.install(job["workdir"], processes=False, files=True, hidden=job.get("hidden", ()))
    _grade(job, channel, token, shell, keeper)


def _wall_in(job: dict) -> str | None:
    """The kernel's walls around this process (`gclab.grader.sandbox`), while it has one thread: nothing
    but the grading folder writable, the course hidden but for gclab and the Python environment.  None once
    they stand, else why not (the grader sees for itself whether they do: `sandbox.walled`).  Within them, no
    process of the verdict's may trace another, read or write its memory or take its descriptors
    (`gclab.syscalls.REACH`): the model server's, whose CPU time and sockets the grader reads; nor page its
    own memory out to swap (`PAGING_OUT`), where what it holds would leave the resident figures the grader
    reads."""
    import gclab
    from gclab import syscalls
    from . import sandbox
    if not job.get("walls", True):
        return "the grader was told to build none (GCLAB_GRADE_WALLS=0)"
    return (sandbox.enter(job["workdir"], hidden=job.get("hidden", ()), keep=[os.path.dirname(gclab.__file__)])
            or syscalls.refuse(syscalls.REACH, syscalls.PAGING_OUT))


def _initialise_cuda() -> None:
    """On a machine with CUDA, initialise it before the guard takes its manifest.  torch.cuda starts
    lazily, at the first use of the device, and then rebinds attributes of its own (`_initialized`,
    `default_generators`, `_cached_device_count`), which the guard would take for the learner's
    code replacing them.  Here, in the verdict process, never in the zygote: a process forked after
    CUDA started cannot use it."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.init()
        torch.cuda.device_count()
        torch.cuda.current_device()


def _grade(job: dict, channel: int, token: _Token, shell, keeper) -> None:
    namespace = shell.user_ns
    # the builtins the tests run with: a copy taken before the learner's code runs, which no rebinding
    # through builtins' __dict__ reaches (one that puts itself back after the test's call went unseen)
    test_builtins = dict(vars(builtins))
    relied_on = _builtins_relied_on([c["source"] for c in job["cells"] if c["kind"] != "answer"]
                                    + [t["source"] for t in job["tests"]], namespace)
    _send_and_wait(channel, token, event="ready", walls=job.get("walls"))
    answer_errors = {}
    given = {}
    for cell in job["cells"]:
        if cell["kind"] == "answer":
            _send(channel, token, event="answer", cell=cell["id"])
            result = shell.run_cell(cell["source"], store_history=False, silent=True)
            error = result.error_in_exec or result.error_before_exec
            if error is not None:
                answer_errors[cell["id"]] = _describe(error)
        else:
            code = keeper.trust(compile(cell["source"], f"<{cell['id']}>", "exec"))
            before = dict(namespace)
            exec(code, namespace)
            given.update((name, value) for name, value in namespace.items() if before.get(name, _UNSET) is not value)
    for name in job.get("answer_names", ()):
        given.pop(name, None)
    tools = [name for name in job.get("tools", ()) if name in given]
    _price_a_full_collection(channel, token)
    for number, test in enumerate(job["tests"]):
        _send_and_wait(channel, token, event="start", test=test["id"])
        _seed(number)
        outcome = _run_test(keeper, test, namespace, given, tools, relied_on, test_builtins)
        _send_and_wait(channel, token, event="result", test=test["id"], answer_errors=answer_errors, **outcome)
    _send_and_wait(channel, token, event="done")


PRICED_COLLECTIONS = 3


def _price_a_full_collection(channel: int, token: _Token) -> None:
    """Full collections between readings of the grader's, once the answer cells have run: what one costs
    in this process, which the grader takes from the reference solution's run to know a collection inside
    a call when it sees one.  The first, untimed, frees what the answer cells left; the price is the median
    of the next ones (the same collection took 3.6 to 12.4 ms of CPU time here from one moment to the
    next: one sample is not a price)."""
    gc.collect()
    _send_and_wait(channel, token, event="price")
    for _ in range(PRICED_COLLECTIONS):
        gc.collect()
        _send_and_wait(channel, token, event="price")


_UNSET = object()


def _rebound(namespace: dict, given: dict, tools, relied_on: dict | None = None) -> list[str]:
    """The grader's tools (names the locked cells imported) that the learner's code bound to
    something else, by whatever route (`globals()`, `exec`, `__main__`); and the builtins the
    lesson's own code calls (`relied_on`: name -> what it was before the learner's code ran) that
    the learner's code bound to something else, `__builtins__` itself included: the given cells'
    functions look names up in the notebook's globals first."""
    found = [f"{name} (which the set-up cell imports) was rebound by the notebook's code" for name in tools
             if namespace.get(name, _UNSET) is not given[name]]
    if namespace.get("__builtins__", builtins) not in (builtins, vars(builtins)):
        found.append("__builtins__ was replaced by the notebook's code")
    found += [f"{name}, a builtin the lesson's own code calls, was bound by the notebook's code to something else "
              "(rename it)" for name, was in (relied_on or {}).items()
              if name in namespace and name not in given and namespace[name] is not was]
    return found


def _torch_modes() -> list[str]:
    """Torch modes the learner's code entered and left active: every torch call of the tests (a
    tensor's tolist(), torch.equal) would go through them."""
    import torch
    stacks = (("function", torch._C._len_torch_function_stack()), ("dispatch", torch._C._len_torch_dispatch_stack()))
    return [f"a torch {kind} mode the notebook's code entered is still active (the tests' torch calls would go "
            "through it)" for kind, depth in stacks if depth]


def _builtins_relied_on(sources, namespace: dict) -> dict:
    """The names of builtins that the lesson's given and test cells use, each with what it is now
    (before the learner's code runs: a builtin, or the shell's own `exit`)."""
    names, codes = set(), []
    for source in sources:
        try:
            codes.append(compile(source, "<lesson>", "exec"))
        except SyntaxError:
            continue
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(const for const in code.co_consts if isinstance(const, types.CodeType))
    return {name: namespace.get(name, getattr(builtins, name)) for name in names if hasattr(builtins, name)}


def _run_test(keeper, test: dict, namespace: dict, given: dict, tools, relied_on, test_builtins: dict) -> dict:
    """Run a test cell: its visible self-checks with their printed output kept for the
    learner's feedback, its hidden parts with their output dropped.  The test sees the
    learner's names, every name a locked cell bound as that cell left it, and `test_builtins`.
    A tool or builtin rebound when the test starts is tampering even if it is put back by the
    end (the test ran with it)."""
    parts = [(hidden, keeper.trust(compile(source, f"<test {test['id']}>", "exec")))
             for hidden, source in _parts(test["source"])]
    at_start = keeper.problems() + _rebound(namespace, given, tools, relied_on) + _torch_modes()
    before = set(at_start)
    from gclab.checks import observations
    observations()                  # what the answer cells or an earlier test recorded is not this test's
    printed = _Printed()
    try:
        scope = {**namespace, **given, "__builtins__": test_builtins}
        for hidden, code in parts:
            if hidden:
                exec(code, scope)
            else:
                _printed_into(printed, code, scope)
        outcome = {"status": "passed", "message": ""}
    except AssertionError as error:
        outcome = {"status": "failed", "message": _message_of(error) or "a hidden check failed"}
    except KeyboardInterrupt:
        outcome = {"status": "timeout", "message": "the test ran past the time limit and was interrupted"}
    except BaseException as error:        # the learner's code may raise anything, SystemExit included
        outcome = {"status": "error", "message": _describe(error)}
    problems = keeper.problems() + _rebound(namespace, given, tools, relied_on) + _torch_modes()
    problems += [problem for problem in at_start if problem not in problems]
    if problems:
        new = [p for p in problems if p not in before] or problems
        outcome = {"status": "tampered", "message": _cut("; ".join(new[:3]))}
    return {**outcome, "output": printed.text(), "observations": observations()}


def _seed(number: int) -> None:
    """The same random numbers for a test in every run: what it observes is compared with what the same
    test observed running the reference solution (gclab.measured), models with random weights included."""
    import random
    import numpy
    import torch
    random.seed(number)
    numpy.random.seed(number)
    torch.manual_seed(number)


def _printed_into(printed, code, scope: dict) -> None:
    """exec(code, scope) with what it prints kept in `printed` (by hand: contextlib's redirect_stdout,
    a library class, would run whatever the learner's code set on it, an __exit__ that swallows the
    test's AssertionError included)."""
    stdout = sys.stdout
    sys.stdout = printed
    try:
        exec(code, scope)
    finally:
        sys.stdout = stdout


def _parts(source: str) -> list[tuple[bool, str]]:
    """A test cell as (hidden?, source) parts in order, cut at its hidden-test markers; the
    whole cell as one hidden part when a part would not compile on its own (markers inside
    a block), so that none of its output is kept."""
    parts, lines, hidden = [], [], False
    for line in source.splitlines():
        marker = "### BEGIN HIDDEN TESTS" in line or "### END HIDDEN TESTS" in line
        if marker:
            parts.append((hidden, "\n".join(lines)))
            lines, hidden = [], "### BEGIN HIDDEN TESTS" in line
        else:
            lines.append(line)
    parts.append((hidden, "\n".join(lines)))
    parts = [(h, s) for h, s in parts if s.strip()]
    try:
        for _, part in parts:
            compile(part, "<part>", "exec")
    except SyntaxError:
        return [(True, source)]
    return parts


class _Printed(io.StringIO):
    """What the visible self-checks print, up to LIMIT characters."""

    LIMIT = 8000

    def write(self, text):
        room = self.LIMIT - self.tell()
        return super().write(text[:max(room, 0)]) if room > 0 else len(text)

    def text(self) -> str:
        text = self.getvalue()
        return text + ("\n[... output cut]" if len(text) >= self.LIMIT else "")


def main() -> int:
    from gclab import zygote
    zygote.die_with_parent(os.getppid())        # the grader: a verdict never outlives it
    channel = int(sys.argv[1])
    job = _read_job(sys.stdin.buffer.read())
    run(job, channel)
    os._exit(0)        # the learner's objects may have finalizers: nothing of theirs runs after the verdict


if __name__ == "__main__":
    sys.exit(main())
