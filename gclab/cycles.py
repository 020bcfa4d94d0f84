"""Reference cycles made visible: the object graph around an object, drawn offline.

    graph = backref_graph(tensor)      # who refers to this tensor, and who refers to them
    show_graph(graph)                  # a picture, and a text listing

`backref_graph` and `ref_graph` walk the graph with objgraph (`show_backrefs`,
`show_refs`), which writes Graphviz dot text; the text is read back into an
`ObjectGraph` of plain strings (it keeps no object alive) whose edges are labelled with
the attribute, dict key, list index or closure cell that makes each reference, and
whose reference cycles are marked.  `show_graph` renders it with Graphviz's `dot` when
that program is installed, and otherwise says how to install it and draws the same
graph with matplotlib.  `garbage_by_type` says what a collection finds unreachable.

    with watch_tensor_cycles() as found:   # slows collections while on (it says so)
        step()
        gc.collect()                       # or let the collector run on its own
    print(found.summary())                 # each cycle that held tensors: loop, labels, bytes
    found.reports[0].show()                # drawn offline, the tensors filled

`watch_tensor_cycles` is the course's tensor-cycle detector: PyTorch's
`torch.utils.viz._cycles` without its CUDA-only defaults, its CDN-loaded HTML and its
edges lost on Python 3.11-3.12.
"""
from __future__ import annotations

import gc
import io
import re
import shutil
import subprocess
import sys
import types
import weakref
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import objgraph
import torch

from .grader.guard import WATCH_EVENT, starting_environment  # TODO(lead): instrument imports grader
# The functions that walk the process's objects raise WATCH_EVENT first, through defaults bound at
# definition (see gclab.held).
from .memory import device_storage, format_bytes
from .refs import frame_local_names

__all__ = ["GraphNode", "GraphEdge", "ObjectGraph", "backref_graph", "ref_graph", "program_objects",
           "reference_label", "describe_object", "garbage_by_type", "draw_graph", "render_png", "show_graph",
           "dot_available", "DOT_MISSING", "CycleReport", "TensorCycles", "watch_tensor_cycles",
           "find_tensor_cycles", "is_tensor", "instance_attributes", "DETECTOR_COST"]

DOT_MISSING = (
    "Graphviz's `dot` program is not installed (or not on PATH), so the graph below is drawn "
    "with matplotlib instead. To get Graphviz's picture, install it and restart the kernel:\n"
    "  conda install -c conda-forge graphviz    (conda)\n"
    "  sudo apt-get install graphviz            (Debian, Ubuntu; also Colab)\n"
    "  brew install graphviz                    (macOS)\n"
    "(`pip install graphviz` installs only Python bindings, not the `dot` program.)")

TENSOR_COLOUR = "#f4a582"
CYCLE_COLOUR = "tab:red"


# -- the graph ------------------------------------------------------------------------
@dataclass(frozen=True)
class GraphNode:
    key: str               # objgraph's node id: "o" + id(obj)
    type_name: str
    summary: str           # a short description: a tensor's shape and bytes, a repr, ...
    depth: int             # references between this object and the ones asked about
    is_root: bool = False  # one of the objects the graph was drawn for
    is_tensor: bool = False
    has_del: bool = False  # its class defines __del__
    omitted: int = 0       # references objgraph left out here (its too_many limit)

    @property
    def label(self) -> str:
        return f"{self.type_name}\n{self.summary}" if self.summary else self.type_name


@dataclass(frozen=True)
class GraphEdge:
    source: str            # the key of the object that holds the reference
    target: str            # the key of the object referred to
    label: str = ""        # ".attribute", "['key']", "[index]", "closure cell 'name'", ... or ""


@dataclass
class ObjectGraph:
    """Objects (nodes) and the references between them (edges: source refers to target)."""
    direction: str                                   # "backrefs" or "refs"
    nodes: dict[str, GraphNode] = field(default_factory=dict)
    edges: list[GraphEdge] = field(default_factory=list)

    @property
    def roots(self) -> list[GraphNode]:
        return [n for n in self.nodes.values() if n.is_root]

    def find(self, type_name: str) -> list[GraphNode]:
        return [n for n in self.nodes.values() if n.type_name == type_name]

    def _reachable(self) -> dict[str, set[str]]:
        following = {key: [] for key in self.nodes}
        for e in self.edges:
            following[e.source].append(e.target)
        reach = {}
        for start in self.nodes:
            seen, todo = set(), list(following[start])
            while todo:
                key = todo.pop()
                if key not in seen:
                    seen.add(key)
                    todo.extend(following[key])
            reach[start] = seen
        return reach

    def cycles(self) -> list[list[str]]:
        """The reference cycles: groups of node keys that all reach each other."""
        reach = self._reachable()
        groups, placed = [], set()
        for key in self.nodes:
            if key in placed or key not in reach[key]:
                continue
            group = [k for k in self.nodes if k == key or (k in reach[key] and key in reach[k])]
            placed.update(group)
            groups.append(group)
        return groups

    def cycle_edges(self) -> list[GraphEdge]:
        """The edges that are part of a reference cycle."""
        reach = self._reachable()
        return [e for e in self.edges if e.source in reach[e.target]]

    def to_dot(self) -> str:
        """Graphviz dot text: tensors filled, the objects asked about outlined, cycles in red."""
        in_cycle = set(self.cycle_edges())
        lines = ["digraph ObjectGraph {", "  node[shape=box, style=filled, fillcolor=white];"]
        for n in self.nodes.values():
            attrs = [f'label="{_dot_quote(n.label)}"']
            if n.is_tensor:
                attrs.append(f'fillcolor="{TENSOR_COLOUR}"')
            if n.is_root:
                attrs.append("penwidth=3")
            lines.append(f"  {n.key}[{', '.join(attrs)}];")
            if n.omitted:
                lines.append(f'  more_{n.key}[label="{n.omitted} more", shape=plaintext];')
                ends = (f"more_{n.key}", n.key) if self.direction == "backrefs" else (n.key, f"more_{n.key}")
                lines.append(f"  {ends[0]} -> {ends[1]}[style=dotted];")
        for e in self.edges:
            attrs = [f'label="{_dot_quote(e.label)}"'] if e.label else []
            if e in in_cycle:
                attrs += ["color=red", "fontcolor=red", "penwidth=2"]
            lines.append(f"  {e.source} -> {e.target}" + (f"[{', '.join(attrs)}]" if attrs else "") + ";")
        lines.append("}")
        return "\n".join(lines) + "\n"

    def to_text(self) -> str:
        """The graph as a listing: the objects, then who refers to whom and how."""
        number = {key: i for i, key in enumerate(self.nodes)}
        name = {key: f"#{number[key]} {n.type_name}" for key, n in self.nodes.items()}
        in_cycle = set(self.cycle_edges())
        what = "Objects that refer to" if self.direction == "backrefs" else "Objects referred to from"
        roots = ", ".join(name[n.key] for n in self.roots)
        cycles = self.cycles()
        lines = [f"{what} {roots}: {len(self.nodes)} objects, {len(self.edges)} references, "
                 f"{len(cycles)} reference cycle(s)" + (" (marked <- cycle)" if cycles else "")]
        for key, n in self.nodes.items():
            notes = [note for flag, note in ((n.is_root, "asked about"), (n.is_tensor, "TENSOR"),
                                             (n.has_del, "has __del__"),
                                             (n.omitted, f"{n.omitted} more not shown")) if flag]
            lines.append(f"  {name[key]:<22} {n.summary}" + (f"   [{', '.join(notes)}]" if notes else ""))
        lines.append("references (holder --how--> held):")
        for e in self.edges:
            mark = "   <- cycle" if e in in_cycle else ""
            lines.append(f"  {name[e.source]} --{e.label or '?'}--> {name[e.target]}{mark}")
        return "\n".join(lines)


def _dot_quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# -- describing objects and references --------------------------------------------------
_DEFAULT_REPR = re.compile(r"^<[\w.]+ object at 0x[0-9a-fA-F]+>$")


def describe_object(obj) -> str:
    """A short description of `obj` for a graph node."""
    if isinstance(obj, torch.Tensor):
        shape = "x".join(map(str, obj.shape)) or "scalar"
        nbytes = obj.untyped_storage().nbytes() if obj.layout == torch.strided else 0
        return f"{str(obj.dtype).replace('torch.', '')}[{shape}] {obj.device.type}, {format_bytes(nbytes)}"
    if isinstance(obj, (list, tuple, dict, set, frozenset)):
        return f"{len(obj)} items"
    if isinstance(obj, types.FunctionType):
        if obj.__name__ == "<lambda>":
            return f"lambda, line {obj.__code__.co_firstlineno}"
        return obj.__qualname__
    if isinstance(obj, types.MethodType):
        return f"{getattr(obj.__func__, '__qualname__', '?')} (bound)"
    if isinstance(obj, types.FrameType):
        return f"{obj.f_code.co_name}() line {obj.f_lineno}"
    if isinstance(obj, types.TracebackType):
        return f"{obj.tb_frame.f_code.co_name}() line {obj.tb_lineno}"
    if isinstance(obj, types.CellType):
        return "closure cell"
    if isinstance(obj, (type, types.ModuleType)):
        return obj.__name__
    try:
        text = repr(obj)
    except Exception:
        return "(no repr)"
    if _DEFAULT_REPR.match(text):      # <module.Class object at 0x7f...>: the address tells them apart
        return f"at 0x…{id(obj) & 0xFFFF:04x}"
    return text if len(text) <= 40 else text[:39] + "…"


def instance_attributes(obj) -> dict:
    """An object's instance attributes: its __dict__ (which reading may create on 3.11+)
    and its __slots__."""
    found = {}
    if getattr(type(obj), "__dictoffset__", 0):
        try:
            found.update(vars(obj))
        except TypeError:
            pass
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in [slots] if isinstance(slots, str) else slots:
            try:
                found.setdefault(name, object.__getattribute__(obj, name))
            except (AttributeError, TypeError):
                pass
    return found


# Named references of objects without a __dict__, in the order they are tried.
_KNOWN_FIELDS = {
    types.MethodType: ("__self__", "__func__"),
    types.FunctionType: ("__closure__", "__defaults__", "__kwdefaults__", "__globals__", "__dict__", "__code__"),
    types.CellType: ("cell_contents",),
    types.TracebackType: ("tb_frame", "tb_next"),
    types.FrameType: ("f_back", "f_code", "f_globals", "f_builtins"),
    BaseException: ("__traceback__", "__context__", "__cause__", "args", "__dict__"),
}


def reference_label(source, target, closure_names: dict | None = None) -> str:
    """How `source` refers to `target`: ".attr", "['key']", "[index]", "closure cell 'name'",
    "__self__", "local 'name'", ... or "" when it cannot be told.

    `closure_names` maps id(a function's __closure__ tuple) to the function's free
    variable names, so that a reference from that tuple to a cell can be named.
    """
    if isinstance(source, dict):
        for k, v in source.items():
            if v is target:
                return f"[{k!r}]"
            if k is target:
                return "key"
        return ""
    if isinstance(source, (list, tuple)):
        names = (closure_names or {}).get(id(source)) if isinstance(source, tuple) else None
        for i, item in enumerate(source):
            if item is target:
                return f"closure cell {names[i]!r}" if names else f"[{i}]"
        return ""
    if isinstance(source, (set, frozenset)):
        return "item"
    if isinstance(source, types.FrameType):
        names = frame_local_names(source, target)
        if names:
            return f"local {names[0]!r}"
    for kind, names in _KNOWN_FIELDS.items():
        if isinstance(source, kind):
            for name in names:
                if getattr(source, name, None) is target:
                    return name
    if not isinstance(source, (type, types.ModuleType)):
        if getattr(type(source), "__dictoffset__", 0) and getattr(source, "__dict__", None) is target:
            return "__dict__"
        for name, value in instance_attributes(source).items():
            if value is target:
                return f".{name}"
    if type(source) is target:
        return "__class__"
    return ""


# -- building a graph with objgraph --------------------------------------------------
def backref_graph(objs, max_depth: int = 6, too_many: int = 10, filter=None) -> ObjectGraph:
    """The objects that refer to `objs` (one object or a list), and those that refer to
    them, up to `max_depth` references away (objgraph's `show_backrefs`).

    Garbage that the collector has not freed yet (a cycle, with the collector off) is
    drawn as it is: objgraph runs `gc.collect()` before it draws, so that collection runs
    with `gc.DEBUG_SAVEALL` and what it finds is let go again after drawing.  The frames
    running this call are left out of the graph.
    """
    return _graph(objgraph.show_backrefs, "backrefs", objs, max_depth, too_many, filter)


# What every object refers to and nobody asks about: its class, code, names, the module.
_PLUMBING = (type, types.ModuleType, types.CodeType, types.BuiltinFunctionType, str, bytes,
             int, float, complex, bool, type(None))


def program_objects():
    """A filter for `ref_graph` that leaves out classes, modules, code, strings, numbers,
    built-in functions and module namespaces (a function's `__globals__`), which every
    graph of references would otherwise fill up with."""
    namespaces = {id(vars(m)) for m in list(sys.modules.values()) if hasattr(m, "__dict__")}
    return lambda obj: not isinstance(obj, _PLUMBING) and id(obj) not in namespaces


def ref_graph(objs, max_depth: int = 5, too_many: int = 10, filter=None) -> ObjectGraph:
    """The objects that `objs` refer to, and so on, up to `max_depth` references away
    (objgraph's `show_refs`).  `filter` (a predicate) decides which objects to draw;
    by default `program_objects()`."""
    return _graph(objgraph.show_refs, "refs", objs, max_depth, too_many, filter or program_objects())


@contextmanager
def _garbage_kept():
    """Collections inside save what they find in gc.garbage (from the index yielded on);
    afterwards it is released again, back to being uncollected garbage, as it was."""
    flags, saved = gc.get_debug(), len(gc.garbage)
    gc.set_debug(flags | gc.DEBUG_SAVEALL)
    try:
        yield saved
    finally:
        gc.set_debug(flags)
        del gc.garbage[saved:]


def garbage_by_type(_audit=sys.audit, _event=WATCH_EVENT) -> Counter:
    """What a full collection finds unreachable, counted by type name.

    The collection runs with `gc.DEBUG_SAVEALL`, so the objects are kept long enough to be
    counted; then the debug flags are restored and, when something was found, a second
    collection frees it.  Call it after a check, never inside one: it collects.
    """
    _audit(_event)
    with _garbage_kept() as start:
        gc.collect()
        found = Counter(type(obj).__name__ for obj in gc.garbage[start:])
    if found:
        gc.collect()
    return found


_EDGE = re.compile(r"^\s*(o_?\d+) -> (o_?\d+)")
_MORE = re.compile(r'^\s*too_many_(o_?\d+)\[label="(\d+) more')


def _graph(walk, direction, objs, max_depth, too_many, filter, _audit=sys.audit, _event=WATCH_EVENT) -> ObjectGraph:
    _audit(_event)
    objs = list(objs) if isinstance(objs, (list, tuple)) else [objs]
    seen = {}                       # node key -> object, while the graph is built

    def remember(obj):
        seen[objgraph._obj_node_id(obj)] = obj
        return {"tooltip": type(obj).__name__}

    ignore = [id(seen), id(objs), id(gc.garbage)]
    frame = sys._getframe()
    while frame is not None:        # this call's own frames refer to `objs`
        ignore.append(id(frame))
        frame = frame.f_back
    out = io.StringIO()
    try:
        with _garbage_kept():
            walk(objs, max_depth=max_depth, too_many=too_many, filter=filter, extra_ignore=ignore,
                 extra_node_attrs=remember, output=out)
            return _read_dot(out.getvalue(), seen, {objgraph._obj_node_id(o) for o in objs}, direction)
    finally:
        seen.clear()
        del objs, frame


def _read_dot(dot: str, seen: dict, roots: set, direction: str) -> ObjectGraph:
    pairs, omitted = [], {}
    for line in dot.splitlines():
        if m := _EDGE.match(line):
            pairs.append((m.group(1), m.group(2)))
        elif m := _MORE.match(line):
            omitted[m.group(1)] = int(m.group(2))
    pairs = _fold_namespaces(dict.fromkeys(pairs), seen, roots)
    closure_names = {id(f.__closure__): f.__code__.co_freevars for f in seen.values()
                     if isinstance(f, types.FunctionType) and f.__closure__}
    edges = [GraphEdge(s, t, reference_label(seen[s], seen[t], closure_names))
             for s, t in pairs if s in seen and t in seen]
    depth = _depths(roots, edges, direction)
    graph = ObjectGraph(direction)
    for key, obj in seen.items():
        graph.nodes[key] = _node(key, obj, depth.get(key, 0), key in roots, isinstance(obj, torch.Tensor),
                                 omitted.get(key, 0))
    graph.edges = edges
    return graph


def _node(key: str, obj, depth: int, is_root: bool, is_tensor: bool, omitted: int = 0) -> GraphNode:
    return GraphNode(key=key, type_name=type(obj).__name__, summary=describe_object(obj), depth=depth,
                     is_root=is_root, is_tensor=is_tensor, has_del=hasattr(type(obj), "__del__"),
                     omitted=omitted)


def _namespace_of(owner, obj) -> bool:
    """Is `obj` the dict that holds `owner`'s attributes, or a frame's locals?"""
    if not isinstance(obj, dict) or isinstance(owner, (type, types.ModuleType)):
        return False
    if isinstance(owner, types.FrameType):     # its locals' snapshot (f_locals is not read: see refs)
        return (obj is not owner.f_globals and obj is not owner.f_builtins
                and any(obj is held for held in gc.get_referents(owner)))
    return bool(getattr(type(owner), "__dictoffset__", 0)) and getattr(owner, "__dict__", None) is obj


def _fold_namespaces(pairs, seen: dict, roots: set) -> list:
    """Fold each instance's __dict__ into the instance: `obj -> its __dict__ -> x` becomes
    `obj -> x` (labelled `.name`).  Python 3.10 always has that dict, 3.11+ only once
    something asks for it; folded, the graph reads the same on every version.  The same
    for the snapshot of a frame's locals that reading `frame.f_locals` leaves on 3.11-3.12
    (objgraph reads it to label references)."""
    owner = {t: s for s, t in pairs if t not in roots and s in seen and t in seen
             and _namespace_of(seen[s], seen[t])}
    for key in owner:
        del seen[key]
    folded = [(owner.get(s, s), owner.get(t, t)) for s, t in pairs if owner.get(t) != s]
    return list(dict.fromkeys(folded))


def _depths(roots, edges, direction) -> dict[str, int]:
    """References between each node and the nearest root, following the walk's direction."""
    nxt = {}
    for e in edges:
        a, b = (e.target, e.source) if direction == "backrefs" else (e.source, e.target)
        nxt.setdefault(a, []).append(b)
    depth, todo = {r: 0 for r in roots}, deque(roots)
    while todo:
        key = todo.popleft()
        for other in nxt.get(key, ()):
            if other not in depth:
                depth[other] = depth[key] + 1
                todo.append(other)
    return depth


# -- drawing -------------------------------------------------------------------------
def _dot() -> str | None:
    """Graphviz's `dot`, found on PATH as it was before any learner code ran (see guard.starting_environment)."""
    return shutil.which("dot", path=starting_environment().get("PATH"))


def dot_available() -> bool:
    return _dot() is not None


def render_png(graph: ObjectGraph) -> bytes:
    """The graph rendered by Graphviz's `dot` as PNG bytes."""
    dot = _dot()
    if dot is None:
        raise FileNotFoundError(DOT_MISSING)
    done = subprocess.run([dot, "-Tpng"], input=graph.to_dot().encode(), capture_output=True, timeout=60,
                          env=starting_environment())
    if done.returncode != 0:
        raise RuntimeError(f"dot failed: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout


def _layout(graph: ObjectGraph) -> dict[str, tuple[float, float]]:
    """Layers by depth (the objects asked about at the bottom for back-references, at the
    top for references); within a layer, ordered next to the neighbours already placed."""
    layers: dict[int, list[str]] = {}
    for key, node in graph.nodes.items():
        layers.setdefault(node.depth, []).append(key)
    neighbours: dict[str, list[str]] = {key: [] for key in graph.nodes}
    for e in graph.edges:
        neighbours[e.source].append(e.target)
        neighbours[e.target].append(e.source)
    width = max(len(keys) for keys in layers.values())
    looped = {key for e in graph.cycle_edges() for key in (e.source, e.target)}
    pos: dict[str, tuple[float, float]] = {}
    for depth in sorted(layers):
        keys = layers[depth]

        def placed_x(key, i):
            xs = [pos[n][0] for n in neighbours[key] if n in pos]
            return sum(xs) / len(xs) if xs else i

        keys = sorted(keys, key=lambda k: placed_x(k, keys.index(k)))
        y = depth if graph.direction == "backrefs" else -depth
        offset = (width - len(keys)) / 2
        for i, key in enumerate(keys):
            # what hangs off a cycle sits a little apart, clear of the arrow that closes it
            apart = 0.6 if key not in looped and any(k in looped for k in keys[:i]) else 0.0
            pos[key] = (offset + i + apart, float(y))
    return pos


def draw_graph(graph: ObjectGraph, ax=None, title: str | None = None):
    """Draw the graph with matplotlib: boxes labelled with type and summary (tensors
    filled, the objects asked about outlined thick), arrows from holder to held labelled
    with how it holds, references that form a cycle in red.  Returns the Axes."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    pos = _layout(graph)
    xs = [p[0] for p in pos.values()] or [0]
    ys = [p[1] for p in pos.values()] or [0]
    if ax is None:
        _, ax = plt.subplots(figsize=(min(16, 2.6 * (max(xs) - min(xs) + 1) + 1),
                                      min(12, 1.5 * (max(ys) - min(ys) + 1) + 0.6)))
    in_cycle = set(graph.cycle_edges())
    boxes = {}
    for key, node in graph.nodes.items():
        label = node.label + (f"\n(+{node.omitted} more)" if node.omitted else "")
        boxes[key] = ax.text(*pos[key], label, ha="center", va="center", fontsize=8, zorder=2,
                             bbox=dict(boxstyle="round,pad=0.4",
                                       facecolor=TENSOR_COLOUR if node.is_tensor else "white",
                                       edgecolor="black", linewidth=2.5 if node.is_root else 0.8))
    for e in graph.edges:
        cyclic = e in in_cycle
        colour = CYCLE_COLOUR if cyclic else "0.35"
        (x0, y0), (x1, y1) = pos[e.source], pos[e.target]
        bend = 0.25 if cyclic or e.source == e.target else 0.0
        # drawn after the boxes (higher zorder): clipping an arrow at a box needs the box's size
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), zorder=3,
                    arrowprops=dict(arrowstyle="-|>", color=colour, lw=1.6 if cyclic else 1,
                                    patchA=boxes[e.source], patchB=boxes[e.target],
                                    shrinkA=2, shrinkB=2, connectionstyle=f"arc3,rad={bend}"))
        if e.label:
            mx, my = (x0 + x1) / 2, (y0 + y1) / 2
            if bend:                     # beside the bent arrow, not on the straight line
                mx, my = mx + bend * (y1 - y0) / 2, my - bend * (x1 - x0) / 2
            ax.text(mx, my, e.label, fontsize=7, color=colour, ha="center", va="center", zorder=4,
                    bbox=dict(boxstyle="square,pad=0.1", facecolor="white", edgecolor="none", alpha=0.8))
    ax.set_xlim(min(xs) - 0.8, max(xs) + 0.8)
    ax.set_ylim(min(ys) - 0.7, max(ys) + 0.7)
    ax.axis("off")
    handles = [Patch(facecolor=TENSOR_COLOUR, edgecolor="black", label="tensor"),
               Patch(facecolor="white", edgecolor="black", linewidth=2.5, label="object asked about"),
               Line2D([], [], color=CYCLE_COLOUR, lw=1.6, label="reference in a cycle"),
               Line2D([], [], color="0.35", lw=1, label="reference (holder → held)")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False)
    what = "back-references of" if graph.direction == "backrefs" else "references from"
    roots = ", ".join(n.type_name for n in graph.roots)
    ax.set_title(title or f"Object graph: {what} {roots}", fontsize=10)
    return ax


def _in_notebook() -> bool:
    ipython = sys.modules.get("IPython")
    return bool(ipython and ipython.get_ipython() is not None)


def show_graph(graph: ObjectGraph, title: str | None = None, text: bool = True) -> str:
    """Show the graph: Graphviz's picture when `dot` is installed; otherwise a note on how
    to install it and the matplotlib drawing.  Then (with `text`) a text listing.
    Returns the renderer used: "graphviz" or "matplotlib"."""
    renderer = "matplotlib"
    if not dot_available():
        print(DOT_MISSING)
    else:
        try:
            png, renderer = render_png(graph), "graphviz"
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            print(f"Graphviz's dot could not draw the graph ({exc}); it is drawn with matplotlib instead.")
    if renderer == "graphviz":
        if _in_notebook():
            from IPython.display import Image, display
            display(Image(png))
    else:
        import matplotlib.pyplot as plt
        ax = draw_graph(graph, title=title)
        if _in_notebook():
            from IPython.display import display
            display(ax.figure)
            plt.close(ax.figure)
    if text:
        print(graph.to_text())
    return renderer


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


def find_tensor_cycles(garbage, generation: int = 2, tensor_test=is_tensor, _audit=sys.audit,
                       _event=WATCH_EVENT) -> list[CycleReport]:
    """The reference cycles in `garbage` (what a collection found unreachable, as
    gc.DEBUG_SAVEALL leaves it in gc.garbage) that contain a tensor or lead to one.

    Each report has the loop, the objects on the way from the loop to each tensor it
    holds (a list or dict that is not itself in a loop, say), and those tensors; other
    garbage is left out.  Cycles that hold no tensor are not reported.  Nor is a tensor
    that no cycle leads to: unreachable, it can only be held through something the
    collector cannot follow (C++ objects such as autograd nodes), which no Python
    attribute can be blamed for.  `tensor_test` decides what counts as a tensor.
    """
    _audit(_event)
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
