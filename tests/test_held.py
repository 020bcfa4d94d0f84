"""gclab.held: which attribute of an object keeps the tensor bytes made since a start."""
import weakref

import torch

from gclab.held import HeldBytes
from gclab.memory import device_storage


def test_held_bytes_on_its_own_and_a_container_as_the_holder():
    log = {"records": [], "latest": torch.zeros(1000)}
    held = HeldBytes(log, name="log")
    for i in range(4):
        log["records"].append(torch.zeros(16) + i)
        log["latest"] = torch.zeros(1000)          # replaced: no growth
    report = held.report()
    held.close()
    assert [(h.path, h.grew, h.new_entries) for h in report.holdings] == [("log['records']", 4 * 64, 4)]
    assert "Where the bytes are, now: log['records'] (256 B more, in 4 entries)" in report.explain()


def test_only_storages_on_the_meters_device_count():
    kept = {"losses": []}
    on_cpu, on_gpu = HeldBytes(kept, name="kept", device="cpu"), HeldBytes(kept, name="kept", device="cuda:0")
    kept["losses"].append(torch.zeros(8))                          # host memory: not what a GPU meter counts
    assert [(h.path, h.grew) for h in on_cpu.report().holdings] == [("kept['losses']", 32)]
    assert on_gpu.report().holdings == []
    on_cpu.close()
    on_gpu.close()


def test_slots_are_walked_by_name():
    class Slotted:
        __slots__ = "kept"               # one slot, written as a string

        def __init__(self):
            self.kept = []

    holder = Slotted()
    held = HeldBytes(holder, name="holder")
    holder.kept.append(torch.zeros(4))
    assert [(h.path, h.grew) for h in held.report().holdings] == [("holder.kept", 16)]
    held.close()


def test_a_storage_is_counted_once_and_as_the_device_counts_it():
    base = torch.zeros(10)
    key, storage, nbytes = device_storage(base)
    assert nbytes == 40 and device_storage(base[2:5])[0] == key       # a view shares its storage
    assert device_storage(base, device=torch.device("cuda:0")) is None
    assert device_storage(torch.zeros(3).to_sparse()) is None


def test_storage_census_finds_gradients_and_what_graphs_saved_and_counts_only_new_ones():
    from gclab.held import StorageCensus
    weight = torch.ones(256, requires_grad=True)
    (weight * 2).sum().backward()                              # weight.grad: 1 KiB
    old_gradient = ("cpu", weight.grad.untyped_storage().data_ptr())
    before = StorageCensus()
    kept = [torch.ones(1024)]                                  # 4 KiB
    kept.append(weight.exp())                                  # 1 KiB, and its graph saves its result
    weight.grad = torch.zeros(256)                             # the old gradient freed, a new one: net 0
    after = StorageCensus()
    try:
        assert after.new_bytes(before, carried=set()) == 4096 + 1024 + 1024
        assert after.new_bytes(before, carried={old_gradient}) == 4096 + 1024   # the step's own, replaced
    finally:
        before.close()
        after.close()


def _bytes_made_by(action):
    """What the storage census counts as made while `action()` ran (whose result is kept meanwhile)."""
    from gclab.held import StorageCensus
    before = StorageCensus()
    try:
        kept = action()
        after = StorageCensus()
        try:
            return after.new_bytes(before, carried=set())
        finally:
            after.close()
            del kept
    finally:
        before.close()


def test_storage_census_counts_what_a_storage_it_had_found_grew_by():
    kept = torch.empty(0)
    assert _bytes_made_by(lambda: kept.resize_(1024)) == 4096      # the same storage, 4 KiB bigger


def test_storage_census_finds_a_storage_kept_without_any_tensor():
    assert _bytes_made_by(lambda: torch.ones(1024).untyped_storage()) == 4096   # the tensor is gone, not its bytes


def test_a_dict_keyed_by_tensors_or_objects_is_named_without_their_repr():
    """An optimizer's state is keyed by its parameters: a path shows what a key is, not its elements
    (a parameter's repr prints them all, and a learner's key's __repr__ is the learner's code)."""
    from gclab.held import tensors_held

    class Key:
        def __repr__(self):
            raise AssertionError("a key's repr was called")

    weight = torch.nn.Parameter(torch.ones(300, 4))
    optimizer = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
    weight.grad = torch.ones(300, 4)
    optimizer.step()
    held = tensors_held({"state": optimizer.state, Key(): torch.zeros(2), 7: torch.zeros(1)}, name="kept")
    assert "kept['state'][<a float32[300x4] tensor>]['momentum_buffer'], a float32[300x4] tensor (4.69 KiB of storage)" in held
    assert "kept[<a Key>], a float32[2] tensor (8 B of storage)" in held
    assert "kept[7], a float32[1] tensor (4 B of storage)" in held


def test_what_a_wrapper_keeps_in_no_attribute_is_held():
    """A staticmethod, a functools.partial, a generator's frame: followed as the collector follows them."""
    import functools
    from gclab.held import tensors_held

    def boxed():
        box = staticmethod(torch.ones(100))

        def scale(x):
            return x / box.__func__.sum()
        return scale

    def paused():
        kept = torch.ones(50)
        yield kept.sum()

    generator = paused()
    next(generator)
    assert tensors_held(boxed(), "scale") == [
        "scale (closure variable 'box').__func__, a float32[100] tensor (400 B of storage)"]
    assert tensors_held(functools.partial(print, torch.ones(10)), "p") == [
        "p (a referent)[0], a float32[10] tensor (40 B of storage)"]
    assert tensors_held(generator, "g") == ["g (a referent), a float32[50] tensor (200 B of storage)"]


def test_an_object_whose_dict_cannot_be_read_by_name_is_still_walked():
    """A class may make `__dict__` a property that raises: what its objects keep is found all the same."""
    from gclab.held import tensors_held

    class Hidden:
        @property
        def __dict__(self):
            raise RuntimeError("not telling")

    hidden = Hidden()
    object.__setattr__(hidden, "kept", torch.ones(25))
    held = tensors_held([hidden], "cache")
    assert len(held) == 1 and "float32[25] tensor (100 B of storage)" in held[0], held


# -- assert_keeps_nothing, cut_off -------------------------------------------------------------
import pytest  # noqa: E402

from gclab.held import assert_keeps_nothing, cut_off  # noqa: E402

_KEPT_ELSEWHERE = []


class _Node:
    """A tree node; with `weak=True` it refers to its parent weakly (no cycle)."""
    def __init__(self, tensor, parent=None, weak=False):
        self.tensor, self.children = tensor, []
        self.parent = parent if parent is None or not weak else weakref.ref(parent)
        if parent is not None:
            parent.children.append(self)


def test_assert_keeps_nothing_says_who_holds_the_bytes():
    assert_keeps_nothing(lambda: {"value": float(torch.ones(256).sum())}, "a report", device="cpu")
    with pytest.raises(AssertionError, match=r"^a report holds 1.00 KiB of tensors with the collector off$"):
        assert_keeps_nothing(lambda: {"t": torch.ones(256)}, "a report", device="cpu")

    def kept_elsewhere():
        _KEPT_ELSEWHERE.append(torch.ones(256))
        return {"t": torch.ones(256)}
    try:
        with pytest.raises(AssertionError, match=r"^2.00 KiB was held while a report was kept, 1.00 KiB of it even once "
                                                 r"it was deleted: something outside the report keeps its batch, and "
                                                 r"the report refers to the rest itself$"):
            assert_keeps_nothing(kept_elsewhere, "a report", outside="its batch", device="cpu")
    finally:
        _KEPT_ELSEWHERE.clear()


def _nodes(node):
    return [node, *(n for child in node.children for n in _nodes(child))]


def _tree(weak=True):
    root = _Node(torch.ones(256))
    for _ in range(2):
        _Node(torch.ones(256), root, weak)
    return root


def test_cut_off_measures_a_structure_that_frees_itself():
    def drop_first(root):
        del root.children[0]
    freed = cut_off(_tree, _nodes, device="cpu")
    assert (freed.held, freed.left, freed.alive, freed.count, freed.collections) == (3072, 0, 0, 3, "")
    pruned = cut_off(_tree, lambda root: _nodes(root.children[0]), cut=drop_first, device="cpu")
    assert (pruned.held, pruned.left, pruned.alive, pruned.count) == (3072, 2048, 0, 1)
    assert pruned.why == "none of it, nor a tensor it held, is still alive" and not pruned.in_cycles


def test_cut_off_says_a_cycle_or_what_refers_to_what_was_cut_off():
    cyclic = cut_off(lambda: _tree(weak=False), _nodes, device="cpu", what="the tree")  # children refer to the parent
    assert (cyclic.left, cyclic.alive, cyclic.in_cycles) == (3072, 3, True)
    assert cyclic.why.startswith("a collection frees the tree: it is still in reference cycles")

    def registered():
        root = _tree()
        _KEPT_ELSEWHERE.append(root.children[1].tensor)
        return root
    try:
        kept = cut_off(registered, _nodes, device="cpu", what="the tree")
    finally:
        _KEPT_ELSEWHERE.clear()
    assert (kept.left, kept.alive, kept.in_cycles) == (1024, 0, False)
    assert kept.why == ("a collection does not free the tree either: something else still refers to the tree "
                        "(test_held._KEPT_ELSEWHERE[0])")


def test_cut_off_names_the_path_from_what_it_keeps():
    def every_node_listed():
        root = _tree()
        root.every_node = _nodes(root)
        return root

    def drop_first(root):
        del root.children[0]
    pruned = cut_off(every_node_listed, lambda root: _nodes(root.children[0]), cut=drop_first, device="cpu",
                     what="the cut branch", holder="root")
    assert (pruned.left, pruned.alive) == (3072, 1)
    assert pruned.why == ("a collection does not free the cut branch either: something else still refers to the cut "
                          "branch (root.every_node[1].tensor)")
