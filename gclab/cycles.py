"""The tensor-cycle detector: the reference cycles a collection frees, and the tensors they held.

    with watch_tensor_cycles() as found:   # slows collections while on (it says so)
        step()
        gc.collect()                       # or let the collector run on its own
    print(found.summary())                 # each cycle that held tensors: loop, labels, bytes
    found.reports[0].show()                # drawn offline, the tensors filled

`watch_tensor_cycles` is the course's tensor-cycle detector: PyTorch's
`torch.utils.viz._cycles` without its CUDA-only defaults, its CDN-loaded HTML and its
edges lost on Python 3.11-3.12.

The object graphs it draws are `gclab.graphs`' (`backref_graph`, `show_graph`, ...), importable
from here too, as the lessons do.
"""
from __future__ import annotations

import gc
import sys
import types
import weakref
from collections import deque
from dataclasses import dataclass

import torch

from .graphs import (CYCLE_COLOUR, DOT_MISSING, TENSOR_COLOUR, GraphEdge, GraphNode,  # noqa: F401
                     ObjectGraph, _depths, _fold_namespaces, _node, backref_graph, describe_object,
                     dot_available, draw_graph, garbage_by_type, instance_attributes, program_objects,
                     ref_graph, reference_label, render_png, show_graph)
from .memory import device_storage, format_bytes

__all__ = ["GraphNode", "GraphEdge", "ObjectGraph", "backref_graph", "ref_graph", "program_objects",
           "reference_label", "describe_object", "garbage_by_type", "draw_graph", "render_png", "show_graph",
           "dot_available", "DOT_MISSING", "CycleReport", "TensorCycles", "watch_tensor_cycles",
           "find_tensor_cycles", "is_tensor", "instance_attributes", "DETECTOR_COST", "assert_no_garbage"]


def assert_no_garbage(hint: str = "") -> None:
    """A full collection now finds nothing in reference cycles (`garbage_by_type`); or an AssertionError
    that says how many objects it found, of which types, and `hint` (what may still refer to itself).
    Call it after a check, never inside one: it collects."""
    found = garbage_by_type()
    assert not found, (f"a collection afterwards still found {sum(found.values())} objects in cycles ("
                       + ", ".join(f"{n} {name}" for name, n in found.most_common(4)) + ")"
                       + (f": {hint}" if hint else ""))


# -- the tensor-cycle detector ---------------------------------------------------------
DETECTOR_COST = (
    "Tensor-cycle detector on: from now until the end of the `with` block, every collection that "
    "finds garbage is followed by one or two extra FULL collections (one to gather all the garbage, "
    "one to free what it kept to look at), so collections are much slower, and every Python call "
    "passes through a profile hook. Do not time anything inside it. (Said once per session.)")
# DETECTOR_COST is printed by the first detector of the process only.  A set that is added to,
# never a name rebound: the grader's guard takes every module attribute rebound as tampering.
_told: set = set()


def is_tensor(obj) -> bool:
    """A torch tensor on any device, CPU included (PyTorch's own detector looks for CUDA ones)."""
    return isinstance(obj, torch.Tensor)


@dataclass(frozen=True)
class CycleReport:
    """One reference cycle that a collection found unreachable, and the tensors it held."""
    generation: int            # of the collection that found it (2: a full one, as gc.collect() runs)
    graph: ObjectGraph         # the loop, the objects leading from it to tensors, the tensors
    loop: tuple[str, ...]      # node keys of the objects that form the loop
    tensors: tuple[str, ...]   # node keys of the tensors the loop held
    nbytes: int                # memory behind those tensors, each storage counted once

    @property
    def objects(self) -> list[GraphNode]:
        """The objects that form the loop."""
        return [self.graph.nodes[key] for key in self.loop]

    @property
    def loop_edges(self) -> list[GraphEdge]:
        """The references that close the loop (every reference between its objects)."""
        order = {key: i for i, key in enumerate(self.loop)}
        return sorted((e for e in self.graph.edges if e.source in order and e.target in order),
                      key=lambda e: order[e.source])

    @property
    def labels(self) -> list[str]:
        """How the loop's objects refer to each other: ".attr", "['key']", "closure cell 'self'", ..."""
        return [e.label for e in self.loop_edges]

    @property
    def title(self) -> str:
        return (f"Reference cycle of {len(self.loop)} objects found by a generation-{self.generation} "
                f"collection: it held {len(self.tensors)} tensor(s), {format_bytes(self.nbytes)}")

    @property
    def shape(self) -> tuple:
        """What the cycle is made of, without addresses: equal for cycles built by the same code."""
        nodes = self.graph.nodes
        return tuple(sorted((nodes[e.source].type_name, e.label, nodes[e.target].type_name)
                            for e in self.graph.edges))

    def summary(self) -> str:
        nodes, members = self.graph.nodes, set(self.loop)
        name = {key: f"{n.type_name} {n.summary}".strip() for key, n in nodes.items()}
        lines = [self.title + ". The loop:"]
        lines += [f"  {name[e.source]} --{e.label or '?'}--> {name[e.target]}" for e in self.loop_edges]
        held = sorted((e for e in self.graph.edges if e.target not in members),
                      key=lambda e: nodes[e.source].depth)      # from the loop outwards
        if held:
            lines.append("and what it held:")
            lines += [f"  {name[e.source]} --{e.label or '?'}--> {name[e.target]}" for e in held]
        return "\n".join(lines)

    def to_graph(self) -> ObjectGraph:
        """The cycle as an ObjectGraph, for draw_graph, render_png or show_graph."""
        return self.graph

    def show(self, text: bool = True) -> str:
        """Draw the cycle offline (Graphviz's dot, else matplotlib), the tensors filled."""
        return show_graph(self.graph, title=self.title, text=text)


def find_tensor_cycles(garbage, generation: int = 2, tensor_test=is_tensor) -> list[CycleReport]:
    """The reference cycles in `garbage` (what a collection found unreachable, as
    gc.DEBUG_SAVEALL leaves it in gc.garbage) that contain a tensor or lead to one.

    Each report has the loop, the objects on the way from the loop to each tensor it
    holds (a list or dict that is not itself in a loop, say), and those tensors; other
    garbage is left out.  Cycles that hold no tensor are not reported.  Nor is a tensor
    that no cycle leads to: unreachable, it can only be held through something the
    collector cannot follow (C++ objects such as autograd nodes), which no Python
    attribute can be blamed for.  `tensor_test` decides what counts as a tensor.
    """
    seen = {f"o{id(obj)}": obj for obj in garbage if type(obj) not in weakref.ProxyTypes}
    pairs = _fold_namespaces(_garbage_pairs(seen), seen, set())
    following = {key: [] for key in seen}
    for source, target in pairs:
        following[source].append(target)
    tensors = {key for key, obj in seen.items() if tensor_test(obj)}
    to_tensor = _reaching(tensors, following)
    closure_names = {id(f.__closure__): f.__code__.co_freevars for f in seen.values()
                     if isinstance(f, types.FunctionType) and f.__closure__}
    reports = []
    for loop in _loops(following):
        if not to_tensor.intersection(loop):
            continue
        held = [key for key in _reachable(loop, following) if key in to_tensor and key not in loop]
        keys = loop + held
        members = set(keys)
        edges = [GraphEdge(s, t, _edge_label(seen[s], seen[t], closure_names))
                 for s, t in pairs if s in members and t in members]
        depth = _depths([loop[0]], edges, "refs")
        graph = ObjectGraph("refs", {key: _node(key, seen[key], depth.get(key, 0), key == loop[0],
                                                key in tensors) for key in keys}, edges)
        found = tuple(key for key in keys if key in tensors)
        reports.append(CycleReport(generation, graph, tuple(loop), found,
                                   _held_bytes(seen[key] for key in found)))
    return reports


def _garbage_pairs(seen: dict) -> list[tuple[str, str]]:
    """(holder, held) pairs of keys of `seen`, from gc.get_referents.

    The referents are read before anything looks at an attribute: on 3.11 and 3.12
    looking at an instance's __dict__ creates it, and from then on the instance refers to
    that dict (which is not in the garbage) instead of to its attributes: the edges
    PyTorch's create_graph loses.  A reference to an instance's __dict__ that is not in
    the garbage counts as one to the instance: on 3.13 a __dict__ that shares its
    instance's values is never in the garbage (its instance's hold on it is not counted)."""
    referents = {key: gc.get_referents(obj) for key, obj in seen.items()}
    key_of = {id(namespace): key for key, namespace in _namespaces(seen)}
    key_of.update({id(obj): key for key, obj in seen.items()})
    pairs = ((key, key_of.get(id(held))) for key, held_list in referents.items() for held in held_list)
    return list(dict.fromkeys((key, held) for key, held in pairs if held is not None))


def _namespaces(seen: dict):
    """(key, its __dict__) for the instances in `seen` (creating the dict on 3.11+)."""
    for key, obj in seen.items():
        if getattr(type(obj), "__dictoffset__", 0) and not isinstance(obj, (type, types.ModuleType)):
            try:
                yield key, object.__getattribute__(obj, "__dict__")
            except Exception:
                pass


def _edge_label(source, target, closure_names: dict) -> str:
    label = reference_label(source, target, closure_names)
    if not label and isinstance(source, types.FrameType):
        return "(a local variable)"
    if not label and getattr(type(target), "__dictoffset__", 0) and not isinstance(target, type):
        # `source` holds `target.__dict__`, which was folded into `target`
        namespace = getattr(target, "__dict__", None)
        names = [f".{name}" for name, value in instance_attributes(source).items() if value is namespace]
        inner = names[0] if names else reference_label(source, namespace, closure_names)
        label = f"{inner} (its __dict__)" if inner else ""
    return label


def _loops(following: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components (Tarjan's algorithm, without recursion) that are
    loops: more than one object, or one that refers to itself.  Each lists its objects in
    the order they were reached from its first one."""
    index, low, stack, on_stack, loops = {}, {}, [], set(), []

    def enter(key):
        index[key] = low[key] = len(index)
        stack.append(key)
        on_stack.add(key)
        return key, iter(following[key])

    for start in following:
        if start in index:
            continue
        work = [enter(start)]
        while work:
            key, children = work[-1]
            for child in children:
                if child not in index:
                    work.append(enter(child))
                    break
                if child in on_stack:
                    low[key] = min(low[key], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[key])
                if low[key] == index[key]:
                    group = stack[stack.index(key):]
                    del stack[stack.index(key):]
                    on_stack.difference_update(group)
                    if len(group) > 1 or key in following[key]:
                        loops.append(group)
    return loops


def _reachable(starts, following: dict[str, list[str]]) -> list[str]:
    """The keys reachable from `starts` (themselves included), in the order first reached."""
    seen, todo = dict.fromkeys(starts), deque(starts)
    while todo:
        for child in following[todo.popleft()]:
            if child not in seen:
                seen[child] = None
                todo.append(child)
    return list(seen)


def _reaching(targets, following: dict[str, list[str]]) -> set[str]:
    """The keys from which one of `targets` can be reached (the targets included)."""
    leading = {key: [] for key in following}
    for source, children in following.items():
        for child in children:
            leading[child].append(source)
    return set(_reachable(list(targets), leading))


def _held_bytes(tensors) -> int:
    """Bytes of memory behind `tensors` as the meter counts them, each storage once (views share one)."""
    storages = {}
    for t in tensors:
        found = device_storage(t) if isinstance(t, torch.Tensor) else None
        if found is not None:
            key, _, nbytes = found
            storages[key] = nbytes
    return sum(storages.values())


class TensorCycles:
    """A context manager that, for each collection while it is on, finds the reference
    cycles that held tensors (`find_tensor_cycles`) and keeps a CycleReport for each.

        with watch_tensor_cycles() as found:
            step()
            gc.collect()              # explicit collections are watched too
        print(found.summary())
        found.reports[0].show()       # the loop drawn, the tensor filled

    How (as PyTorch's observe_garbage): a collection's "start" callback turns on
    gc.DEBUG_SAVEALL, so what it finds is kept in gc.garbage instead of freed.  When it
    found something, the rest waits for the next Python call or return (a sys.setprofile
    hook), because nothing can be collected from inside the collector's callbacks: a
    full collection that gathers the garbage of the older generations too (skipped after
    a full collection; without it, the collection that frees would free that garbage
    unseen), the report, then the debug flags put back, the saved garbage taken out of
    gc.garbage and a second full collection that frees it.  That is the cost
    DETECTOR_COST warns of (printed by the first detector a process turns on, not by every
    one); a collection that finds nothing costs about what it did.
    """

    def __init__(self, tensor_test=is_tensor):
        self.tensor_test = tensor_test
        self.reports: list[CycleReport] = []
        self.collections = 0            # collections whose garbage it looked at
        self._callback = self._on_gc    # one bound method, to remove the same one it added
        self._pending: int | None = None   # generation of the collection whose garbage waits
        self._busy = False              # its own collections: not watched
        self._ran = False
        self._flags = self._flags_at_enter = 0
        self._start = 0
        self._previous_profile = None

    def __enter__(self) -> "TensorCycles":
        if "cost" not in _told:
            print(DETECTOR_COST)
            _told.add("cost")
        self._flags_at_enter = gc.get_debug()
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        try:
            if self._pending is not None:
                self._report_and_free()
        finally:
            if self._callback in gc.callbacks:
                gc.callbacks.remove(self._callback)
            self._unhook_profile()
            self._pending = None
            gc.set_debug(self._flags_at_enter)
        return False

    def __iter__(self):
        return iter(self.reports)

    def __len__(self) -> int:
        return len(self.reports)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.reports)

    def summary(self) -> str:
        """Each shape of cycle once (the first found), with how many of that shape there were."""
        head = (f"{len(self.reports)} reference cycle(s) holding tensors "
                f"({format_bytes(self.nbytes)}) in {self.collections} collection(s)")
        by_shape: dict[tuple, list[CycleReport]] = {}
        for report in self.reports:
            by_shape.setdefault(report.shape, []).append(report)
        parts = [head]
        for same in by_shape.values():
            more = len(same) - 1
            note = f"\n(and {more} more cycle(s) of the same shape, {format_bytes(sum(r.nbytes for r in same[1:]))})"
            parts.append(same[0].summary() + (note if more else ""))
        return "\n\n".join(parts)

    # -- the collector's side ----------------------------------------------------------
    def _on_gc(self, phase: str, info: dict) -> None:
        if self._busy:
            self._ran = True
        elif phase == "start" and self._pending is None:
            self._flags, self._start = gc.get_debug(), len(gc.garbage)
            gc.set_debug(self._flags | gc.DEBUG_SAVEALL)
        elif phase == "stop" and self._pending is None:
            if len(gc.garbage) == self._start:     # found nothing: nothing to look at or to free
                gc.set_debug(self._flags)
                return
            self._pending = info["generation"]
            self._previous_profile = sys.getprofile()
            sys.setprofile(self._on_profile)

    def _on_profile(self, frame, event, arg):
        if self._pending is not None:
            self._report_and_free()
        if self._pending is None:          # else still inside the collector: next event
            self._unhook_profile()
        if self._previous_profile is not None:
            self._previous_profile(frame, event, arg)

    def _unhook_profile(self) -> None:
        if sys.getprofile() == self._on_profile:
            sys.setprofile(self._previous_profile)

    def _collect(self, generation: int = 2) -> bool:
        """Run a collection it does not watch; False if the collector is still running
        (then gc.collect() returns at once, without a collection)."""
        self._busy, self._ran = True, False
        try:
            gc.collect(generation)
        finally:
            self._busy = False
        return self._ran

    def _report_and_free(self) -> None:
        generation = self._pending
        # gathers the older generations' garbage after a partial collection; a cheap
        # probe that the collector has returned after a full one
        if not self._collect(0 if generation == 2 else 2):
            return
        keep = self._flags & gc.DEBUG_SAVEALL      # saving was on before: leave gc.garbage alone
        found = gc.garbage[self._start:]
        if not keep:
            del gc.garbage[self._start:]
        gc.set_debug(self._flags)
        self._pending = None
        self.collections += 1
        try:
            self.reports += find_tensor_cycles(found, generation, self.tensor_test)
        finally:
            del found
            if not keep:
                self._collect()


def watch_tensor_cycles(tensor_test=is_tensor) -> TensorCycles:
    """`with watch_tensor_cycles() as found:` reports the reference cycles that held
    tensors in each collection inside the block (see TensorCycles)."""
    return TensorCycles(tensor_test)
