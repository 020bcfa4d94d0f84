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
  the working folder, and reading the course's own files (its solutions).

An event is the learner's when a frame of the learner's code is anywhere on the stack;
code from the standard library, installed packages and gclab, and code the grader compiled
itself (`Guard.trust`), is the grader's.  What was refused is listed by `problems()`, so a
grade can say why.

The guard's own state is out of the learner's reach too.  `install()` hands its `Guard` to
its caller alone: gclab.guard keeps no reference to it, its methods are looked up in a class
made for that one installation (replacing `Guard`'s members changes nothing installed), and
the audit hook, which CPython lists nowhere, holds the only other reference.  The learner's
code can reach neither (frames and the collector's object graph are refused), so it cannot
clear the manifest or the refusals, trust its own code, or change the guard's settings.  What
it can still do through a module's `__dict__` (rebind a guarded module's names, the guard's
own included) is not prevented but is listed by `problems()`.
"""
from __future__ import annotations

import os
import re
import sys
import sysconfig
import threading
import types

__all__ = ["Guard", "install", "starting_environment"]

GUARDED_MODULES = ("gc", "time", "weakref", "math", "builtins", "sys", "os", "posixpath", "torch", "torch.cuda",
                   "numpy")
# frozen: the hook reads them at every event, and a learner could reach a mutable set
_FRAME_ATTRIBUTES = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
# library functions that hand frames back to whoever called them
_FRAME_RETURNING = frozenset({("inspect.py", "currentframe"), ("inspect.py", "stack"), ("inspect.py", "trace"),
                              ("inspect.py", "getouterframes"), ("inspect.py", "getinnerframes"),
                              ("traceback.py", "walk_stack"), ("traceback.py", "walk_tb"),
                              ("traceback.py", "_walk_tb_with_full_positions"),
                              ("base_tasks.py", "_task_get_stack"), ("__init__.py", "<lambda>")})
_REACHING = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
                       "sys.settrace", "sys.setprofile", "sys._getframe", "marshal.loads", "marshal.load",
                       "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function", "ctypes.addressof",
                       "ctypes.cdata/buffer", "ctypes.create_string_buffer", "ctypes.string_at",
                       "ctypes.wstring_at", "function.__new__", "sys.monitoring.register_callback",
                       "cpython.PyInterpreterState_Clear", "sys._getframemodulename"})
# Of those, the events whose result or effect reaches past the caller (objects handed back, a hook
# installed for every later call): allowed only where gclab's own code or the grader's makes the call.
# A library making it for the learner (objgraph.by_type, IPython calling back a functools.partial of
# sys.settrace after a cell) is the learner's doing, whether or not a frame of the learner's is on the stack.
_GRADER_ONLY = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
                          "sys.settrace", "sys.setprofile"})
# Library code that calls back what it was handed, with none of the learner's frames on the stack:
# a call made from one of these is the learner's doing.
_CALLING_BACK = frozenset({("weakref.py", "__call__"), ("events.py", "trigger"), ("events.py", "_run"),
                           ("threading.py", "run"), ("thread.py", "run")})
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
    sealed = type(Guard.__name__, (Guard,), {name: member for name, member in vars(Guard).items()
                                             if name not in ("__dict__", "__weakref__")})
    guard = sealed(workdir or os.getcwd(), processes, files, hidden)
    guard._arm()
    return guard


def _library_roots() -> tuple:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots |= {os.path.dirname(os.__file__), os.path.dirname(os.path.abspath(__file__))}
    roots |= {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    return tuple(sorted({os.path.realpath(r) + os.sep for r in roots}))


class Guard:
    def __init__(self, workdir, processes: bool, files: bool, hidden=()):
        self.workdir = os.path.realpath(workdir) + os.sep
        self.processes, self.files = processes, files
        self.gclab_dir = os.path.dirname(os.path.realpath(__file__)) + os.sep
        self.hidden = tuple(os.path.realpath(h) + os.sep for h in hidden)
        self.refused: list = []
        self._roots = _library_roots()
        self._trusted_codes: dict = {}
        self._file_trust: dict = {}
        self._gclab_files: dict = {}
        self._busy = threading.local()
        self._modules = self._guarded_modules()
        self._module_ids = frozenset(id(m) for m in self._modules.values())
        # bound now: the hook and the manifest's check must not look names up in globals the
        # learner's code can rebind through a module's __dict__ (that would be listed, not prevented)
        self._same_tool, self._read, self._realpath, self._fsdecode = _same_tool, _read, os.path.realpath, os.fsdecode
        self._memory_file, self._memory_folders = _MEMORY_FILES.fullmatch, _MEMORY_FOLDERS
        self._manifest = self._take_manifest()

    # -- what the grader's tools are -------------------------------------------------------
    @staticmethod
    def _guarded_modules() -> dict:
        names = list(GUARDED_MODULES) + sorted(n for n in sys.modules if n == "gclab" or n.startswith("gclab."))
        return {n: sys.modules[n] for n in names if isinstance(sys.modules.get(n), types.ModuleType)}

    def _take_manifest(self) -> list:
        """(what, how to read it now, what it was) for every tool."""
        entries = []
        for name, module in self._modules.items():
            entries.append((f"sys.modules[{name!r}]", lambda n=name: sys.modules.get(n), module))
            namespace = vars(module)
            for attr, value in list(namespace.items()):
                if name == "sys" and attr not in ("modules", "audit", "addaudithook", "_getframe", "exit"):
                    continue            # sys holds streams and settings ordinary code changes
                if name == "os" and attr != "environ" and not callable(value):
                    continue
                entries.append((f"{name}.{attr}", lambda ns=namespace, a=attr: ns.get(a, _MISSING), value))
                if name.startswith("gclab") and getattr(value, "__module__", None) == name:
                    entries += self._definition(f"{name}.{attr}", value)
        torch = self._modules.get("torch")
        if torch is not None:
            members = vars(torch.Tensor)
            entries += [(f"torch.Tensor.{a}", lambda a=a: members.get(a, _MISSING), v) for a, v in list(members.items())]
        return entries

    def _definition(self, qualname, value) -> list:
        if isinstance(value, type):
            members = vars(value)
            entries = [(f"{qualname}.{a}", lambda a=a: members.get(a, _MISSING), m) for a, m in list(members.items())]
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
            same, read = self._same_tool, self._read
            return [what for what, now, was in self._manifest if not same(self, what, read(now), was)]
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
        known = self._file_trust.get(filename)
        if known is None:
            if filename.startswith("<frozen "):
                known = True
            elif filename.startswith("<") or not filename:
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
        known = self._gclab_files.get(code.co_filename)
        if known is None:
            known = self._gclab_files[code.co_filename] = (
                code.co_filename.startswith("/") and self._realpath(code.co_filename).startswith(self.gclab_dir))
        return known

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
        return (frame is not None and self._library_file(frame.f_code.co_filename)
                and (os.path.basename(frame.f_code.co_filename), frame.f_code.co_name) in _CALLING_BACK)

    def learner_on_stack(self, frame) -> bool:
        while frame is not None:
            if not self._grader_frame(frame):
                return True
            frame = frame.f_back
        return False

    # -- the audit hook --------------------------------------------------------------------
    def _arm(self) -> None:
        for module in self._modules.values():
            if type(module) is types.ModuleType:
                module.__class__ = _LockedModule
        getframe, busy = sys._getframe, self._busy

        def hook(event, args):
            if getattr(busy, "depth", 0):
                return
            busy.depth = 1
            try:
                try:
                    frame = getframe(1)
                except ValueError:          # an event raised with no Python frame above it
                    frame = None
                refusal = self._judge(event, args, frame)
            finally:
                busy.depth = 0
            if refusal:
                self.refused.append(refusal)
                error = (AttributeError if event in _MODULE_EVENTS else
                         PermissionError if (event == "open" or event in _FILE_EVENTS) else RuntimeError)
                raise error(f"refused while grading: {refusal}")
        sys.addaudithook(hook)

    def _judge(self, event, args, frame):
        if event == "sys.addaudithook":     # another hook, even one a library adds for the learner, sees first-hand
            return f"{event} (a hook of the learner's own)" if self.learner_on_stack(frame) else None
        if event in _GRADER_ONLY:
            return None if self._made_for_the_grader(frame) else f"{event} (reaching into the grader's objects)"
        if event in _REACHING:
            if not self._calling_back(frame) and (self._library_reads_frame(frame) or not self.learner_on_stack(frame)):
                return None
            return f"{event} (reaching into the grader's objects)"
        if event == "object.__getattr__":
            if (args[1] in _FRAME_ATTRIBUTES and not self._library_reads_frame(frame)
                    and self.learner_on_stack(frame)):
                return f"reading {type(args[0]).__name__}.{args[1]} (a frame of the grader's code)"
            return None
        if event == "object.__setattr__":
            if self._is_tool(args[0]) and self.learner_on_stack(frame):
                return f"setting {getattr(args[0], '__qualname__', type(args[0]).__name__)}.{args[1]}"
            return None
        if event == "exec":
            if id(args[0]) in self._trusted_codes and self.learner_on_stack(frame):
                return "running the grader's code with the learner's globals"
            return None
        if event in ("compile", "code.__new__"):
            filename = os.fsdecode(args[1]) if isinstance(args[1], (str, bytes)) else ""
            if filename.startswith("/") and self._library_file(filename) and self.learner_on_stack(frame):
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

    def _judge_module_change(self, event, module, name, value=None, frame=None):
        """A guarded module's attribute replaced or deleted (only an assignment the learner's code
        itself makes: a library may still wrap its own function, torch._dynamo does)."""
        if id(module) not in self._module_ids or frame is None or self._grader_frame(frame.f_back):
            return None
        namespace = vars(module)
        if event == "gclab.guard.delattr":
            return f"deleting {module.__name__}.{name} (one of the grader's tools)" if name in namespace else None
        if name == "__class__" or (name in namespace and namespace[name] is not value):
            return f"replacing {module.__name__}.{name} (one of the grader's tools)"
        return None

    def _judge_file(self, event, args, frame):
        path = args[0]
        if isinstance(path, int) or path is None:
            return None
        try:
            real = self._realpath(self._fsdecode(path))
        except (TypeError, ValueError):
            return None
        inside = (real + os.sep).startswith(self.workdir)
        if self._memory_file(real) and self.learner_on_stack(frame):
            return f"opening {real} (a process's memory)"
        writes = event != "open" or (isinstance(args[1], str) and any(c in args[1] for c in "wax+")) or (
            args[1] is None and isinstance(args[2], int) and bool(args[2] & _WRITE_FLAGS))
        device = real.startswith("/dev/") and not (real + os.sep).startswith(self._memory_folders)
        if writes and self.files and not inside and not device:
            if self.learner_on_stack(frame):
                return f"writing {real} (outside the grading folder)"
        elif (not inside and (real + os.sep).startswith(self.hidden) and not self._library_file(real)
              and not (real + os.sep).startswith(self.gclab_dir) and self.learner_on_stack(frame)):
            return f"reading {real} (the course's own files)"
        return None

    def _is_tool(self, target) -> bool:
        if isinstance(target, types.ModuleType):
            return target.__name__ in self._modules
        code = getattr(target, "__code__", None)
        return isinstance(code, types.CodeType) and (
            self._library_file(code.co_filename) or id(code) in self._trusted_codes)

    def _library_reads_frame(self, frame) -> bool:
        """Library code that reads a frame for its own use (logging's caller lookup, traceback
        formatting, namedtuple's module name) and hands no frame to the learner's code."""
        if frame is None or not self._library_file(frame.f_code.co_filename):
            return False
        where = (os.path.basename(frame.f_code.co_filename), frame.f_code.co_name)
        if where not in _FRAME_RETURNING:
            return True
        consumer = frame.f_back          # who gets the frames: a library, or the learner
        return consumer is not None and self._library_reads_frame(consumer)


def _same_tool(guard, what: str, now, was, getattr=getattr, isinstance=isinstance) -> bool:
    """Is `now` still the tool `was`?  Outside gclab, a library may wrap its own function
    (torch._dynamo wraps torch.manual_seed when an optimizer first runs): a wrapper whose
    `__wrapped__` is the original, made by library code, is still the tool."""
    if now is was:
        return True
    if what.startswith("gclab"):
        return False
    inner = getattr(now, "__wrapped__", None) if not isinstance(now, _Missing) else None
    code = getattr(now, "__code__", None)
    return inner is was and code is not None and guard._library_file(code.co_filename)


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
        audit("gclab.guard.setattr", self, name, value)
        super().__setattr__(name, value)

    def __delattr__(self, name, audit=sys.audit):
        audit("gclab.guard.delattr", self, name)
        super().__delattr__(name)
