"""Lesson 02 end to end: the solution runs clean, and grading accepts only a tree without cycles."""
import re

import pytest
from lesson_support import (
    ROOT, assert_full_marks, assert_less_than_full_marks, assert_no_marks_until_answered, cell_result,
    grade_all, plots_drawn, printed_text, problems, write_variants,
)

from gclab import cycles, grading

LESSON = "02_cycles_and_the_collector"
SOLUTION = ROOT / "solutions" / LESSON / f"{LESSON}.ipynb"
RELEASE = ROOT / "notebooks" / LESSON / f"{LESSON}.ipynb"
MAX_SCORE = 10

LEAKY = '''
class TreeNode:
    def __init__(self, name, tensor, parent=None):
        {extra}
        self.name = name
        self.tensor = tensor
        self.children = []
        self.parent = parent
        if parent is not None:
            parent.children.append(self)
'''

WEAK_CHILDREN = '''
class TreeNode:
    def __init__(self, name, tensor, parent=None):
        self.name = name
        self.tensor = tensor
        self._children = []
        self.parent = parent
        if parent is not None:
            parent._children.append(weakref.ref(self))

    @property
    def children(self):
        return [c() for c in self._children if c() is not None]
'''

NO_PARENT_LINK = '''
class TreeNode:
    def __init__(self, name, tensor, parent=None):
        self.name = name
        self.tensor = tensor
        self.children = []
        self.parent = None                # "breaks the cycle"
        if parent is not None:
            parent.children.append(self)
'''

PROXY_EVERYWHERE = '''
class TreeNode:
    def __init__(self, name, tensor, parent=None):
        self.name = name
        self.tensor = tensor
        self.children = []
        self.parent = None if parent is None else weakref.proxy(parent)
        if parent is not None:
            parent.children.append(weakref.proxy(self))
'''

# Plausible wrong fixes: none may earn full marks, each loses points with a reason.
WRONG = {
    "collect_when_a_tree_starts": LEAKY.format(extra="if parent is None:\n            gc.collect()"),
    "raised_thresholds": "gc.set_threshold(100_000, 50, 50)\n" + LEAKY.format(extra="pass"),
    "weak_children": WEAK_CHILDREN,
    "no_parent_link": NO_PARENT_LINK,
    "proxy_everywhere": PROXY_EVERYWHERE,
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submissions")
    return grade_all({"solution": SOLUTION, "untouched": RELEASE, **write_variants(RELEASE, WRONG, folder)}, folder)


def test_solution_notebook_runs_clean_on_cpu(graded):
    """The solution as the grader ran it (every cell, hidden tests included): no error, no stderr."""
    executed = graded["solution"].executed
    assert not problems(executed), f"errors or stderr output in the solution notebook: {problems(executed)}"
    text = printed_text(executed)
    assert "in a cycle, after make_pair returned:  128.00 KiB held" in text
    assert re.search(r"gc\.collect\(\) found \d+ unreachable objects; now 0 B held", text)
    assert re.search(r"no back-reference \(control\) +0 B +0 +0 B", text), "the acyclic control frees itself"
    assert re.search(r"lambda using self +64\.00 KiB", text), "the closure over self holds its tensor"
    assert re.search(r"parent <-> child, weakref\.ref +0 B +0 +0 B", text), "the weak parent leaves no garbage"
    assert "0 uncollectable, 0 objects in gc.garbage" in text, "PEP 442: a cycle with __del__ is collected"
    assert "#1 Trainer --.on_step--> #4 function   <- cycle" in text, "the object graph names the cycle"
    assert "after gc.garbage.clear(): 640.00 KiB; after one more gc.collect(): 0 B" in text
    assert cycles.dot_available() or "apt-get install graphviz" in text, "without dot, say how to install it"
    assert "memory was back at its baseline after each of 20 iterations" in text
    assert plots_drawn(executed) >= 3, "the generations plot, the freeze bars and the object graph"


def test_solution_earns_full_marks(graded):
    assert_full_marks(graded["solution"], MAX_SCORE)


def test_untouched_student_notebook_earns_nothing(graded):
    assert_no_marks_until_answered(graded["untouched"], MAX_SCORE)
    assert all("TreeNode is not defined yet" in t.message for t in graded["untouched"].tests)


@pytest.mark.parametrize("name", sorted(WRONG))
def test_wrong_fix_does_not_earn_full_marks(graded, name):
    assert_less_than_full_marks(graded[name], MAX_SCORE)


def test_leaning_on_the_collector_keeps_only_the_behaviour_points(graded):
    for name in ("collect_when_a_tree_starts", "raised_thresholds"):
        result = graded[name]
        assert cell_result(result, "test_tree_behaviour").status == "passed", grading.format_results([result])
        assert result.score == 3, grading.format_results([result])
    assert "collector ran" in cell_result(graded["collect_when_a_tree_starts"], "test_tree_frees_itself").message
    assert "did not return to its baseline" in cell_result(graded["raised_thresholds"], "test_memory_flat").message


def test_weak_links_in_the_owning_direction_break_the_tree(graded):
    weak = graded["weak_children"]
    assert weak.score == 0, grading.format_results([weak])
    assert "can be reached from the root" in cell_result(weak, "test_tree_behaviour").message
    assert "nodes died too early" in cell_result(weak, "test_tree_frees_itself").message
    proxy = graded["proxy_everywhere"]
    assert proxy.score == 0, grading.format_results([proxy])
    assert "ReferenceError" in cell_result(proxy, "test_tree_behaviour").message


def test_dropping_the_parent_link_frees_memory_but_changes_behaviour(graded):
    result = graded["no_parent_link"]
    assert cell_result(result, "test_tree_frees_itself").status == "passed", grading.format_results([result])
    assert "child.parent is node" in cell_result(result, "test_tree_behaviour").message
    assert "results during the check" in cell_result(result, "test_memory_flat").message
    assert result.score == 3
