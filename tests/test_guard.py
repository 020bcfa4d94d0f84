"""gclab.grader.guard keeps its own state out of the graded code's reach: what the learner's code does
to the guard's module, class or settings changes nothing installed, and every replacement it
makes is still listed by the installer's handle.

A guard cannot be removed once installed, so the scenario runs in a fresh Python: the grader
installs the guard, then runs "learner" code compiled from a file in the grading folder."""
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import sysconfig
import textwrap

import pytest

GRADER = textwrap.dedent('''
    import json, sys
    import gclab.checks, gclab.memory, gclab.serving
    from gclab.grader import guard
    workdir = sys.argv[1]
    if len(sys.argv) > 2:         # a folder of installed libraries whose bytecode is never cached
        sys.path.append(sys.argv[2])
        sys.dont_write_bytecode = True
    grader = sys._getframe(0).f_code
    keeper = guard.install(workdir, processes=False, files=True)
    keeper.trust(grader)
    outcomes = {}
    learner = open(workdir + "/learner.py").read()
    exec(compile(learner, workdir + "/learner.py", "exec"), {"outcomes": outcomes})
    try:                          # code of the grader's own (a hidden test), where there is one
        hidden = open(workdir + "/hidden.py").read()
    except FileNotFoundError:
        hidden = None
    if hidden is not None:
        try:
            exec(keeper.trust(compile(hidden, workdir + "/hidden.py", "exec")), {})
        except Exception as error:
            outcomes["the grader's own code"] = f"{type(error).__name__}: {error}"
    print(json.dumps({"outcomes": outcomes, "problems": keeper.problems()}))
''')

# What the learner's code runs first: `attempt` records whether an action was allowed, or its refusal.
ATTEMPT = textwrap.dedent('''
    def attempt(name, action):
        try:
            action()
            outcomes[name] = "allowed"
        except Exception as error:
            outcomes[name] = f"{type(error).__name__}: {error}"
''')

LEARNER = ATTEMPT + textwrap.dedent('''
    import gc, os, subprocess, sys, types
    import gclab.grader.guard, gclab.memory

    outcomes["a handle on the installed guard"] = [n for n in ("current", "_current") if hasattr(gclab.grader.guard, n)]
    mine = gclab.grader.guard.install()                    # a guard of its own: its hook is refused
    getattr(mine, "_manifest").clear()
    mine.refused.clear()
    mine.processes, mine.files = True, False
    mine.trust(compile("", workdir_file, "exec"))
    gclab.grader.guard.Guard._judge = lambda self, event, args, frame: None
    gclab.grader.guard.Guard.replaced = lambda self: []
    vars(gclab.grader.guard)["_same_tool"] = lambda *args, **kwargs: True
    put = setattr
    put(gclab.memory.Meter, "describe", lambda self: "exact, trust me")
    vars(gc)["isenabled"] = lambda: False
    attempt("frames", lambda: sys._getframe(0))
    attempt("processes", lambda: subprocess.run(["true"]))
    attempt("writing outside", lambda: open(outside, "w"))
    attempt("reading its own memory", lambda: open("/proc/self/mem", "rb"))
    attempt("reading the grader's memory", lambda: os.open(f"/proc/{os.getppid()}/task/{os.getppid()}/mem", os.O_RDONLY))
    attempt("writing shared memory", lambda: open("/dev/shm/gclab-guard-test", "w"))
    attempt("writing to /dev/null", lambda: open("/dev/null", "w").write("fine"))
    attempt("unlocking gc through its class", lambda: put(gc, "__class__", types.ModuleType))
    attempt("replacing gc.collect", lambda: put(gc, "collect", lambda *args: 0))
    # what the grader's numbers pass through inside libraries: the P99 a budget is judged by, a storage's size
    import numpy.lib._function_base_impl as quantiles, torch
    attempt("replacing numpy's quantile", lambda: put(quantiles, "_quantile_unchecked", lambda *args, **kw: 0.0))
    vars(quantiles)["_ureduce"] = lambda *args, **kwargs: 0.0
    put(torch.UntypedStorage, "nbytes", lambda self: 0)
''')


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("grading")
    outside = tmp_path_factory.mktemp("elsewhere") / "note.txt"
    prelude = f"workdir_file = {str(workdir / 'learner.py')!r}\noutside = {str(outside)!r}\n"
    (workdir / "learner.py").write_text(prelude + LEARNER)
    done = subprocess.run([sys.executable, "-c", GRADER, str(workdir)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout.splitlines()[-1]), "outside": outside}


def test_the_learners_code_finds_no_handle_on_the_installed_guard(attacked):
    assert attacked["outcomes"]["a handle on the installed guard"] == []
    assert "sys.addaudithook (a hook of the learner's own)" in attacked["problems"]


@pytest.mark.parametrize("action, refusal", [
    ("frames", "sys._getframe"),
    ("processes", "subprocess.Popen"),
    ("writing outside", "outside the grading folder"),
    ("reading its own memory", "(a process's memory)"),
    ("reading the grader's memory", "(a process's memory)"),
    ("writing shared memory", "writing /dev/shm/gclab-guard-test (outside the grading folder)"),
    ("unlocking gc through its class", "gc.__class__"),
    ("replacing gc.collect", "gc.collect"),
    ("replacing numpy's quantile", "numpy.lib._function_base_impl._quantile_unchecked"),
])
def test_refusals_hold_after_the_learner_rewrote_the_guard_class_and_its_own_guard(attacked, action, refusal):
    assert attacked["outcomes"][action] != "allowed" and refusal in attacked["outcomes"][action]
    assert any(refusal in problem for problem in attacked["problems"]), attacked["problems"]
    assert not attacked["outside"].exists()


def test_devices_that_are_not_memory_may_still_be_written(attacked):
    assert attacked["outcomes"]["writing to /dev/null"] == "allowed"


@pytest.mark.parametrize("replaced", [
    "gclab.memory.Meter.describe", "gclab.grader.guard.Guard._judge", "gclab.grader.guard.Guard.replaced",
    "gclab.grader.guard._same_tool", "gc.isenabled",
    "numpy.lib._function_base_impl._ureduce",   # a library's internals, which the grader's statistics run through
    "torch.UntypedStorage.nbytes",              # inherited from torch's C base, shadowed on the class
])
def test_every_replacement_is_listed_by_the_installers_handle(attacked, replaced):
    assert f"{replaced} was replaced" in attacked["problems"]


# Routes to a frame, or to code the hook does not judge, that once handed the learner's code the
# verdict's frames (and with them the result channel's token); and what honest code does with the
# same libraries, which stays allowed.
ROUTES = ATTEMPT + textwrap.dedent('''
    import functools, heapq, importlib.machinery, inspect, os, shutil, signal, sys, textwrap, traceback, types
    import gclab.grader.guard

    def caught():
        try:
            1 / 0
        except ZeroDivisionError as error:
            return error.__traceback__

    class PathThatReadsFrames:
        def __fspath__(self):
            outcomes["fspath saw"] = repr(sys._getframe(0))
            return workdir_file + ".gone"

    class NamedByAStrOfItsOwn(str):
        def __hash__(self):
            outcomes["hashed inside the hook"] = repr(sys._getframe(0))
            return str.__hash__(self)

    def thread_pool_frames():
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(inspect.getinnerframes, caught()).result()

    def own_module_from_its_bytecode():     # bytes beside it: any code object at all
        import importlib.util, py_compile
        path = os.path.join(os.path.dirname(workdir_file), "own_module.py")
        with open(path, "w") as source:
            source.write("ANSWER = 42\\n")
        py_compile.compile(path, doraise=True)
        spec = importlib.util.spec_from_file_location("own_module", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))

    def fresh_signal_module():
        import _imp
        return _imp.create_builtin(types.SimpleNamespace(name="_signal", origin=None)).signal

    def extension_from_the_grading_folder():
        import importlib.machinery, importlib.util, _json
        copy = os.path.join(os.path.dirname(workdir_file), os.path.basename(_json.__file__))
        shutil.copy(_json.__file__, copy)
        spec = importlib.util.spec_from_file_location("_json", copy)
        return importlib.util.module_from_spec(spec)

    attempt("a signal handler", lambda: signal.signal(signal.SIGUSR1, lambda number, frame: frame))
    import collections, gclab.checks, torch
    attempt("a signal handler installed through gclab's code", lambda: gclab.checks.run_flat_check(
        collections.defaultdict(functools.partial(signal.signal, signal.SIGUSR1, lambda number, frame: frame)).__getitem__,
        iterations=1, device=torch.device("cpu")))
    attempt("a fresh _signal module", fresh_signal_module)
    attempt("CPython's test extensions", lambda: __import__("_testinternalcapi"))
    attempt("an extension module from the grading folder", extension_from_the_grading_folder)
    attempt("sys._getframe through singledispatch", lambda: functools.singledispatch(sys._getframe)(0))
    attempt("currentframe through a mock", lambda: __import__("unittest.mock").mock.Mock(side_effect=inspect.currentframe)())
    attempt("walk_tb through heapq.merge", lambda: list(heapq.merge(traceback.walk_tb(caught()))))
    attempt("getinnerframes in a thread pool", thread_pool_frames)
    attempt("summary with captured locals", lambda: traceback.StackSummary.extract(traceback.walk_stack(None), capture_locals=True))
    attempt("a module of the notebook's own from its cached bytecode", own_module_from_its_bytecode)
    attempt("code renamed as gclab's", lambda: __import__("_imp")._fix_co_filename(
        compile("sys._getframe(0)", workdir_file, "eval"), gclab.checks.__file__))
    attempt("code named as a frozen module", lambda: eval(compile("sys._getframe(0)", "<frozen importlib._bootstrap>", "eval")))

    class SourceOfItsOwn(importlib.machinery.SourceFileLoader):
        def get_data(self, path):
            return b"import sys; sys._getframe(0)"
    attempt("a loader of the learner's that gives a library file other source",
            lambda: SourceOfItsOwn("textwrap_forged", textwrap.__file__).get_code("textwrap_forged"))
    attempt("code named by a relative path into the libraries",
            lambda: eval(compile("sys._getframe(0)", "../" * 12 + os.__file__.lstrip("/"), "eval")))
    attempt("a path whose __fspath__ the hook would call", lambda: shutil.rmtree(PathThatReadsFrames(), ignore_errors=True))
    attempt("code named by a str of its own", lambda: eval(compile("sys._getframe(0)", NamedByAStrOfItsOwn("<mine>"), "eval")))
    vars(gclab.grader.guard)["_REACHING"] = frozenset()
    vars(gclab.grader.guard)["_FRAME_EVENTS"] = frozenset()
    import builtins
    real_type = builtins.type
    vars(builtins)["type"] = lambda *args: str
    attempt("the guard's own names rebound", lambda: sys._getframe(0))
    vars(builtins)["type"] = real_type

    # What summarises the stack, or reads a frame for its own use, while code it hands the frames to is the
    # learner's: a stand-in of the learner's records what it was handed.
    import io, linecache, logging, objgraph
    handed = outcomes["what the learner's stand-ins were handed"] = []

    def stand_in(original):
        def spy(*args, **kwargs):
            handed.extend(type(a).__name__ for a in args              # a frame, frames, a module's globals
                          if type(a).__name__ in ("frame", "generator") or (type(a) is dict and "__name__" in a))
            return original(*args, **kwargs)
        return spy

    def while_replaced(namespace, name, replacement, route, action):
        original = namespace[name]
        namespace[name] = replacement
        try:
            attempt(route, action)
        finally:
            namespace[name] = original

    def print_stack():
        traceback.print_stack(file=io.StringIO())

    while_replaced(vars(traceback), "walk_stack", stand_in(traceback.walk_stack), "print_stack, walk_stack rebound",
                   print_stack)
    while_replaced(vars(linecache), "lazycache", stand_in(linecache.lazycache), "format_stack, lazycache rebound",
                   traceback.format_stack)
    while_replaced(vars(builtins), "set", stand_in(set), "extract_stack, a builtin rebound", traceback.extract_stack)
    while_replaced(vars(traceback), "print_stack", stand_in(traceback.print_stack), "a logger's stack, print_stack rebound",
                   lambda: logging.getLogger("x").warning("x", stack_info=True))
    extract = traceback.StackSummary.__dict__["_extract_from_extended_frame_gen"]
    traceback.StackSummary._extract_from_extended_frame_gen = classmethod(stand_in(extract.__func__))
    attempt("print_stack, a class member replaced", print_stack)
    traceback.StackSummary._extract_from_extended_frame_gen = extract
    defaults = traceback.StackSummary.extract.__func__.__kwdefaults__
    defaults["capture_locals"] = True
    attempt("print_stack, its locals captured by default", print_stack)
    defaults["capture_locals"] = False
    chain = lambda: objgraph.find_backref_chain(object(), lambda found: False, max_depth=1)
    vars(objgraph)["id"] = stand_in(id)
    attempt("objgraph, a builtin it calls shadowed in its globals", chain)
    del vars(objgraph)["id"]
    while_replaced(vars(builtins), "id", stand_in(id), "objgraph, a builtin it calls rebound", chain)

    # ... or while the learner's code runs after the check, inside the summary: what it rebinds there would be
    # handed the frames' globals (the grader's among them), or frames, unless the summary is watched to its end
    import gc
    lazycache = linecache.lazycache

    def rebinds_lazycache(*args):
        vars(linecache)["lazycache"] = stand_in(lazycache)

    def summarised_while(set_up, undo):
        def action():
            set_up()
            try:
                traceback.extract_stack()
            finally:
                undo()
                vars(linecache)["lazycache"] = lazycache
        return action

    class LoaderOfItsOwn:
        def __getattr__(self, name):
            rebinds_lazycache()

    def summary_of_a_module_with_its_own_loader():
        namespace = {"__name__": "mine", "__loader__": LoaderOfItsOwn(), "traceback": traceback}
        try:
            exec(compile("traceback.extract_stack()", workdir_file + ".mine.py", "exec"), namespace)
        finally:
            vars(linecache)["lazycache"] = lazycache
    attempt("a loader of the learner's, asked in the summary", summary_of_a_module_with_its_own_loader)

    class KeyOfItsOwn(str):
        armed = False

        def __hash__(self):
            return hash(workdir_file)

        def __eq__(self, other):
            if KeyOfItsOwn.armed:
                rebinds_lazycache()
            return False

    def key_in_linecaches_cache():
        linecache.cache[key] = (0, None, [], "mine")      # compared with this file's entry, unarmed
        KeyOfItsOwn.armed = True

    def key_out():
        KeyOfItsOwn.armed = False
        linecache.cache.pop(key)
    key = KeyOfItsOwn("mine")
    attempt("a key of the learner's in linecache's cache, compared in the summary",
            summarised_while(key_in_linecaches_cache, key_out))
    collections_seen = []

    def third_collection(phase, info):
        collections_seen.append(phase)
        if len(collections_seen) == 3:      # after the frame was read and the check made
            rebinds_lazycache()
    callbacks = gc.callbacks
    attempt("a collector callback, run in the summary after the check",
            summarised_while(lambda: (callbacks.append(third_collection), gc.set_threshold(1)),
                             lambda: (gc.set_threshold(700), callbacks.remove(third_collection))))

    # gclab's own code walking the process's objects meets the frames of a kept exception's traceback (and,
    # through them, the grader's), and calls builtins and its module's functions with them
    import gclab.held, gclab.refs

    def kept_exception():
        target = [0]

        def fails(local):
            raise ValueError("kept")
        try:
            fails(target)
        except ValueError as error:
            return error, target
    kept, target = kept_exception()
    while_replaced(vars(builtins), "isinstance", stand_in(isinstance), "gclab.held's walk, a builtin rebound",
                   lambda: gclab.held.tensors_held([kept], "kept"))
    children = vars(gclab.held)["_children"]

    def called_through_its_rebound_name(*args, **kwargs):
        outcomes["gclab's function called through its rebound name"] = True
        return stand_in(children)(*args, **kwargs)
    while_replaced(vars(gclab.held), "_children", called_through_its_rebound_name,
                   "gclab.held's walk, one of its functions rebound", lambda: gclab.held.tensors_held([kept], "kept"))
    while_replaced(vars(builtins), "isinstance", stand_in(isinstance), "gclab.refs' search, a builtin rebound",
                   lambda: gclab.refs.reference_paths(target))
''')
HONEST = textwrap.dedent('''
    import asyncio, collections, enum, io, logging, traceback, warnings
    import numpy, typing_extensions

    async def answer():
        return 42

    def library_uses():
        collections.namedtuple("Point", "x y")
        enum.Enum("Colour", "RED GREEN")
        typing_extensions.TypeVar("T", default=int)
        logging.getLogger("honest").warning("a warning through logging")
        warnings.warn("a warning")
        try:
            1 / 0
        except ZeroDivisionError:
            traceback.format_exc()
        traceback.clear_frames(caught())
        numpy.r_["0,2", [1, 2], [3, 4]]
        asyncio.run(answer())
        traceback.print_stack(file=io.StringIO())
        traceback.format_stack(limit=-2)
        outcomes["the stack's last frame"] = traceback.extract_stack()[-1].name
        logging.getLogger("honest").warning("a warning with its stack", stack_info=True)
        notes = Notes()
        traceback.print_stack(file=notes)
        outcomes["the stack printed to a file of its own"] = bool(notes.lines)

    class Notes:
        def __init__(self):
            self.lines = []

        def write(self, text):
            self.lines.append(text)

    attempt("libraries that read frames for their own use", library_uses)

    # a library with no cached bytecode (a read-only site-packages, PYTHONDONTWRITEBYTECODE): the import
    # system compiles its source, and the compile names the library's file
    attempt("a library module compiled from its source", lambda: __import__("library_without_bytecode"))
''')


# A stand-in left in place, then the stack summarised by the grader's own code: its frames' globals (the
# grader's, with the guard in them) would be handed to the stand-in.
LEFT_IN_PLACE = 'vars(linecache)["lazycache"] = stand_in(linecache.lazycache)\n'
HIDDEN_TEST = "import traceback\ntraceback.format_stack()\n"


@pytest.fixture(scope="module")
def routes(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("grading")
    prelude = f"workdir_file = {str(workdir / 'learner.py')!r}\n"
    (workdir / "learner.py").write_text(prelude + ROUTES + HONEST + LEFT_IN_PLACE)
    (workdir / "hidden.py").write_text(HIDDEN_TEST)
    libraries = tmp_path_factory.mktemp("installed") / "site-packages"
    libraries.mkdir()
    (libraries / "library_without_bytecode.py").write_text("VALUE = 1\n")
    done = subprocess.run([sys.executable, "-c", GRADER, str(workdir), str(libraries)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("route, refusal", [
    ("a signal handler", "signal.signal with a handler of the learner's own"),
    ("a fresh _signal module", "_imp.create_builtin of _signal"),
    ("an extension module from the grading folder", "_imp.create_dynamic of _json"),
    ("CPython's test extensions", "_imp.create_dynamic of _testinternalcapi"),
    ("sys._getframe through singledispatch", "sys._getframe by functools.py"),
    ("currentframe through a mock", "sys._getframe by inspect.py:currentframe"),
    ("walk_tb through heapq.merge", "reading traceback.tb_frame by traceback.py:walk_tb"),
    ("getinnerframes in a thread pool", "reading traceback.tb_frame by inspect.py"),
    ("summary with captured locals", "sys._getframe by traceback.py:walk_stack"),
    ("print_stack, walk_stack rebound", "sys._getframe by traceback.py:print_stack"),
    ("format_stack, lazycache rebound", "sys._getframe by traceback.py:format_stack"),
    ("extract_stack, a builtin rebound", "sys._getframe by traceback.py:extract_stack"),
    ("a logger's stack, print_stack rebound", "sys._getframe by logging/__init__.py:<lambda> for logging/__init__.py:findCaller"),
    ("print_stack, a class member replaced", "sys._getframe by traceback.py:print_stack"),
    ("print_stack, its locals captured by default", "sys._getframe by traceback.py:print_stack"),
    ("objgraph, a builtin it calls shadowed in its globals", "sys._getframe by objgraph.py:_find_chain"),
    ("objgraph, a builtin it calls rebound", "sys._getframe by objgraph.py:_find_chain"),
    ("a module of the notebook's own from its cached bytecode", "marshal.loads (code loaded from bytes could be any"),
    ("code renamed as gclab's", "_imp._fix_co_filename (it would name the notebook's code after a library's file)"),
    ("code named as a frozen module", "compile of code that claims to be <frozen importlib._bootstrap>"),
    ("a loader of the learner's that gives a library file other source", "compile of code that claims to be /"),
    ("code named by a relative path into the libraries", "sys._getframe"),
    ("the guard's own names rebound", "sys._getframe"),
    ("a loader of the learner's, asked in the summary",
     "traceback.py:_extract_from_extended_frame_gen called a name rebound since grading began while "
     "traceback.py:extract_stack could reach the grader's frames"),
    ("gclab.held's walk, a builtin rebound", "gclab/held.py:_walk called a name rebound since grading began "
     "while gclab/held.py:tensors_held could reach the grader's frames"),
    ("gclab.refs' search, a builtin rebound", "called a name rebound since grading began while "
     "gclab/refs.py:reference_paths could reach the grader's frames"),
    ("a key of the learner's in linecache's cache, compared in the summary",
     "called a name rebound since grading began while traceback.py:extract_stack could reach the grader's frames"),
])
def test_no_route_hands_the_learner_a_frame(routes, route, refusal):
    assert refusal in routes["outcomes"][route], routes["outcomes"][route]


def test_gclabs_walk_calls_none_of_its_own_functions_rebound(routes):
    """gclab's code is pinned when the guard is installed (`gclab.grader.pinning`): its walk calls its own function,
    not the stand-in put in its module's namespace, which is handed nothing.  Where pinning is not supported
    (Python other than 3.11) the guard refuses the call instead."""
    from gclab.grader import pinning
    outcome = routes["outcomes"]["gclab.held's walk, one of its functions rebound"]
    if pinning.SUPPORTED:
        assert outcome == "allowed", outcome
        assert "gclab's function called through its rebound name" not in routes["outcomes"]
    else:   # a Python whose bytecode gclab does not pin: the stand-in is called, and refused what it would be handed
        assert ("gclab/held.py:_unseen_children called a name rebound since grading began while "
                "gclab/held.py:tensors_held could reach the grader's frames") in outcome, outcome


def test_a_gate_judges_what_is_asked_whoever_asks(routes):
    """A flat check's step that calls signal.signal in C (a defaultdict's factory): gclab's code is on top of
    the stack, and the handler is still refused."""
    outcome = routes["outcomes"]["a signal handler installed through gclab's code"]
    assert outcome == "allowed", outcome          # run_flat_check reports what its step raised
    assert any("signal.signal with a handler of the learner's own" in problem for problem in routes["problems"])


def test_the_hook_runs_none_of_the_learners_code(routes):
    """Whatever the hook is handed (a path object, a code object's name), it calls no method of it:
    code run inside the hook raises no event the hook would judge."""
    assert "fspath saw" not in routes["outcomes"] and "hashed inside the hook" not in routes["outcomes"]
    assert routes["outcomes"]["code named by a str of its own"] != "allowed"


def test_libraries_that_read_frames_for_their_own_use_still_work(routes):
    assert routes["outcomes"]["libraries that read frames for their own use"] == "allowed"
    assert routes["outcomes"]["a library module compiled from its source"] == "allowed"
    assert routes["outcomes"]["the stack's last frame"] == "library_uses"
    assert routes["outcomes"]["the stack printed to a file of its own"] is True


def test_no_collection_runs_the_learners_callbacks_while_a_library_holds_a_frame(routes):
    """The collector is off from a frame's read to the end of the function it was read for: a callback that
    rebinds linecache.lazycache at its third collection runs after the summary, which completes."""
    assert routes["outcomes"]["a collector callback, run in the summary after the check"] == "allowed"


def test_a_frame_read_for_the_graders_own_code_is_watched_too(routes):
    """traceback.format_stack called by the grader's code, with a stand-in of the learner's left in place of
    linecache.lazycache: the read is the grader's, and the call to the stand-in is refused."""
    refusal = ("traceback.py:_extract_from_extended_frame_gen called a name rebound since grading began while "
               "traceback.py:format_stack could reach the grader's frames")
    assert refusal in routes["outcomes"]["the grader's own code"]
    assert any(refusal in problem for problem in routes["problems"]), routes["problems"]


def test_no_stand_in_of_the_learners_is_handed_a_frame(routes):
    """Every route above that rebinds what a frame would be handed to is refused before the frame is read."""
    assert routes["outcomes"]["what the learner's stand-ins were handed"] == []


def test_a_library_imported_for_the_learner_may_read_the_frames_of_its_own_import(tmp_path):
    """torch imports hundreds of modules the first time an optimizer is made; some read their own
    import's frames (torch.fx.wrap at a module's top level, a dispatch decorator in a class body)."""
    (tmp_path / "learner.py").write_text(ATTEMPT + textwrap.dedent('''
        import sys
        for name in [n for n in sys.modules if n.startswith(("torch.fx", "sympy"))]:
            del sys.modules[name]
        attempt("importing torch.fx and sympy again", lambda: __import__("torch.fx.experimental.symbolic_shapes"))
        attempt("torch.fx.wrap from the learner's own code", lambda: __import__("torch").fx.wrap("len"))
    '''))
    done = subprocess.run([sys.executable, "-c", GRADER, str(tmp_path)], capture_output=True, text=True, timeout=120)
    outcomes = json.loads(done.stdout.splitlines()[-1])["outcomes"]
    assert outcomes["importing torch.fx and sympy again"] == "allowed", outcomes
    assert "sys._getframe by inspect.py:currentframe for torch/fx/_symbolic_trace.py:wrap" in outcomes[
        "torch.fx.wrap from the learner's own code"], outcomes


def test_library_functions_are_named_by_their_path_in_their_library(tmp_path):
    """The guard's lists of library functions name each file from the folder its library is installed in,
    so another package's file with the same basename (dask's core.py beside sympy's) is not taken for it;
    and every file listed is, where its package is installed, a file of it with the function listed in it."""
    from gclab.grader import guard
    keeper = guard.Guard(str(tmp_path), processes=False, files=False)
    purelib = sysconfig.get_paths()["purelib"]
    assert keeper._library_name(inspect.__file__) == "inspect.py"
    assert keeper._library_name(os.path.join(purelib, "dask", "bag", "core.py")) == "dask/bag/core.py"
    assert keeper._library_name(guard.__file__) == "gclab/grader/guard.py"
    listed = (guard._FRAME_PASSING | guard._FRAME_SUMMARIES | guard._FRAME_LOCALS_READERS
              | guard._CALLER_LOCALS_READERS | guard._CALLING_BACK | guard._SIGNAL_HANDLERS)
    for file, function in sorted(listed):
        paths = [root + file for root in keeper._naming_roots if os.path.isfile(root + file)]
        package = file.split("/")[0].removesuffix(".py")
        assert paths or importlib.util.find_spec(package) is None, f"{file} is not a file of {package}"
        if paths and function != "<lambda>":
            assert any(f"def {function}(" in open(path).read() for path in paths), (file, function)


# Keys of the learner's own in the namespaces the guard reads (a str subclass with the hash of a name
# the guard looks up, planted before that name): a lookup would call its __eq__ inside the hook, where
# no event is judged, or inside the manifest's check, and hand it the grader's frames.
KEYS_OF_ITS_OWN = ATTEMPT + textwrap.dedent('''
    import _imp, gc, sys, traceback, types

    def key_that_compares(name, route):
        class KeyThatCompares(str):
            def __hash__(self):
                return hash(name)
            def __eq__(self, other):
                try:
                    outcomes[route] = "a frame seen where no event is judged: " + repr(sys._getframe(0).f_back)
                except RuntimeError:
                    pass
                return False
        return KeyThatCompares("planted")

    def plant(namespace, name, route):
        outcomes[route] = "no code of the learner's ran unjudged"
        value = namespace.pop(name)
        namespace[key_that_compares(name, route)] = None
        namespace[name] = value

    def uproot(namespace):
        for key in [key for key in namespace if type(key) is not str]:
            del namespace[key]

    def traceback_formatted():
        try:
            1 / 0
        except ZeroDivisionError:
            traceback.format_exc()

    plant(vars(traceback), "linecache", "a key of its own in a library's globals")
    attempt("a traceback formatted", traceback_formatted)
    uproot(vars(traceback))

    plant(vars(gc), "collect", "a key of its own in a guarded module")
    attempt("a guarded module's attribute set", lambda: setattr(gc, "collect", gc.collect))
    uproot(vars(gc))

    spec = types.SimpleNamespace(origin=None)
    vars(spec)["name"] = "_signal"
    plant(vars(spec), "name", "a key of its own in a spec")
    # the gate hands the hook a plain copy of the spec; the learner's code may raise the gate's event itself
    attempt("a builtin module made from the spec", lambda: sys.audit("gclab.guard.gate", "_imp.create_builtin", (spec,), []))

    plant(sys.modules, "gc", "a key of its own in sys.modules")

    class LooksWrapped:
        __code__ = traceback.format_exc.__code__
        def __getattr__(self, name):
            try:
                outcomes["the replacement's own code, run by the manifest's check"] = repr(sys._getframe(0).f_back)
            except RuntimeError:
                pass
            return gc.get_stats
        def __call__(self):
            return []
    vars(gc)["get_stats"] = LooksWrapped()
    traceback.StackSummary.extract.__func__.__kwdefaults__["capture_locals"] = True
''')


@pytest.fixture(scope="module")
def own_keys(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("grading")
    (workdir / "learner.py").write_text(KEYS_OF_ITS_OWN)
    done = subprocess.run([sys.executable, "-c", GRADER, str(workdir)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("route", ["a key of its own in a library's globals", "a key of its own in a guarded module",
                                   "a key of its own in a spec", "a key of its own in sys.modules"])
def test_a_key_of_the_learners_own_runs_nothing_where_no_event_is_judged(own_keys, route):
    assert own_keys["outcomes"][route] == "no code of the learner's ran unjudged"


def test_a_replacement_that_claims_to_wrap_the_tool_is_listed_and_not_run(own_keys):
    """A library's wrapper of its own function (`__wrapped__`, library code) is still the tool; an object
    that claims the same through attributes of its own is neither believed nor asked."""
    assert "the replacement's own code, run by the manifest's check" not in own_keys["outcomes"]
    assert "gc.get_stats was replaced" in own_keys["problems"]


def test_keyword_defaults_changed_in_place_are_listed(own_keys):
    assert "traceback.StackSummary.extract.__kwdefaults__['capture_locals'] was replaced" in own_keys["problems"]


# Code the collector runs (a gc.callbacks callback, a finalizer) while an allocation of the hook's
# started a collection: inside the hook, where the guard's own events are let through.
COLLECTED_INSIDE_THE_HOOK = ATTEMPT + textwrap.dedent('''
    import gc, sys, traceback
    seen = outcomes["frames seen inside the hook"] = []

    def reach():
        try:
            seen.append(sys._getframe(1).f_code.co_name)
        except (RuntimeError, ValueError):
            pass

    class Garbage:
        def __init__(self):
            self.me = self
        def __del__(self):
            reach()

    def callback(phase, info):
        reach()

    def formatted_often():
        for _ in range(20):
            Garbage()
            try:
                1 / 0
            except ZeroDivisionError:
                traceback.format_exc()

    callbacks = gc.callbacks
    callbacks.append(callback)
    gc.set_threshold(1)
    attempt("tracebacks formatted, a collection at every allocation", formatted_often)
    gc.set_threshold(700)
    callbacks.remove(callback)
''')


def test_code_a_collection_runs_inside_the_hook_is_judged(tmp_path):
    (tmp_path / "learner.py").write_text(COLLECTED_INSIDE_THE_HOOK)
    done = subprocess.run([sys.executable, "-c", GRADER, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    attacked = json.loads(done.stdout.splitlines()[-1])
    assert attacked["outcomes"]["frames seen inside the hook"] == []
    assert attacked["outcomes"]["tracebacks formatted, a collection at every allocation"] == "allowed"
    assert "sys._getframe (a frame of the grader's code, handed to the learner's)" in attacked["problems"]
