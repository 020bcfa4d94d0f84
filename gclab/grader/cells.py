"""The cells of a lesson's source and of a submission, as the grader reads them.

A test cell's visible and hidden parts (cut where nbgrader's ClearHiddenTests cuts them), a
submission's answer cells by grade_id, and the names a cell binds at its top level.  It reads
nbgrader's cell metadata as it stands: a cell whose metadata a learner stripped is not an answer.
"""
from __future__ import annotations

import ast

from .tampering import _parse

def _split_hidden(source: str) -> tuple[list[str], list[str]]:
    """(visible lines, hidden lines) of a test cell, cut at its hidden-test markers as nbgrader's
    ClearHiddenTests cuts it (so the release is the same either way)."""
    parts, hidden = ([], []), False
    for line in source.splitlines():
        if "### BEGIN HIDDEN TESTS" in line:
            hidden = True
        elif "### END HIDDEN TESTS" in line:
            hidden = False
        else:
            parts[hidden].append(line)
    return parts


def without_hidden_tests(source: str) -> str:
    """A test cell as a learner may see it: its hidden part removed."""
    return "\n".join(_split_hidden(source)[0])


def hidden_tests(source: str) -> str:
    """The hidden parts of a test cell: what `without_hidden_tests` removes."""
    return "\n".join(_split_hidden(source)[1])


def _meta(cell) -> dict:
    return cell.metadata.get("nbgrader", {}) if cell.cell_type == "code" else {}


def answer_cells(submitted) -> dict[str, list]:
    """The learner's answer cells, by grade_id (a cell whose metadata was stripped is not one):
    every copy of one, in order (a cell copied in JupyterLab keeps its metadata)."""
    answers = {}
    for c in submitted.cells:
        if _meta(c).get("solution") and _meta(c).get("grade_id"):
            answers.setdefault(_meta(c)["grade_id"], []).append(c)
    return answers


def _answers_of(submitted) -> dict[str, list[str]]:
    return {grade_id: [c.source for c in cells] for grade_id, cells in answer_cells(submitted).items()}


def top_level_names(source: str) -> set[str]:
    """Names a cell binds at its top level (definitions, imports, assignments)."""
    tree = _parse(source)
    names = set()
    for node in tree.body if tree is not None else ():
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names
