"""What in an answer's source replaces or mutates the tools the grader relies on.

It reads the source, never runs it: an assignment to an attribute of `gc`, `torch`, `gclab`, `sys`,
`builtins`, `time`, `weakref` (or of a name imported from them), `setattr`/`delattr` on them, a
mutation of `gc.callbacks`, a name the lesson's locked cells imported rebound to something else.  What
it cannot see: code that reaches the same objects by a route no line spells (through `vars()`, a
frame, `gc.get_objects()`, memory read as an array); the verdict process's guard
(`gclab.guard`) and the grader's own measurements (`gclab.grader.measured`) answer those.
Hidden tests import it too (lesson 06: `tampering` on the learner's policy file).
"""
from __future__ import annotations

import ast
import functools
import re
import threading

_GUARDED = {"gc", "gclab", "torch", "numpy", "sys", "builtins", "time", "weakref", "nbgrader", "importlib"}
_SETTINGS = ("torch.backends.", "sys.last_")   # what ordinary code sets or clears; not the grader's tools
_MUTATORS = {"append", "clear", "remove", "pop", "extend", "insert", "__setitem__", "__delitem__"}


def _root_name(node):
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


_AST_LOCK = threading.Lock()     # CPython 3.11's ast.parse is not safe in two threads at once


def _parse(source):
    for text in (source, _without_magics(source)):
        try:
            with _AST_LOCK:
                return ast.parse(text)
        except SyntaxError:
            pass
    return None


def _without_magics(source: str) -> str:
    """A cell's Python as IPython runs it: a cell magic's body (`%%writefile f.py`, `%%time`)
    is read as Python; line magics and shell escapes (`%xdel x`, `!pip ...`) become `pass`."""
    lines = source.splitlines()
    if lines and lines[0].lstrip().startswith("%%"):
        lines = lines[1:]
    return "\n".join(re.sub(r"^(\s*)[%!].*$", r"\1pass", line) for line in lines)


def imported_tools(sources) -> dict[str, str]:
    """Names that `sources` (the lesson's locked cells) import from the guarded modules,
    each with where it comes from: {"checks": "gclab.checks", "Meter": "gclab.memory.Meter"}."""
    names = {}
    for source in sources:
        names.update(_tools_imported_by(source))
    return names


@functools.lru_cache(maxsize=4096)
def _tools_imported_by(source: str) -> tuple[tuple[str, str], ...]:
    """imported_tools of one source, kept: a submission's every cell is the context of each of its cells."""
    names = []
    tree = _parse(source)
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in _GUARDED:
                    names.append((a.asname or a.name.split(".")[0], a.name if a.asname else a.name.split(".")[0]))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _GUARDED:
            names += [(a.asname or a.name, f"{node.module}.{a.name}") for a in node.names]
    return tuple(names)


def _in_module_scope(tree):
    """The nodes of `tree` whose bindings are the module's (the notebook's) names: not those inside a
    function's or a class's body, whose names are its own, but those a function declares `global`."""
    todo = list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            declared = {name for inner in ast.walk(node) if isinstance(inner, ast.Global) for name in inner.names}
            yield from (inner for inner in ast.walk(node) if inner is not node and declared & set(_bound(inner)))
            continue
        todo.extend(ast.iter_child_nodes(node))


def _bound(node) -> list[str]:
    """The names `node` binds (a def or class its own name, an assignment, loop or `with` its targets)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Assign, ast.Delete)):
        return [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor, ast.NamedExpr)):
        return [n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)]
    if isinstance(node, ast.withitem) and node.optional_vars is not None:
        return [n.id for n in ast.walk(node.optional_vars) if isinstance(n, ast.Name)]
    return []


def _rebindings(tree, tools: dict[str, str]):
    """Statements of `tree` that bind one of `tools`' names, in the notebook's namespace, to something
    else (a function's own variable of the same name replaces nothing)."""
    for node in _in_module_scope(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            again = imported_tools([ast.unparse(node)])
            if any(name in tools and again.get(name) != tools[name]
                   for name in (a.asname or a.name.split(".")[0] for a in node.names)):
                yield node
        elif any(name in tools for name in _bound(node)):
            yield node


def tampering(source: str, context: tuple[str, ...] = (), tools: dict[str, str] | None = None) -> list[str]:
    """Lines of `source` that replace or mutate the tools the grader relies on.

    Flagged: assigning to an attribute of gc, torch, gclab, sys, builtins, time, weakref
    (or of anything imported from them, here or in the notebook's other cells given as
    `context`), setattr/delattr on them, mutating gc.callbacks, and binding a name that
    the lesson's locked cells imported from them (`tools`, see `imported_tools`) to
    anything else. Calling them, or importing them again, is fine.
    """
    tree = _parse(source)
    if tree is None:
        return []           # a syntax error scores itself
    guarded = _GUARDED | set(imported_tools([source, *context]))
    found = [ast.unparse(node).splitlines()[0] for node in _rebindings(tree, tools or {})]
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            if (isinstance(target, (ast.Attribute, ast.Subscript)) and _root_name(target) in guarded
                    and not ast.unparse(target).startswith(_SETTINGS)):
                found.append(ast.unparse(node).splitlines()[0])
        if isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Name) and func.id in ("setattr", "delattr")
                    and node.args and _root_name(node.args[0]) in guarded):
                found.append(ast.unparse(node))
            elif (isinstance(func, ast.Attribute) and func.attr in _MUTATORS
                  and isinstance(func.value, ast.Attribute) and func.value.attr == "callbacks"
                  and _root_name(func.value) in guarded):
                found.append(ast.unparse(node))
    return list(dict.fromkeys(found))   # a line caught by two rules is listed once


def _student_sources(nb) -> list[str]:
    """Code the student wrote or could edit: answer cells and cells nbgrader does not know."""
    return [cell.source for cell in nb.cells if cell.cell_type == "code"
            and (cell.metadata.get("nbgrader", {}).get("solution")
                 or not cell.metadata.get("nbgrader", {}).get("locked"))]
