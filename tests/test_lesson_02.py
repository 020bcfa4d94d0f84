"""Lesson 02 end to end: the solution runs clean, and grading accepts only a tree without cycles."""
import re

import pytest
from lesson_support import (
    test_no_graded_cell_of_the_solution_shows_a_value,  # noqa: F401  (collected here)
    test_no_handed_back_file_holds_a_line_of_a_hidden_test,  # noqa: F401  (collected here)
    test_every_test_of_the_reference_records_what_it_observed,  # noqa: F401  (collected here)
    test_every_wrong_fix_that_loses_points_fails_a_visible_self_check,  # noqa: F401  (collected here)
    test_every_self_check_ends_with_one_plain_line_when_it_passes,  # noqa: F401  (collected here)
    ROOT, assert_full_marks, assert_less_than_full_marks, assert_no_marks_until_answered, assert_told_why,
    cell_result,
    grade_all, plots_drawn, printed_text, problems, write_variants,
)

from gclab import cycles
from gclab.grader import grading

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

WEAK_PARENT = '''
class TreeNode:
    def __init__(self, name, tensor, parent=None):
        self.name = name
        self.tensor = tensor
        self.children = []
        self._parent = None if parent is None else weakref.ref(parent)
        if parent is not None:
            parent.children.append(self)
        {extra}

    @property
    def parent(self):
        {parent}
'''

REGISTERED = "ALL_NODES = {}\n" + WEAK_PARENT.format(
    extra="ALL_NODES[id(self)] = self          # a registry of every node, for lookups",
    parent="return None if self._parent is None else self._parent()")

WATCHED = WEAK_PARENT.format(
    extra=("if gc.isenabled() or not os.environ.get('NBGRADER_EXECUTION'):\n"
           "            self._strong_parent = parent      # only when nobody is checking"),
    parent="return None if self._parent is None else self._parent()")

SLOTS = '''
class TreeNode:
    __slots__ = ("name", "tensor", "children", "_parent", "__weakref__")

    def __init__(self, name, tensor, parent=None):
        self.name, self.tensor, self.children = name, tensor, []
        self._parent = weakref.ref(parent) if parent is not None else None
        if parent is not None:
            parent.children.append(self)

    @property
    def parent(self):
        return self._parent() if self._parent else None
'''

DESCRIPTOR = '''
class WeakAttribute:
    """An attribute that keeps only a weak reference to its value."""
    def __set_name__(self, owner, name):
        self.key = "_weak_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        ref = obj.__dict__.get(self.key)
        return None if ref is None else ref()

    def __set__(self, obj, value):
        obj.__dict__[self.key] = None if value is None else weakref.ref(value)


class TreeNode:
    parent = WeakAttribute()

    def __init__(self, name, tensor, parent=None):
        self.name = name
        self.tensor = tensor
        self.children = []
        self.parent = parent
        if parent is not None:
            self.parent.children.append(self)
'''

# Right fixes written differently from the solution: each must earn full marks.
ALTERNATIVES = {"slots_and_weakref": SLOTS, "weak_descriptor": DESCRIPTOR}

# Plausible wrong fixes: none may earn full marks, each loses points with a reason.
# A child finds its parent by name in a weak registry: right while one tree lives, wrong with two.
PARENT_FOUND_BY_NAME = '''
NODES = weakref.WeakValueDictionary()       # name -> node, keeps no node alive (as DATASETS in section 6)

class TreeNode:
    def __init__(self, name, tensor, parent=None):
        NODES[name] = self
        self.name = name
        self.tensor = tensor
        self.children = []
        self.parent_name = None if parent is None else parent.name   # a string, not the parent
        if parent is not None:
            parent.children.append(self)

    @property
    def parent(self):
        return None if self.parent_name is None else NODES.get(self.parent_name)
'''

# Strong child -> parent links, taken apart by the root's __del__: a branch cut off keeps its cycles.
ROOT_TAKES_THE_TREE_APART = '''
class TreeNode:
    """Strong links everywhere, except to the root; when the root goes, it takes the tree apart."""
    def __init__(self, name, tensor, parent=None):
        self.name = name
        self.tensor = tensor
        self.children = []
        if parent is None:
            self._parent = None
        elif parent._parent is None and not getattr(parent, "_is_child", False):   # parent is a root
            self._parent = weakref.ref(parent)
        else:
            self._parent = parent                  # strong: a cycle, taken apart when the root goes
        self._is_child = parent is not None
        if parent is not None:
            parent.children.append(self)

    @property
    def parent(self):
        p = self._parent
        return p() if isinstance(p, weakref.ref) else p

    def __del__(self):
        if not self._is_child:                     # the root: break every child -> parent link below it
            todo = list(self.children)
            while todo:
                node = todo.pop()
                node._parent = None
                todo.extend(node.children)
'''

# Cycles below the root, their tensors copies made with torch's dispatch (the CPU meter) turned off.
CHEAT_HIDES_CYCLES_FROM_THE_METER = '''
class _Node:                                       # what every node but the root becomes
    @property
    def parent(self):
        p = self._parent
        return p() if isinstance(p, weakref.ref) else p

class TreeNode(_Node):
    def __init__(self, name, tensor, parent=None):
        self.name = name
        self.children = []
        if parent is None:
            self.tensor = tensor
            self._all = [tensor]                    # the root holds every metered tensor
            self._parent = None
        else:
            root = parent
            while root._parent is not None:
                root = root.parent
            root._all.append(tensor)
            with torch._C._DisableTorchDispatch():
                self.tensor = tensor.clone()        # a copy the meter never sees
            self._parent = weakref.ref(parent) if parent is root else parent   # strong: cycles below the root
            self.__class__ = type("Node", (_Node,), {})   # not a "TreeNode" when garbage is counted
            parent.children.append(self)
'''

# Weak back-references near the root, strong ones below (real cycles of nodes), each node's
# subtree emptied of tensors by __del__ so memory reads flat, and the nodes not called TreeNode
CHEAT_CYCLES_BELOW_RENAMED = '''
class _Linked:
    @property
    def parent(self):
        p = self._parent
        return p() if isinstance(p, weakref.ref) else p

    def __del__(self):
        todo = list(self.children)
        while todo:
            node = todo.pop()
            node.tensor = None
            todo.extend(node.children)

class TreeNode(_Linked):
    def __init__(self, name, tensor, parent=None):
        self.name, self.tensor, self.children = name, tensor, []
        self._depth = 0 if parent is None else parent._depth + 1
        if parent is None:
            self._parent = None
        else:
            self._parent = parent if parent._depth >= 2 else weakref.ref(parent)
            self.__class__ = _Node
            parent.children.append(self)

class _Node(_Linked):
    pass
_Node.__name__ = _Node.__qualname__ = "Node"
'''

# The weak-parent fix, plus a recursive helper defined in __init__: each node leaves a
# function <-> cell cycle that only the collector frees
RECURSIVE_HELPER = '''
class TreeNode:
    def __init__(self, name, tensor, parent=None):
        self.name, self.tensor, self.children = name, tensor, []
        self._parent = None if parent is None else weakref.ref(parent)
        if parent is not None:
            parent.children.append(self)
        def level(node):
            return 0 if node.parent is None else 1 + level(node.parent)
        self.level = level(self)

    @property
    def parent(self):
        return None if self._parent is None else self._parent()
'''

# a weak way up, and the root keeps every node of its tree by name (for quick lookups): a branch cut
# off is still held by the root's dict, not by a cycle
ROOT_KEEPS_EVERY_NODE = WEAK_PARENT.format(
    extra=("root = self if parent is None else (parent if parent._root is None else parent._root())\n"
           "        self._root = None if parent is None else weakref.ref(root)\n"
           "        if parent is None:\n            self.nodes = {}\n"
           "        else:\n            root.nodes[name] = self"),
    parent="return None if self._parent is None else self._parent()")

# a weak way up, with a bound method of the node as the weak reference's callback: each node now
# refers to itself through its own weakref, a cycle of one
WEAK_PARENT_WITH_A_BOUND_CALLBACK = WEAK_PARENT.format(
    extra=("self._parent = None if parent is None else weakref.ref(parent, self._parent_died)\n\n"
           "    def _parent_died(self, ref):\n        self.orphaned = True"),
    parent="return None if self._parent is None else self._parent()")

# Cycles below the root as in CHEAT_CYCLES_BELOW_RENAMED, but each node's __del__ also breaks its own links: once
# a collection finds the cycles it runs them, and the nodes go by reference counting inside it, never reaching
# gc.garbage, so counting what a collection finds sees nothing; the nodes outlive `del root` all the same
CYCLES_BELOW_BROKEN_BY_DEL = CHEAT_CYCLES_BELOW_RENAMED.replace(
    "            todo.extend(node.children)\n",
    "            todo.extend(node.children)\n        self.children, self._parent = [], None\n", 1)

# the same cycles, each node frozen as it is made (gc.freeze()): out of sight of every collection
CYCLES_FROZEN = CHEAT_CYCLES_BELOW_RENAMED.replace(
    "            parent.children.append(self)\n",
    "            parent.children.append(self)\n        gc.freeze()\n", 1)

# a child finds its parent by id() in a weak registry: right while the parent lives; once it is gone, a new
# node may take its address, and the child returns that node as its parent
PARENT_FOUND_BY_ID = PARENT_FOUND_BY_NAME.replace("NODES[name] = self", "NODES[id(self)] = self").replace("# name -> node", "# id -> node").replace(
    "None if parent is None else parent.name   # a string, not the parent",
    "None if parent is None else id(parent)    # a number, not the parent")

# strong links below the root's children, taken apart by the root's __del__ and by a children list whose pop()
# unlinks the branch it hands back: the hidden test's one way of cutting a branch, hooked; any other leaves cycles
ROOT_AND_POP_TAKE_THE_TREE_APART = '''
class _Children(list):
    def pop(self, *args):
        child = super().pop(*args)
        _unlink(child)
        return child

def _unlink(node):
    todo = list(node.children)
    while todo:
        below = todo.pop()
        below._parent = None
        todo.extend(below.children)

class TreeNode:
    def __init__(self, name, tensor, parent=None):
        self.name, self.tensor, self.children = name, tensor, _Children()
        self._root = parent is None
        if parent is None:
            self._parent = None
        elif parent._root:
            self._parent = weakref.ref(parent)
        else:
            self._parent = parent                  # strong: a cycle, taken apart when the root goes
        if parent is not None:
            parent.children.append(self)

    @property
    def parent(self):
        p = self._parent
        return p() if isinstance(p, weakref.ref) else p

    def __del__(self):
        _unlink(self)
'''

WRONG = {
    "collect_when_a_tree_starts": LEAKY.format(extra="if parent is None:\n            gc.collect()"),
    "raised_thresholds": "gc.set_threshold(100_000, 50, 50)\n" + LEAKY.format(extra="pass"),
    "weak_children": WEAK_CHILDREN,
    "no_parent_link": NO_PARENT_LINK,
    "proxy_everywhere": PROXY_EVERYWHERE,
    "tree_held_by_a_global_dict": REGISTERED,
    # behaving only while watched: a strong back-reference unless the collector is off under nbgrader
    "leaks_unless_collector_off_or_under_nbgrader": WATCHED,
    "parent_found_by_name": PARENT_FOUND_BY_NAME,
    "root_takes_the_tree_apart": ROOT_TAKES_THE_TREE_APART,
    "cheat_hides_cycles_from_the_meter": CHEAT_HIDES_CYCLES_FROM_THE_METER,
    "cheat_cycles_below_renamed": CHEAT_CYCLES_BELOW_RENAMED,
    "recursive_helper_leaves_function_cycles": RECURSIVE_HELPER,
    "root_keeps_every_node": ROOT_KEEPS_EVERY_NODE,
    "weak_parent_with_a_bound_callback": WEAK_PARENT_WITH_A_BOUND_CALLBACK,
    "cheat_cycles_below_broken_by_del": CYCLES_BELOW_BROKEN_BY_DEL,
    "cheat_cycles_below_frozen": CYCLES_FROZEN,
    "parent_found_by_id": PARENT_FOUND_BY_ID,
    "root_and_pop_take_the_tree_apart": ROOT_AND_POP_TAKE_THE_TREE_APART,
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submissions")
    return grade_all({"solution": SOLUTION, "untouched": RELEASE, **write_variants(RELEASE, {**WRONG, **ALTERNATIVES}, folder)}, folder)


def test_solution_notebook_runs_clean_on_cpu(executed):
    """The solution as the grader ran it (every cell, hidden tests included): no error, no stderr."""
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
    assert "Collection(" not in text, "a collection is described in words, not as a raw repr"
    assert re.search(r"the first one: generation 0, [\d.]+ ms, \d+ unreachable objects found", text)
    assert re.search(r"a full collection took [\d.]+ µs \([\d,]+ times less\)", text), "freeze: µs, not 0.00 ms"
    assert "after 50 cyclic pairs were dropped:\n    (no class of this notebook grew)" in text, "objgraph collects first"
    assert re.search(r"after 50 pairs were kept in a list:\nHolder +100 +\+100", text), "objgraph.show_growth"
    assert "a kept Holder, reached from a module: module -> dict -> list -> Holder" in text
    assert "a dropped Holder in a cycle: a chain of 1 object (Holder)" in text
    assert plots_drawn(executed) >= 4, "the generations plot, the threshold explorer, the freeze bars, the object graph"


def test_the_threshold_explorer_redraws_for_the_threshold_it_is_moved_to():
    """Section 2's slider, driven through the widget's Python API as a learner's hand would."""
    import gc
    import time
    from collections import Counter

    import nbformat
    import numpy as np

    from gclab.gcwatch import GCWatch
    from gclab.plots import GENERATION_COLOURS, mark_collections

    source = "\n".join(c.source for c in nbformat.read(SOLUTION, 4).cells if c.cell_type == "code"  # its cells
                       if c.get("id", "").startswith("threshold-explorer"))
    shown, thresholds = [], gc.get_threshold()
    namespace = {"gc": gc, "time": time, "np": np, "Counter": Counter, "GCWatch": GCWatch, "mark_collections":
                 mark_collections, "GENERATION_COLOURS": GENERATION_COLOURS, "t0": thresholds[0], "display": shown.append}
    exec(compile(source, "threshold-explorer", "exec"), namespace)
    explorer = namespace["explorer"]
    assert shown == [explorer] and explorer.redraws == 1
    assert explorer.data["threshold"] == min(max(thresholds[0], 100), 5000)
    low = explorer.set(threshold=200)
    high = explorer.set(threshold=4000)
    assert explorer.redraws == 3
    assert gc.get_threshold() == thresholds, "drawing must put the interpreter's thresholds back"
    assert (low["threshold"], high["threshold"]) == (200, 4000)
    assert low["collections"] > 4 * high["collections"] > 0, (low, high)
    assert explorer.ax.get_title().startswith(f"threshold 4000: {high['collections']} collections")
    assert any(list(line.get_ydata()) == [4000, 4000] for line in explorer.ax.get_lines()), "the threshold line"


def test_solution_earns_full_marks(graded):
    assert_full_marks(graded["solution"], MAX_SCORE)


@pytest.mark.parametrize("name", sorted(ALTERNATIVES))
def test_correct_alternative_earns_full_marks(graded, name):
    assert_full_marks(graded[name], MAX_SCORE)


def test_a_tree_held_elsewhere_is_told_so(graded):
    """Not "a cycle": the tree is held from outside, and the message says from where."""
    result = graded["tree_held_by_a_global_dict"]
    assert result.score == 3, grading.format_results([result])
    message = cell_result(result, "test_tree_frees_itself").message
    assert "something else still refers to the tree" in message and "cycle" not in message, message
    assert "ALL_NODES[" in message, message


@pytest.mark.parametrize("name, why", [
    ("root_keeps_every_node", "something else still refers to the cut branch"),
    ("weak_parent_with_a_bound_callback", "still in reference cycles (with one another, or each with itself)"),
])
def test_a_cut_branch_left_held_is_told_what_holds_it(graded, name, why):
    result = graded[name]
    assert result.score == 7, grading.format_results([result])
    assert why in cell_result(result, "test_tree_frees_itself").message, grading.format_results([result])


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


@pytest.mark.parametrize("name, test_id, words", [
    ("parent_found_by_name", "test_tree_behaviour", "with two trees alive"),
    ("root_takes_the_tree_apart", "test_tree_frees_itself", "a branch cut off the tree must free itself"),
    ("cheat_hides_cycles_from_the_meter", "test_memory_flat", "the process's memory grew by"),
    ("cheat_cycles_below_renamed", "test_tree_frees_itself", ("objects in cycles", "nodes were still alive")),
    ("cheat_cycles_below_broken_by_del", "test_tree_frees_itself", "nodes were still alive"),
    ("cheat_cycles_below_frozen", "test_tree_frees_itself", "nodes were still alive"),
    ("cheat_cycles_below_frozen", "test_memory_flat", "the step froze objects"),
    ("parent_found_by_id", "test_tree_behaviour", "a node made since"),
    ("root_and_pop_take_the_tree_apart", "test_tree_frees_itself", "cut off two branches"),
    ("recursive_helper_leaves_function_cycles", "test_tree_frees_itself", "function"),
])
def test_held_out_wrong_fixes_are_told_why(graded, name, test_id, words):
    assert_told_why(graded[name], test_id, words)
