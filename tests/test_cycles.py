"""gclab.cycles: the object graph around an object, its labels, and its offline drawing."""
import gc
import os
import stat
import weakref

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from gclab import cycles, graphs  # noqa: E402
from gclab.gcwatch import gc_disabled  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


class Node:
    def __init__(self, name, parent=None):
        self.name = name
        self.tensor = torch.zeros(256)
        self.children = []
        self.parent = parent
        if parent is not None:
            parent.children.append(self)


class Slotted:
    __slots__ = ("payload",)

    def __init__(self, payload):
        self.payload = payload


def _leaked_child_tensor():
    """A parent/child cycle that nothing refers to; returns a weak reference to the child's tensor."""
    root = Node("root")
    child = Node("child", root)
    return weakref.ref(child.tensor)


def _labels(graph):
    return {e.label for e in graph.edges}


def test_back_references_of_a_tensor_in_a_cycle_are_labelled_with_attributes_and_indexes():
    with gc_disabled():
        gc.collect()
        tensor = _leaked_child_tensor()
        graph = cycles.backref_graph(tensor())
        assert [n.type_name for n in graph.roots] == ["Tensor"] and graph.roots[0].is_tensor
        assert sorted(n.type_name for n in graph.nodes.values()) == ["Node", "Node", "Tensor", "list"]
        assert _labels(graph) == {".tensor", ".children", "[0]", ".parent"}
        [cycle] = graph.cycles()
        assert sorted(graph.nodes[k].type_name for k in cycle) == ["Node", "Node", "list"]
        assert {e.label for e in graph.cycle_edges()} == {".children", "[0]", ".parent"}
        assert tensor() is not None, "drawing must not collect the cycle it draws"
        assert not gc.garbage and gc.get_debug() == 0, "debug flags and gc.garbage are restored"
        gc.collect()
        assert tensor() is None, "the graph keeps no object alive"


def test_dict_keys_list_indexes_and_slots_label_references():
    t = torch.ones(3)
    holder = {"weights": [None, Slotted(t)], 7: t}
    graph = cycles.backref_graph(t, max_depth=3)
    assert {"['weights']", "[1]", ".payload", "[7]"} <= _labels(graph)
    del holder


def test_closure_cells_and_bound_methods_are_named():
    class Trainer:
        def __init__(self):
            self.state = torch.zeros(2)
            self.callback = lambda: self.state.sum()
            self.on_step = self.step

        def step(self):
            pass

    trainer = Trainer()
    graph = cycles.ref_graph(trainer)
    labels = _labels(graph)
    assert {".callback", "__closure__", "closure cell 'self'", "cell_contents", ".on_step", "__self__"} <= labels
    assert {"Trainer", "function", "tuple", "cell", "method", "Tensor"} <= {n.type_name for n in graph.nodes.values()}
    assert not graph.find("str") and not graph.find("code"), "plumbing is left out of reference graphs"
    assert len(graph.cycles()) == 1


def test_a_stored_exception_shows_the_frame_local_it_keeps():
    def step():
        batch = torch.zeros(8)
        try:
            raise ValueError("bad batch")
        except ValueError as error:
            log = {"error": error}
        return weakref.ref(batch), log

    with gc_disabled():
        batch, log = step()
        graph = cycles.backref_graph(batch())
        assert "local 'batch'" in _labels(graph)
        assert graph.find("frame")
        del log
        gc.collect()


def test_reference_label_says_when_it_cannot_tell():
    assert cycles.reference_label([1, 2], 3) == ""
    assert cycles.reference_label({"a": 1}, "a") == "key"
    assert cycles.reference_label((0, "x"), "x") == "[1]"


def test_describe_object_is_short():
    assert cycles.describe_object(torch.zeros(4, 4)) == "float32[4x4] cpu, 64 B"
    assert cycles.describe_object([1, 2, 3]) == "3 items"
    assert cycles.describe_object(Node("n")).startswith("at 0x")
    assert len(cycles.describe_object("x" * 200)) <= 40


def test_dot_text_has_labels_tensor_fill_and_red_cycle():
    with gc_disabled():
        tensor = _leaked_child_tensor()
        graph = cycles.backref_graph(tensor())
        dot = graph.to_dot()
        gc.collect()
    assert dot.startswith("digraph ObjectGraph {") and dot.rstrip().endswith("}")
    assert 'label=".parent", color=red' in dot
    assert f'fillcolor="{cycles.TENSOR_COLOUR}"' in dot
    assert dot.count(" -> ") == len(graph.edges)


def test_text_listing_names_every_reference_and_marks_the_cycle():
    with gc_disabled():
        tensor = _leaked_child_tensor()
        text = cycles.backref_graph(tensor()).to_text()
        gc.collect()
    assert "4 objects, 4 references, 1 reference cycle(s)" in text
    assert "#1 Node --.tensor--> #0 Tensor" in text
    assert text.count("<- cycle") == 4       # the header's note and the three cycle edges


def test_matplotlib_drawing_has_a_box_per_object_and_a_label_per_reference():
    with gc_disabled():
        tensor = _leaked_child_tensor()
        graph = cycles.backref_graph(tensor())
        gc.collect()
    ax = cycles.draw_graph(graph)
    texts = [t.get_text() for t in ax.texts]
    assert sum("\n" in t for t in texts) == len(graph.nodes)
    assert {".tensor", ".children", "[0]", ".parent"} <= set(texts)
    assert len(ax.patches) + len([c for c in ax.get_children() if type(c).__name__ == "Annotation"]) >= len(graph.edges)
    ax.figure.canvas.draw()          # renders without error


def _dot_searched_on(monkeypatch, path):
    """`dot` is looked up on the PATH gclab started with (a PATH the graded code sets later is not
    used): make that one `path`."""
    monkeypatch.setattr(graphs, "starting_environment", lambda: {**os.environ, "PATH": path})


def _dot_found_in(monkeypatch, folder):
    _dot_searched_on(monkeypatch, f"{folder}{os.pathsep}{os.environ.get('PATH', '')}")


def test_without_dot_show_graph_says_how_to_install_it_and_draws_with_matplotlib(monkeypatch, capsys):
    _dot_searched_on(monkeypatch, "")
    assert not cycles.dot_available()
    with pytest.raises(FileNotFoundError, match="apt-get install graphviz"):
        cycles.render_png(cycles.ObjectGraph("refs"))
    with gc_disabled():
        tensor = _leaked_child_tensor()
        renderer = cycles.show_graph(cycles.backref_graph(tensor()))
        gc.collect()
    out = capsys.readouterr().out
    assert renderer == "matplotlib"
    for hint in ("conda install -c conda-forge graphviz", "apt-get install graphviz", "brew install graphviz"):
        assert hint in out
    assert "#1 Node --.tensor--> #0 Tensor" in out
    assert plt.get_fignums(), "a matplotlib figure was drawn"


def test_a_dot_put_on_path_after_gclab_started_is_not_run(monkeypatch, tmp_path):
    planted = tmp_path / "dot"
    planted.write_text(f"#!/bin/sh\ntouch {tmp_path}/ran\n")
    planted.chmod(planted.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    assert graphs._dot() != str(planted)
    if cycles.dot_available():
        cycles.render_png(cycles.backref_graph(torch.zeros(1)))
    assert not (tmp_path / "ran").exists()


def test_with_dot_show_graph_renders_through_graphviz(monkeypatch, tmp_path, capsys):
    fake_dot = tmp_path / "dot"          # records its input, answers with PNG magic bytes
    fake_dot.write_text(f"#!/bin/sh\ncat > {tmp_path}/input.dot\nprintf '\\211PNG'\n")
    fake_dot.chmod(fake_dot.stat().st_mode | stat.S_IEXEC)
    _dot_found_in(monkeypatch, tmp_path)
    with gc_disabled():
        tensor = _leaked_child_tensor()
        graph = cycles.backref_graph(tensor())
        assert cycles.render_png(graph) == b"\x89PNG"
        assert cycles.show_graph(graph, text=False) == "graphviz"
        gc.collect()
    assert (tmp_path / "input.dot").read_text() == graph.to_dot()
    assert "not installed" not in capsys.readouterr().out


def test_garbage_by_type_counts_what_a_collection_finds_and_frees_it():
    with gc_disabled():
        gc.collect()
        tensor = _leaked_child_tensor()
        found = cycles.garbage_by_type()
        assert found["Node"] == 2 and found["Tensor"] == 2 and found["list"] == 2
        assert tensor() is None, "what was found is freed"
        assert not gc.garbage and gc.get_debug() == 0
        assert not cycles.garbage_by_type(), "nothing left the second time"


def test_when_dot_fails_show_graph_falls_back_to_matplotlib(monkeypatch, tmp_path, capsys):
    broken_dot = tmp_path / "dot"
    broken_dot.write_text("#!/bin/sh\necho 'syntax error' >&2\nexit 1\n")
    broken_dot.chmod(broken_dot.stat().st_mode | stat.S_IEXEC)
    _dot_found_in(monkeypatch, tmp_path)
    assert cycles.show_graph(cycles.ref_graph([torch.zeros(1)]), text=False) == "matplotlib"
    assert "dot could not draw the graph (dot failed: syntax error)" in capsys.readouterr().out


def test_an_instance_dict_is_folded_into_its_instance_as_on_every_python_version():
    with gc_disabled():
        root = Node("root")
        child = Node("child", root)
        vars(root), vars(child)           # 3.11+ create the dict only when asked; 3.10 always has it
        tensor = weakref.ref(child.tensor)
        del root, child
        graph = cycles.backref_graph(tensor())
        assert sorted(n.type_name for n in graph.nodes.values()) == ["Node", "Node", "Tensor", "list"]
        assert _labels(graph) == {".tensor", ".children", "[0]", ".parent"}
        gc.collect()


def test_assert_no_garbage_counts_what_a_collection_finds():
    from gclab.cycles import assert_no_garbage
    gc.collect()
    assert_no_garbage()

    class Node:
        pass
    was = gc.isenabled()
    gc.disable()
    try:
        a, b = Node(), Node()
        a.other, b.other = b, a
        del a, b
        with pytest.raises(AssertionError, match=r"found \d+ objects in cycles \(.*2 Node.*\): a node refers"):
            assert_no_garbage("a node refers to another")
    finally:
        if was:
            gc.enable()
    assert_no_garbage()
