"""What an instructor may want to read in a submission by hand: answer code that looks at what tells a
grading run from the learner's own.

A grade measures the code, wherever it runs; but code can ask where it runs (is the collector on, is a
meter's dispatch mode active, which modules are loaded, which of the lesson's example cells ran) and
behave well only where it is measured.  The checks close every such route they can (a flat check's
unwatched iterations, a cache driven with the lesson's own loader); no check can close them all.  So the
grader also lists the lines of an answer that read such things, and the class report shows them
(`NotebookResult.review`): a score is never changed by them, and a learner's feedback never shows them.
"""
from __future__ import annotations

import ast

from .tampering import _parse

__all__ = ["environment_reads"]

# module attribute -> what reading it tells the code
_ATTRIBUTES = {
    ("sys", "modules"): "which modules are loaded",
    ("sys", "argv"): "how the process was started",
    ("sys", "gettrace"): "whether a tracer is set",
    ("sys", "getprofile"): "whether a profiler is set",
    ("sys", "_getframe"): "who called it",
    ("os", "environ"): "the environment variables",
    ("os", "getenv"): "the environment variables",
    ("os", "getppid"): "which process started it",
    ("os", "getcwd"): "which folder it runs in",
    ("Path", "cwd"): "which folder it runs in",
    ("os", "getpid"): "which process it is",
    ("sys", "orig_argv"): "how the process was started",
    ("sys", "flags"): "how the process was started",
    ("gc", "isenabled"): "whether the collector is on (a check switches it off)",
    ("gc", "callbacks"): "whether something watches the collector",
    ("gc", "get_debug"): "the collector's debug flags",
    ("threading", "enumerate"): "which threads run",
    ("inspect", "stack"): "who called it",
    ("inspect", "currentframe"): "who called it",
    ("_C", "_len_torch_dispatch_stack"): "whether a dispatch mode (the CPU meter) is active",
    ("_C", "_is_torch_function_mode_enabled"): "whether a torch function mode is active",
    ("_autograd", "_profiler_enabled"): "whether torch's profiler (an allocation count) runs",
    ("_python_dispatch", "_get_current_dispatch_mode"): "whether a dispatch mode (the CPU meter) is active",
}
_CALLS = {
    "get_ipython": "the notebook's shell (how the grader runs cells)",
    "globals": "which names the notebook defined (the grader runs no example cell)",
}
_DUNDERS = {"__globals__": "another function's globals", "__closure__": "another function's variables"}


def environment_reads(source: str) -> list[str]:
    """`line  (what it reads)` for each line of `source` that reads what a grading run and a learner's
    own run can differ in; [] for code that does not parse (a syntax error is graded as such)."""
    tree = _parse(source)
    if tree is None:
        return []
    lines = source.splitlines()
    found = {}
    for node in ast.walk(tree):
        what = _reads(node)
        if what is not None and 0 < getattr(node, "lineno", 0) <= len(lines):
            found.setdefault(node.lineno, what)
    return [f"{lines[number - 1].strip()}  ({what})" for number, what in sorted(found.items())]


def _reads(node) -> str | None:
    if isinstance(node, ast.Attribute):
        owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", None)
        if node.attr in _DUNDERS:
            return _DUNDERS[node.attr]
        return _ATTRIBUTES.get((owner, node.attr))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args:
        return _CALLS.get(node.func.id)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        if "NBGRADER" in node.value:
            return "whether nbgrader runs it"
        if node.value.startswith("/proc/"):
            return "what the system says of a process (its command line, its parent)"
        return _DUNDERS.get(node.value)          # getattr(f, "__globals__")
    return None
