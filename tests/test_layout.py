"""The layout: the learner's instruments in gclab/, the grader in gclab/grader/, the course's tools in
gclab/tools/.  Imports run one way (tools -> grader -> instruments), and no module imports itself back
through others (every import counted, also those inside a function)."""
import ast
from pathlib import Path

import gclab

PACKAGE = Path(gclab.__file__).parent

def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict:
    modules = {_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names]
                targets = [t for t in targets if t in modules] or [base]      # modules, else names of a module
            else:
                continue
            found |= {t for t in targets if t in modules and t != name and t != "gclab"}
        graph[name] = found
    return graph


def _side(name: str) -> str:
    return "grader" if name.startswith("gclab.grader") else "tools" if name.startswith("gclab.tools") else (
        "command" if name == "gclab.__main__" else "instruments")


def test_imports_run_one_way():
    order = {"instruments": 0, "grader": 1, "tools": 2, "command": 3}
    backwards = {(a, b) for a, targets in _imports().items() for b in targets
                 if order[_side(b)] > order[_side(a)]}
    assert backwards == set()


def test_no_module_imports_itself_back():
    graph, cycles = _imports(), []

    def visit(node, path):
        for nxt in sorted(graph.get(node, ())):
            if nxt == path[0]:
                cycles.append(path + [nxt])
            elif nxt not in path and nxt > path[0]:
                visit(nxt, path + [nxt])
    for start in sorted(graph):
        visit(start, [start])
    assert cycles == []
