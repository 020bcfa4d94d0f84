"""What an object holds: which of its attributes keeps the tensor bytes a loop left behind.

    held = HeldBytes(trainer, name="trainer")    # the start: what it holds now
    ... run the steps ...
    print(held.report().explain())

The forward twin of `gclab.refs.reference_paths` (which searches backwards, from an object to
the globals that keep it): a breadth-first walk from one object through its attributes,
containers, closures, exceptions with their tracebacks' frames, and each tensor's autograd
graph, crediting every tensor storage to the first path that reaches it.  Bytes are counted
as `gclab.memory.Meter` counts them (`memory.device_storage`).  `gclab.checks.run_flat_check`
uses it, with `holder=`, to name what a leaking loop's object keeps.
"""
from __future__ import annotations

import gc
import itertools
import sys
import types
import warnings
import weakref
from collections import deque
from dataclasses import dataclass

import torch

from .cycles import instance_attributes
from .gcwatch import GCWatch, gc_disabled
from .memory import Meter, device_storage, format_bytes, storage_entry
from .refs import Lifetimes, reference_paths

__all__ = ["CutOff", "GraphCensus", "HeldBytes", "HeldReport", "Holding", "StorageCensus", "Unfrozen",
           "assert_keeps_nothing", "cut_off", "graphs_held", "tensors_held"]

# torch's C-level weak references to a storage: they keep no Python object alive
_expired, _free_weak_ref = torch.UntypedStorage._expired, torch.UntypedStorage._free_weak_ref

_SKIPPED = (type, types.ModuleType, types.BuiltinFunctionType, types.CodeType,
            weakref.ref, weakref.ProxyType, weakref.CallableProxyType, str, bytes, int, float, complex, bool,
            type(None), range)
# Wrappers that keep what they wrap in no __dict__: followed by name
_WRAPPED_FIELDS = {staticmethod: ("__func__",), classmethod: ("__func__",), property: ("fget", "fset", "fdel")}
_FRAME_NAMES = sys.version_info >= (3, 13)     # f_locals is a live view; before, reading it stores a copy


def _describe_tensor(tensor) -> str:
    shape = "x".join(map(str, tensor.shape)) or "scalar"
    dtype = str(tensor.dtype).replace("torch.", "")
    graph = f" with grad_fn {type(tensor.grad_fn).__name__}" if tensor.grad_fn is not None else ""
    return f"a {dtype}[{shape}] tensor{graph}"


def _describe(obj) -> str:
    if isinstance(obj, torch.Tensor):
        return _describe_tensor(obj)
    if isinstance(obj, BaseException):
        return f"a {type(obj).__name__}" + (" with its traceback" if obj.__traceback__ is not None else "")
    if isinstance(obj, (list, tuple, dict, set, deque)):
        return f"a {type(obj).__name__} of {len(obj)}"
    return f"a {type(obj).__name__}"


_PLAIN_KEYS = (str, int, float, bool, bytes, type(None))


def _key_text(key) -> str:
    """A dict's key as a path shows it: its repr where it is a plain value; otherwise what it is (an
    optimizer's state is keyed by parameters, whose repr prints every element, and a learner's key's
    __repr__ is the learner's code)."""
    if type(key) in _PLAIN_KEYS:
        return repr(key)
    return f"<{_describe_tensor(key) if type(key) in (torch.Tensor, torch.nn.Parameter) else 'a ' + type(key).__name__}>"


def _children(obj, names: bool):
    """(text that follows obj in an expression, what it refers to) for what `obj` keeps alive
    that may lead to a tensor; a tensor's autograd graph is followed by _graph_tensors."""
    if isinstance(obj, dict):
        return [(f"[{_key_text(key)}]", value) for key, value in list(obj.items())]
    if isinstance(obj, (list, tuple, deque)):
        return [(f"[{i}]", value) for i, value in enumerate(list(obj))]
    if isinstance(obj, (set, frozenset)):
        return [(" (a member)", value) for value in list(obj)]
    if isinstance(obj, BaseException):
        found = [(".__traceback__", obj.__traceback__), (".__cause__", obj.__cause__),
                 (".__context__", obj.__context__), (".args", obj.args)]
        return found + [(f".{k}", v) for k, v in list(getattr(obj, "__dict__", {}).items())]
    if isinstance(obj, types.TracebackType):
        return [(".tb_frame", obj.tb_frame), (".tb_next", obj.tb_next)]
    if isinstance(obj, types.FrameType):
        if names or _FRAME_NAMES:
            return [(f".f_locals[{k!r}]", v) for k, v in list(obj.f_locals.items())]
        skip = {id(obj.f_back), id(obj.f_globals), id(obj.f_builtins), id(obj.f_code)}
        return [(" (a local)", v) for v in gc.get_referents(obj) if id(v) not in skip]
    if isinstance(obj, types.MethodType):
        return [(".__self__", obj.__self__)]
    if isinstance(obj, types.FunctionType):      # what it closes over and its defaults, not its module's globals
        found = []
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            try:
                found.append((f" (closure variable {name!r})", cell.cell_contents))
            except ValueError:                   # an empty cell
                pass
        return found + [(".__defaults__", obj.__defaults__), (".__kwdefaults__", obj.__kwdefaults__)]
    if isinstance(obj, _SKIPPED):
        return []
    fields = _WRAPPED_FIELDS.get(type(obj))
    if fields:
        return [(f".{field}", getattr(obj, field)) for field in fields]
    found, own_dict = [], None
    try:                        # by name; a class may make its __dict__ a property that raises
        if isinstance(obj, torch.Tensor):
            found.append((".grad", obj.grad))
        attributes = instance_attributes(obj)
        found += [(f".{k}", v) for k, v in attributes.items() if k not in ("__dict__", "__weakref__")]
        own_dict = id(vars(obj)) if attributes and getattr(type(obj), "__dictoffset__", 0) else None
    except Exception:
        pass
    # and whatever else it keeps where no attribute shows it (a functools.partial's arguments, a
    # generator's frame, an object of a C type, attributes that could not be read by name): the
    # references the collector itself follows
    return found + [(" (a referent)", v) for v in gc.get_referents(obj) if id(v) != own_dict]


def _graph_tensors(tensor):
    """The tensors a tensor's autograd graph keeps (saved for backward, the parameters it leads to)."""
    found, seen, todo, walked = [], set(), [tensor.grad_fn], []
    while todo and len(seen) < 10_000:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        walked.append(node)                               # alive while ids are compared
        variable = getattr(node, "variable", None)        # AccumulateGrad: a parameter
        if isinstance(variable, torch.Tensor):
            found.append(variable)
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    value = getattr(node, name)
                except Exception:                         # released by backward()
                    continue
                values = value if isinstance(value, (tuple, list)) else (value,)
                found.extend(v for v in values if isinstance(v, torch.Tensor))
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found


class StorageCensus:
    """Every tensor storage the process's Python objects reach now (tensors the collector tracks,
    leaf tensors' gradients, and what their autograd graphs saved), held by C-level weak
    references, so taking it keeps nothing alive and leaves nothing the code could see.

    `new_bytes(earlier, carried)`: the bytes of storages alive now that `earlier` did not hold,
    and what those it held grew by (`resize_`), less those `earlier` held that are gone now and
    were in `carried` (a set of (device, address) of memory the code itself made before, which it
    may replace).

    `marker`: an `Unfrozen` made before; `frozen` says whether it was out of sight (frozen since), and with
    it whatever the census should have found."""

    def __init__(self, marker: Unfrozen | None = None):
        self._storages: dict[int, tuple[int, int, tuple[str, int]]] = {}    # key -> (weak ref, bytes, where)
        self.frozen = marker is not None
        for obj in _storage_holders():
            if type(obj) is Unfrozen:
                self.frozen = self.frozen and obj is not marker
                continue
            found = storage_entry(obj) if isinstance(obj, torch._C.StorageBase) else device_storage(obj)
            if found is None or found[0] in self._storages:
                continue
            key, storage, nbytes = found
            self._storages[key] = (storage._weak_ref(), nbytes, (str(storage.device), storage.data_ptr()))

    def new_bytes(self, earlier: "StorageCensus", carried) -> int:
        before = earlier._storages
        made = sum(nbytes if key not in before or _expired(before[key][0]) else max(0, nbytes - before[key][1])
                   for key, (_, nbytes, _) in self._storages.items())
        replaced = sum(nbytes for ref, nbytes, where in before.values() if where in carried and _expired(ref))
        return made - replaced

    def new_places(self, earlier: "StorageCensus") -> set:
        """(device, address) of the storages alive now that `earlier` did not hold."""
        before = earlier._storages
        return {where for key, (_, _, where) in self._storages.items() if key not in before or _expired(before[key][0])}

    def close(self) -> None:
        for ref, _, _ in self._storages.values():
            _free_weak_ref(ref)
        self._storages.clear()


class _TensorTypes(dict):
    """type -> whether it is a tensor's or a storage's type, filled as types are met."""

    def __missing__(self, kind):
        self[kind] = holds_storage = issubclass(kind, (torch.Tensor, torch._C.StorageBase))
        return holds_storage


class Unfrozen:
    """A marker a check makes at its start and hands each `StorageCensus` it takes.  The collector tracks
    it, and `gc.freeze()` moves it, with every other object, where gc.get_objects() lists nothing: a census
    that no longer finds it knows that the code froze objects since, which it would not find either."""
    __slots__ = ()


_TENSOR_TYPES = _TensorTypes()
_TENSOR_TYPES[Unfrozen] = True              # found with the tensors, in C


def _tensor_holders():
    """The tensors and storages among the objects the collector tracks, filtered in C (compress, map): a
    Python loop over a server's heap takes twice as long."""
    objects = gc.get_objects()
    return itertools.compress(objects, map(_TENSOR_TYPES.__getitem__, map(type, objects)))


def _storage_holders():
    for obj in _tensor_holders():
        yield obj
        if type(obj) is Unfrozen or isinstance(obj, torch._C.StorageBase):   # a check's marker; a storage kept
            continue                                                          # without any tensor
        try:
            if obj.is_leaf:
                if obj.grad is not None:
                    yield obj.grad
            elif obj.grad_fn is not None:
                yield from _graph_tensors(obj)
        except Exception:                       # a subclass that refuses: its own storage is counted
            continue


@dataclass
class _Found:
    """Where the walk first reached a storage."""
    group: str          # the attribute of the holder: "trainer.errors"
    entry: str          # the first step inside it: "trainer.errors[0]" (the group itself for a tensor)
    entry_what: str     # "a FloatingPointError with its traceback"
    root: str           # the path from the entry to the tensor that keeps the storage ("" when it is the entry)
    root_what: str      # "a float32[256x32] tensor with grad_fn AddmmBackward0"
    frame: str          # the function whose frame holds that tensor, if one does
    nbytes: int
    via_graph: bool     # saved by that tensor's autograd graph, not its own storage


def _unseen_children(node, names: bool, seen: set, keep: list) -> list:
    """`node`'s children (see `_children`) that the walk has not reached yet, now marked as reached
    (and kept alive while ids are compared)."""
    try:
        children = _children(node, names)
    except Exception:
        return []
    fresh = []
    for piece, child in children:
        if child is None or id(child) in seen or isinstance(child, _SKIPPED):
            continue
        seen.add(id(child))
        keep.append(child)
        fresh.append((piece, child))
    return fresh


def _walk(obj, name: str, names: bool, device=None, max_objects: int = 50_000) -> dict:
    """storage key -> (storage, _Found) for every tensor storage reachable from `obj` through
    attributes, containers, closures, exceptions with their frames and autograd graphs; each
    storage is credited to the first path a breadth-first walk reaches it by."""
    found, seen = {}, {id(obj)}
    keep = [obj]                                   # what is walked stays alive while ids are compared
    # (object, path, group, entry path, entry object, the function of the last frame passed)
    queue = deque([(obj, name, None, None, None, "")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")            # some objects warn when merely looked at
        while queue and len(seen) < max_objects:
            node, path, group, entry, entry_obj, frame = queue.popleft()
            if isinstance(node, torch.Tensor):
                where = (path, group or path, entry or path, node if entry_obj is None else entry_obj, frame)
                _credit(found, device, node, *where)
                for kept in _graph_tensors(node):
                    _credit(found, device, kept, *where, via_graph=node)
            for piece, child in _unseen_children(node, names, seen, keep):
                child_path = path + piece
                if group is None:                  # an attribute of the holder: a group
                    item = (child_path, child_path, None, None)
                elif entry is None:                # the first step inside a group: an entry
                    item = (child_path, group, child_path, child)
                else:
                    item = (child_path, group, entry, entry_obj)
                child_frame = f"{child.f_code.co_name}()" if isinstance(child, types.FrameType) else frame
                queue.append((child, *item, child_frame))
    return found


def tensors_held(obj, name: str = "it", device=None) -> list[str]:
    """Every tensor storage `obj` keeps alive (through its attributes, containers, closures,
    exceptions with their frames and autograd graphs, not its module's globals), each said as
    where it is reached and what it is, most bytes first; [] when it keeps none.  A view of a
    bigger tensor counts: it keeps all of its storage alive."""
    found = _walk(obj, name, names=True, device=device)
    held = sorted((where for _, where in found.values()), key=lambda where: -where.nbytes)
    del found
    return [f"{where.entry}{where.root}, {where.root_what} ({format_bytes(where.nbytes)} of storage)" for where in held]


def graphs_held(obj, name: str = "it", max_objects: int = 50_000) -> dict:
    """path -> the number of nodes in its autograd graph, for every tensor with a graph that `obj`
    keeps (through its attributes, containers, closures and exceptions, as `tensors_held` walks).
    backward() frees what a graph saved, not its nodes: a graph that every step extends (a running
    total, `total += loss`) grows on the heap, where no tensor meter sees it, but its node count does."""
    sizes, seen, keep = {}, {id(obj)}, [obj]
    queue = deque([(obj, name)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while queue and len(seen) < max_objects:
            node, path = queue.popleft()
            if isinstance(node, torch.Tensor) and node.grad_fn is not None:
                sizes[path] = _graph_size(node)
            queue.extend((child, path + piece) for piece, child in _unseen_children(node, True, seen, keep))
    return sizes


def _graph_size(tensor, limit: int = 1_000_000) -> int:
    return len(_graph_nodes(tensor.grad_fn, limit))


def _graph_nodes(grad_fn, limit: int = 1_000_000) -> dict:
    """id -> node for every node of the autograd graph from `grad_fn` (kept alive while ids are compared)."""
    seen, todo = {}, [grad_fn]
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        todo.extend(next_node for next_node, _ in node.next_functions)
    return seen


class GraphCensus:
    """The autograd graphs alive in the process now: `nodes`, how many nodes every tensor the collector
    tracks reaches through its grad_fn (each counted once).  A graph that something links each step to (a
    running total kept in a global, on a class, anywhere) grows here, though no walk from a holder reaches
    it, and says where: the tensor whose graph grew most since a census taken earlier (`most_grown`)."""

    def __init__(self, limit: int = 1_000_000):
        """`limit`: nodes walked at most, all graphs together (many tensors of one big graph walk it each)."""
        every, self._graphs = {}, {}              # id of a tensor -> (its graph's size, a weak reference)
        for tensor in _tensor_holders():
            if limit <= 0:
                break
            if type(tensor) is Unfrozen or isinstance(tensor, torch._C.StorageBase):
                continue
            try:
                grad_fn = tensor.grad_fn
            except Exception:                   # a subclass that refuses
                continue
            if grad_fn is None:
                continue
            nodes = _graph_nodes(grad_fn, limit)
            limit -= len(nodes)
            every.update(nodes)
            self._graphs[id(tensor)] = (len(nodes), weakref.ref(tensor))
        self.nodes = len(every)

    def most_grown(self, earlier: "GraphCensus"):
        """(nodes it gained, tensor) for the tensor whose graph grew most since `earlier` (a tensor `earlier`
        did not list gained its whole graph; one changed in place, `total += loss`, what it added), or (0, None)."""
        best = (0, None)
        for key, (size, ref) in self._graphs.items():
            tensor = ref()
            if tensor is None:
                continue
            was = earlier._graphs.get(key)
            gained = size - was[0] if was is not None and was[1]() is tensor else size
            if gained > best[0]:
                best = (gained, tensor)
        return best


def _credit(found, device, tensor, path, group, entry, entry_obj, frame, via_graph=None):
    storage = device_storage(tensor, device)
    if storage is None or storage[0] in found:
        return
    key, storage_obj, nbytes = storage
    holder = via_graph if via_graph is not None else tensor
    found[key] = (storage_obj, _Found(group, entry, _describe(entry_obj), path[len(entry):],
                                      _describe_tensor(holder), frame, nbytes, via_graph is not None))


@dataclass
class Holding:
    """One attribute of the holder (or one item, when the holder is a container) and what it
    holds beyond what it held at the start: `grew` bytes, `new_entries` of its entries holding
    storages made since then, and the first of them (`example`, what keeps its bytes)."""
    path: str
    grew: int = 0
    new_entries: int = 0
    example: str = ""
    example_bytes: int = 0

    def __str__(self):
        text = f"{self.path} ({format_bytes(self.grew)} more"
        if self.new_entries > 1:
            text += f", in {self.new_entries} entries"
        text += ")"
        if self.example:
            text += f": {self.example}"
        return text


@dataclass
class HeldReport:
    """What `HeldBytes.report` found: the holdings that grew, most bytes first, next to the meter's growth."""
    name: str
    holdings: list
    growth: int
    iterations: int

    @property
    def accounted(self) -> int:
        return sum(h.grew for h in self.holdings)

    def explain(self) -> str:
        after = f"after {self.iterations} iterations" if self.iterations else "now"
        if not self.holdings:
            return (f"Nothing reachable from {self.name} (its attributes, what they hold, exceptions with their "
                    f"frames, autograd graphs) grew {after}: the bytes are held elsewhere (a global, a closure, "
                    "a cache) or sit in reference cycles waiting for the collector "
                    "(gclab.cycles.watch_tensor_cycles finds those).")
        shown = "; ".join(str(h) for h in self.holdings[:3])
        more = f"; and {len(self.holdings) - 3} more" if len(self.holdings) > 3 else ""
        text = f"Where the bytes are, {after}: {shown}{more}."
        rest = self.growth - self.accounted
        if self.growth and rest > 512:
            text += (f" That is {format_bytes(self.accounted)} of the {format_bytes(self.growth)} above the "
                     "baseline; the rest is held elsewhere.")
        return text


class HeldBytes:
    """Which attribute of `holder` keeps the tensor bytes a loop left behind.

        held = HeldBytes(trainer, name="trainer")    # the start: what it holds now
        ... run the steps ...
        print(held.report().explain())
        # Where the bytes are, now: trainer.errors (1.69 MiB more, in 3 entries): trainer.errors[0],
        # a FloatingPointError with its traceback, whose __traceback__.tb_frame.f_locals['output']
        # (in train_step()) is a float32[256x32] tensor with grad_fn AddmmBackward0: 576.01 KiB ...

    At the start it notes every tensor storage alive (by a weak reference to it, which keeps
    nothing alive) and what each attribute of the holder holds; `report` walks the holder again,
    through attributes, containers, closures, exceptions with their tracebacks' frames, and
    each tensor's autograd graph (the tensors saved for backward), and credits each attribute
    with the storages made since the start that it holds, less those it held at the start and
    let go (a replaced `last_output` did not grow).  Storages that existed at the start (the
    data, the parameters) are never growth.  A storage two attributes share counts once, for
    the one a breadth-first walk reaches first.  Bytes are counted as the meter counts them
    (on CUDA rounded up to the allocator's 512-byte blocks); with `device`, only storages on it.  Frames' locals are read by name
    only in `report` (on Python 3.11 and 3.12 reading `frame.f_locals` stores a copy on the frame).
    """

    def __init__(self, holder, name: str | None = None, device=None):
        self._holder = holder
        self.name = name or _name_of(holder)
        self.device = torch.device(device) if device is not None else None
        self._refs: dict[int, int] = {}          # storage key -> weak reference handle
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for obj in _tensor_holders():
                if issubclass(type(obj), torch.Tensor):
                    self._remember(obj)
        found = _walk(holder, self.name, names=False, device=self.device)
        self._at_start: dict[int, tuple[str, int]] = {}
        for key, (storage, where) in found.items():
            if key not in self._refs:
                self._refs[key] = storage._weak_ref()
            self._at_start[key] = (where.group, where.nbytes)
        del found

    def _remember(self, tensor):
        storage = device_storage(tensor, self.device)
        if storage is not None and storage[0] not in self._refs:
            self._refs[storage[0]] = storage[1]._weak_ref()

    def _from_start(self, key) -> bool:
        """Is this storage one that was alive at the start (not a new one at a reused address)?"""
        ref = self._refs.get(key)
        return ref is not None and not _expired(ref)

    def report(self, growth: int = 0, iterations: int = 0) -> HeldReport:
        found = _walk(self._holder, self.name, names=True, device=self.device)
        groups: dict[str, Holding] = {}
        entries: dict[str, dict[str, list]] = {}
        for key, (_, where) in found.items():
            if not self._from_start(key):
                groups.setdefault(where.group, Holding(where.group)).grew += where.nbytes
                entries.setdefault(where.group, {}).setdefault(where.entry, []).append(where)
        for key, (group, nbytes) in self._at_start.items():
            if not self._from_start(key):         # held at the start, freed since (replaced)
                groups.setdefault(group, Holding(group)).grew -= nbytes
        for group, holding in groups.items():
            in_group = entries.get(group, {})
            holding.new_entries = len(in_group)
            if in_group:
                entry, wheres = next(iter(in_group.items()))      # the first, in the walk's order
                holding.example_bytes = sum(w.nbytes for w in wheres)
                holding.example = _example(entry, wheres)
        del found
        grew = sorted((h for h in groups.values() if h.grew > 0), key=lambda h: -h.grew)
        return HeldReport(self.name, grew, growth, iterations)

    def close(self) -> None:
        """Let go of the weak references (the storages themselves were never held)."""
        for ref in self._refs.values():
            _free_weak_ref(ref)
        self._refs.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _example(entry: str, wheres: list) -> str:
    """What one entry is and what in it keeps its new bytes: "trainer.errors[0], a FloatingPointError
    with its traceback, whose __traceback__.tb_frame.f_locals['output'] (in train_step()) is a
    float32[256x32] tensor with grad_fn AddmmBackward0: 576.01 KiB, most of it saved by its graph"."""
    first = wheres[0]
    own = [w for w in wheres if not w.via_graph]
    root = own[0] if own else first
    text = f"{entry}, {first.entry_what}"
    if root.root:
        where = f" (in {root.frame})" if root.frame else ""
        text += f", whose {root.root.lstrip('.')}{where} is {root.root_what}"
    saved = sum(w.nbytes for w in wheres if w.via_graph)
    total = sum(w.nbytes for w in wheres)
    text += f": {format_bytes(total)}"
    if saved:
        text += f", {format_bytes(saved)} of it saved by its autograd graph"
    return text


def _name_of(holder) -> str:
    """The holder's name in the notebook (`trainer`), else "the Trainer"."""
    try:
        from .refs import reference_paths
        paths = reference_paths(holder, max_paths=1, max_visits=4)
    except Exception:
        paths = []
    if paths and all(part.isidentifier() for part in paths[0].split(".")):
        return paths[0]
    return f"the {type(holder).__name__}"


# -- what is dropped must go at once, with the collector off ---------------------------------------
def assert_keeps_nothing(make, what: str, outside: str = "what it was made from", device=None) -> None:
    """What `make()` returns, kept, holds no tensor memory with the collector off; or an AssertionError
    that says how much it holds and whether something outside it holds (part of) that: what is still
    held once it is deleted and a collection has run.  `what` names the object ("a kept scaler"),
    `outside` what the rest of the program may keep of it ("its batch (a default argument, a global)")."""
    with gc_disabled(), Meter(device) as meter:
        kept = make()
        held = meter.growth()
        kept = None
        gc.collect()                          # what the object held goes now, cycles included
        held_without_it = meter.growth()      # so this is what something else holds
    article, _, rest = what.partition(" ")
    the = f"the {rest}" if article in ("a", "an") and rest else what
    assert held == 0, (
        f"{what} holds {format_bytes(held)} of tensors with the collector off" if not held_without_it else
        f"{format_bytes(held)} was held while {what} was kept, {format_bytes(held_without_it)} of it even once it "
        f"was deleted: something outside {the} keeps {outside}"
        + (f", and {the} refers to the rest itself" if held_without_it < held else ""))


@dataclass
class CutOff:
    """What `cut_off` measured: bytes held before the cut and after it, how many of the objects cut off
    (`count`) were still alive after it, the collections that ran (a summary, "" when none), and `why`:
    what keeps what was cut off, if anything (`in_cycles`: only reference cycles among them, which a
    collection frees)."""
    held: int
    left: int
    alive: int
    count: int
    collections: str
    why: str = ""
    in_cycles: bool = False


def cut_off(make, doomed, cut=None, device=None, what: str = "it", holder: str = "kept") -> CutOff:
    """With the collector off and a Meter running: `kept = make()`, then `doomed(kept)` (the objects the
    cut must free, at once), then `cut(kept)` (None: `kept` itself is dropped).  Keeps none of `doomed`'s
    objects.  When one of them, or a tensor one of them held, is still alive after the cut, a collection
    runs and `why` says whether it freed them (they were in reference cycles) or what still refers to
    them: paths from the globals (`gclab.refs.reference_paths`) and, while `kept` is kept, from `kept`
    (named `holder`); `what` names what was cut off ("the cut branch").  When none is, `why` says so.
    It collects first: what earlier code left in cycles is not counted."""
    gc.collect()
    with gc_disabled(), Meter(device) as meter, GCWatch() as watch:
        kept = make()
        held = meter.growth()
        parts = list(doomed(kept))
        lives = Lifetimes(parts)
        weak = [weakref.ref(t) for part in parts for t in _direct_tensors(part)]
        weak += [ref for ref in map(_weak_or_none, parts) if ref is not None]
        parts = None
        if cut is None:
            kept = None
        else:
            cut(kept)
        left, alive = meter.growth(), lives.alive()
        collections = watch.summary() if watch.collections else ""
        why, in_cycles = f"none of {what}, nor a tensor it held, is still alive", False
        if alive or any(ref() is not None for ref in weak):
            why, in_cycles = _why_survived(weak, what, kept, holder, meter.device)
        kept = None
    return CutOff(held, left, alive, lives.count, collections, why, in_cycles)


def _weak_or_none(obj):
    try:
        return weakref.ref(obj)
    except TypeError:
        return None


def _direct_tensors(obj) -> list:
    """The tensors `obj` refers to itself (in its slots or its __dict__)."""
    referents = gc.get_referents(obj)
    referents += gc.get_referents(*[r for r in referents if type(r) is dict])
    return [r for r in referents if isinstance(r, torch.Tensor)]


def _why_survived(weak: list, what: str, kept, holder: str, device) -> tuple[str, bool]:
    gc.collect()                              # a cycle is freed now; what something else refers to is not
    survivor = next((ref() for ref in weak if ref() is not None), None)
    if survivor is None:
        return (f"a collection frees {what}: it is still in reference cycles (with one another, or each with "
                "itself), which only a collection frees"), True
    where = reference_paths(survivor)
    storage = device_storage(survivor, device) if isinstance(survivor, torch.Tensor) and kept is not None else None
    if storage is not None:
        found = _walk(kept, holder, names=True, device=device).get(storage[0])
        where += [f"{found[1].entry}{found[1].root}"] if found is not None else []
    return (f"a collection does not free {what} either: something else still refers to {what}"
            + (f" ({'; '.join(where[:3])})" if where else "")), False
