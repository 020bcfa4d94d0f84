"""`gclab grade` on hostile or broken submissions, with a tiny course of its own."""
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import nbformat
import pytest

from gclab.grader import grading, measured, memory_group
from toy_course import lesson, make_course

ROOT = Path(__file__).resolve().parent.parent


# Each test observes what it checks (gclab.checks.observe): the grader compares that with the reference's
TESTS = [("test_double", "checks.observe('double(2)', double(2))\nassert double(2) == 4\n### BEGIN HIDDEN TESTS\n"
                         "checks.observe('double(5)', double(5))\nassert double(5) == 10\n### END HIDDEN TESTS", 1),
         ("test_zero", "checks.assert_untampered()\nchecks.observe('double(0)', double(0))\nassert double(0) == 0", 1)]


def _lesson(answer):
    return lesson(answer, TESTS, setup="import gc\nfrom gclab import checks")


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    return make_course(tmp_path_factory.mktemp("course"), {
        "toy": _lesson("### BEGIN SOLUTION\ndef double(x):\n    return 2 * x\n### END SOLUTION")})


def _submit(course, tmp_path, name, answer):
    path = tmp_path / f"{name}-toy.ipynb"
    nbformat.write(_lesson(answer), path)
    return path


def _raw(tmp_path, name, text):
    path = tmp_path / f"{name}-toy.ipynb"
    path.write_text(text)
    return path


def _variant(tmp_path, name, edit):
    nb = _lesson("def double(x):\n    return 2 * x")
    edit(nb)
    path = tmp_path / f"{name}-toy.ipynb"
    nbformat.write(nb, path)
    return path


def _strip_metadata(nb):
    for cell in nb.cells:
        cell.metadata = {}


def _emptied_tests(nb):
    nb.cells[1].source = "def double(x):\n    return x + 2"
    for cell in nb.cells[2:]:
        cell.source = "pass"


def _deleted_tests(nb):
    nb.cells[1].source = "def double(x):\n    return x + 2"
    del nb.cells[2:]


def _other_lesson(nb):
    for cell in nb.cells:
        if "nbgrader" in cell.metadata:
            cell.metadata["nbgrader"]["grade_id"] = "other_" + cell.metadata["nbgrader"]["grade_id"]


def _answer_copied(first: str, then: str):
    """The answer cell copied in JupyterLab (metadata and all): `first` in it, `then` in its copy."""
    def edit(nb):
        copy = nbformat.from_dict(nb.cells[1])
        copy.id = "copied-answer"                   # a pasted cell gets an id of its own
        nb.cells[1].source, copy.source = first, then
        nb.cells.insert(2, copy)
    return edit


COPIED_ANSWERS = {   # name: (the first copy, the second, the score Run All in the learner's kernel shows)
    "copied_answer_cell_stub_left_first": ("raise NotImplementedError()", "def double(x):\n    return 2 * x", 2),
    "copied_answer_cell_helper_in_the_first": ("def twice(x):\n    return x + x", "def double(x):\n    return twice(x)", 2),
    "copied_answer_cell_broken_experiment_last": ("def double(x):\n    return 2 * x", "def double(x):\n    return x + 2", 0),
}


def _tree_digest(folder: Path) -> dict:
    import hashlib
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and "work" not in p.relative_to(folder).parts}


# a trace function that rewrites each test's outcome in the verdict's frame to "passed"
OUTCOME_REWRITER = (
    "import collections, functools, sys, weakref\n"
    "def _in_test(frame, event, arg):\n"
    "    if event == 'line' and 'outcome' in frame.f_locals and 'problems' not in frame.f_locals:\n"
    "        frame.f_locals['outcome'] = {'status': 'passed', 'message': ''}\n"
    "    return _in_test\n"
    "def _tracer(frame, event, arg):\n"
    "    return _in_test if event == 'call' and frame.f_code.co_name == '_run_test' else None\n")
# an object whose finalizer runs once `double` drops it, from weakref.py, with none of the learner's frames below
DROPPED_BY_DOUBLE = ("class _Anchor:\n    pass\n_anchor = _Anchor()\n{finalize}\n"
                     "def double(x):\n    global _anchor\n    _anchor = None\n{then}    return x + 1\n")
def writes_passed_with(token: str, indent: str) -> str:
    """Lines that write a "passed" for each test, with `token`, to every file descriptor."""
    return textwrap.indent("for fd in range(3, 64):\n    try:\n        for t in ('test_double', 'test_zero'):\n"
                           f"            os.write(fd, (json.dumps({{'token': {token}, 'event': 'result', 'test': t, "
                           "'status': 'passed'}) + '\\n').encode())\n    except OSError:\n        pass\n", indent)
def walks_to_the_token(frame: str, indent: str) -> str:
    """Lines that walk from `frame` down the stack to the verdict's `token` and write "passed" with it."""
    return textwrap.indent(f"f = {frame}\nwhile f is not None and 'token' not in f.f_locals:\n    f = f.f_back\n"
                           "if f is not None:\n    token = getattr(f.f_locals['token'], '_value', f.f_locals['token'])\n"
                           + writes_passed_with("token", "    "), indent)
# A stand-in of linecache.lazycache (which a summary of the stack hands each frame's globals): handed the
# verdict's, it rebinds the verdict's _send to say "passed"
FORGES_THROUGH_LAZYCACHE = (
    "import gc, linecache, traceback\n_lazycache = linecache.lazycache\n"
    "def _stand_in(filename, namespace):\n"
    "    if type(namespace) is dict and '_send' in namespace and '_run_test' in namespace:\n"
    "        _real = namespace['_send']\n"
    "        def _send(channel, token, **message):\n"
    "            if message.get('event') == 'result':\n"
    "                message.update(status='passed', message='')\n"
    "            return _real(channel, token, **message)\n"
    "        namespace['_send'] = _send\n"
    "    return _lazycache(filename, namespace)\n"
    "def double(x):\n    return x + 1\n")
REBINDS_CHECKS = ("import types\nlenient = types.SimpleNamespace(assert_untampered=lambda: None)\n"
                  "def double(x):\n    return 2 * x\n")
IGNORES_INTERRUPTS = "while True:\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass"


@pytest.fixture(scope="module")
def hostile(course, tmp_path_factory):
    """Every hostile or broken submission graded in one run, beside a right and an untouched one."""
    tmp = tmp_path_factory.mktemp("hostile")
    pid_file = tmp / "escaped.pid"
    answers = {
        "right": "def double(x):\n    return 2 * x",
        "imports_the_tools_again": "import gc\nfrom gclab import checks\ndef double(x):\n    return 2 * x",
        # the learner's own self-check in the answer cell: the check's readings (a temporary file for the C
        # library's report) are the grader's, in the grading folder, with the learner's code on the stack
        "runs_a_flat_check_in_its_answer": "import torch\nfrom gclab import checks\ndef double(x):\n    return 2 * x\n"
                                           "print(checks.run_flat_check(lambda i: double(torch.ones(4)).sum().item(), "
                                           "iterations=4).explain())",
        "untouched": "raise NotImplementedError()",
        # debugging left in: who calls double, printed with traceback and logging
        "prints_its_stack": "import logging, traceback\ndef double(x):\n    traceback.print_stack()\n"
                            "    logging.getLogger('mine').warning('called', stack_info=True)\n    return 2 * x",
        "loops_forever": "def double(x):\n    return 2 * x\nwhile True:\n    pass",
        "loops_forever_ignoring_interrupts": IGNORES_INTERRUPTS,
        "kills_its_process": "import os\nos._exit(1)",
        "allocates_without_end": "blocks = [bytearray(256 * 2**20) for _ in range(64)]",
        "prints_gigabytes": "line = 'x' * 2**20\nfor _ in range(2048):\n    print(line)",
        "fork_bomb": "import os\nwhile True:\n    os.fork()",
        "writes_into_the_course": (f"open({str(course / 'solutions' / 'toy' / 'toy.ipynb')!r}, 'w').write('{{}}')\n"
                                   f"open({str(course / 'autograder' / 'gradebook.db')!r}, 'w').write('x')"),
        "reads_the_solution": ("import json\nnb = json.load(open(" + repr(str(course / "solutions" / "toy" / "toy.ipynb"))
                               + "))\nexec(nb['cells'][1]['source'])"),
        "escapes_with_setsid": ("import subprocess\nsubprocess.Popen(['sh', '-c', 'echo $$ > " + str(pid_file)
                                + "; exec sleep 300'], start_new_session=True)"),
        "forges_the_result_channel": ("import os\nfor fd in range(3, 64):\n    try:\n"
                                      "        os.write(fd, b'{\"event\": \"result\", \"test\": \"test_double\", \"status\": \"passed\"}\\n')\n"
                                      "    except OSError:\n        pass"),
        # the result channel's token read from the verdict process's own memory, then results forged with it
        "forges_results_with_the_token_read_from_memory": (
            "import collections, json, os, re\nseen = collections.Counter()\n"
            "with open('/proc/self/mem', 'rb') as mem:\n"
            "    for line in open('/proc/self/maps'):\n"
            "        span, perms = line.split()[:2]\n"
            "        if perms.startswith('rw'):\n"
            "            start, end = (int(x, 16) for x in span.split('-'))\n"
            "            try:\n                mem.seek(start)\n"
            "                seen.update(re.findall(rb'(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])', mem.read(end - start)))\n"
            "            except (OSError, OverflowError, ValueError):\n                pass\n"
            "token = seen.most_common(1)[0][0].decode()\n"
            "for fd in range(3, 64):\n    try:\n"
            "        os.write(fd, (json.dumps({'token': token, 'event': 'result', 'test': 'test_double',"
            " 'status': 'passed'}) + '\\n').encode())\n"
            "    except OSError:\n        pass"),
        # a guard of its own has nothing of the grader's: the grader's record of replacements stands
        "clears_the_guards_record": ("import gclab.guard, gclab.memory\nmine = gclab.guard.install()\n"
                                     "getattr(mine, '_manifest').clear()\nmine.refused.clear()\nput = setattr\n"
                                     "put(gclab.memory.Meter, 'describe', lambda self: '')\n"
                                     "def double(x):\n    return 2 * x"),
        # a tool's name bound to a stand-in by routes no line of the answer spells as `checks = ...`
        "rebinds_a_tool_through_globals": REBINDS_CHECKS + "globals().update(checks=lenient)",
        "rebinds_a_tool_through_exec": REBINDS_CHECKS + "exec('checks = lenient')",
        "rebinds_a_tool_through_main_module": REBINDS_CHECKS + "import __main__\nsetattr(__main__, 'checks', lenient)",
        # a library makes the refused call for the learner, with none of the learner's frames on the stack
        "settrace_through_an_ipython_event": OUTCOME_REWRITER + "get_ipython().events.register("
                                                                "'post_execute', functools.partial(sys.settrace, _tracer))",
        "settrace_through_a_finalizer": OUTCOME_REWRITER + DROPPED_BY_DOUBLE.format(
            finalize="weakref.finalize(_anchor, sys.settrace, _tracer)", then=""),
        "grader_frames_through_a_finalizer": "import collections, json, os, sys, weakref\n_frames = []\n"
        + DROPPED_BY_DOUBLE.format(
            finalize="weakref.finalize(_anchor, collections.deque(maxlen=0).extend, map(_frames.append, map(sys._getframe, [1])))",
            then="    f = _frames[0] if _frames else None\n    while f is not None and 'token' not in f.f_locals:\n"
                 "        f = f.f_back\n    if f is not None:\n" + writes_passed_with("f.f_locals['token']", " " * 8)),
        "token_found_with_objgraph": "import json, objgraph, os\n"
        "jobs = [d for d in objgraph.by_type('dict') if isinstance(d.get('token'), str) and 'tests' in d]\n"
        "if jobs:\n" + writes_passed_with("jobs[0]['token']", " " * 4),
        # the verdict's frames are below the answer's: a summary of the stack lists their locals' reprs
        "token_read_from_a_summary_of_the_stack": "import json, os, traceback\nfound = [f.locals['token'].strip(\"'\")"
        " for f in traceback.StackSummary.extract(traceback.walk_stack(None), capture_locals=True)\n"
        "         if f.locals and 'token' in f.locals]\nif found:\n" + writes_passed_with("found[0]", " " * 4),
        # a signal handler is called with the frame it interrupted: the verdict's, below the answer's
        "signal_handler_reads_the_grader_frames": "import json, os, signal\ndef double(x):\n    return x + 1\n"
        "def handler(number, frame):\n" + walks_to_the_token("frame", " " * 4)
        + "signal.signal(signal.SIGALRM, handler)\nsignal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)",
        # a library function that calls what it is given hands back the frame sys._getframe returns
        "frames_through_singledispatch": "import functools, json, os, sys\ndef double(x):\n    return x + 1\n"
        "def steal():\n" + walks_to_the_token("functools.singledispatch(sys._getframe)(0)", " " * 4) + "steal()",
        # the audit hook handed a path object: its __fspath__ must not run inside the hook, where no event is judged
        "fspath_called_inside_the_hook": "import json, os, shutil, sys\ndef double(x):\n    return x + 1\n"
        "class Path:\n    def __fspath__(self):\n" + walks_to_the_token("sys._getframe(0)", " " * 8)
        + "        return 'nowhere'\nshutil.rmtree(Path(), ignore_errors=True)",
        # a key of its own in a library module's globals, with the hash of a name the hook looks up there (one that
        # traceback's code itself looks up only for a negative limit): the lookup would call its __eq__ inside the
        # hook, where no event is judged
        "key_compared_inside_the_hook": "import json, os, sys, traceback\ndef double(x):\n    return x + 1\n"
        "class Key(str):\n    armed = False\n    def __hash__(self):\n        return hash('collections')\n"
        "    def __eq__(self, other):\n        if Key.armed:\n" + walks_to_the_token("sys._getframe(0)", " " * 12)
        + "        return False\n_module = vars(traceback)\n_value = _module.pop('collections')\n"
        "_module[Key('k')] = None\n_module['collections'] = _value\nKey.armed = True\n"
        "try:\n    1 / 0\nexcept ZeroDivisionError:\n    traceback.format_exc()",
        # a library function allowed to read its own frame (objgraph's _find_chain) hands it to `id`, a builtin: one
        # shadowed by a global of the learner's in objgraph's module is handed the frame
        "frame_through_a_builtin_shadowed_in_a_library": "import json, objgraph, os\ndef double(x):\n    return x + 1\n"
        "class Stolen(Exception):\n    pass\ndef _id(obj):\n    if type(obj).__name__ == 'frame':\n"
        + walks_to_the_token("obj", " " * 8) + "        raise Stolen\n    return id(obj)\n"
        "vars(objgraph)['id'] = _id\ntry:\n    objgraph.find_backref_chain(object(), lambda found: False, max_depth=1)\n"
        "except Stolen:\n    pass\ndel vars(objgraph)['id']",
        # a collector callback (added where no line spells gc.callbacks.append), run by a collection that an allocation
        # of the hook's started, inside the hook, where no event was judged: the grader's frames, then the guard's
        # record of refusals cleared through them
        "collector_callback_inside_the_hook": "import gc, json, os, sys, traceback\ndef double(x):\n    return x + 1\n"
        "_won = []\ndef _callback(phase, info):\n    if _won:\n        return\n    try:\n"
        "        f = sys._getframe(1)\n    except Exception:\n        return\n    _won.append(f)\n"
        "    g = f\n    while g is not None:\n        if g.f_code.co_name == 'hook' and 'self' in g.f_locals:\n"
        "            g.f_locals['self'].refused.clear()\n        g = g.f_back\n"
        + walks_to_the_token("f", " " * 4) + "_callbacks = gc.callbacks\n_callbacks.append(_callback)\n"
        "gc.set_threshold(1)\ntry:\n    1 / 0\nexcept ZeroDivisionError:\n    traceback.format_exc()\n"
        "gc.set_threshold(700)\n_callbacks.remove(_callback)",
        # a tool replaced through a module's __dict__ by an object that claims to wrap it: the manifest's check would
        # believe it, and run its __getattr__ where no event is judged
        "claims_to_wrap_a_tool": "import gc, json, os, sys, traceback\ndef double(x):\n    return x + 1\n"
        "class LooksWrapped:\n    __code__ = traceback.format_exc.__code__\n    def __getattr__(self, name):\n"
        + walks_to_the_token("sys._getframe(0)", " " * 8) + "        return _original\n"
        "    def __call__(self):\n        return _original()\n"
        "_original = gc.get_stats\nvars(gc).update(get_stats=LooksWrapped())",
        # the verdict's own names and the libraries it used, rebound: json.dumps sees every result (and the token),
        # contextlib's redirect_stdout could swallow a self-check's AssertionError, _run_test could say "passed"
        "rewrites_results_in_json_dumps": "import json\n_dumps = json.dumps\n"
        "def _passed(obj, *args, **kwargs):\n    if type(obj) is dict and obj.get('event') == 'result':\n"
        "        obj = {**obj, 'status': 'passed', 'message': ''}\n    return _dumps(obj, *args, **kwargs)\n"
        "json.dumps = _passed\ndef double(x):\n    return x + 1",
        "swallows_failures_in_redirect_stdout": "import contextlib\n"
        "contextlib._RedirectStream.__exit__ = lambda self, *exc: True\ndef double(x):\n    return x + 1",
        "rebinds_the_verdicts_own_names": "import gclab.grader.verdict\nvars(gclab.grader.verdict)['_run_test'] = "
        "lambda *args: {'status': 'passed', 'message': '', 'output': ''}\ndef double(x):\n    return x + 1",
        # sys._getframe called in C by a callable handed to gclab's code (a flat check's step): the frame is gclab's
        "step_that_calls_getframe_in_c": "import collections, json, os, sys, torch\ndef double(x):\n    return x + 1\n"
        "def steal():\n    seen = collections.defaultdict(sys._getframe)\n    try:\n"
        "        checks.run_flat_check(seen.__getitem__, iterations=1, device=torch.device('cpu'))\n"
        "    except BaseException:\n        pass\n    for frame in list(seen.values()):\n"
        + walks_to_the_token("frame", " " * 8) + "steal()",
        # a torch function mode left on: every torch call of the tests goes through it
        "torch_function_mode_left_active": "import torch\nfrom torch.overrides import TorchFunctionMode\n"
        "class Lenient(TorchFunctionMode):\n    def __torch_function__(self, func, types, args=(), kwargs=None):\n"
        "        return func(*args, **(kwargs or {}))\nLenient().__enter__()\ndef double(x):\n    return x + 1",
        # the stand-in put in place after the summary's check, by the learner's code that the summary runs: a
        # loader's __getattr__ (looked up for a frame whose globals name it), a collector callback
        "loader_asked_while_the_stack_is_summarised": FORGES_THROUGH_LAZYCACHE
        + "class _Loader:\n    def __getattr__(self, name):\n        vars(linecache)['lazycache'] = _stand_in\n"
        "_mine = {'__name__': 'mine', '__loader__': _Loader(), 'traceback': traceback}\n"
        "try:\n    exec(compile('traceback.extract_stack()', '/nonexistent/mine.py', 'exec'), _mine)\n"
        "except Exception:\n    pass\nvars(linecache)['lazycache'] = _lazycache",
        "collector_callback_after_the_summarys_check": FORGES_THROUGH_LAZYCACHE
        + "_seen = []\ndef _callback(phase, info):\n    _seen.append(phase)\n    if len(_seen) == 3:\n"
        "        vars(linecache)['lazycache'] = _stand_in\n"
        "def _summarise():\n    _callbacks.append(_callback)\n    gc.set_threshold(1)\n    traceback.extract_stack()\n"
        "_callbacks = gc.callbacks\n_summarise()\ngc.set_threshold(700)\n_callbacks.remove(_callback)\n"
        "vars(linecache)['lazycache'] = _lazycache",
        # the functions IPython's traceback of the cell's error hands its frames to, rebound
        "rebinds_what_ipython_hands_frames_to": "import json, os, sys, types\nimport IPython.core.ultratb\n"
        "def double(x):\n    return x + 1\n_done = []\ndef _wrap(function):\n    def spy(*args, **kwargs):\n"
        "        for arg in args:\n"
        "            if type(arg) is types.FrameType and not _done:\n                _done.append(arg)\n"
        + walks_to_the_token("arg", " " * 16) + "        return function(*args, **kwargs)\n    return spy\n"
        "_module = vars(IPython.core.ultratb)\nfor _name, _value in list(_module.items()):\n"
        "    if type(_value) is types.FunctionType:\n        _module[_name] = _wrap(_value)\n"
        "raise ValueError('the traceback is drawn')",
        # an exception kept by test_double's call, whose traceback's frames lead to the verdict's; in test_zero's
        # call, gclab.held walks it with isinstance rebound, and the stand-in is handed those frames
        "frames_through_a_builtin_gclabs_walk_calls": "import builtins, json, os, types\nimport gclab.held\n_kept = []\n"
        "def _inner():\n    raise ValueError('kept')\n_real = builtins.isinstance\n_seen = []\n"
        "def _spy(obj, kinds):\n    if type(obj) is types.FrameType and not _seen:\n        _f = obj\n"
        "        while _f is not None and 'token' not in _f.f_locals:\n            _f = _f.f_back\n"
        "        if _f is not None:\n            _seen.append(_f)\n    return _real(obj, kinds)\n"
        "def double(x):\n    if not _kept:\n        try:\n            _inner()\n        except ValueError as e:\n"
        "            _kept.append(e)\n    else:\n        vars(builtins)['isinstance'] = _spy\n        try:\n"
        "            gclab.held.tensors_held(_kept, 'kept')\n        finally:\n"
        "            vars(builtins)['isinstance'] = _real\n        if _seen:\n"
        "            token = getattr(_seen[0].f_locals['token'], '_value', _seen[0].f_locals['token'])\n"
        + writes_passed_with("token", " " * 12) + "            os._exit(0)\n    return x + 1\n",
        "warns": "import warnings\ndef double(x):\n    warnings.warn('a library warning')\n    return 2 * x",
        # an answer cell's error goes with every test's result: megabytes of it must not pass for a crash
        "right_then_raises_megabytes": "def double(x):\n    return 2 * x\nraise ValueError('x' * 3_000_000)",
        # an error whose message cannot be read: its __str__ raises
        "raises_an_unprintable_error": "class Unprintable(Exception):\n    def __str__(self):\n"
                                       "        raise Unprintable()\ndef double(x):\n    raise Unprintable()",
        # a failed assertion of megabytes, the learner's own
        "fails_an_assertion_of_megabytes": "def double(x):\n    assert x < 0, 'x' * 3_000_000\n    return 2 * x",
        "wrong": "def double(x):\n    return x + 2",
    }
    paths = {name: _submit(course, tmp, name, src) for name, src in answers.items()}
    paths["invalid_json"] = _raw(tmp, "invalid_json", "{ not a notebook")
    paths["stripped_metadata"] = _variant(tmp, "stripped_metadata", _strip_metadata)
    paths["emptied_test_cells"] = _variant(tmp, "emptied_test_cells", _emptied_tests)
    paths["deleted_test_cells"] = _variant(tmp, "deleted_test_cells", _deleted_tests)
    paths["right_but_deleted_test_cells"] = _variant(tmp, "right_but_deleted_test_cells", lambda nb: nb.cells.__delitem__(slice(2, None)))
    paths["another_lessons_notebook"] = _variant(tmp, "another_lessons_notebook", _other_lesson)
    for name, (first, then, _) in COPIED_ANSWERS.items():
        paths[name] = _variant(tmp, name, _answer_copied(first, then))
    before = _tree_digest(course)
    started = time.monotonic()
    graded = grading.grade(list(paths.values()), root=course, cell_timeout=10, memory_limit=6 * 1024**3, jobs=2)
    return {"results": dict(zip(paths, graded)), "seconds": time.monotonic() - started,
            "course_before": before, "course_after": _tree_digest(course), "pid_file": pid_file}


HOSTILE = ["loops_forever_ignoring_interrupts", "kills_its_process", "allocates_without_end", "prints_gigabytes",
           "fork_bomb", "writes_into_the_course", "reads_the_solution", "forges_the_result_channel", "invalid_json",
           "stripped_metadata", "emptied_test_cells", "deleted_test_cells", "another_lessons_notebook",
           "escapes_with_setsid", "clears_the_guards_record", "rebinds_a_tool_through_globals",
           "rebinds_a_tool_through_exec", "rebinds_a_tool_through_main_module",
           "forges_results_with_the_token_read_from_memory", "settrace_through_an_ipython_event",
           "settrace_through_a_finalizer", "grader_frames_through_a_finalizer", "token_found_with_objgraph",
           "token_read_from_a_summary_of_the_stack", "signal_handler_reads_the_grader_frames",
           "frames_through_singledispatch", "fspath_called_inside_the_hook",
           "rewrites_results_in_json_dumps", "swallows_failures_in_redirect_stdout", "rebinds_the_verdicts_own_names",
           "step_that_calls_getframe_in_c", "torch_function_mode_left_active", "key_compared_inside_the_hook",
           "claims_to_wrap_a_tool", "frame_through_a_builtin_shadowed_in_a_library",
           "collector_callback_inside_the_hook", "loader_asked_while_the_stack_is_summarised",
           "collector_callback_after_the_summarys_check", "rebinds_what_ipython_hands_frames_to",
           "frames_through_a_builtin_gclabs_walk_calls"]


def test_right_and_untouched_submissions_beside_the_hostile_ones(hostile):
    results = hostile["results"]
    assert results["right"].score == 2, grading.format_results([results["right"]])
    assert results["untouched"].score == 0


def test_an_error_of_megabytes_is_cut_not_taken_for_a_crash(hostile):
    right = hostile["results"]["right_then_raises_megabytes"]
    assert right.score == 2, grading.format_results([right])
    wrong = hostile["results"]["fails_an_assertion_of_megabytes"]
    assert wrong.score == 0 and all(t.status == "failed" for t in wrong.tests), grading.format_results([wrong])
    assert all("more characters]" in t.message and len(t.message) < 5000 for t in wrong.tests), grading.format_results([wrong])


def test_an_error_that_cannot_be_printed_is_said_so(hostile):
    result = hostile["results"]["raises_an_unprintable_error"]
    assert result.score == 0, grading.format_results([result])
    assert all(t.message == "Unprintable: (its message could not be read: turning it into text raised an error)"
               for t in result.tests), grading.format_results([result])


def test_importing_the_set_up_cells_tools_again_is_not_tampering(hostile):
    result = hostile["results"]["imports_the_tools_again"]
    assert result.score == 2, grading.format_results([result])


def test_a_flat_check_run_by_the_answer_itself_is_not_tampering(hostile):
    result = hostile["results"]["runs_a_flat_check_in_its_answer"]
    assert result.score == 2, grading.format_results([result])


def test_printing_the_stack_is_not_tampering(hostile):
    """traceback.print_stack and logging's stack_info read the grader's frames, and print only their names and lines."""
    result = hostile["results"]["prints_its_stack"]
    assert result.score == 2, grading.format_results([result])


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_submission_scores_no_more_than_the_untouched_one_and_says_why(hostile, name):
    result = hostile["results"][name]
    assert result.max_score == 2 and result.score <= hostile["results"]["untouched"].score, grading.format_results([result])
    assert all(t.message for t in result.tests), grading.format_results([result])


@pytest.mark.parametrize("name, words", [
    ("loops_forever_ignoring_interrupts", "did not stop when interrupted"),
    ("kills_its_process", "ended the process that ran it"),
    ("fork_bomb", "os.fork"),
    ("writes_into_the_course", "outside the grading folder"),
    ("reads_the_solution", "the course's own files"),
    ("escapes_with_setsid", "subprocess.Popen"),
    ("forges_the_result_channel", "result channel"),
    ("forges_results_with_the_token_read_from_memory", "(a process's memory)"),
    ("settrace_through_an_ipython_event", "your process reported that the test passed, but it recorded 0 outputs"),
    ("frames_through_singledispatch", "your process reported that the test passed, but it recorded 0 outputs"),
    ("fspath_called_inside_the_hook", "your process reported that the test passed, but it recorded 0 outputs"),
    ("step_that_calls_getframe_in_c", "your process reported that the test passed, but it recorded 0 outputs"),
    ("key_compared_inside_the_hook", "your process reported that the test passed, but it recorded 0 outputs"),
    ("frame_through_a_builtin_shadowed_in_a_library", "your process reported that the test passed, but it recorded 0 outputs"),
    ("collector_callback_inside_the_hook", "your process reported that the test passed, but it recorded 0 outputs"),
    ("rebinds_the_verdicts_own_names", "gclab.grader.verdict._run_test was replaced"),
    ("torch_function_mode_left_active", "a torch function mode the notebook's code entered is still active"),
    ("claims_to_wrap_a_tool", "gc.get_stats was replaced"),
    ("rebinds_what_ipython_hands_frames_to", "ValueError: the traceback is drawn"),
    ("clears_the_guards_record", "gclab.memory.Meter.describe was replaced"),
    ("rebinds_a_tool_through_globals", "checks (which the set-up cell imports) was rebound by the notebook's code"),
    ("rebinds_a_tool_through_exec", "checks (which the set-up cell imports) was rebound"),
    ("rebinds_a_tool_through_main_module", "checks (which the set-up cell imports) was rebound"),
    ("invalid_json", "not a readable notebook"),
    ("stripped_metadata", "no answer cell answer"),
    ("another_lessons_notebook", "no answer cell answer"),
])
def test_hostile_submission_reason_names_what_happened(hostile, name, words):
    result = hostile["results"][name]
    assert words in result.reason + " ".join(t.message for t in result.tests), grading.format_results([result])


@pytest.mark.parametrize("name", COPIED_ANSWERS)
def test_every_copy_of_an_answer_cell_runs_in_order_and_the_learner_is_told(hostile, name):
    result = hostile["results"][name]
    assert result.score == COPIED_ANSWERS[name][2], grading.format_results([result])
    assert "answer cell answer is in the notebook 2 times" in result.reason, result.reason


def test_the_course_folder_is_intact_after_hostile_submissions(hostile):
    assert hostile["course_after"] == hostile["course_before"]


def test_no_process_a_submission_started_outlives_grading(hostile):
    pid_file = hostile["pid_file"]
    assert not pid_file.exists() or not _running(int(pid_file.read_text()))


def test_a_runaway_answer_cell_is_interrupted_and_the_tests_still_run(hostile):
    assert hostile["results"]["loops_forever"].score == 2, "double was defined before the loop"


def test_a_python_warning_does_not_zero_a_test(hostile):
    assert hostile["results"]["warns"].score == 2


def test_deleted_test_cells_are_graded_from_the_lesson(hostile):
    assert hostile["results"]["right_but_deleted_test_cells"].score == 2
    assert hostile["results"]["wrong"].score == 0 and hostile["results"]["wrong"].tests[0].status == "failed"


def test_hostile_submissions_do_not_stall_the_run(hostile):
    assert hostile["seconds"] < 600, f"grading {len(hostile['results'])} submissions took {hostile['seconds']:.0f} s"


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"                   # a zombie has stopped; only its exit status is left


def _parent_of(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return 0


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")     # utime + stime


def _stopped_in_time(pid: int, seconds: float = 5) -> bool:
    deadline = time.monotonic() + seconds
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _running(pid)


def _started_as_a_verdict(pid: int) -> bool:
    """Started as `gclab.grader.verdict` (a fresh Python), which shows a kernel's command line once it runs."""
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    return b"gclab.grader.verdict" in cmdline or b"ipykernel_launcher" in cmdline


def _verdict_processes() -> list:
    """Verdict processes still running: started as `gclab.grader.verdict`, or forked from the grader's
    zygote server (the one process allowed to stay; its children show a kernel's command line)."""
    servers = {z.proc.pid for z in grading._ZYGOTE}
    return [pid for pid in _descendants_of(os.getpid()) if pid not in servers and _running(pid)
            and (_parent_of(pid) in servers or _started_as_a_verdict(pid))]


def _descendants_of(parent: int) -> list:
    from gclab.grader._nbgrader_job import _children_of, _descendants
    return _descendants(_children_of(parent))


def test_a_notebook_that_times_out_as_a_whole_is_stopped_with_its_process(course, tmp_path):
    path = _submit(course, tmp_path, "slow", "import time\ntime.sleep(600)")
    [result] = grading.grade([path], root=course, timeout=15)
    assert grading._ZYGOTE, "the verdict should have been forked from the zygote server"
    assert result.score == 0
    assert all(t.status == "timeout" for t in result.tests)
    assert "longer than 15 s" in result.reason
    assert not _verdict_processes(), "the verdict process of a stopped grading job is still running"


@pytest.mark.parametrize("forked", [True, False], ids=["forked_from_the_zygote", "started_as_a_process"])
def test_a_grader_killed_mid_grading_leaves_no_verdict_running(course, tmp_path, forked):
    """A grader killed outright (SIGKILL: no clean-up runs) takes its verdict processes with it: the one
    grading a notebook that loops forever would run on, unwatched, for good."""
    path = _submit(course, tmp_path, "loops_forever", IGNORES_INTERRUPTS)
    env = dict(os.environ, GCLAB_GRADE_FORK="1" if forked else "0")
    grader = subprocess.Popen([sys.executable, "-m", "gclab", "grade", str(path)], cwd=course, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # the verdict that runs the notebook: the zygote server's child, or the one process started; in the loop
        # once it has used more CPU than its start-up takes (the server's imports, or a fresh process's)
        deadline, verdicts, looping = time.monotonic() + 90, [], lambda: False
        while time.monotonic() < deadline and not looping():
            time.sleep(0.2)
            verdicts = [pid for pid in _descendants_of(grader.pid) if _running(pid)
                        and (forked or _started_as_a_verdict(pid))]
            runs_it = [pid for pid in verdicts if _parent_of(pid) in verdicts] if forked else verdicts
            looping = lambda: any(_cpu_seconds(pid) > (2 if forked else 6) for pid in runs_it)   # noqa: E731
        assert looping(), "no verdict process ran the submission's loop"
    finally:
        grader.kill()
        grader.wait()
    assert all(_stopped_in_time(pid) for pid in verdicts), "a verdict process outlived its grader"


def test_a_job_run_as_a_subprocess_is_stopped_with_what_it_started(tmp_path):
    """A job (nbgrader's generation) is a subprocess; a timeout stops it and the processes it started."""
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
    "if True:\n    Meter = dict",
    "def swap():\n    global checks\n    checks = None",
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
    # a function's or a class's own names of the same spelling replace nothing the tests use
    "def unseen(mode):\n    checks, fb = mode.size, mode.weak\n    return checks",
    "class Node:\n    Meter = None\n    def link(self):\n        for fb in range(2):\n            pass",
    "f = lambda checks: checks",
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


def test_a_submission_leaves_nothing_behind_for_the_next(course, tmp_path):
    """Verdicts forked from one zygote server each start from it untouched."""
    first = _submit(course, tmp_path, "sets_state", "import os, json\nos.environ['LEFT_BEHIND'] = '1'\n"
                                                   "json.LEFT_BEHIND = 1\ndef double(x):\n    return 2 * x")
    second = _submit(course, tmp_path, "reads_state", "import os, json\ndef double(x):\n"
                                                     "    return 0 if 'LEFT_BEHIND' in os.environ or hasattr(json, 'LEFT_BEHIND') else 2 * x")
    results = grading.grade([first, second], root=course)
    assert [r.score for r in results] == [2.0, 2.0], grading.format_results(results)


def test_torchs_own_cache_folders_go_in_the_grading_folder_wherever_the_grader_points_them(course, tmp_path, monkeypatch):
    """An optimizer imports torch._dynamo, which makes its cache folder: with the grader's environment
    pointing it outside (TORCHINDUCTOR_CACHE_DIR is set once dynamo was imported anywhere), that write
    must not be taken for the submission tampering."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "outside" / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "outside" / "triton"))
    monkeypatch.setenv("GCLAB_GRADE_FORK", "0")            # a verdict process started with this environment
    path = _submit(course, tmp_path, "trains", "import torch\n_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)\n"
                                               "def double(x):\n    return 2 * x")
    [result] = grading.grade([path], root=course)
    assert result.score == 2.0, grading.format_results([result])
    assert not (tmp_path / "outside").exists()


FORKED_UNTIL_THE_GUARD = '''
import os, sys
from gclab import guard
from gclab.grader import verdict
verdict.preload()
preloaded = set(sys.modules)

def stop_at_the_guard(*args, **kwargs):         # the verdict's own output goes nowhere: a file
    with open("imported-after-the-fork.txt", "w") as out:
        out.write(repr(sorted(set(sys.modules) - preloaded)))
    os._exit(0)

guard.install = stop_at_the_guard
job_read, job_write = os.pipe()
channel_read, channel = os.pipe()
os.write(job_write, b'{"token": "t", "workdir": "%s", "cells": [], "tests": []}')
os.close(job_write)
verdict.forked({"memory_limit": None}, [job_read, channel])
'''


def test_a_forked_verdict_imports_nothing_before_the_learners_code(tmp_path):
    """What a verdict needs is imported once by the zygote server: a module imported after the fork
    is paid again by every submission (nbformat, through gclab.grader.grading, cost 2 s each)."""
    done = subprocess.run([sys.executable, "-c", FORKED_UNTIL_THE_GUARD % tmp_path], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    imported = (tmp_path / "imported-after-the-fork.txt").read_text()
    assert imported == "[]", f"imported after the fork, by every verdict: {imported}"


# The first test keeps double(2)'s answer; when its namespace is let go (after its own check for tampering),
# the answer's finalizer puts in a builtins.all that says True once and then puts the real one back
BUILTIN_TESTS = [("test_kept", "from gclab import checks\n_kept = double(2)\nchecks.observe('kept', int(_kept))\nassert _kept == 4", 1),
                 ("test_all", "from gclab import checks\nchecks.observe('doubles', [double(i) for i in (0, 1, 2)])\n"
                              "assert all(double(i) == 2 * i for i in (0, 1, 2))", 1)]
PLANTS_A_BUILTIN_BETWEEN_TESTS = (
    "import builtins\n_real_all = builtins.all\n"
    "def _all(items):\n    vars(builtins)['all'] = _real_all\n    return True\n"
    "class _Planter(int):\n    def __del__(self):\n        vars(builtins)['all'] = _all\n"
    "def double(x):\n    return _Planter(4) if x == 2 else x + 1\n")


def test_a_builtin_rebound_between_two_tests_reaches_neither(tmp_path):
    """The tests run with builtins copied before the answer ran, and a tool or builtin replaced when a test
    starts is tampering even when it is put back before the test ends."""
    course = make_course(tmp_path / "course", {"toy": lesson(
        "### BEGIN SOLUTION\ndef double(x):\n    return 2 * x\n### END SOLUTION", BUILTIN_TESTS)})
    path = tmp_path / "plants_a_builtin_between_tests-toy.ipynb"
    nbformat.write(lesson(PLANTS_A_BUILTIN_BETWEEN_TESTS, BUILTIN_TESTS), path)
    [result] = grading.grade([path], root=course, cell_timeout=10)
    assert result.score == 0 and "builtins.all was replaced" in result.reason, grading.format_results([result])


# A step that leaks only while the meter watches, and a stand-in that says True to the flat check's
# `all(g == 0 for g in growth)` the three times it is asked (run_flat_check twice, assert_flat once), then
# puts the real one back: before gclab's names were pinned it passed the leak off as flat
FLAT_TESTS = [("test_flat", "checks.assert_flat(checks.run_flat_check(step, iterations=10))", 2)]
LEAKS_WHILE_WATCHED = (
    "import builtins, sys, types, torch\n_kept = []\n_real_all = builtins.all\n_asked = []\n"
    "def step(i):\n"
    "    if torch._C._len_torch_dispatch_stack():\n        _kept.append(torch.ones(1000))\n"
    "    if i == 9:\n        {plant}\n"
    "def _all(items):\n"
    "    if type(items) is not types.GeneratorType:\n        return _real_all(items)\n"
    "    _asked.append(1)\n"
    "    if len(_asked) == 3:\n        {restore}\n"
    "    return True\n")
LIES_INSIDE_GCLABS_CHECK = {
    "builtin_that_lies_to_the_flat_check_then_restores": LEAKS_WHILE_WATCHED.format(
        plant="vars(builtins)['all'] = _all", restore="vars(builtins)['all'] = _real_all"),
    "checks_global_that_lies_to_the_flat_check_then_goes": LEAKS_WHILE_WATCHED.format(
        plant="vars(sys.modules['gclab.' + 'checks'])['all'] = _all",
        restore="del vars(sys.modules['gclab.' + 'checks'])['all']"),
}


def test_a_name_gclabs_check_reads_cannot_be_swapped_while_it_runs(tmp_path):
    """gclab's code looks up none of its global names while it runs (`gclab.pinning`): a builtin or a name
    put in gclab's module that lies to the flat check and then goes is never asked."""
    course = make_course(tmp_path / "course", {"toy": lesson(
        "### BEGIN SOLUTION\ndef step(i):\n    torch.ones(1000)\n### END SOLUTION", FLAT_TESTS,
        setup="import gc, torch\nfrom gclab import checks")})
    paths = []
    for name, answer in LIES_INSIDE_GCLABS_CHECK.items():
        paths.append(tmp_path / f"{name}-toy.ipynb")
        nbformat.write(lesson(answer, FLAT_TESTS, setup="import gc, torch\nfrom gclab import checks"), paths[-1])
    builtin, module_global = grading.grade(paths, root=course, cell_timeout=30)
    assert builtin.score == 0 and "builtins.all was replaced" in builtin.reason, grading.format_results([builtin])
    assert module_global.score == 0, grading.format_results([module_global])
    assert "memory did not return to its baseline" in module_global.tests[0].message, grading.format_results([module_global])


def _with_example_cell(answer):
    """The toy lesson with an example cell (no nbgrader metadata) after the set-up: it defines `helper`."""
    nb = _lesson(answer)
    nb.cells.insert(1, nbformat.v4.new_code_cell("def helper(x):\n    return x * 2"))
    return nb


def test_a_name_only_an_example_cell_defines_is_said_so(tmp_path):
    """Grading runs the set-up and given cells, the answers and the tests, not the lesson's examples: an answer
    that uses a name an example defines is told why it is not defined."""
    course = make_course(tmp_path / "course", {"toy": _with_example_cell(
        "### BEGIN SOLUTION\ndef double(x):\n    return 2 * x\n### END SOLUTION")})
    path = tmp_path / "uses_an_examples_helper-toy.ipynb"
    nbformat.write(_with_example_cell("def double(x):\n    return helper(x)"), path)
    [result] = grading.grade([path], root=course, cell_timeout=10)
    assert result.score == 0, grading.format_results([result])
    assert all("'helper' is defined in one of the lesson's example cells, which grading does not run" in t.message
               for t in result.tests), grading.format_results([result])


def test_a_reference_is_kept_apart_for_each_way_a_verdict_is_started(monkeypatch):
    """A reference run in a fresh Python, or with every assert stripped, is never the figure a forked
    verdict is compared with (lesson 04's reference, run so by a test of forgeries, once took 1.63 s of CPU
    in a test where a forked right answer spends 0.09 s, and right answers graded after it lost 5 points)."""
    kept = []
    monkeypatch.setattr(measured, "reference", lambda cache, compute: kept.append(cache.name) or {})

    def kept_as(**variables):
        with monkeypatch.context() as changed:
            for name in ("GCLAB_GRADE_FORK", "GCLAB_GRADE_WALLS", "GCLAB_GRADE_STRIP_ASSERTS"):
                changed.delenv(name, raising=False)
            for name, value in variables.items():
                changed.setenv(name, value)
            grading.reference_of(ROOT, "04_awaitable_callback_oom")
        return kept[-1]

    usual = kept_as()
    assert usual == kept_as()
    for name, value in (("GCLAB_GRADE_FORK", "0"), ("GCLAB_GRADE_WALLS", "0"), ("GCLAB_GRADE_STRIP_ASSERTS", "1")):
        assert kept_as(**{name: value}) != usual, name


# Right only where its process shows a kernel's command line and no variable of the grader's
RIGHT_ONLY_UNSEEN = ("def double(x):\n"
                     "    cmdline, environ = (open(f'/proc/self/{name}', 'rb').read() for name in ('cmdline', 'environ'))\n"
                     "    unseen = b'ipykernel_launcher' in cmdline and b'gclab' not in cmdline and b'GCLAB_GRADE' not in environ\n"
                     "    return 2 * x if unseen else -1")


@pytest.mark.parametrize("forked", [True, False], ids=["forked_from_the_zygote", "started_as_a_process"])
def test_a_verdict_shows_a_kernels_command_line_however_deep_its_grading_folder(course, tmp_path, monkeypatch,
                                                                                 forked):
    """A verdict started as a fresh Python showed `python -m gclab.grader.verdict` and the grader's variables
    (GCLAB_GRADE_FORK=0 among them); one forked from a zygote started for a shallower grading folder (`grade`,
    then `grade-class` in one process) kept the zygote's command line: code right only there got full marks."""
    monkeypatch.setenv("GCLAB_GRADE_FORK", "1" if forked else "0")
    path = _submit(course, tmp_path, "right_only_unseen", RIGHT_ONLY_UNSEEN)
    deeper = tmp_path / "deeper"
    deeper.mkdir()
    [shallow] = grading.grade([path], root=course)
    monkeypatch.setattr(tempfile, "tempdir", str(deeper))         # as grade-class's scratch folder does
    [deep] = grading.grade([path], root=course)
    assert (shallow.score, deep.score) == (2, 2), grading.format_results([shallow, deep])
    assert not forked or len(grading._ZYGOTE) == 1, "the zygote no verdict used any more was not ended"


def test_loading_the_course_settings_again_leaves_path_as_it_was(monkeypatch):
    """The course's nbgrader_config.py puts this Python's bin folder on PATH once: the grader loads it for
    every grading, and PATH grew by the folder each time (each grading's verdict started with a longer one)."""
    monkeypatch.setenv("PATH", "/usr/bin")
    grading._course_config(ROOT)
    once = os.environ["PATH"]
    grading._course_config(ROOT)
    assert os.environ["PATH"] == once == os.path.dirname(sys.executable) + os.pathsep + "/usr/bin"


@pytest.mark.parametrize("forked", [True, False], ids=["forked_from_the_zygote", "started_as_a_process"])
def test_a_graders_pythonoptimize_does_not_strip_the_tests_asserts(course, tmp_path, monkeypatch, forked):
    """PYTHONOPTIMIZE in the grader's environment (set for speed, say) reached a fresh verdict, whose tests'
    asserts then vanished: every test said "passed" and only the grader's own figures were left to decide."""
    monkeypatch.setenv("GCLAB_GRADE_FORK", "1" if forked else "0")
    monkeypatch.setenv("PYTHONOPTIMIZE", "1")
    path = _submit(course, tmp_path, "wrong", "def double(x):\n    return 3 * x")
    [result] = grading.grade([path], root=course)
    failed = [t for t in result.tests if t.status != "passed"]
    assert failed and not any("your process reported" in t.message for t in failed), grading.format_results([result])


def _altering_runs(monkeypatch, alter) -> list:
    """run_verdict, its results and whole-run figures handed to `alter(number, results, whole)` (runs numbered
    from 1 once this is in place); the runs."""
    real, runs = grading.run_verdict, []

    def run_verdict(job, whole=None, **kwargs):
        results = real(job, whole=whole, **kwargs)
        runs.append(job["tests"])
        alter(len(runs), results, whole)
        return results
    monkeypatch.setattr(grading, "run_verdict", run_verdict)
    return runs


def _inflating(monkeypatch, key: str, runs: set) -> list:
    """run_verdict, with `key` of every test's figures raised by 500 MiB in the calls numbered in `runs` (a cold
    page cache charging the files read to the verdict's memory cgroup; or a process that hid memory): the
    submission's run is the first, then, where that is graded once more, the reference's run again and the
    submission's; the calls."""
    def inflate(number, results, whole):
        if number in runs:
            for result in results.values():
                result.measured[key] = result.measured.get(key, 0) + 500 * 1024 * 1024
    return _altering_runs(monkeypatch, inflate)


@pytest.mark.skipif(memory_group.available() is not None, reason="no memory cgroup here")
@pytest.mark.parametrize("inflated, runs, graded, score", [
    ("charged_peak_growth", {1}, 3, 2),     # a cold cache: the second run's figures decide
    ("charged_peak_growth", {1, 3}, 3, 0),  # charged in both runs: refuted
    ("peak_growth", {1}, 1, 0),             # the resident figures refute alone: no second run
], ids=["charged_once_then_not", "charged_every_time", "resident_figures_over"])
def test_a_pass_refuted_by_its_cgroups_charges_alone_is_graded_once_more(course, tmp_path, monkeypatch,
                                                                        inflated, runs, graded, score):
    grading.reference_of(course, "toy")
    path = _submit(course, tmp_path, "right", "def double(x):\n    return 2 * x")
    calls = _inflating(monkeypatch, inflated, runs)
    result, = grading.grade([path], root=course)
    assert (len(calls), result.score) == (graded, score), grading.format_results([result])


def _timed(monkeypatch, slow_runs) -> list:
    """run_verdict, every test's calls timed by the grader (1 ms of CPU each, 50 ms in the runs numbered in
    `slow_runs`: the reference's kept run is the first, the submission's the second, then, where that is refuted,
    the reference's run again and the submission's) and a full collection priced at 4 ms: the runs."""
    def time_calls(number, results, whole):
        for result in results.values():
            result.measured["calls"] = [0.050 if number in slow_runs else 0.001] * 20
        whole[0]["full_collection_cpu_s"] = 0.004
    return _altering_runs(monkeypatch, time_calls)


@pytest.mark.parametrize("slow_runs, graded, score", [
    ({2}, 3, 2),            # the machine ran slow for the first run: the second run's figures decide
    ({2, 4}, 3, 0),         # the submission's runs slow and the reference's not, as a collection inside every call is
    ({2, 3, 4}, 3, 2),      # the machine slow since the reference was kept: the reference run again is as slow
], ids=["slow_once_then_not", "slow_every_time", "machine_slow_since_the_reference_was_kept"])
def test_a_pass_refuted_by_its_calls_cpu_time_alone_is_graded_once_more(tmp_path, monkeypatch, slow_runs, graded,
                                                                        score):
    course = make_course(tmp_path / "course", {
        "toy": _lesson("### BEGIN SOLUTION\ndef double(x):\n    return 2 * x\n### END SOLUTION")})
    runs = _timed(monkeypatch, slow_runs)
    grading.reference_of(course, "toy")
    path = _submit(course, tmp_path, "right", "def double(x):\n    return 2 * x")
    result, = grading.grade([path], root=course)
    assert (len(runs) - 1, result.score) == (graded, score), grading.format_results([result])
    if score == 0:
        assert "found 20 that took far more CPU time" in result.tests[0].message, result.tests[0].message


@pytest.mark.skipif(memory_group.available() is not None, reason="no memory cgroup here")
def test_a_grader_that_can_make_no_memory_cgroup_says_so_once_and_in_each_result(course, tmp_path, monkeypatch, capfd):
    from gclab.grader import launch
    monkeypatch.setattr(launch, "_SAID", set())
    monkeypatch.setenv("GCLAB_GRADE_MEMORY_GROUP", "0")
    paths = [_submit(course, tmp_path, name, "def double(x):\n    return 2 * x") for name in ("one", "two")]
    results = grading.grade(paths, root=course)
    assert [r.score for r in results] == [2, 2], grading.format_results(results)
    said = capfd.readouterr().err
    assert said.count("the grader makes no memory cgroup for its verdicts on this machine (the grader was told "
                      "to make none (GCLAB_GRADE_MEMORY_GROUP=0))") == 1, said
    # and each result says it, for the class report (a cluster's workers show no terminal)
    assert [r.unguarded for r in results] == [
        ["without a memory cgroup (the grader was told to make none (GCLAB_GRADE_MEMORY_GROUP=0))"]] * 2
    assert "unguarded" not in results[0].measured
    monkeypatch.delenv("GCLAB_GRADE_MEMORY_GROUP")
    guarded, = grading.grade(paths[:1], root=course)
    assert guarded.score == 2 and not any("memory cgroup" in note for note in guarded.unguarded)
