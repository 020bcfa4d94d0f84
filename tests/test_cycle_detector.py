"""gclab.cycles.watch_tensor_cycles: the reference cycles that held tensors, per collection."""
import gc
import sys
import weakref

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from gclab import cycles, graphs  # noqa: E402


@pytest.fixture(autouse=True)
def clean_collector():
    gc.collect()
    yield
    plt.close("all")


class Node:
    def __init__(self, tensor):
        self.tensor = tensor
        self.other = None


def node_pair(size=256):
    a, b = Node(torch.zeros(size)), Node(torch.zeros(size))
    a.other, b.other = b, a
    return weakref.ref(a.tensor)


class AwaitableTensor:
    def __init__(self, size):
        self._tensor = torch.zeros(size)

    def wait(self):
        return self._tensor


class AwaitableTensorWithViewCallback:
    """The blog's leak: the callback is a lambda that captures `self`."""

    def __init__(self, awaitable, view_dim):
        self._tensor_awaitable = awaitable
        self._view_dim = view_dim
        self._callback = lambda ret: ret.view(-1, self._view_dim)

    def wait(self):
        return self._callback(self._tensor_awaitable.wait())


def watched(make):
    """Run `make` and a collection with the detector on; its reports."""
    with cycles.watch_tensor_cycles() as found:
        make()
        gc.collect()
    return found


def test_node_pair_reported_with_both_attributes_and_bytes():
    tensor_alive = []
    found = watched(lambda: tensor_alive.append(node_pair(256)))
    assert len(found) == 1
    report = found.reports[0]
    assert [n.type_name for n in report.objects] == ["Node", "Node"]
    assert report.labels == [".other", ".other"]
    assert report.nbytes == 2 * 256 * 4
    assert len(report.tensors) == 2 and all(report.graph.nodes[k].is_tensor for k in report.tensors)
    assert {e.label for e in report.graph.edges} == {".other", ".tensor"}
    assert report.generation == 2
    assert tensor_alive[0]() is None          # and the garbage really was freed


def test_awaitable_cycle_names_the_closure_cell():
    found = watched(lambda: AwaitableTensorWithViewCallback(AwaitableTensor(100), 10).wait())
    assert len(found) == 1
    report = found.reports[0]
    assert sorted(n.type_name for n in report.objects) == ["AwaitableTensorWithViewCallback", "cell",
                                                            "function", "tuple"]
    assert report.labels == ["._callback", "__closure__", "closure cell 'self'", "cell_contents"]
    assert report.nbytes == 400
    held = [e.label for e in report.graph.edges if e.target not in report.loop]
    assert sorted(held) == ["._tensor", "._tensor_awaitable"]
    assert "closure cell 'self'" in report.summary()


def test_views_of_one_storage_counted_once():
    def make():
        base = torch.zeros(1000)
        a, b = Node(base[:10]), Node(base[500:])
        a.other, b.other = b, a
    report, = watched(make).reports
    assert report.nbytes == 4000


def test_cycle_through_a_dict_and_a_list():
    def make():
        box, shelf = {}, []
        box["shelf"] = shelf
        shelf.append(box)
        shelf.append(torch.ones(8, dtype=torch.float64))
    report, = watched(make).reports
    assert sorted(n.type_name for n in report.objects) == ["dict", "list"]
    assert sorted(report.labels) == ["['shelf']", "[0]"]
    assert report.nbytes == 64
    assert any(e.label == "[1]" and e.target in report.tensors for e in report.graph.edges)


def test_tensor_held_through_a_list_hanging_off_the_loop():
    def make():
        a, b = Node(None), Node(None)
        a.other, b.other = b, a
        a.tensor = [torch.zeros(4)]           # the list is garbage, but in no loop
    report, = watched(make).reports
    assert report.labels == [".other", ".other"]
    assert [report.graph.nodes[k].type_name for k in report.graph.nodes if k not in report.loop] == \
        ["list", "Tensor"]
    assert report.nbytes == 16


def test_cycle_without_a_tensor_is_not_reported():
    def make():
        a, b = Node(None), Node([1, 2, 3])
        a.other, b.other = b, a
    found = watched(make)
    assert len(found) == 0 and found.collections == 1


def test_cycle_through_an_instance_dict():
    def make():
        holder = Node(torch.zeros(16))
        holder.namespace = vars(holder)           # the instance refers to its own __dict__
        keeper = Node(None)
        keeper.other, keeper.me = holder, keeper
        holder.other = keeper.__dict__            # another object's __dict__ closes a loop
    report, = watched(make).reports
    assert sorted(n.type_name for n in report.objects) == ["Node", "Node"]
    assert "dict" not in [n.type_name for n in report.graph.nodes.values()]   # folded
    assert ".other (its __dict__)" in report.labels and ".other" in report.labels
    assert any(e.source == e.target and e.label.startswith(".namespace") for e in report.graph.edges)
    assert report.nbytes == 64


def test_restores_debug_flags_and_garbage_and_stops_after_exit():
    gc.set_debug(0)
    marker = object()
    gc.garbage.append(marker)
    try:
        with cycles.watch_tensor_cycles() as found:
            node_pair()
            gc.collect()
            assert gc.get_debug() == 0
        assert gc.garbage == [marker]
        assert gc.callbacks.count(found._callback) == 0 and sys.getprofile() is None
        node_pair()
        gc.collect()
        assert len(found) == 1 and found.collections == 1
    finally:
        gc.garbage.remove(marker)


def test_restores_state_when_the_body_raises():
    flags = gc.get_debug()
    with pytest.raises(RuntimeError):
        with cycles.watch_tensor_cycles() as found:
            node_pair()
            gc.collect()
            raise RuntimeError("boom")
    assert gc.get_debug() == flags and gc.garbage == []
    assert len(found) == 1


def test_report_is_waiting_after_a_collection_without_python_calls_until_exit():
    with cycles.watch_tensor_cycles() as found:
        node_pair()
        gc.collect()
    assert len(found) == 1 and gc.get_debug() & gc.DEBUG_SAVEALL == 0 and gc.garbage == []


def test_a_collection_that_finds_nothing_costs_no_extra_collection():
    collections = []
    with cycles.watch_tensor_cycles() as found:
        gc.callbacks.append(lambda phase, info: collections.append(phase))
        try:
            gc.collect()
            assert sys.getprofile() is None and gc.get_debug() & gc.DEBUG_SAVEALL == 0
        finally:
            gc.callbacks.pop()
    assert collections == ["start", "stop"] and found.collections == 0


def test_automatic_collections_are_watched_too():
    kept = []
    with cycles.watch_tensor_cycles() as found:
        gc.enable()
        for _ in range(3):
            node_pair(4)
            kept.extend([] for _ in range(3000))  # allocations: the collector runs on its own
    assert len(found) >= 1 and found.collections >= 1
    assert all(r.labels == [".other", ".other"] for r in found)


def test_says_once_that_it_slows_collections(capsys, monkeypatch):
    monkeypatch.setattr(cycles, "_told", set())      # as in a fresh process
    with cycles.watch_tensor_cycles():
        pass
    out, err = capsys.readouterr()
    assert "slower" in out and err == ""
    with cycles.watch_tensor_cycles():
        pass
    assert capsys.readouterr() == ("", ""), "the notice is printed by the first detector only"


def test_a_reported_cycle_is_drawn_offline(monkeypatch, capsys):
    report, = watched(lambda: AwaitableTensorWithViewCallback(AwaitableTensor(10), 5)).reports
    graph = report.to_graph()
    ax = cycles.draw_graph(graph, title=report.title)
    tensor_boxes = [t for t in ax.texts if t.get_text().startswith("Tensor")]
    assert tensor_boxes and tensor_boxes[0].get_bbox_patch().get_facecolor()[:3] == \
        matplotlib.colors.to_rgb(cycles.TENSOR_COLOUR)
    assert {"closure cell 'self'", "cell_contents"} <= {t.get_text() for t in ax.texts}
    monkeypatch.setattr(graphs.shutil, "which", lambda name, path=None: None)
    assert report.show() == "matplotlib"
    assert "Graphviz" in capsys.readouterr().out
    assert "<- cycle" in graph.to_text()


def test_core_works_with_any_tensor_test():
    class FakeTensor:
        pass

    def make():
        a, b = Node(FakeTensor()), Node(None)
        a.other, b.other = b, a

    with cycles.watch_tensor_cycles(tensor_test=lambda o: isinstance(o, FakeTensor)) as found:
        make()
        gc.collect()
    report, = found.reports
    assert report.labels == [".other", ".other"] and report.nbytes == 0


def failing_step():
    big = torch.zeros(32)
    try:
        raise ValueError("step failed")
    except ValueError as exc:
        caught = exc          # caught -> exception -> traceback -> this frame -> caught
    return big.shape, caught is None


def test_frame_cycle_found_without_reading_f_locals():
    gc.set_debug(gc.DEBUG_SAVEALL)        # saving was on already: the detector leaves gc.garbage alone
    try:
        with cycles.watch_tensor_cycles() as found:
            failing_step()
            gc.collect()
        assert gc.get_debug() == gc.DEBUG_SAVEALL
        report, = found.reports
        assert sorted(n.type_name for n in report.objects) == ["ValueError", "frame", "traceback"]
        assert report.nbytes == 128
        frame, = [o for o in gc.garbage if type(o).__name__ == "frame"]
        if sys.version_info < (3, 13):    # reading f_locals there would have left a snapshot dict
            assert not [d for d in gc.get_referents(frame) if isinstance(d, dict) and "caught" in d]
        del frame
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.collect()


def test_summary_shows_each_shape_of_cycle_once_with_a_count():
    def leak_many():
        for _ in range(5):
            node_pair(64)
        AwaitableTensorWithViewCallback(AwaitableTensor(100), 10).wait()

    found = watched(leak_many)
    assert len(found) == 6
    assert len({r.shape for r in found}) == 2
    text = found.summary()
    assert text.startswith("6 reference cycle(s) holding tensors")
    assert text.count("The loop:") == 2
    assert "(and 4 more cycle(s) of the same shape, 2.00 KiB)" in text
    assert "closure cell 'self'" in text


def test_bound_method_stored_on_its_instance_is_a_loop_of_two():
    class Holder:
        def __init__(self):
            self.tensor = torch.zeros(32)
            self.callback = self.run

        def run(self):
            return self.tensor

    found = watched(Holder)
    assert [r.labels for r in found] == [[".callback", "__self__"]]
