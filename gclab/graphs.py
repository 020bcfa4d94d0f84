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

The tensor-cycle detector, which finds the cycles a collection frees and draws them with these
graphs, is `gclab.cycles`.
"""
from __future__ import annotations

import gc
import io
import re
import shutil
import subprocess
import sys
import types
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import objgraph
import torch

from .environment import starting_environment
from .memory import format_bytes
from .refs import frame_local_names

__all__ = ["GraphNode", "GraphEdge", "ObjectGraph", "backref_graph", "ref_graph", "program_objects",
           "reference_label", "describe_object", "garbage_by_type", "draw_graph", "render_png", "show_graph",
           "dot_available", "DOT_MISSING", "instance_attributes"]

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


def garbage_by_type() -> Counter:
    """What a full collection finds unreachable, counted by type name.

    The collection runs with `gc.DEBUG_SAVEALL`, so the objects are kept long enough to be
    counted; then the debug flags are restored and, when something was found, a second
    collection frees it.  Call it after a check, never inside one: it collects.
    """
    with _garbage_kept() as start:
        gc.collect()
        found = Counter(type(obj).__name__ for obj in gc.garbage[start:])
    if found:
        gc.collect()
    return found


_EDGE = re.compile(r"^\s*(o_?\d+) -> (o_?\d+)")
_MORE = re.compile(r'^\s*too_many_(o_?\d+)\[label="(\d+) more')


def _graph(walk, direction, objs, max_depth, too_many, filter) -> ObjectGraph:
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
    """Graphviz's `dot`, found on PATH as it was before any learner code ran (see gclab.environment)."""
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
