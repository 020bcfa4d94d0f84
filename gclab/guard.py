"""Reasons a learner can read, when the code being graded reaches for the grader's tools or the machine.

The guard is not what a grade rests on.  The process that runs a learner's code can read and rewrite
any address of itself (an array over any address needs no audit event), so nothing inside it can be
trusted to hold: a point is earned only on figures the grader measured itself, in a process where no
learner code ever ran (`gclab.measured`).  What the guard adds, in the process it is installed in, is
an early and plain account of what the code did:

- `problems()` lists the grader's tools that were replaced, by any route (an alias, `exec`,
  `sys.modules`, a module's `__dict__`): every attribute of the guarded modules, the members of
  gclab's classes, the code, defaults and closures of gclab's functions, torch.Tensor's methods;
- replacing or deleting an attribute of a guarded module (`gc.collect = ...`) is refused at once;
- an audit hook (PEP 578) refuses, to the learner's code: starting processes and sending signals
  (as configured), writing outside the grading folder, reading the course's own files (its solutions
  and hidden tests), and opening a process's memory as a file.

An action is the learner's when a frame of the learner's code is on the stack: code from the
standard library, installed packages and gclab, and code the grader compiled itself
(`Guard.trust`), is the grader's.  What was refused is listed by `problems()` too, so that a
grade can say why.
"""
from __future__ import annotations

import os
import re
import sys
import sysconfig
import threading
import types

from .environment import starting_environment

__all__ = ["Guard", "install", "pin_gclab", "starting_environment"]

GUARDED_MODULES = ("gc", "time", "weakref", "math", "builtins", "sys", "os", "posixpath", "torch", "torch.cuda",
                   "numpy") + (
    # the libraries whose Python classes gclab's tools and the verdict run (a context manager's
    # __exit__ that returned True would swallow a check's AssertionError): their classes' members too
    LIBRARY_CLASSES := ("contextlib", "collections", "threading", "warnings", "traceback", "linecache", "inspect",
                        "copy", "dataclasses", "functools", "json", "json.encoder", "io", "torch.utils._python_dispatch",
                        # the meter reads a storage's size through torch.UntypedStorage and runs every op as an OpOverload
                        "torch.storage", "torch._ops"))
# Packages whose every loaded submodule is guarded like LIBRARY_CLASSES: the in-process statistics run through
# their internals (np.percentile calls numpy.lib._function_base_impl's functions by name).
LIBRARY_PACKAGES = ("numpy",)
# socket.sendmsg: how a request with file descriptors reaches a fork server (gclab.zygote)
_PROCESS_EVENTS = frozenset({"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                             "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill",
                             "socket.sendmsg"})
_FILE_EVENTS = frozenset({"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
                          "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move",
                          "os.setxattr", "os.removexattr"})
_MODULE_EVENTS = frozenset({"gclab.guard.setattr", "gclab.guard.delattr"})
_JUDGED = _PROCESS_EVENTS | _FILE_EVENTS | _MODULE_EVENTS | {"open"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
# A process's memory, read as a file: any pid (the grader's own), any thread, the kernel's and the machine's.
_MEMORY_FILES = re.compile(r"/proc/[^/]+/(task/[^/]+/)?mem|/proc/kcore|/dev/k?mem|/dev/port")
# Devices whose files are memory (tmpfs): not counted in the process's address-space limit, and left
# behind after grading.
_MEMORY_FOLDERS = ("/dev/shm/", "/dev/mqueue/")
_FILESYSTEM_ENCODING = sys.getfilesystemencoding()


def install(workdir=None, processes: bool = False, files: bool = True, hidden=()) -> "Guard":
    """Install a guard and hand it to the caller.  Each call installs another, independent one.

    `workdir`: the folder the learner's code may write to (default: the current one);
    `processes`: may the learner's code start processes and send signals;  `files`: refuse
    writes outside `workdir`;  `hidden`: folders the learner's code may not read (the course:
    its solutions and hidden tests), gclab's own package excepted."""
    guard = Guard(workdir or os.getcwd(), processes, files, hidden)
    pin_gclab()                        # before the manifest, which takes gclab's code
    guard._arm()
    guard._manifest = guard._take_manifest()
    return guard


def _in_library_package(name: str) -> bool:
    return name.partition(".")[0] in LIBRARY_PACKAGES and "." in name


def pin_gclab() -> int:
    """Pin the global names of gclab's code (`gclab.pinning`): the builtins, its modules' names, and the
    functions, classes and modules it reads as module attributes (`gc.collect`, `subprocess.Popen`), so
    that a self-check's message describes what the check measured, whatever the notebook rebinds.
    Returns how many functions were pinned now."""
    from . import pinning
    gclab_dir = os.path.dirname(os.path.realpath(__file__)) + os.sep
    modules = {id(m): m for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)
               and os.path.realpath(getattr(m, "__file__", None) or "/").startswith(gclab_dir)
               and m.__name__ not in (__name__, pinning.__name__)}
    return pinning.pin(list(modules.values()))


def _resolve(path: str) -> str:
    """`path` made absolute and canonical as the kernel resolves it (links, `..`): its longest part that
    exists, opened without being read (O_PATH) and named by /proc/self/fd, then the rest."""
    if not path.startswith("/"):
        path = os.getcwd() + "/" + path
    rest = ""
    while True:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            head, _, tail = path.rpartition("/")
            rest = tail + "/" + rest if rest else tail
            if not head:
                return "/" + rest
            path = head
            continue
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:             # no /proc: the path as it was written
            real = path
        finally:
            os.close(fd)
        return real if not rest else real.rstrip("/") + "/" + rest


def _path(value):
    """A path the hook was handed, as a str; None for anything else."""
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bytes):
        return bytes(value).decode(_FILESYSTEM_ENCODING, "surrogateescape")
    return None


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
        self._busy = threading.local()
        self._modules = self._guarded_modules()
        self._module_names = {id(m): name for name, m in self._modules.items()}
        self._manifest: list = []

    # -- what the grader's tools are -------------------------------------------------------
    @staticmethod
    def _guarded_modules() -> dict:
        names = list(GUARDED_MODULES) + sorted(n for n in sys.modules if n == "gclab" or n.startswith("gclab.")
                                               or _in_library_package(n))
        return {n: sys.modules[n] for n in names if isinstance(sys.modules.get(n), types.ModuleType)}

    def _take_manifest(self) -> list:
        """(what, how to read it now, what it was) for every tool: how to read it is (namespace, key) for
        an entry of a module's, class's or keyword defaults' namespace, or a function."""
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
        for cell in function.__closure__ or ():
            try:
                entries.append((f"{qualname} (closure)", lambda c=cell: c.cell_contents, cell.cell_contents))
            except ValueError:
                pass
        return entries

    def replaced(self) -> list:
        """The grader's tools that are no longer what they were when the guard was installed."""
        self._busy.judging = True
        try:
            return [what for what, source, was in self._manifest if not self._same_tool(what, _now(source), was)]
        finally:
            self._busy.judging = False

    def _same_tool(self, what: str, now, was) -> bool:
        """Is `now` still the tool `was`?  Outside gclab, a library may wrap its own function
        (torch._dynamo wraps torch.manual_seed when an optimizer first runs): a function of library
        code whose `__wrapped__` is the original is still the tool."""
        if now is was:
            return True
        if what.startswith("gclab") or type(now) is not types.FunctionType:
            return False
        return now.__dict__.get("__wrapped__") is was and self._library_file(now.__code__.co_filename)

    def problems(self) -> list:
        """What says the learner's code reached for the grader's tools or the machine: replaced tools and
        refused actions, in words, each once."""
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
        an installed package's or gclab's?"""
        if type(filename) is not str:
            return False
        known = self._file_trust.get(filename)
        if known is None:
            if filename.startswith("<frozen "):
                known = True
            elif not filename.startswith("/"):
                known = False
            else:
                real = _resolve(filename)
                known = real.startswith(self._roots) and not real.startswith(self.workdir)
            self._file_trust[filename] = known
        return known

    def _grader_frame(self, frame) -> bool:
        code = frame.f_code
        return id(code) in self._trusted_codes or self._library_file(code.co_filename)

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
        busy = self._busy

        def hook(event, args):
            if event not in _JUDGED or getattr(busy, "judging", False):
                return
            busy.judging = True         # the hook's own calls (resolving a path) raise events too
            try:
                refusal = self._judge(event, args, sys._getframe(1))
            finally:
                busy.judging = False
            if refusal:
                self.refused.append(refusal)
                error = (AttributeError if event in _MODULE_EVENTS else
                         PermissionError if (event == "open" or event in _FILE_EVENTS) else RuntimeError)
                raise error(f"refused while grading: {refusal}")
        sys.addaudithook(hook)

    def _judge(self, event, args, frame):
        if event in _PROCESS_EVENTS:
            if not self.processes and self.learner_on_stack(frame):
                return f"{event} (a submission may not start processes or send signals while graded)"
            return None
        if event in _MODULE_EVENTS:
            return self._judge_module_change(event, *args, frame=frame)
        return self._judge_file(event, args, frame)

    def _judge_module_change(self, event, module, name, value=None, frame=None):
        """A guarded module's attribute replaced or deleted (only an assignment the learner's code
        itself makes: a library may still wrap its own function, torch._dynamo does)."""
        name = _path(name)
        if id(module) not in self._module_names or name is None or frame is None or self._grader_frame(frame.f_back):
            return None
        namespace = vars(module)
        module_name = self._module_names[id(module)]
        if event == "gclab.guard.delattr":
            return f"deleting {module_name}.{name} (one of the grader's tools)" if name in namespace else None
        if name == "__class__" or (name in namespace and namespace[name] is not value):
            return f"replacing {module_name}.{name} (one of the grader's tools)"
        if name.startswith("__") and name.endswith("__"):
            return f"adding {module_name}.{name} (it would change how the grader's tools are found)"
        return None

    def _judge_file(self, event, args, frame):
        path = _path(args[0])
        if path is None:
            return None
        try:
            real = _resolve(path)
        except (TypeError, ValueError):
            return None
        inside = (real + "/").startswith(self.workdir)
        if _MEMORY_FILES.fullmatch(real) and self.learner_on_stack(frame):
            return f"opening {real} (a process's memory)"
        mode = args[1] if len(args) > 1 else None
        flags = args[2] if len(args) > 2 else None
        writes = event != "open" or (type(mode) is str and any(c in mode for c in "wax+")) or (
            mode is None and type(flags) is int and bool(flags & _WRITE_FLAGS))
        device = real.startswith("/dev/") and not (real + "/").startswith(_MEMORY_FOLDERS)
        if writes and self.files and not inside and not device:
            if self.learner_on_stack(frame):
                return f"writing {real} (outside the grading folder)"
        elif (not inside and (real + "/").startswith(self.hidden) and not self._library_file(real)
              and not (real + "/").startswith(self.gclab_dir) and self.learner_on_stack(frame)):
            return f"reading {real} (the course's own files)"
        return None


def _now(source):
    if type(source) is tuple:
        namespace, key = source
        return namespace.get(key, _MISSING)
    try:
        return source()
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
