"""Who keeps an object alive: readable paths from module globals down to it.

    reference_paths(tensor)
    # ["Out[12]", "_12", "sys.last_traceback.tb_next.tb_frame.f_locals['big']   # frame of failing_step()"]

A search backwards through `gc.get_referrers`, from the object to the globals of a
module in `sys.modules` (a notebook's own globals are written without a module name,
as you would type them in a cell).  Each path is a Python expression you can evaluate
to reach the object, written with the attribute or key each link uses.  It does not
draw anything, so it needs no Graphviz (objgraph's `show_backrefs` does).

What it cannot see: references from functions that are running right now (their local
variables are not objects the collector knows on Python 3.11+, and this call's own
caller always holds the object), and references from C code that the collector is not
told about.  Each step of the search scans every object the collector tracks, so it
stops after `max_visits` objects.

Also here, for tests of stores that keep objects (caches, registries): `Lifetimes` (how many of some
objects are still alive), `Stub` (a stand-in whose freed address the next one takes) and
`objects_added` (what calls left alive, counted).
"""
from __future__ import annotations

import gc
import inspect
import sys
import traceback
import types
import warnings
import weakref
from collections import deque


__all__ = ["Lifetimes", "Stub", "reference_paths", "direct_referrers", "forget_last_error", "link", "links",
           "objects_added", "weakref_or_none", "reuse_address", "assert_is"]

_MAIN = "__main__"
_SHELL = "get_ipython()"


def _module_globals() -> dict[int, str]:
    """id(module.__dict__) -> module name, for every module imported so far (a module
    listed under two names, as a notebook's `__main__` often is, keeps its first name)."""
    roots = {}
    for name, module in sorted(sys.modules.items(), key=lambda item: item[0] != _MAIN):
        if isinstance(module, types.ModuleType):
            roots.setdefault(id(module.__dict__), name)
    return roots


def _running_frames() -> set[int]:
    ids, frame = set(), sys._getframe()
    while frame is not None:
        ids.add(id(frame))
        frame = frame.f_back
    return ids


def _dict_links(mapping: dict, child) -> list[str]:
    found = [f"[{key!r}]" for key, value in list(mapping.items()) if value is child]
    return found or [" (a key of the dict)" for key in list(mapping) if key is child][:1]


def _sequence_link(seq, child) -> str | None:
    for i, item in enumerate(seq):
        if item is child:
            return f"[{i}]"
    return None


_NAMED_LINKS = {
    types.TracebackType: ("tb_next", "tb_frame"),
    types.FrameType: ("f_back",),
    types.MethodType: ("__self__", "__func__"),
    types.FunctionType: ("__defaults__", "__kwdefaults__", "__closure__", "__globals__", "__dict__"),
    types.CellType: ("cell_contents",),
    BaseException: ("__traceback__", "__context__", "__cause__", "args", "__dict__"),
}


def link(parent, child) -> str:
    """How `parent` refers to `child`, as the text that follows `parent` in an expression:
    `.tb_frame`, `['key']`, `[3]`, `.f_locals['x']`, or ` -> TypeName` when it cannot tell."""
    found = links(parent, child)
    return next((piece for piece in found if not piece.startswith(("['_", '["_'))), found[0])


def links(parent, child) -> list[str]:
    """Every way `parent` refers to `child` (a dict can hold it under several keys)."""
    for kind, names in _NAMED_LINKS.items():
        if isinstance(parent, kind):
            for name in names:
                try:
                    if getattr(parent, name) is child:
                        return [f".{name}"]
                except (AttributeError, ValueError):     # an empty cell raises ValueError
                    pass
    if isinstance(parent, types.FrameType):
        return _frame_links(parent, child)
    if isinstance(parent, dict):
        found = _dict_links(parent, child)
        if found:
            return found
    elif isinstance(parent, (list, tuple, deque)):
        found = _sequence_link(parent, child)
        if found:
            return [found]
    elif isinstance(parent, (set, frozenset)) and child in parent:
        return [" (a member of the set)"]
    if isinstance(parent, type) and isinstance(child, dict) and _is_class_dict(parent, child):
        return [".__dict__"]
    try:
        attributes = vars(parent)
    except TypeError:
        attributes = {}
    if attributes is child:
        return [".__dict__"]
    found = [f".{key}" for key, value in list(attributes.items()) if value is child and str(key).isidentifier()]
    if found:
        return found
    for name in getattr(type(parent), "__slots__", ()):
        if getattr(parent, name, None) is child:
            return [f".{name}"]
    return [f" -> {type(child).__name__}"]


def frame_local_names(frame, child) -> list[str]:
    """The names of `frame`'s local variables that hold `child`, on every Python version.

    Up to 3.12, reading `frame.f_locals` refreshes a snapshot of the locals that the frame
    keeps (PEP 667 removed it in 3.13), and `frame.clear()` (so `traceback.clear_frames`)
    leaves that snapshot alone: a search that left one behind would keep the locals alive
    after `clear_frames`.  There the snapshot is read and then put back as it was found:
    emptied when this call made it, its old contents restored when it was there already.
    """
    if sys.version_info >= (3, 13):      # f_locals is a live view (PEP 667): reading it stores nothing
        return _names_of(dict(frame.f_locals), child)
    shared = (frame.f_globals, frame.f_builtins)
    found_before = {id(d): dict(d) for d in gc.get_referents(frame)
                    if type(d) is dict and not any(d is s for s in shared)}
    try:
        if not frame.f_code.co_flags & inspect.CO_OPTIMIZED:
            # a module or class body: its locals are a namespace of its own, read as it is
            return [name for d in found_before.values() for name in _names_of(d, child)]
        snapshot = frame.f_locals
        try:
            names = _names_of(snapshot, child) + _names_of(found_before.get(id(snapshot), {}), child)
            return list(dict.fromkeys(names))       # the second: a stale snapshot that still holds it
        finally:
            snapshot.clear()
            snapshot.update(found_before.get(id(snapshot), {}))
    finally:
        found_before.clear()


def _names_of(namespace: dict, child) -> list[str]:
    return list(dict.fromkeys(name for name, value in list(namespace.items()) if value is child))


def _frame_links(frame, child) -> list[str]:
    return [f".f_locals[{name!r}]" for name in frame_local_names(frame, child)] or [_HELD_BY_FRAME]


_HELD_BY_FRAME = " (held by the frame, under no local variable's name)"


def _is_class_dict(cls: type, mapping: dict) -> bool:
    """Is `mapping` the dict behind `cls.__dict__` (which Python shows as a read-only proxy)?"""
    proxy = cls.__dict__
    return len(proxy) == len(mapping) and all(proxy.get(k, _MISSING) is v for k, v in list(mapping.items()))


_MISSING = object()


def _render(root: str, pieces: list[str], frames: list[str]) -> str:
    text = root
    for piece in pieces:
        key = piece[2:-2]
        if text.endswith(".__dict__") and piece[:2] in ("['", '["') and key.isidentifier():
            text = text[: -len(".__dict__")] + "." + key      # obj.__dict__['x'] -> obj.x
        else:
            text += piece
    if frames:
        text += "   # frame of " + ", ".join(f"{f}()" for f in frames)
    return text


def reference_paths(obj, max_paths: int = 8, max_depth: int = 12, max_visits: int = 60) -> list[str]:
    """Paths from module globals (or, in IPython, from `get_ipython()`) to `obj`, shortest
    first: each says what keeps it alive.

    One path per direct holder of `obj` (and per name, when a namespace holds it under
    several).  An empty list means that nothing reachable from a module refers to it any
    more: it may still be held by a running function, or be garbage in a reference cycle.

    Each step of a path is written the way Python reaches it, the same for the same kind
    of holder on every version: `.name` (an attribute, also a traceback's `.tb_frame`, a
    function's `.__closure__`, a cell's `.cell_contents`, an exception's
    `.__traceback__`), `['key']` (a dict; `obj.__dict__['x']` is written `obj.x`), `[3]`
    (a list or tuple), `.f_locals['name']` (a local variable of a frame that has
    finished, such as one a traceback keeps), `` (held by the frame, under no local
    variable's name)`` (a frame holds it, for example through a closure cell),
    `` (a key of the dict)``, `` (a member of the set)``, and `` -> TypeName`` where the
    link cannot be named.  A frame's path ends with `# frame of f()`.
    """
    roots = _module_globals()
    shell = _ipython()
    if shell is not None:
        roots[id(shell)] = _SHELL            # IPython's machinery reads best from get_ipython()
    # Bookkeeping holds ids, except `nodes`, which the search skips as a referrer.
    nodes = {id(obj): obj}
    child_of: dict[int, int] = {}       # holder -> what it holds, one step nearer to obj
    queue = deque([(id(obj), 0)])
    ignored = _running_frames() | {id(nodes), id(queue)}
    found: list[str] = []
    explained: set[tuple] = set()        # (what the global names, obj's direct holder) already shown
    visits = 0
    with warnings.catch_warnings():       # some objects warn when merely inspected (deprecated attributes)
        warnings.simplefilter("ignore")
        try:
            while queue and len(found) < max_paths and visits < max_visits:
                node_id, depth = queue.popleft()
                visits += 1
                referrers = gc.get_referrers(nodes[node_id])
                ignored.add(id(referrers))
                for holder in referrers:
                    holder_id = id(holder)
                    if holder_id in ignored or holder_id in nodes or isinstance(holder, types.ModuleType):
                        continue
                    if holder_id in roots:
                        path = [holder] + [nodes[i] for i in _chain(node_id, child_of)]
                        key = (_named(path), id(path[-2]))
                        if key not in explained:
                            explained.add(key)
                            found.extend(_paths(path, roots[holder_id]))
                        continue
                    nodes[holder_id] = holder
                    child_of[holder_id] = node_id
                    if depth + 1 < max_depth:
                        queue.append((holder_id, depth + 1))
                del referrers
        finally:
            nodes.clear()
    return found[:max_paths]


def _named(path: list) -> int:
    """The object a path's global name stands for, seen through bound methods, classes and
    `__dict__`s (so that `get_ipython.__self__.x` and `sys.excepthook.__self__.x` count once)."""
    for parent, child in zip(path, path[1:]):
        if not (isinstance(child, (types.MethodType, type)) or link(parent, child) == ".__dict__"):
            return id(child)
    return id(path[-1])


def _chain(start: int, child_of: dict) -> list[int]:
    """Ids from `start` down to the searched object."""
    chain = [start]
    while chain[-1] in child_of:
        chain.append(child_of[chain[-1]])
    return chain


def _paths(objects: list, module: str) -> list[str]:
    """The expressions that reach the searched object along `objects`, from a module's
    globals down to it (one per name it has in its last holder)."""
    pieces = [link(parent, child) for parent, child in zip(objects[:-2], objects[1:-1])]
    frames = [o.f_code.co_name for o in objects[:-1] if isinstance(o, types.FrameType)]
    paths = []
    for last in links(objects[-2], objects[-1]):
        steps = pieces + [last]
        if module == _SHELL:
            root = _SHELL
        else:
            first = steps.pop(0)                 # the global's name: ['x'] -> x
            name = first[2:-2] if first[:2] in ("['", '["') else first
            root = name if module in (_MAIN, "builtins") else f"{module}.{name}"
        paths.append(_render(root, steps, frames))
    return paths


def direct_referrers(obj) -> list[str]:
    """What refers to `obj` directly, one short line each: `list[0]`, `dict['x']`, `frame of f()`."""
    ignored = _running_frames()
    lines = []
    referrers = gc.get_referrers(obj)
    for holder in referrers:
        if id(holder) in ignored:
            continue
        name = f"frame of {holder.f_code.co_name}()" if isinstance(holder, types.FrameType) else type(holder).__name__
        lines.extend(f"{name}{piece}" for piece in links(holder, obj))
    del referrers
    return lines


def forget_last_error() -> list[str]:
    """Drop the references that Python and IPython keep to the last uncaught exception.

    After a cell fails, the exception, its traceback, and through the traceback every local
    variable of every function it passed through, stay alive in `sys.last_value`,
    `sys.last_traceback` (and `sys.last_exc` from Python 3.12), for post-mortem debugging
    (`%debug`, `%tb`), and IPython's traceback printer keeps the traceback too.  This
    clears the frames' local variables (`traceback.clear_frames`: some frames sit in
    reference cycles that only the collector would free) and deletes those references;
    it returns the names it deleted.
    """
    shell = _ipython()
    printer = getattr(shell, "InteractiveTB", None)
    for holder, name in ((sys, "last_traceback"), (getattr(sys, "last_exc", None), "__traceback__"),
                         (sys.__dict__.get("last_value"), "__traceback__"), (printer, "tb")):
        tb = getattr(holder, name, None)
        if tb is not None:
            traceback.clear_frames(tb)
    cleared = []
    for name in ("last_exc", "last_value", "last_traceback", "last_type"):
        if getattr(sys, name, None) is not None:
            delattr(sys, name)
            cleared.append(f"sys.{name}")
    if getattr(printer, "tb", None) is not None:
        del printer.tb
        cleared.append("get_ipython().InteractiveTB.tb")
    return cleared


def _ipython():
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None


class Lifetimes:
    """How many of some objects are still alive, keeping none of them:

        lives = Lifetimes(nodes)      # a weak reference to each
        del nodes, root
        lives.alive()                 # 0 once reference counting freed them all

    Memory coming back says only that their tensors went; this says the objects themselves did (a
    `__del__` that empties the nodes of a cycle frees their tensors and leaves the cycle).  An object
    that takes no weak reference is looked for, by identity, among the objects the collector tracks;
    ask before new objects are made, which could take a dead one's address."""

    def __init__(self, objects):
        self._weak, self._ids = [], {}
        for obj in objects:
            try:
                self._weak.append(weakref.ref(obj))
            except TypeError:
                self._ids[id(obj)] = type(obj)
        self.count = len(self._weak) + len(self._ids)

    def alive(self) -> int:
        alive = sum(1 for ref in self._weak if ref() is not None)
        if self._ids:
            kinds = self._ids
            alive += sum(1 for obj in gc.get_objects() if kinds.get(id(obj)) is type(obj))
        return alive



class Stub:
    """A stand-in for a real object (a model a loader builds, a connection): it has a `name`, takes weak
    references, and is of a size few other objects are (twenty spare slots), so that once one is freed the
    next Stub made usually takes its address, and with it its id().  A store that finds its objects by
    id() instead of by name hands a new Stub back for an old one's id.

        Stub("m0").name     # "m0"
    """
    __slots__ = ("name", "__weakref__", *(f"_spare{i}" for i in range(20)))

    def __init__(self, name=None):
        self.name = name

    def __repr__(self):
        return f"Stub({self.name!r})"


def objects_added(action, times: int = 1) -> int:
    """How many more objects the collector tracks after `action(i)` ran for i in range(times), what each
    returned dropped at once, than before: what the calls left alive (an entry kept for each, say)."""
    before = len(gc.get_objects())
    for i in range(times):
        action(i)
    return len(gc.get_objects()) - before


# -- an object found again: by its own link, or by a name or an address a newcomer can take over ----------
def weakref_or_none(obj):
    """A weak reference to `obj` (call it: `obj`, or None once it is freed); for an object that takes no
    weak reference, a function that returns None (nothing can tell whether it is still alive)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: None


def reuse_address(address: int, make, limit: int = 2000) -> list:
    """New objects, `make()` after `make()`, until one of them has the `id()` `address` (of an object
    freed just before) or `limit` were made; all of them, kept alive while the caller holds the list.

    CPython hands a freed object's address to the next object of its size, so code that finds an
    object again by `id()` (or by a name, through a registry) can be shown to return a newcomer in its
    place: keep the list while reading what the code returns."""
    made = []
    while len(made) < limit:
        made.append(make())
        if id(made[-1]) == address:
            break
    return made


def assert_is(got, expected, what: str, hint: str = "", name: str = "the expected object") -> None:
    """`got is expected`, or an AssertionError that says `what` is not `name` (what `expected` is), and why
    when the cause is one that `is` hides: a `weakref.proxy` of `expected` (another object, though it
    answers like it)."""
    if got is expected:
        return
    if isinstance(got, weakref.ProxyTypes):
        try:
            same = any(ref is got for ref in weakref.getweakrefs(expected))
        except TypeError:
            same = False
        raise AssertionError(f"{what} is a weakref.proxy{' of ' + name if same else ''}, not {name}: a proxy "
                             "is another object, so `is` says no. Keep a weakref.ref and make the attribute a property "
                             "that calls it and returns the object")
    raise AssertionError(f"{what} is not {name}" + (f": {hint}" if hint else ""))
