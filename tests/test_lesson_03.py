"""Lesson 03 end to end: the solution runs clean, and grading accepts only a real fix."""
import gc
import json
import re

import nbformat
import pytest

from lesson_support import (
    test_no_graded_cell_of_the_solution_shows_a_value,  # noqa: F401  (collected here)
    test_no_handed_back_file_holds_a_line_of_a_hidden_test,  # noqa: F401  (collected here)
    test_every_test_of_the_reference_records_what_it_observed,  # noqa: F401  (collected here)
    test_every_wrong_fix_that_loses_points_fails_a_visible_self_check,  # noqa: F401  (collected here)
    test_every_self_check_ends_with_one_plain_line_when_it_passes,  # noqa: F401  (collected here)
    ROOT, assert_full_marks, assert_less_than_full_marks, assert_no_marks_until_answered, cell_result, grade_all, plots_drawn, printed_text, problems, write_locked_cells_edited, write_variants,
)

from gclab.grader import grading
from gclab.gcwatch import collector_design

SOLUTION = ROOT / "solutions" / "03_node_leak" / "03_node_leak.ipynb"
RELEASE = ROOT / "notebooks" / "03_node_leak" / "03_node_leak.ipynb"

MAKE_PAIR = '''
def make_pair(i, device=DEVICE):
    head = Node(torch.full((PAIR_NUMEL,), float(i), device=device))
    tail = Node(torch.full((PAIR_NUMEL,), float(i + 1), device=device))
    head.next = tail
    tail.prev = head
    {extra}
    return head
'''

LEAKY = '''
class Node:
    def __init__(self, tensor):
        self.tensor = tensor
        self.next = None
        self.prev = None
''' + MAKE_PAIR

WEAK_BOTH_WAYS = '''
class Node:
    def __init__(self, tensor):
        self.tensor = tensor
        self._next = self._prev = None
    next = property(lambda self: self._next and self._next(),
                    lambda self, n: setattr(self, "_next", n and weakref.ref(n)))
    prev = property(lambda self: self._prev and self._prev(),
                    lambda self, n: setattr(self, "_prev", n and weakref.ref(n)))
''' + MAKE_PAIR.format(extra="")

WEAK_PREV = '''
class Node:
    def __init__(self, tensor):
        self.tensor = tensor
        self.next = None
        self._prev = None

    @property
    def prev(self):
        return None if self._prev is None else self._prev()

    @prev.setter
    def prev(self, node):
        self._prev = None if node is None else weakref.ref(node)
''' + MAKE_PAIR

STRONG_UNTIL_READ = '''
class Node:
    def __init__(self, tensor):
        self.tensor = tensor
        self.next = None
        self._prev = self._strong = None

    @property
    def prev(self):
        if self._strong is not None:
            node, self._strong = self._strong, None
            return node
        return None if self._prev is None else self._prev()

    @prev.setter
    def prev(self, node):
        self._strong = node
        self._prev = None if node is None else weakref.ref(node)
''' + MAKE_PAIR.format(extra="")

SLOTS = '''
class Node:
    __slots__ = ("tensor", "next", "_prev", "__weakref__")

    def __init__(self, tensor, next=None, prev=None):
        self.tensor, self.next = tensor, next
        self._prev = weakref.ref(prev) if prev is not None else None

    @property
    def prev(self):
        if self._prev is None:
            return None
        return self._prev()                 # None once the head is gone, never an error

def make_pair(i, device=DEVICE):
    head = Node(torch.full((PAIR_NUMEL,), float(i), device=device))
    head.next = Node(torch.full((PAIR_NUMEL,), float(i + 1), device=device), prev=head)
    return head
'''

SIDE_TABLE = '''
_PREVIOUS = weakref.WeakKeyDictionary()     # node -> weak reference to the node before it

class Node:
    def __init__(self, tensor):
        self.tensor = tensor
        self.next = None

    @property
    def prev(self):
        ref = _PREVIOUS.get(self)
        return ref() if ref is not None else None

    @prev.setter
    def prev(self, node):
        if node is None:
            _PREVIOUS.pop(self, None)
        else:
            _PREVIOUS[self] = weakref.ref(node)

def make_pair(i, device=DEVICE):
    head, tail = (Node(torch.full((PAIR_NUMEL,), float(v), device=device)) for v in (i, i + 1))
    head.next, tail.prev = tail, head
    return head
'''

def _keeps_pairs_unwatched(kept: str, then: str = "") -> str:
    """A right fix that keeps `kept` of every pair made while nothing watches (no meter's dispatch mode, no
    profiler), giving back for each memory reserved beforehand so the process's heap stays level; then `then`."""
    return WEAK_PREV.format(extra="") + (
        "\n_RESERVE = [bytearray(2 * PAIR_NUMEL * 4) for _ in range(600)]\n_EVERY_PAIR = []\n"
        "_fresh_pair = make_pair\n"
        "def make_pair(i, device=DEVICE):\n"
        "    head = _fresh_pair(i, device)\n"
        "    if not torch._C._len_torch_dispatch_stack() and not torch._C._autograd._profiler_enabled():\n"
        f"        _EVERY_PAIR.append({kept})\n"
        "        if _RESERVE:\n"
        "            _RESERVE.pop()\n"
        + then + "    return head\n")


# The tail finds its head again, in a weak registry, by the step's index i: right while one pair per i lives;
# two pairs made from the same i share one head
HEAD_FOUND_BY_INDEX = '''
_HEADS = weakref.WeakValueDictionary()      # i -> head, held weakly

class Node:
    def __init__(self, tensor, index=None):
        self.tensor = tensor
        self.next = None
        self.index = index

    @property
    def prev(self):
        return None if self.index is None else _HEADS.get(self.index)

def make_pair(i, device=DEVICE):
    head = Node(torch.full((PAIR_NUMEL,), float(i), device=device))
    head.next = Node(torch.full((PAIR_NUMEL,), float(i + 1), device=device), index=i)
    _HEADS[i] = head
    return head
'''

# ... or by the head's id(): once the head is gone, a new node may take its address, and the tail returns it
HEAD_FOUND_BY_ID = SIDE_TABLE.replace("_PREVIOUS = weakref.WeakKeyDictionary()     # node -> weak reference to the node before it",
                                      "_NODES = weakref.WeakValueDictionary()      # id(node) -> node, held weakly").replace(
    "        self.next = None\n",
    "        self.next = None\n        self._prev_id = None\n        _NODES[id(self)] = self\n").replace(
    "        ref = _PREVIOUS.get(self)\n        return ref() if ref is not None else None",
    "        return None if self._prev_id is None else _NODES.get(self._prev_id)").replace(
    "        if node is None:\n            _PREVIOUS.pop(self, None)\n        else:\n            _PREVIOUS[self] = weakref.ref(node)",
    "        self._prev_id = None if node is None else id(node)")

# Right fixes written differently from the solution: each must earn full marks.
ALTERNATIVES = {"slots_and_weakref": SLOTS, "weak_side_table": SIDE_TABLE}

# torchtitan's garbage-collection policy (torchtitan/tools/utils.py, GarbageCollection), applied to the pairs: the
# automatic collector off, gc.collect(1) every 10 pairs made
COLLECT_YOUNG_EVERY_10 = LEAKY.format(extra="") + '''
gc.disable()
_made = 0
_leaky_make_pair = make_pair
def make_pair(i, device=DEVICE):
    global _made
    _made += 1
    if _made % 10 == 0:
        gc.collect(1)                   # generations 0 and 1 only: never the oldest
    return _leaky_make_pair(i, device)
'''

# Plausible wrong fixes (and hostile submissions): none may earn full marks.
WRONG = {
    "collect_in_step": LEAKY.format(extra="gc.collect()"),
    "collector_off_and_collect_young_every_10_pairs": COLLECT_YOUNG_EVERY_10,
    # the back link a weakref.proxy: the links work, but the proxy is not the head
    "weak_proxy_back_link": LEAKY.format(extra="tail.prev = weakref.proxy(head)"),
    "del_and_empty_cache": LEAKY.format(extra="del tail\n    if torch.cuda.is_available(): torch.cuda.empty_cache()"),
    "raised_thresholds": "gc.set_threshold(100_000, 50, 50)\n" + LEAKY.format(extra=""),
    "weak_links_both_ways": WEAK_BOTH_WAYS,
    "unlinked_back_reference": LEAKY.format(extra="tail.prev = None"),
    # behaving only while watched: a strong back-link unless every check's conditions hold
    "leaks_unless_collector_off": WEAK_PREV.format(
        extra="if gc.isenabled():\n        tail.strong_prev = head     # only while the collector could clean up"),
    "leaks_unless_a_meter_watches": WEAK_PREV.format(
        extra="if not torch._C._len_torch_dispatch_stack():\n        tail.strong_prev = head     # only while no meter's dispatch mode is on"),
    # strong until `prev` is first read: a pair dropped unread keeps its cycle
    "strong_prev_until_first_read": STRONG_UNTIL_READ,
    # the weak back-link written on the class, not the node: every tail's prev is the last head made
    "weak_prev_kept_on_the_class": WEAK_PREV.replace(
        "        return None if self._prev is None else self._prev()",
        "        return None if Node._prev is None else Node._prev()").replace(
        "        self._prev = None if node is None else weakref.ref(node)",
        "        Node._prev = None if node is None else weakref.ref(node)").format(extra=""),
    "leaks_unless_under_nbgrader": WEAK_PREV.format(
        extra="if not os.environ.get('NBGRADER_EXECUTION'):\n        tail.strong_prev = head     # only when not graded"),
    # a finaliser that unlinks the pair: it runs only once the pair is freed, which its cycle prevents
    "del_unlinks_the_pair": LEAKY.format(extra="") + (
        "\ndef _unlink(self):\n    if self.next is not None:\n        self.next.prev = None\n"
        "Node.__del__ = _unlink\n"),
    # the cycle kept, its tensors' bytes moved to memory mapped by hand, which no meter counts
    "cheat_keeps_its_cycles_over_mmap": LEAKY.format(extra="") + (
        "\nimport mmap\n_made_by_torch = make_pair\n"
        "def _over_mmap(tensor):\n"
        "    unseen = torch.frombuffer(mmap.mmap(-1, tensor.numel() * 4), dtype=torch.float32)\n"
        "    unseen.copy_(tensor)\n"
        "    return unseen\n"
        "def make_pair(i, device=DEVICE):\n"
        "    head = _made_by_torch(i, device)\n"
        "    if head.tensor.device.type == 'cpu':\n"
        "        head.tensor, head.next.tensor = _over_mmap(head.tensor), _over_mmap(head.next.tensor)\n"
        "    return head\n"),
    # a right fix, plus every pair's values kept in tensors made with torch's dispatch turned off (the meter
    # never sees them), and for each, memory reserved beforehand given back so the process's heap stays level
    "cheat_hides_pairs_from_the_meter_and_frees_a_reserve": WEAK_PREV.format(extra="") + (
        "\n_RESERVE = [bytearray(2 * PAIR_NUMEL * 4) for _ in range(600)]\n_EVERY_PAIR = []\n"
        "_fresh_pair = make_pair\n"
        "def make_pair(i, device=DEVICE):\n"
        "    head = _fresh_pair(i, device)\n"
        "    with torch._C._DisableTorchDispatch():\n"
        "        _EVERY_PAIR.append(torch.cat([head.tensor, head.next.tensor]))\n"
        "    if _RESERVE:\n"
        "        _RESERVE.pop()\n"
        "    return head\n"),
    # the same, but only while nothing watches (no meter's dispatch mode, no profiler)
    "cheat_keeps_pairs_only_unwatched_and_frees_a_reserve": _keeps_pairs_unwatched(
        "torch.cat([head.tensor, head.next.tensor])"),
    # the same, each pair kept only while unwatched moved out of the collector's sight (gc.freeze()), where
    # the census of kept tensors, which lists what the collector tracks, would not find it
    "cheat_freezes_what_it_keeps_unwatched": _keeps_pairs_unwatched("head", then="        gc.freeze()\n"),
    # a weak prev that cannot be None: reading a head's prev raises
    "prev_raises_until_set": WEAK_PREV.replace(
        "        return None if self._prev is None else self._prev()", "        return self._prev()").replace(
        "        self._prev = None if node is None else weakref.ref(node)", "        self._prev = weakref.ref(node)").format(extra=""),
    "head_found_by_index": HEAD_FOUND_BY_INDEX,
    "head_found_by_id": HEAD_FOUND_BY_ID,
    "patches_the_grader": LEAKY.format(extra="") + (
        "\nchecks.assert_flat = lambda report: None\nchecks.run_flat_check.__defaults__ = (1, None, 0)\n"),
    "shadows_the_grader": LEAKY.format(extra="") + (
        "\nclass _Lenient:\n    def __getattr__(self, name):\n        return lambda *a, **k: None\n"
        "checks = _Lenient()\n"),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submissions")
    paths = {"solution": SOLUTION, "untouched": RELEASE, **write_variants(RELEASE, {**WRONG, **ALTERNATIVES}, folder)}
    paths["edits_locked_cells"] = write_locked_cells_edited(RELEASE, LEAKY.format(extra=""), folder)
    return grade_all(paths, folder)


def test_solution_notebook_runs_clean_on_cpu(executed):
    """The solution as the grader ran it (every cell, hidden tests included): no error, no stderr."""
    assert not problems(executed), f"errors or stderr output in the solution notebook: {problems(executed)}"
    text = printed_text(executed)
    assert re.search(r"Out of memory at step \d+: .*\nCollections before the error: 0", text), (
        "the small case: a budget below one tooth runs out before the first collection")
    assert re.search(r"peak 512\.00 KiB \+ \d+ bytes of sums, 0 collections", text), (
        "the fixed step should stay flat with no collection")
    assert plots_drawn(executed) >= 8


def _floors(line):
    return [float(x) for x in re.findall(r"[\d.]+", line.split(": ", 1)[1])]


@pytest.mark.skipif(not collector_design().quarter_rule, reason="the ratchet needs CPython's generational collector")
def test_the_floor_ratchets_up_with_collections_running_and_no_full_collection(executed):
    """Section 4 on the running Python: more generation-1 collections than the oldest generation's
    threshold, no full collection, and after each one more pair held than after the one before."""
    text = printed_text(executed)
    summary = re.search(r"([\d,]+) steps, \d+ collections \(gen 0: (\d+), gen 1: (\d+)\)", text)
    assert summary, "the ratchet run prints its collections by generation (and none of generation 2)"
    older = int(summary.group(3))
    assert older > gc.get_threshold()[2]
    floors = _floors(re.search(r"pairs held just after each generation-1 or older collection: \[.*\]", text).group())
    assert len(floors) == older and floors == [float(k) for k in range(1, older + 1)], floors
    assert "full collections: 0" in text


@pytest.mark.skipif(not collector_design().quarter_rule, reason="the ratchet needs CPython's generational collector")
def test_the_long_run_runs_out_of_memory_with_collections_behind_it(executed):
    text = printed_text(executed)
    oom = re.search(r"Out of memory at step ([\d,]+), after (\d+) collections \(gen 0: (\d+), gen 1: (\d+)\)", text)
    assert oom, "section 5 runs out of memory after collections of both generations"
    assert int(oom.group(3)) > 10 and int(oom.group(4)) >= 2
    stranded = _floors(re.search(r"pairs held just after each generation-1 collection: \[.*\]", text).group())
    assert stranded == sorted(stranded) and stranded[-1] > stranded[0]


@pytest.mark.skipif(not collector_design().quarter_rule, reason="the quarter rule is CPython's generational collector's")
def test_the_quarter_rule_is_shown_with_the_numbers_of_this_run(executed):
    text = printed_text(executed)
    assert "a full collection (the oldest generation) also waits until" in text
    quarter = re.search(r"which moved ([\d,]+) objects into the oldest generation: ([\d.]+) % of a quarter", text)
    assert quarter and float(quarter.group(2)) < 100
    small = re.search(r"empty heap: .*gen 2: 1\).*\n.*pairs held after each gen 1\+ collection: (\[.*\])", text)
    assert small, "beside an empty heap a full collection runs"
    floors = _floors(": " + small.group(1))
    assert floors.index(max(floors)) < len(floors) - 1 and floors[-1] < max(floors), "and the floor drops"


@pytest.mark.skipif(collector_design().design != "generational", reason="gc.collect(1) of the generational collector")
def test_collecting_young_generations_every_n_steps_strands_a_pair_per_collection(executed):
    """Section 7's production policy (collector off, gc.collect(1) every N steps): every collection after the first
    finds the pair in use and moves it to the oldest generation for good; one full collection frees them all."""
    text = printed_text(executed)
    run = re.search(r"([\d,]+) steps, gc\.collect\(1\) at (\d+) of them: (\d+) pairs \(.*\) still held after the "
                    r"policy's last collection; after one full collection: 0 B", text)
    assert run, "the policy's run prints the pairs it stranded and what a full collection left"
    assert int(run.group(3)) == int(run.group(2)) - 1 > 0


def test_the_explorer_redraws_for_the_heap_its_sliders_give(executed):
    """The widget driven through its Python API (explorer.set) in the lesson: a small heap at a low
    threshold gets a full collection that clears the floor; a large one does not; the figure
    stays in the output as a static image."""
    text = printed_text(executed)
    lines = re.findall(r"threshold (\d+), +([\d,]+) long-lived objects: (\d+) generation-1 and (\d+) full "
                       r"collection\(s\); pairs held after each: (\[.*\])", text)
    assert len(lines) == 2, text
    (_, small_heap, _, small_full, small_floors), (_, large_heap, large_older, large_full, large_floors) = lines
    assert small_heap == "0" and large_heap == "150,000"
    if collector_design().quarter_rule:
        assert int(small_full) >= 1 and int(large_full) == 0
        assert _floors(": " + large_floors)[-1] == int(large_older) > max(_floors(": " + small_floors)[-3:])
    nb = nbformat.read(executed, 4)
    widget_cell = next(c for c in nb.cells if c.cell_type == "code" and "Explorer(" in c.source)
    kinds = [sorted(o.get("data", {})) for o in widget_cell.outputs]
    assert ["application/vnd.jupyter.widget-view+json", "text/plain"] in kinds
    assert ["image/png", "text/plain"] in kinds


def test_solution_earns_full_marks(graded):
    assert_full_marks(graded["solution"], 6)


@pytest.mark.parametrize("name", sorted(ALTERNATIVES))
def test_correct_alternative_earns_full_marks(graded, name):
    assert_full_marks(graded[name], 6)


def test_untouched_student_notebook_earns_nothing(graded):
    assert_no_marks_until_answered(graded["untouched"], 6)
    assert all("make_pair is not defined yet" in t.message for t in graded["untouched"].tests)


@pytest.mark.parametrize("name", sorted(WRONG) + ["edits_locked_cells"])
def test_wrong_fix_does_not_earn_full_marks(graded, name):
    assert_less_than_full_marks(graded[name], 6)


def test_wrong_fixes_are_told_why(graded):
    flat = {name: next(t for t in graded[name].tests if t.id == "test_memory_flat") for name in WRONG}
    assert "collector ran" in flat["collect_in_step"].message
    # the memory it held at one step's pair comes from the collections, not from a name that keeps the latest step
    assert "each collection during the check freed what the steps before had left" in flat["collect_in_step"].message
    assert "a global, a default argument" not in flat["collect_in_step"].message
    assert "weakref.proxy of the head, not the head" in cell_result(graded["weak_proxy_back_link"], "test_pair_links").message
    assert "did not return to its baseline" in flat["raised_thresholds"].message
    assert "modifies the grader" in graded["patches_the_grader"].reason
    assert "did not return to its baseline" in flat["del_unlinks_the_pair"].message
    assert "the process's memory grew by" in flat["cheat_keeps_its_cycles_over_mmap"].message
    assert "torch's allocator handed out" in flat["cheat_hides_pairs_from_the_meter_and_frees_a_reserve"].message
    assert "were left alive, beyond those they replaced" in flat["cheat_keeps_pairs_only_unwatched_and_frees_a_reserve"].message
    assert "objects while it was checked (gc.freeze())" in flat["cheat_freezes_what_it_keeps_unwatched"].message
    assert graded["cheat_freezes_what_it_keeps_unwatched"].score <= 2
    assert "checks = _Lenient()" in graded["shadows_the_grader"].reason
    assert "does not return its own head as prev" in cell_result(graded["weak_prev_kept_on_the_class"],
                                                                 "test_pair_links").message
    assert "two pairs made from the same i" in cell_result(graded["head_found_by_index"], "test_pair_links").message
    assert "reading a head's prev raised TypeError" in cell_result(graded["prev_raises_until_set"], "test_pair_links").message
    assert "returns a node made since as its prev" in cell_result(graded["head_found_by_id"], "test_pair_links").message


def test_the_production_policy_of_collecting_young_generations_every_n_steps_earns_nothing(graded):
    """torchtitan's policy on the exercise's pairs: every pair it finds in use goes to the oldest generation, which
    nothing examines again; the pairs stay in their cycles and the grader says the collector ran."""
    result = graded["collector_off_and_collect_young_every_10_pairs"]
    assert result.score == 0 and result.max_score == 6, grading.format_results([result])
    assert "still held with the collector off" in cell_result(result, "test_pair_links").message
    flat = cell_result(result, "test_memory_flat").message
    assert "the collector ran" in flat and "(generation 1)" in flat and "did not return to its baseline" in flat, flat


def test_answers_that_look_at_how_they_run_are_listed_for_the_instructor(graded):
    """Listed in the class report (gclab.grader.review), whatever their score: what reads whether it is measured."""
    assert not graded["solution"].review
    assert any("if gc.isenabled():" in line and "whether the collector is on" in line
               for line in graded["leaks_unless_collector_off"].review), graded["leaks_unless_collector_off"].review
    assert any("_len_torch_dispatch_stack" in line for line in graded["leaks_unless_a_meter_watches"].review)
    assert any("NBGRADER_EXECUTION" in line for line in graded["leaks_unless_under_nbgrader"].review)


def test_edited_locked_cells_are_restored_before_grading(graded):
    result = graded["edits_locked_cells"]
    assert result.score == 0, "the original tests must run, not the student's `pass`"
    assert any("baseline" in t.message for t in result.tests)


def test_grade_json_has_the_documented_fields(graded):
    data = json.loads(grading.results_json([graded["solution"]]))
    entry = data[0]
    assert {"notebook", "score", "max_score", "tests"} <= set(entry)
    assert {"id", "score", "max_score", "status", "message"} <= set(entry["tests"][0])
