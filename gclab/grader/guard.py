"""Keep a grading process's instruments out of reach of the code it grades.

`install()` runs once, in a process the grader started, before any learner code:

- it takes a manifest of the grader's tools (every attribute of the guarded modules, the
  members of the classes gclab defines, the code, defaults and closures of gclab's
  functions, torch.Tensor's methods), so that `Guard.problems()` names whatever was
  replaced, by any route: an alias, `exec`, `sys.modules`, a module's `__dict__`;
- it refuses, at once, replacing an attribute of a guarded module;
- it adds an audit hook (PEP 578: once added, CPython offers no way to remove it) that
  refuses, to the learner's code, what reaches past the tools: frames (`sys._getframe`, a
  traceback's or a generator's frame), the collector's object graph (`gc.get_objects`,
  `get_referrers`, `get_referents`), ctypes, `marshal`, tracing, code of the grader's run
  with other globals; and, as configured, new processes and signals, writing files outside
  the working folder, and reading the course's own files (its solutions);
- it pins gclab's own code (`gclab.pinning`): every global name it reads is a constant in its
  bytecode, so a builtin or a name of gclab's swapped in while a check runs, and put back before
  anything looks, is never asked;
- it replaces the functions in C that hand a frame to a callable of the caller's, or load
  code that no audit event sees (`_GATED`: signal handlers, fresh builtin modules, extension
  modules, torch's frame-evaluation hooks), by ones that ask the hook, which alone holds the
  originals.

An event is the learner's when a frame of the learner's code is anywhere on the stack;
code from the standard library, installed packages and gclab, and code the grader compiled
itself (`Guard.trust`), is the grader's.  A frame, though, is judged by who gets it: every
frame leads (through `f_back`, which no event audits) to the verdict's, so one read while the
learner's code runs is refused unless gclab's or the grader's code asked for it, or the library
that read it is known to keep it to itself (`_FRAME_SUMMARIES`); and until that library code (or
gclab's code walking the process's objects, `WATCH_EVENT`) is done with it, the calls it makes are
watched (see `Guard._arm`).  What was refused is listed by `problems()`, so a grade can say why.

The guard's own state is out of the learner's reach too.  `install()` hands its `Guard` to
its caller alone: gclab.guard keeps no reference to it, its methods are looked up in a class
made for that one installation (replacing `Guard`'s members changes nothing installed), and
the audit hook, which CPython lists nowhere, holds the only other reference.  The learner's
code can reach neither (frames and the collector's object graph are refused), so it cannot
clear the manifest or the refusals, trust its own code, or change the guard's settings.  The
hook runs none of the learner's code: what it is handed is read by exact type only, and its
names are looked up in a private copy of this module's globals and of the builtins, taken at
installation.  What the learner's code can still do through a module's `__dict__` (rebind a
guarded module's names, this one's included) is not prevented, is listed by `problems()`, and
changes nothing the hook does.
"""
from __future__ import annotations

import builtins
import functools
import importlib.machinery
import itertools
import operator
import os
import re
import sys
import sysconfig
import threading
import types

__all__ = ["WATCH_EVENT", "Guard", "install", "pin_gclab", "sealed", "starting_environment"]

GUARDED_MODULES = ("gc", "time", "weakref", "math", "builtins", "sys", "os", "posixpath", "torch", "torch.cuda",
                   "numpy") + (
    # the libraries whose Python classes gclab's tools and the verdict run (a context manager's
    # __exit__ that returned True would swallow a check's AssertionError): their classes' members too
    LIBRARY_CLASSES := ("contextlib", "collections", "threading", "warnings", "traceback", "linecache", "inspect",
                        "copy", "dataclasses", "functools", "json", "json.encoder", "io", "torch.utils._python_dispatch",
                        # the meter reads a storage's size through torch.UntypedStorage and runs every op as an OpOverload
                        "torch.storage", "torch._ops"))
# Packages whose every loaded submodule is guarded like LIBRARY_CLASSES: the grader's statistics run through
# their internals (np.percentile, a P99 budget, calls numpy.lib._function_base_impl's functions by name).
LIBRARY_PACKAGES = ("numpy",)
# frozen: the hook reads them at every event, and a learner could reach a mutable set
_FRAME_ATTRIBUTES = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
_FRAME_HOLDERS = (types.TracebackType, types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)
_TracebackType, _FrameType, _FunctionType, _MethodType = types.TracebackType, types.FrameType, types.FunctionType, types.MethodType
_CodeType, _ModuleType, _MappingProxyType = types.CodeType, types.ModuleType, types.MappingProxyType
_BuiltinFunctionType, _SimpleNamespace, _partial = types.BuiltinFunctionType, types.SimpleNamespace, functools.partial
_FILESYSTEM_ENCODING = sys.getfilesystemencoding()
# A frame leads to every frame below it (f_back is never audited), the verdict's own included, so a
# frame is judged by who gets it, however many libraries stand between (functools.singledispatch(
# sys._getframe), a mock's side effect, heapq.merge over walk_tb).  Library functions that hand the
# frames they read to their caller:
_FRAME_PASSING = frozenset({("inspect.py", "currentframe"), ("inspect.py", "stack"), ("inspect.py", "trace"),
                            ("inspect.py", "getouterframes"), ("inspect.py", "getinnerframes"),
                            ("traceback.py", "walk_stack"), ("traceback.py", "walk_tb"),
                            ("traceback.py", "_walk_tb_with_full_positions"), ("traceback.py", "extended_frame_gen"),
                            ("logging/__init__.py", "<lambda>"),
                            ("asyncio/base_tasks.py", "_task_get_stack")})
# ... of which those that hand each frame, and the frames below it, to a helper of their module
_FRAME_PASSING_ON = frozenset({("inspect.py", "stack"), ("inspect.py", "trace"), ("inspect.py", "getouterframes"),
                               ("inspect.py", "getinnerframes")})
# The library functions known to read a frame for their own use and to hand back nothing of it but
# names and lines (a summary of a traceback, a warning's module, a logger's caller), and to hand the
# frame itself to no function the learner's code could have rebound.  A frame read for any other
# function while the learner's code runs is refused.
_FRAME_SUMMARIES = frozenset({("traceback.py", "_extract_from_extended_frame_gen"), ("traceback.py", "clear_frames"),
                              ("logging/__init__.py", "findCaller"), ("typing.py", "_caller"), ("enum.py", "_create_"),
                              ("collections/__init__.py", "namedtuple"),
                              ("matplotlib/_api/__init__.py", "warn_external"),
                              ("IPython/core/magic.py", "parse_options"), ("asyncio/coroutines.py", "_format_coroutine"),
                              ("typing_extensions.py", "_has_generic_or_protocol_as_origin"),
                              ("typing_extensions.py", "_caller"), ("traitlets/traitlets.py", "__init__"),
                              ("objgraph.py", "_find_chain"), ("objgraph.py", "_show_graph"), ("decorator.py", "update"),
                              ("torch/_refs/__init__.py", "_make_alias"),
                              ("torch/_jit_internal.py", "get_class_name_lineno")})
# ... the value each of those must hold in a local for it to be one (a traceback summary without the
# frames' locals; a logger's caller without its stack, unless the stack's summary is kept, below):
_FRAME_SUMMARY_CONDITIONS = (("_extract_from_extended_frame_gen", "capture_locals"), ("findCaller", "stack_info"))
# Those that summarise the caller's stack: they pass its frames on (extract_stack to walk_stack, then to
# StackSummary.extract, whose summary reads each frame's globals through linecache.lazycache), so each is
# one only while all the code the frames reach is what it was (`Guard._stack_summary_kept`).
_STACK_SUMMARIES = frozenset({("traceback.py", "print_stack"), ("traceback.py", "format_stack"),
                              ("traceback.py", "extract_stack")})
# ... and those that use the locals of the frame they read, or of its caller (IPython expanding {names} in
# a magic's line, numpy's np.r_["..."] and bmat, a multiple-dispatch decorator in a class body): allowed
# unless that frame is gclab's or the grader's.
_FRAME_LOCALS_READERS = frozenset({("IPython/core/interactiveshell.py", "var_expand"),
                                   ("IPython/core/interactiveshell.py", "get_local_scope"),
                                   ("IPython/core/interactiveshell.py", "push"), ("IPython/core/magic.py", "magic_deco"),
                                   ("six.py", "exec_")})
_CALLER_LOCALS_READERS = frozenset({("numpy/lib/_index_tricks_impl.py", "__getitem__"),
                                    ("numpy/matrixlib/defmatrix.py", "bmat"), ("sympy/multipledispatch/core.py", "_"),
                                    ("torch/fx/experimental/unification/multipledispatch/core.py", "_df")})
# Where the import system runs a module's code: a library module being imported may read the frames
# of its own import (a decorator in a class body reading the class's namespace, torch.fx.wrap at a
# module's top level), however deep in a lazy import the learner's call set off (torch imports
# torch._dynamo, sympy and hundreds more the first time an optimizer is made).
_IMPORTING = ("<frozen importlib._bootstrap>", "_call_with_frames_removed")
_EXECUTING_A_MODULE = ("<frozen importlib._bootstrap_external>", "exec_module")
_COMPILING_BYTECODE = ("<frozen importlib._bootstrap_external>", "_compile_bytecode")
_GETTING_CODE = ("<frozen importlib._bootstrap_external>", "get_code")
_SOURCE_TO_CODE = ("<frozen importlib._bootstrap_external>", "source_to_code")
_FRAME_EVENTS = frozenset({"sys._getframe", "object.__getattr__"})
# Code that resumes where it left off (a generator, a coroutine): a profiler sees it "return" at every yield.
# CO_GENERATOR, CO_COROUTINE, CO_ITERABLE_COROUTINE, CO_ASYNC_GENERATOR:
_RESUMABLE = 0x20 | 0x80 | 0x100 | 0x200
# What leads to frames, handed to the learner's code while library code holds a frame (see `Guard._arm`)
_LEADING_TO_FRAMES = (types.FrameType, types.TracebackType, types.GeneratorType, types.CoroutineType,
                      types.AsyncGeneratorType)
_tuple_new = tuple.__new__
# The name the code that calls each of these functions in C uses for it
_CALL_NAMES = types.MappingProxyType({
    "sys._getframe": "_getframe", "sys._current_frames": "_current_frames", "gc.get_objects": "get_objects",
    "gc.get_referrers": "get_referrers", "gc.get_referents": "get_referents", "sys.settrace": "settrace",
    "sys.setprofile": "setprofile", "marshal.loads": "loads", "marshal.load": "load",
    "function.__new__": "FunctionType"})
# What reaches past the caller (objects handed back, a hook installed for every later call, memory, code
# made up): allowed only where gclab's own code or the grader's makes the call, directly or through
# libraries it called.  A library making it for the learner (objgraph.by_type, IPython calling back a
# functools.partial of sys.settrace after a cell) is the learner's doing.
_REACHING = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
                       "sys.settrace", "sys.setprofile", "marshal.loads", "marshal.load",
                       "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function", "ctypes.addressof",
                       "ctypes.cdata/buffer", "ctypes.create_string_buffer", "ctypes.string_at",
                       "ctypes.wstring_at", "function.__new__", "sys.monitoring.register_callback",
                       "cpython.PyInterpreterState_Clear"})
# (Not sys._getframemodulename, Python 3.12's: it hands back a module's name, no frame, and
# collections.namedtuple, enum and typing call it for every class they make.)
# Functions in C that hand a frame to a callable of the caller's, or load code that no audit event
# sees: each is replaced by one that asks the guard (an audit event), and only the guard's hook holds
# the original.  A signal handler is called with the interrupted frame; a fresh _signal or _imp module
# (from _imp.create_builtin) would hold the originals again; an extension module loaded from the
# grading folder is machine code; torch's frame-evaluation hooks see every frame that starts.
_GATED = (("_signal", "signal"), ("_imp", "create_builtin"), ("_imp", "create_dynamic"), ("_imp", "_fix_co_filename"),
          ("torch._C._dynamo.eval_frame", "set_eval_frame"),
          ("torch._C._dynamo.eval_frame", "set_bytecode_debugger_callback"),
          ("torch._C._dynamo.eval_frame", "set_guard_error_hook"),
          ("torch._C._dynamo.eval_frame", "set_guard_complete_hook"))
# Library signal handlers that ignore the frame they are handed (uvicorn's, installed while a server runs)
_SIGNAL_HANDLERS = frozenset({("uvicorn/server.py", "handle_exit")})
_GATE_EVENT = "gclab.guard.gate"
# Raised by gclab's code that walks the objects of the process (gclab.held, refs, cycles), which may
# meet frames (a kept exception's traceback, a referrer) and hand them on: the hook watches the function
# that raised it as it watches a library that read a frame (see `Guard._arm`), until it returns.
WATCH_EVENT = "gclab.guard.watch"
_GUARD_FILE = __file__      # the hook tells its own code's events by the file their code was compiled from
_BUILTINS_HOLDING_GATES = frozenset({"_signal", "_imp"})
# CPython's own test extensions (in the standard library's folder): C functions that poke at the interpreter
_TEST_EXTENSIONS = ("_test", "_ctypes_test", "_xxtestfuzz", "_xxsubinterpreters", "xxsubtype", "xxlimited")
# Library code that calls back what it was handed, with none of the learner's frames on the stack:
# a call made from one of these is the learner's doing.
_CALLING_BACK = frozenset({("weakref.py", "__call__"), ("IPython/core/events.py", "trigger"),
                           ("asyncio/events.py", "_run"), ("threading.py", "run"), ("concurrent/futures/thread.py", "run"),
                           ("ipykernel/thread.py", "run")})
# socket.sendmsg: how a request with file descriptors reaches a fork server (gclab.zygote)
_PROCESS_EVENTS = frozenset({"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                             "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill",
                             "socket.sendmsg"})
_FILE_EVENTS = frozenset({"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
                          "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move",
                          "os.setxattr", "os.removexattr"})
_MODULE_EVENTS = frozenset({"gclab.guard.setattr", "gclab.guard.delattr"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
# A process's memory, read as a file: the verdict's secrets (its result channel's token) and the
# hidden tests are in it.  Any pid (the grader's own), any thread, the kernel's and the machine's.
_MEMORY_FILES = re.compile(r"/proc/[^/]+/(task/[^/]+/)?mem|/proc/kcore|/dev/k?mem|/dev/port")
# Devices whose files are memory (tmpfs): not counted in the process's address-space limit, and left
# behind after grading.
_MEMORY_FOLDERS = ("/dev/shm/", "/dev/mqueue/")

# The environment as the process was when gclab.guard was first imported: the grader imports
# its instruments (and this module) before any learner code runs, and the processes gclab
# starts for the grader (the model server, its load generator, Graphviz) get this one, so a
# variable the learner's code set (PATH, LD_PRELOAD, PYTHONPATH) does not reach them.
_STARTING_ENVIRONMENT = tuple(os.environ.items())


def starting_environment() -> dict:
    return dict(_STARTING_ENVIRONMENT)


def install(workdir=None, processes: bool = False, files: bool = True, hidden=()) -> "Guard":
    """Install a guard and hand it to the caller, its only holder (keep it where the learner's
    code cannot reach: a local variable, a closure).  Each call installs another, independent one.

    `workdir`: the folder the learner's code may write to (default: the current one);
    `processes`: may the learner's code start processes and send signals;  `files`: refuse
    writes outside `workdir`;  `hidden`: folders the learner's code may not read (the course:
    its solutions and hidden tests), gclab's own package excepted."""
    # A class of this installation's own: its members are the ones defined below, whatever
    # the learner's code does to `Guard` afterwards; nothing but the returned object refers to it.
    # Its code looks names up in a private copy of this module's globals and of the builtins, taken
    # now, before any learner code runs: what the learner's code rebinds through this module's
    # __dict__ or builtins' (listed by `problems()`, not refused) changes nothing the hook does.
    private = _private_namespace()
    sealed = type(Guard.__name__, (Guard,), {name: _bound_to(member, private) for name, member in vars(Guard).items()
                                             if name not in ("__dict__", "__weakref__")})
    originals = _gated_originals()
    guard = sealed(workdir or os.getcwd(), processes, files, hidden)
    pin_gclab()                        # before the manifest, which takes gclab's code
    guard._arm(originals)
    _install_gates(originals)          # after the hook, which calls the originals (imports use _imp's)
    guard._take_stock()                # the manifest and the modules' globals, gates included
    return guard


def _in_library_package(name: str) -> bool:
    return name.partition(".")[0] in LIBRARY_PACKAGES and "." in name


def pin_gclab() -> int:
    """Pin the global names of gclab's code (`gclab.pinning`): the builtins, its modules' names, and the
    functions, classes and modules it reads as module attributes (`gc.collect`, `subprocess.Popen`).
    This module's code, which binds its own names (`sealed`), is left alone.  Returns how many
    functions were pinned now."""
    from . import pinning
    gclab_dir = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep
    modules = {id(m): m for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)
               and os.path.realpath(getattr(m, "__file__", None) or "/").startswith(gclab_dir)
               and m.__name__ not in (__name__, pinning.__name__)}
    return pinning.pin(list(modules.values()))


def sealed(function):
    """`function` looking its global names up in a private copy, taken now, of its module's globals
    (the module's functions copied likewise) and of the builtins: what code run afterwards rebinds
    through the module's __dict__ or builtins' (listed by `Guard.problems()`, not refused) changes
    nothing it does.  Call it before the learner's code runs."""
    return _bound_to(function, _private_namespace(function.__globals__))


def _private_namespace(source: dict | None = None) -> dict:
    source = globals() if source is None else source
    private = dict(source)
    private["__builtins__"] = dict(vars(builtins))
    for name, value in list(private.items()):
        if type(value) is types.FunctionType and value.__globals__ is source:
            private[name] = _bound_to(value, private)
    return private


def _bound_to(member, namespace: dict):
    """`member` (a function, or a static method's) looking its global names up in `namespace`."""
    if isinstance(member, staticmethod):
        return staticmethod(_bound_to(member.__func__, namespace))
    if type(member) is not types.FunctionType:
        return member
    copy = types.FunctionType(member.__code__, namespace, member.__name__, member.__defaults__, member.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = member.__kwdefaults__, member.__qualname__
    return copy


def _resolve(path: str, open=os.open, readlink=os.readlink, close=os.close, getcwd=os.getcwd,
             flags=os.O_PATH | os.O_CLOEXEC) -> str:
    """`path` made absolute and canonical as the kernel resolves it (links, `..`): its longest part that
    exists, opened without being read (O_PATH) and named by /proc/self/fd, then the rest.  Only
    functions in C, bound now: the hook calls it, and must run no code the learner's could rebind."""
    if not path.startswith("/"):
        path = getcwd() + "/" + path
    rest = ""
    while True:
        try:
            fd = open(path, flags)
        except OSError:
            head, _, tail = path.rpartition("/")
            rest = tail + "/" + rest if rest else tail
            if not head:
                return "/" + rest
            path = head
            continue
        try:
            real = readlink(f"/proc/self/fd/{fd}")
        except OSError:             # no /proc: the path as it was written
            real = path
        finally:
            close(fd)
        return real if not rest else real.rstrip("/") + "/" + rest


def _gated_originals() -> dict:
    """The gated functions (`_GATED`) still in place, by name: the originals, for the hook alone.
    Empty for those another guard of this process already took: its hook calls them."""
    originals = {}
    for module_name, name in _GATED:
        module = sys.modules.get(module_name)
        if module is None and module_name.startswith("torch."):
            continue
        if module is None:
            module = __import__(module_name)
        function = vars(module).get(name)
        if isinstance(function, types.BuiltinFunctionType):
            originals[f"{module_name}.{name}"] = function
    return originals


def _install_gates(originals: dict) -> None:
    """Replace each of `originals` by a function that asks the guard."""
    for key in originals:
        module_name, _, name = key.rpartition(".")
        object.__setattr__(sys.modules[module_name], name, _gate(key))


def _gate(key: str):
    def asks_the_guard(*args, audit=sys.audit, prepare=_GATE_ARGUMENTS.get(key, _as_given)):
        answer = []
        audit(_GATE_EVENT, key, prepare(*args), answer)
        if not answer:
            raise RuntimeError(f"{key} is not available while grading")
        return answer[0]
    asks_the_guard.__name__ = asks_the_guard.__qualname__ = key.rpartition(".")[2]
    return asks_the_guard


def _module_spec(spec, file=None):
    """What _imp reads of a spec, read once (the learner's spec could answer differently twice)."""
    return (types.SimpleNamespace(name=_text(spec.name), origin=_text(getattr(spec, "origin", None))),
            *(() if file is None else (file,)))


# How each gated function's arguments are made plain (exact types, read once) before the hook sees them:
# the hook never calls a method of the learner's objects.
_GATE_ARGUMENTS = {"_signal.signal": lambda signalnum, handler: (operator.index(signalnum), handler),
                   "_imp.create_builtin": _module_spec, "_imp.create_dynamic": _module_spec,
                   "_imp._fix_co_filename": lambda code, path: (code, _text(path))}


def _as_given(*args):
    return args


def _text(value):
    """`value` as an exact str, with none of the learner's methods run (None when it is no str)."""
    kind = type(value)
    if kind is str:
        return value
    if issubclass(kind, str):
        return str.__str__(value)
    return None


# Functions in C the hook reads namespaces with, bound now (a module's names could be rebound later)
_first, _is, _compress, _repeat = operator.itemgetter(0), operator.is_, itertools.compress, itertools.repeat


def _keys_of(namespace):
    """The keys of `namespace` (a dict, or the mappingproxy of a class the guard took), iterated in C
    whatever the namespace's own type says; None for anything else."""
    if issubclass(type(namespace), dict):
        return dict.keys(namespace)
    return namespace.keys() if type(namespace) is _MappingProxyType else None


def _exact_keys(namespace, names=None) -> dict:
    """`namespace`, or its entries named in `names` (a frozenset of exact strs), copied with its exact-str
    keys only, in C: no method of a key or a value runs (looking a name up in a namespace that holds a
    key of the learner's own, a str subclass with the name's hash, would run its __eq__), and no other
    thread's code runs meanwhile."""
    keys = _keys_of(namespace)
    if keys is None:
        return {}
    items = list(dict.items(namespace) if issubclass(type(namespace), dict) else namespace.items())
    exact = dict(_compress(items, map(_is, map(type, map(_first, items)), _repeat(str))))
    return exact if names is None else {name: exact[name] for name in names if name in exact}


def _same_entries(namespace, taken: dict) -> bool:
    """Does `namespace` hold, by identity, the entries of `taken` (a copy made with `_exact_keys`), and no
    other exact-str key?"""
    now = _exact_keys(namespace)
    return len(now) == len(taken) and all(now.get(key, _MISSING) is value for key, value in taken.items())


def _stack_summary_code() -> tuple:
    """The functions a stack's frames reach when traceback summarises it, each with its code and
    defaults as they are now, and the classes of the summary with copies of their namespaces."""
    import linecache
    import traceback
    functions = [traceback.print_stack, traceback.format_stack, traceback.extract_stack, traceback.walk_stack,
                 traceback.StackSummary.extract.__func__, traceback.StackSummary._extract_from_extended_frame_gen.__func__,
                 traceback.FrameSummary.__init__, linecache.lazycache]
    return (tuple((f, f.__code__, f.__defaults__, _exact_keys(f.__kwdefaults__ or {})) for f in functions),
            tuple((vars(c), _exact_keys(vars(c))) for c in (traceback.StackSummary, traceback.FrameSummary)))


def _called(value) -> bool:
    """Is `value` (a library's, taken at installation) what code calls or reads attributes of (a function,
    a class, a module), not data its own code rebinds (warnings.filters, which catch_warnings replaces)?"""
    return value is not _MISSING and (callable(value) or type(value) is _ModuleType)


def _type_name(value) -> str:
    return type.__dict__["__name__"].__get__(type(value))


def _library_roots() -> tuple:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots |= {os.path.dirname(os.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    roots |= {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    return tuple(sorted({os.path.realpath(r) + os.sep for r in roots}))


class Guard:
    def __init__(self, workdir, processes: bool, files: bool, hidden=()):
        self.workdir = os.path.realpath(workdir) + os.sep
        self.processes, self.files = processes, files
        self.gclab_dir = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep
        self.hidden = tuple(os.path.realpath(h) + os.sep for h in hidden)
        self.refused: list = []
        self._roots = _library_roots()
        self._trusted_codes: dict = {}
        self._file_trust: dict = {}
        self._library_names: dict = {}
        # gclab's files are named gclab/..., whether it is installed or a checkout
        self._naming_roots = tuple(root for root in self._roots if root != self.gclab_dir) + (
            os.path.dirname(self.gclab_dir[:-1]) + os.sep,)
        self._gclab_files: dict = {}
        self._busy = threading.local()
        self._modules = self._guarded_modules()
        self._module_ids = frozenset(id(m) for m in self._modules.values())
        self._module_names = {id(m): name for name, m in self._modules.items()}
        self._module_dicts = {id(m): vars(m) for m in self._modules.values()}
        import _signal
        self._default_int_handler = _signal.default_int_handler
        # bound now: the hook and the manifest's check must not look names up in globals the
        # learner's code can rebind through a module's __dict__ (that would be listed, not prevented)
        self._same_tool, self._read, self._realpath = _same_tool, _read, _resolve
        self._memory_file, self._memory_folders = _MEMORY_FILES.fullmatch, _MEMORY_FOLDERS
        # taken by install(), once the gates are in place
        self._manifest, self._snapshots, self._module_snapshots = [], {}, {}
        self._stack_functions, self._stack_classes = (), ()
        self._name_triples: dict = {}      # id of library code -> (it, globals, builtins, names to keep): `_names_kept`

    def _take_stock(self) -> None:
        """The manifest of the tools, and every imported module's globals as they are now (before any
        learner code: see `_unchanged`)."""
        self._manifest = self._take_manifest()
        modules = [module for module in list(sys.modules.values()) if isinstance(module, types.ModuleType)]
        self._snapshots = {id(vars(module)): (vars(module), dict(vars(module))) for module in modules}
        self._module_snapshots = {id(module): self._snapshots[id(vars(module))] for module in modules}
        self._stack_functions, self._stack_classes = _stack_summary_code()

    # -- what the grader's tools are -------------------------------------------------------
    @staticmethod
    def _guarded_modules() -> dict:
        names = list(GUARDED_MODULES) + sorted(n for n in sys.modules if n == "gclab" or n.startswith("gclab.")
                                               or _in_library_package(n))
        return {n: sys.modules[n] for n in names if isinstance(sys.modules.get(n), types.ModuleType)}

    def _take_manifest(self) -> list:
        """(what, how to read it now, what it was) for every tool: how to read it is a function that
        runs none of the learner's code, or (namespace, key) for an entry of a module's, class's or
        keyword defaults' namespace, which `replaced` reads through a copy (`_exact_keys`)."""
        entries, modules = [], sys.modules
        for name, module in self._modules.items():
            entries.append((f"sys.modules[{name!r}]", (modules, name), module))
            namespace = vars(module)
            for attr, value in list(namespace.items()):
                if name == "sys" and attr not in ("modules", "audit", "addaudithook", "_getframe", "exit"):
                    continue            # sys holds streams and settings ordinary code changes
                library = name in LIBRARY_CLASSES or _in_library_package(name)
                if (name == "os" and attr != "environ" or library) and not callable(value):
                    continue            # settings and state its own code rebinds (warnings.filters)
                entries.append((f"{name}.{attr}", (namespace, attr), value))
                if (name.startswith("gclab") or library) and getattr(value, "__module__", None) == name:
                    entries += self._definition(f"{name}.{attr}", value)
        torch = self._modules.get("torch")
        if torch is not None:
            # the classes the meter reads tensors through: a name they inherit from torch's C base (which
            # cannot be changed) can still be shadowed on them (torch.UntypedStorage.nbytes = ...)
            for cls in (torch.Tensor, torch.UntypedStorage):
                members = vars(cls)
                entries += [(f"torch.{cls.__name__}.{a}", (members, a), members.get(a, _MISSING))
                            for a in sorted(set(dir(cls)) | set(members))]
        return entries

    def _definition(self, qualname, value) -> list:
        if isinstance(value, type):
            members = vars(value)
            entries = [(f"{qualname}.{a}", (members, a), m) for a, m in list(members.items())]
            for attr, member in list(members.items()):
                function = getattr(member, "__func__", getattr(member, "fget", member))
                if isinstance(function, types.FunctionType):
                    entries += self._function(f"{qualname}.{attr}", function)
            return entries
        if isinstance(value, types.FunctionType):
            return self._function(qualname, value)
        return []

    @staticmethod
    def _function(qualname, function) -> list:
        entries = [(f"{qualname}.{a}", lambda a=a: getattr(function, a), getattr(function, a))
                   for a in ("__code__", "__defaults__", "__kwdefaults__")]
        # a dict, changed in place by no assignment (StackSummary.extract's capture_locals=False)
        kwdefaults = function.__kwdefaults__ or {}
        entries += [(f"{qualname}.__kwdefaults__[{k!r}]", (kwdefaults, k), v) for k, v in list(kwdefaults.items())]
        for i, cell in enumerate(function.__closure__ or ()):
            try:
                entries.append((f"{qualname} (closure)", lambda c=cell: c.cell_contents, cell.cell_contents))
            except ValueError:
                pass
        return entries

    def replaced(self) -> list:
        """The grader's tools that are no longer what they were when the guard was installed."""
        self._busy.depth = getattr(self._busy, "depth", 0) + 1
        try:
            same, read, copies = self._same_tool, self._read, {}

            def now(source):
                if type(source) is not tuple:
                    return read(source)
                namespace, key = source
                copy = copies.get(id(namespace))
                if copy is None:
                    copy = copies[id(namespace)] = _exact_keys(namespace)
                return copy.get(key, _MISSING)
            return [what for what, source, was in self._manifest if not same(self, what, now(source), was)]
        finally:
            self._busy.depth -= 1

    def problems(self) -> list:
        """What says the learner's code reached for the grader: replaced tools and refused
        actions, in words, each once."""
        return list(dict.fromkeys([f"{what} was replaced" for what in self.replaced()] + self.refused))

    # -- whose code is running ---------------------------------------------------------------
    def trust(self, code: types.CodeType) -> types.CodeType:
        """Mark `code`, and the functions and classes it defines, as the grader's."""
        stack = [code]
        while stack:
            c = stack.pop()
            self._trusted_codes[id(c)] = c
            stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
        return code

    def _library_file(self, filename) -> bool:
        """Is `filename` the file of library code: the standard library's (frozen modules included),
        an installed package's or gclab's?  Only an exact str that is an absolute path, or a frozen
        module's name, can be: the learner's code may name its code anything (a str of its own whose
        methods would run here, a relative path into the libraries)."""
        if type(filename) is not str:
            return False
        known = self._file_trust.get(filename)
        if known is None:
            if filename.startswith("<frozen "):
                known = True
            elif not filename.startswith("/"):
                known = False
            else:
                real = self._realpath(filename)
                known = real.startswith(self._roots) and not real.startswith(self.workdir)
            self._file_trust[filename] = known
        return known

    def _grader_frame(self, frame) -> bool:
        code = frame.f_code
        return id(code) in self._trusted_codes or self._library_file(code.co_filename)

    def _grader_own(self, frame) -> bool:
        """Is `frame` gclab's own code, or code the grader compiled (its given and test cells)?"""
        if frame is None:
            return False
        code = frame.f_code
        if id(code) in self._trusted_codes:
            return True
        filename = code.co_filename
        if type(filename) is not str:
            return False
        known = self._gclab_files.get(filename)
        if known is None:
            known = self._gclab_files[filename] = (
                filename.startswith("/") and self._realpath(filename).startswith(self.gclab_dir))
        return known

    def _where(self, frame):
        """(file, function) of a library frame, the file named from its library's folder as the lists
        above name it; None otherwise."""
        code = frame.f_code
        if not self._library_file(code.co_filename) or type(code.co_name) is not str:
            return None
        return self._library_name(code.co_filename), code.co_name

    def _library_name(self, filename: str) -> str:
        """A library file's path from the folder it was installed in (inspect.py, logging/__init__.py,
        IPython/core/events.py, gclab/guard.py): exact, where a basename would let another package's
        file of the same name (dask's core.py, torch's polyfill traceback.py) pass for it."""
        name = self._library_names.get(filename)
        if name is None:
            name = filename                       # a frozen module's
            if filename.startswith("/"):
                real = self._realpath(filename)
                root = max([root for root in self._naming_roots if real.startswith(root)], key=len, default="")
                name = real[len(root):]
            self._library_names[filename] = name
        return name

    def _made_for_the_grader(self, frame) -> bool:
        """Is the call made by gclab's or the grader's own code, directly or through libraries it
        called (gclab.cycles drawing with objgraph), and not by library code calling back what the
        learner handed it?"""
        while frame is not None and not self._grader_own(frame):
            if self._calling_back(frame) or not self._library_file(frame.f_code.co_filename):
                return False
            frame = frame.f_back
        return frame is not None

    def _calling_back(self, frame) -> bool:
        """Is `frame` library code calling back something it was handed (a finalizer, an IPython event
        handler, a thread's target)?"""
        return frame is not None and self._where(frame) in _CALLING_BACK

    def _frame_kept_to_itself(self, reader, frame) -> bool:
        """Does the library code that read `frame` (from `reader` down, through functions that pass frames
        on) keep it to itself: a summary of names and lines, or the locals of the learner's own frame?"""
        while reader is not None and self._where(reader) in _FRAME_PASSING:
            if self._where(reader) in _FRAME_PASSING_ON or not self._unchanged(reader):
                return False
            reader = reader.f_back
        if reader is None or not self._unchanged(reader):
            return False
        where = self._where(reader)
        if where in _STACK_SUMMARIES:
            return self._stack_summary_kept()
        if where in _FRAME_SUMMARIES:
            for function, local in _FRAME_SUMMARY_CONDITIONS:
                if where[1] == function:
                    value = reader.f_locals.get(local)
                    # a logger's stack (stack_info) is printed by traceback.print_stack
                    return value is None or value is False or (function == "findCaller" and self._stack_summary_kept())
            return True
        if where in _CALLER_LOCALS_READERS and frame is not None:
            frame = frame.f_back
        elif where not in _FRAME_LOCALS_READERS:
            return False
        return frame is not None and not self._grader_own(frame)

    def _unchanged(self, frame) -> bool:
        """Does library code run with its own module's globals and the builtins, and are the names its
        code uses, in those globals, in the builtins and in the modules they name, what they were when
        the guard was installed?  A helper rebound through a module's __dict__ (linecache.lazycache,
        logging._is_internal_frame), or a builtin rebound in builtins' or shadowed by a global of the
        same name (objgraph passes its frame to `id`), would be handed what the code reads; a copy of
        the code run with other globals would be too."""
        return self._names_unchanged(frame.f_code, frame.f_globals, frame.f_builtins)

    def _names_unchanged(self, code, live, live_builtins) -> bool:
        # names looked up directly: a key of the learner's own there runs its __eq__ inside the hook, where
        # whatever it raises is judged (see `_arm`)
        return self._names_kept(code, live, live_builtins) is True

    def _stack_summary_kept(self) -> bool:
        """Is the code that traceback.print_stack, format_stack and extract_stack (and logging, for
        stack_info) hand the frames to as it was when the guard was installed: the functions that walk
        and summarise a stack (`_stack_summary_code`), with their defaults and the names they use,
        and the classes they build the summary with?  Then the frames reach no code but theirs, and only
        names and lines come back (without the frames' locals: capture_locals is a keyword default)."""
        for function, code, defaults, kwdefaults in self._stack_functions:
            if (function.__code__ is not code or function.__defaults__ is not defaults
                    or not _same_entries(function.__kwdefaults__ or {}, kwdefaults)
                    or not self._names_unchanged(code, function.__globals__, function.__builtins__)):
                return False
        return all(_same_entries(namespace, taken) for namespace, taken in self._stack_classes)

    def _read_while_importing(self, reader, read) -> bool:
        """Is `read` a frame of a library module's import, read by that import's own code, and kept by it:
        through no function that hands the frames below to a helper (inspect.stack), and, for a module
        imported before the guard, with its names as they were?"""
        chain = self._importing(reader)
        if not any(frame is read for frame in chain):
            return False
        for frame in chain:
            where = self._where(frame)
            if where in _FRAME_PASSING_ON or (id(frame.f_globals) in self._snapshots and not self._unchanged(frame)):
                return False
            if where not in _FRAME_PASSING:
                return True
        return False

    def _importing(self, frame) -> list:
        """The frames from `frame` down to the import system when they are all library code run by the
        import of a library module (none calling back); [] otherwise."""
        frames = []
        while frame is not None:
            where = self._where(frame)
            if where is None or where in _CALLING_BACK:
                return []
            if where == _IMPORTING:
                return frames
            frames.append(frame)
            frame = frame.f_back
        return []

    def learner_on_stack(self, frame) -> bool:
        while frame is not None:
            if not self._grader_frame(frame):
                return True
            frame = frame.f_back
        return False

    # -- the audit hook --------------------------------------------------------------------
    # The hook runs none of the learner's code: what it is handed (the arguments of any event, which the
    # learner's code can raise itself with sys.audit) is read by exact type only, since code run inside
    # the hook raises no event the hook would judge.
    def _arm(self, originals: dict) -> None:
        for module in self._modules.values():
            if type(module) is types.ModuleType:
                module.__class__ = _LockedModule
        import gc
        getframe, busy, own_file = sys._getframe, self._busy, _GUARD_FILE
        collecting, stop_collecting, collect_again = gc.isenabled, gc.disable, gc.enable
        module_setters = (_LockedModule.__setattr__.__code__, _LockedModule.__delattr__.__code__)

        # While the hook judges an event (or `replaced` reads the manifest), events come back here.  Its own
        # reading of the caller's frame is let through at once (`reading`, the collector off: nothing else
        # runs meanwhile); another event is let through if the guard's own code raised it (resolving a path,
        # a traceback's frame read), and judged like any event otherwise (a finalizer run by dropping the last
        # reference to an object).  The collector is off while an event is judged: no finalizer or
        # gc.callbacks callback of the learner's runs inside the judging, where a name it rebinds after the
        # hook read it would go unseen.
        # While library code holds a frame it read (from the read until the function it read the frame for
        # returns: a "window"), or gclab's code walks the process's objects (WATCH_EVENT), a profile function
        # of this thread's watches every call it makes: the collector is off (no gc.callbacks callback or
        # finalizer of the learner's runs), the learner's code may run only when it is handed nothing that
        # leads to a frame or a namespace (a loader's __getattr__, a key's __eq__, a file's write), and every
        # call library code makes goes through names that are what they were when the guard was installed
        # (`_watch_refusal`; checked again after the learner's code ran).  What was checked when the frame was
        # read holds until the frame is let go: nothing rebinds, after the check, what the library hands the
        # frame, or a frame's globals, to (linecache.lazycache, a logger's _is_internal_frame).
        def open_window(anchor, collector_was_on):
            busy.window = _SimpleNamespace(anchor=anchor, collector_was_on=collector_was_on, clean={}, checked={})
            sys.setprofile(watch)

        def close_window(window):
            busy.window = None
            sys.setprofile(None)
            if window.collector_was_on:
                collect_again()

        def watch(frame, event, arg):
            window = getattr(busy, "window", None)
            if window is None or getattr(busy, "depth", 0):      # the hook's own calls, judging an event
                return
            if event == "return":
                if frame is window.anchor:
                    close_window(window)
            elif event == "call" or event == "c_call":
                refusal = self._watch_refusal(window, frame, event)
                if refusal:
                    close_window(window)
                    self.refused.append(refusal)
                    busy.unwatching = True      # CPython takes this profile function off (raising sys.setprofile)
                    raise RuntimeError(f"refused while grading: {refusal}")

        def hook(event, args):
            # what no rule refuses, at once: id() (which the guard's own checks call all the time) and the
            # attributes read (f_code, __code__) that lead to no frame
            if event == "builtins.id" or (event == "object.__getattr__" and type(args[1]) is str
                                          and args[1] not in _FRAME_ATTRIBUTES):
                return
            if event == "sys.setprofile" and getattr(busy, "unwatching", False):
                busy.unwatching = False
                return
            depth = getattr(busy, "depth", 0)
            if depth and (getattr(busy, "reading", False) or depth > 2):
                return
            busy.depth = depth + 1
            collector_was_on = collecting()
            if collector_was_on:
                stop_collecting()
            try:
                busy.reading = True
                try:
                    frame = getframe(1)
                except ValueError:          # an event raised with no Python frame above it
                    frame = None
                finally:
                    busy.reading = False
                if depth:
                    code = frame.f_code if frame is not None else None
                    if (code is not None and code.co_filename == own_file and code is not module_setters[0]
                            and code is not module_setters[1]):
                        return
                refusal = self._judge(event, args, frame)
                window = getattr(busy, "window", None)
                if window is not None and sys.getprofile() is not watch:    # taken off by other code: over
                    busy.window = None
                    if window.collector_was_on:
                        collect_again()
                    window = None
                # not while another profile function is set (gclab.cycles' detector reports from inside
                # its own, where no call would be seen): that one's code runs unwatched
                if refusal is None and window is None and sys.getprofile() is None:
                    anchor = None
                    if event in _FRAME_EVENTS:
                        anchor = self._window_anchor(event, args, frame)
                    elif event == WATCH_EVENT and frame is not None and self._grader_own(frame):
                        anchor = frame
                    if anchor is not None:
                        open_window(anchor, collector_was_on)
                        collector_was_on = False        # off until the window closes
            finally:
                if collector_was_on:
                    collect_again()
                busy.depth = depth
            if refusal:
                self.refused.append(refusal)
                error = (AttributeError if event in _MODULE_EVENTS else
                         PermissionError if (event == "open" or event in _FILE_EVENTS) else RuntimeError)
                raise error(f"refused while grading: {refusal}")
            if event == _GATE_EVENT and args[0] in originals and type(args[1]) is tuple and type(args[2]) is list:
                args[2].append(originals[args[0]](*args[1]))
        sys.addaudithook(hook)

    def _judge(self, event, args, frame):
        if event == "sys.addaudithook":     # another hook, even one a library adds for the learner, sees first-hand
            return f"{event} (a hook of the learner's own)" if self.learner_on_stack(frame) else None
        if event in _FRAME_EVENTS:
            return self._judge_frame(event, args, frame)
        if event in _REACHING:
            if (self._made_for_the_grader(frame) and self._names_the_call(frame, event, args)
                    or self._loads_library_bytecode(event, frame)):
                return None
            if event.startswith("marshal."):
                return (f"{event} (code loaded from bytes could be any code at all: a module of the notebook's "
                        "own is compiled from its source)")
            return f"{event} (reaching into the grader's objects)"
        if event == _GATE_EVENT:
            return self._judge_gate(args, frame)
        if event == "object.__setattr__":
            if self._is_tool(args[0]) and self.learner_on_stack(frame):
                return f"setting {self._tool_name(args[0])}.{_text(args[1])}"
            if (len(args) > 2 and _text(args[1]) == "__code__" and self._code_of_the_grader(args[2], libraries=True)
                    and self.learner_on_stack(frame)):
                return "setting a function's __code__ to library or grader code (it would run with the notebook's globals)"
            return None
        if event == "exec":
            if (self._code_of_the_grader(args[0], libraries=False) and self.learner_on_stack(frame)
                    and not self._module_being_imported(frame)):
                return "running the grader's code with the learner's globals"
            return None
        if event in ("compile", "code.__new__"):
            filename = self._path(args[1])
            if (filename and self._library_file(filename) and self.learner_on_stack(frame)
                    and not (event == "compile" and self._compiles_library_source(filename, frame))):
                return f"{event} of code that claims to be {filename}"
            return None
        if event in _PROCESS_EVENTS:
            if not self.processes and self.learner_on_stack(frame):
                return f"{event} (a submission may not start processes or send signals while graded)"
            return None
        if event == "open" or event in _FILE_EVENTS:
            return self._judge_file(event, args, frame)
        if event in _MODULE_EVENTS:
            return self._judge_module_change(event, *args, frame=frame)
        return None

    def _judge_frame(self, event, args, frame):
        """sys._getframe, or a traceback's, generator's or coroutine's frame read: see `_FRAME_PASSING`."""
        if event == "object.__getattr__":
            if type(args[1]) is not str or args[1] not in _FRAME_ATTRIBUTES:
                return None
            holder = args[0]
            if not any(type(holder) is kind for kind in _FRAME_HOLDERS):     # `in` would call a metaclass's __eq__
                return None
            read = holder.tb_frame if type(holder) is _TracebackType else getattr(holder, args[1])
            what = f"reading {_type_name(holder)}.{args[1]}"
        else:
            read = args[0] if args and type(args[0]) is _FrameType else None
            what = event
        if self._names_the_call(frame, event, args) and (
                self._made_for_the_grader(frame) or self._frame_kept_to_itself(frame, read)
                or self._read_while_importing(frame, read)):
            return None
        return f"{what}{self._handed_to(frame)} (a frame of the grader's code, handed to the learner's)"

    # -- while library code holds a frame (see `_arm`) ----------------------------------------
    def _window_anchor(self, event, args, reader):
        """The frame whose return closes the window a frame read opens: the library function that read it,
        or, below generators and the functions that pass frames on (`_FRAME_PASSING`), the one they hand
        the frames to.  None when nothing was read, or when gclab's or the grader's own code read it."""
        if event == "object.__getattr__" and (type(args[1]) is not str or args[1] not in _FRAME_ATTRIBUTES
                                              or not any(type(args[0]) is kind for kind in _FRAME_HOLDERS)):
            return None
        if reader is None or self._grader_own(reader):
            return None
        anchor = reader
        while anchor is not None and (anchor.f_code.co_flags & _RESUMABLE or self._where(anchor) in _FRAME_PASSING):
            anchor = anchor.f_back
        if anchor is None or self._where(anchor) is None:
            return reader
        return None if self._grader_own(anchor) else anchor

    def _watch_refusal(self, window, frame, event):
        """What a call made in a window (see `_arm`) must be refused for, or None: the learner's code handed
        what leads to a frame or a namespace, or a call made by library code through a name rebound since
        installation.  Library code is told by its file (a str, looked up at no cost), before any id(): the
        caches below are keyed by the code's id (its hash would hash its constants, and gclab's pinned code holds
        unhashable ones: `gclab.pinning`), and hold the code itself, so that no other code takes its id."""
        if event == "call":
            code = frame.f_code
            if not self._library_file(code.co_filename) and id(code) not in self._trusted_codes:
                if self._namedtuple_new(frame):
                    return None
                if self._handed_a_frame(frame):
                    return (f"the notebook's {_text(code.co_name) or 'code'} was handed a frame or a module's "
                            f"globals while {self._holder(window)} could reach the grader's frames")
                window.clean, window.checked = {}, {}      # it may have rebound any name: read them again
                return None
            caller = frame.f_back
            if caller is None:
                return None
        else:
            caller = frame
        code = caller.f_code
        if not self._library_file(code.co_filename) or window.checked.get(id(code)) is code:
            return None                 # the grader's compiled code and the learner's have globals of their own
        if self._names_kept(code, caller.f_globals, caller.f_builtins, window.clean) is False:
            where = self._where(caller)
            return (f"{where[0]}:{where[1]} called a name rebound since grading began "
                    f"while {self._holder(window)} could reach the grader's frames")
        window.checked[id(code)] = code
        return None

    def _names_kept(self, code, live, live_builtins, clean: dict | None = None):
        """Are the names `code` uses, in `live` (its globals), in `live_builtins` and in the
        modules they name, what they were when the guard was installed (see `_unchanged`)?  None for globals
        the guard took no copy of (a module imported since).  With `clean` (a window's, see `_watch_refusal`),
        a namespace is read directly only where all its keys are exact strs (checked once per window: no
        method of a key runs), and through a copy of those otherwise."""
        if not self._library_file(code.co_filename):       # a key of the cache would hash its constants
            kept = self._names_to_keep(code, live, live_builtins)
        else:
            entry = self._name_triples.get(id(code))
            if entry is None or entry[0] is not code or entry[1] is not live or entry[2] is not live_builtins:
                entry = self._name_triples[id(code)] = (code, live, live_builtins,
                                                        self._names_to_keep(code, live, live_builtins))
            kept = entry[3]
        if kept is None:
            return None
        for namespace, names in kept:
            view = namespace
            if clean is not None:
                view = clean.get(id(namespace))
                if view is None:
                    view = clean[id(namespace)] = (namespace if all(map(_is, map(type, dict.keys(namespace)), _repeat(str)))
                                                   else _exact_keys(namespace))
            for name, was in names:
                now = view.get(name, _MISSING)
                if now is not was and not self._same_tool(self, name, now, was):
                    return False
        return True

    def _names_to_keep(self, code, live, live_builtins):
        """(namespace, ((name, what it held at installation), ...)) for the names `code` uses that held what is
        called (`_called`): in its globals (and, for a builtin's name, that it stays out of them), and in the
        builtins and each module they name.  None where the guard took no copy of `live` or `live_builtins`."""
        taken, builtins_taken = self._snapshots.get(id(live)), self._snapshots.get(id(live_builtins))
        if taken is None or taken[0] is not live or builtins_taken is None or builtins_taken[0] is not live_builtins:
            return None
        names = code.co_names
        kept = [(live, tuple((name, taken[1].get(name, _MISSING)) for name in names
                             if _called(taken[1].get(name, _MISSING)) or name in builtins_taken[1]))]
        pairs = [builtins_taken]
        for name in names:
            module_taken = self._module_snapshots.get(id(taken[1].get(name, _MISSING)))
            if module_taken is not None:
                pairs.append(module_taken)
        kept += [(namespace, tuple((name, then[name]) for name in names if name in then and _called(then[name])))
                 for namespace, then in pairs]
        return tuple(kept)

    def _holder(self, window) -> str:
        where = self._where(window.anchor)
        return f"{where[0]}:{where[1]}" if where else "a library"

    def _handed_a_frame(self, frame) -> bool:
        """Is the code `frame` starts handed (in its arguments, or one level into a tuple or dict of them)
        what leads to a frame, or a module's or function's globals (a dict with __builtins__)?"""
        values = list(frame.f_locals.values())
        for value in list(values):
            if type(value) is tuple:
                values.extend(value)
            elif type(value) is dict:
                values.extend(dict.values(value))
        return any(any(type(value) is kind for kind in _LEADING_TO_FRAMES)
                   or (type(value) is dict and "__builtins__" in _exact_keys(value)) for value in values)

    @staticmethod
    def _namedtuple_new(frame) -> bool:
        """Is `frame` a namedtuple's __new__ (code collections made from a string: `_tuple_new(_cls, (...))`
        and nothing else, with tuple.__new__ as `_tuple_new` and no builtins)?"""
        code, namespace = frame.f_code, frame.f_globals
        return (code.co_names == ("_tuple_new",) and not code.co_freevars and not code.co_cellvars
                and all(const is None for const in code.co_consts) and type(namespace) is dict
                and _exact_keys(namespace).get("_tuple_new") is _tuple_new and frame.f_builtins == {})

    def _handed_to(self, reader) -> str:
        """ by file:function (for file:function), naming the library code that read the frame and, when
        it passed the frame on, the code it passed it to."""
        names = []
        while reader is not None and len(names) < 2:
            where = self._where(reader)
            if where is None:
                name = reader.f_code.co_name
                names.append(f"the notebook's {_text(name) or 'code'}" if names else "")
                break
            names.append(f"{where[0]}:{where[1]}")
            if where not in _FRAME_PASSING:
                break
            reader = reader.f_back
        by = f" by {names[0]}" if names and names[0] else ""
        return by + (f" for {names[1]}" if len(names) > 1 else "")

    def _code_of_the_grader(self, code, libraries: bool) -> bool:
        """Is `code` the grader's (code it compiled, gclab's) or, with `libraries`, any library's?"""
        if type(code) is not _CodeType:
            return False
        if id(code) in self._trusted_codes:
            return True
        filename = code.co_filename
        return self._library_file(filename) if libraries else (
            type(filename) is str and filename.startswith("/") and self._realpath(filename).startswith(self.gclab_dir))

    def _module_being_imported(self, frame) -> bool:
        """Is `frame` the import system running a module's code (exec_module), called by nothing else?"""
        return (frame is not None and self._where(frame) == _IMPORTING
                and frame.f_back is not None and self._where(frame.f_back) == _EXECUTING_A_MODULE)

    def _names_the_call(self, frame, event, args) -> bool:
        """Does the code on top of the stack name the function in C that raised `event` (or the frame
        attribute read)?  When it does not, the function was called through a callable in C that it was
        handed (a defaultdict(sys._getframe).__getitem__ passed to gclab as a step, an attrgetter)."""
        name = args[1] if event == "object.__getattr__" else _CALL_NAMES.get(event)
        if name is None:
            return True
        return frame is not None and any(type(used) is str and used == name for used in frame.f_code.co_names)

    def _loads_library_bytecode(self, event, frame) -> bool:
        """marshal.loads by the import system loading a library module: _compile_bytecode called by a
        loader's get_code, for a library file (called directly, it would take any bytes and any name)."""
        if (not event.startswith("marshal.") or frame is None or self._where(frame) != _COMPILING_BYTECODE
                or frame.f_back is None or self._where(frame.f_back) != _GETTING_CODE):
            return False
        paths = [frame.f_locals.get("bytecode_path"), frame.f_locals.get("source_path")]
        return all(path is None or (type(path) is str and self._library_file(path)) for path in paths) and any(paths)

    def _compiles_library_source(self, filename, frame) -> bool:
        """compile by the import system of a library module whose cached bytecode is missing or stale
        (a read-only site-packages, PYTHONDONTWRITEBYTECODE): source_to_code, called by the get_code of
        a plain SourceFileLoader, which read the source from that very file."""
        source_to_code = frame.f_back if frame is not None and self._where(frame) == _IMPORTING else None
        if source_to_code is None or self._where(source_to_code) != _SOURCE_TO_CODE:
            return False
        get_code = source_to_code.f_back
        if get_code is None or self._where(get_code) != _GETTING_CODE:
            return False
        loader, path = get_code.f_locals.get("self"), get_code.f_locals.get("source_path")
        return type(loader) is importlib.machinery.SourceFileLoader and type(path) is str and path == filename

    def _judge_gate(self, args, frame):
        """A gated function (`_GATED`) called: no signal handler but those that ignore the frame they get
        (Python's, asyncio's, `_SIGNAL_HANDLERS`), no module that would hold the originals again, no extension
        module from outside the libraries, and no frame-evaluation hook but those torch sets while it is
        imported."""
        if len(args) != 3 or type(args[0]) is not str or type(args[1]) is not tuple:
            return "gclab.guard.gate called with something else than what the gates send"
        key, call = args[0], args[1]
        caller = frame.f_back if frame is not None else None       # frame: the gate itself, in gclab
        # judged by what is asked, whoever asks: the grader's code needs none of what is refused here, and a
        # callable in C handed to gclab's code (a defaultdict's factory) would call a gate with gclab on top
        if key == "_signal.signal":
            handler = call[1] if len(call) == 2 else None
            if type(handler) is int or self._library_handler(handler):
                return None
            return "signal.signal with a handler of the learner's own (a handler gets the frame it interrupted)"
        if key == "_imp._fix_co_filename":
            path = call[1] if len(call) == 2 else None
            if type(path) is str and not self._library_file(path):
                return None          # code named after a file of the notebook's (a module of its own, loaded again
                                     # from its cached bytecode): a name that earns it no trust
            if self._loads_library_bytecode("marshal.loads", caller):
                return None          # the import system naming a library's cached code after its source
            return f"{key} (it would name the notebook's code after a library's file)"
        if key in ("_imp.create_builtin", "_imp.create_dynamic"):
            spec = _exact_keys(vars(call[0]), frozenset(("name", "origin"))) if (
                call and type(call[0]) is _SimpleNamespace) else {}
            name = spec.get("name")
            if key == "_imp.create_builtin" and type(name) is str and name not in _BUILTINS_HOLDING_GATES:
                return None
            if (key == "_imp.create_dynamic" and self._library_file(spec.get("origin")) and type(name) is str
                    and not name.rpartition(".")[2].startswith(_TEST_EXTENSIONS)):
                return None
            return f"{key} of {name} (a module whose functions the guard keeps)"
        if all(value is None or value is False for value in call):
            return None
        if self._importing(caller) and all(self._library_function(value) for value in call):
            return None         # torch._dynamo.guards, imported, sets its own guard error hook
        return f"{key} (a hook that would see every frame)"

    def _library_function(self, value) -> bool:
        return type(value) is _FunctionType and self._library_file(value.__code__.co_filename)

    def _library_handler(self, handler) -> bool:
        """Python's own SIGINT handler, asyncio's (asyncio.run installs one, through a partial), or one of
        `_SIGNAL_HANDLERS`: none of them hands the frame it is called with to anything."""
        if type(handler) is _partial:
            handler = handler.func
        if type(handler) is _BuiltinFunctionType:
            return handler is self._default_int_handler
        function = handler.__func__ if type(handler) is _MethodType else handler
        if type(function) is not _FunctionType:
            return False
        filename = function.__code__.co_filename
        if not self._library_file(filename):
            return False
        name = self._library_name(filename)
        return name.startswith("asyncio/") or (name, function.__code__.co_name) in _SIGNAL_HANDLERS

    def _judge_module_change(self, event, module, name, value=None, frame=None):
        """A guarded module's attribute replaced or deleted (only an assignment the learner's code
        itself makes: a library may still wrap its own function, torch._dynamo does)."""
        name = _text(name)
        if id(module) not in self._module_ids or name is None or frame is None or self._grader_frame(frame.f_back):
            return None
        namespace = _exact_keys(self._module_dicts[id(module)], frozenset((name,)))
        module_name = self._module_names[id(module)]
        if event == "gclab.guard.delattr":
            return f"deleting {module_name}.{name} (one of the grader's tools)" if name in namespace else None
        if name == "__class__" or (name in namespace and namespace[name] is not value):
            return f"replacing {module_name}.{name} (one of the grader's tools)"
        if name.startswith("__") and name.endswith("__"):
            return f"adding {module_name}.{name} (it would change how the grader's tools are found)"
        return None

    def _path(self, value):
        """A path the hook was handed, as an exact str; None for anything else (the functions in C that
        raise these events pass the path they were given already converted: shutil.rmtree passes the
        learner's own object, and the calls it makes are judged one by one, with their paths converted)."""
        text = _text(value)
        if text is None and issubclass(type(value), bytes):
            text = bytes.decode(bytes.__getitem__(value, slice(None)), _FILESYSTEM_ENCODING, "surrogateescape")
        return text

    def _judge_file(self, event, args, frame):
        path = self._path(args[0])
        if path is None:
            return None
        try:
            real = self._realpath(path)
        except (TypeError, ValueError):
            return None
        inside = (real + "/").startswith(self.workdir)
        if self._memory_file(real) and self.learner_on_stack(frame):
            return f"opening {real} (a process's memory)"
        mode = args[1] if len(args) > 1 else None
        flags = args[2] if len(args) > 2 else None
        writes = event != "open" or (type(mode) is str and any(c in mode for c in "wax+")) or (
            mode is None and type(flags) is int and bool(flags & _WRITE_FLAGS))
        device = real.startswith("/dev/") and not (real + "/").startswith(self._memory_folders)
        if writes and self.files and not inside and not device:
            if self.learner_on_stack(frame):
                return f"writing {real} (outside the grading folder)"
        elif (not inside and (real + "/").startswith(self.hidden) and not self._library_file(real)
              and not (real + "/").startswith(self.gclab_dir) and self.learner_on_stack(frame)):
            return f"reading {real} (the course's own files)"
        return None

    def _is_tool(self, target) -> bool:
        if id(target) in self._module_ids:
            return True
        if type(target) is not _FunctionType:
            return False
        code = target.__code__
        return self._library_file(code.co_filename) or id(code) in self._trusted_codes

    def _tool_name(self, target) -> str:
        if id(target) in self._module_ids:
            return self._module_names[id(target)]
        return _text(target.__qualname__) or "a function"


def _same_tool(guard, what: str, now, was) -> bool:
    """Is `now` still the tool `was`?  Outside gclab, a library may wrap its own function
    (torch._dynamo wraps torch.manual_seed when an optimizer first runs): a function of library
    code whose `__wrapped__` is the original is still the tool.  Nothing of `now` but a function's
    own attributes is read: any other object's could be properties of the learner's, which would
    run here, and claim any `__wrapped__` and `__code__`."""
    if now is was:
        return True
    if what.startswith("gclab") or type(now) is not _FunctionType:
        return False
    inner = _exact_keys(now.__dict__, frozenset(("__wrapped__",))).get("__wrapped__")
    return inner is was and guard._library_file(now.__code__.co_filename)


def _read(getter):
    try:
        return getter()
    except Exception:
        return _MISSING


class _Missing:
    def __repr__(self):
        return "<missing>"


_MISSING = _Missing()


class _LockedModule(types.ModuleType):
    """A guarded module: replacing or deleting one of its attributes raises an audit event that
    the guard's hook refuses when the learner's code makes the assignment (new attributes, such
    as a submodule imported later, may be added)."""

    def __setattr__(self, name, value, audit=sys.audit):
        name = _text(name) or name
        audit("gclab.guard.setattr", self, name, value)
        super().__setattr__(name, value)

    def __delattr__(self, name, audit=sys.audit):
        name = _text(name) or name
        audit("gclab.guard.delattr", self, name)
        super().__delattr__(name)
