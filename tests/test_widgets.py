"""gclab.widgets: controls that redraw a figure, a live memory gauge and a picker that adds runs to a
comparison, each with its figure always in the output, each driven here through its Python API."""
import ipywidgets
import nbclient
import nbformat
import pytest

from gclab.widgets import Explorer, Gauge, Picker


def executed(*sources):
    """A notebook of these code cells, run top to bottom in a kernel with no frontend."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in sources])
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=120).execute()
    return nb


def _line(ax, points, slope):
    ys = [slope * i for i in range(points)]
    ax.plot(ys)
    return ys


def test_moving_a_control_redraws_with_its_value():
    explorer = Explorer(_line, points=ipywidgets.IntSlider(value=3, min=1, max=10),
                        slope=ipywidgets.FloatSlider(value=1.0, min=0, max=5))
    assert explorer.data == [0.0, 1.0, 2.0]
    explorer.set(points=4, slope=2.0)
    assert explorer.data == [0.0, 2.0, 4.0, 6.0]
    assert list(explorer.ax.get_lines()[0].get_ydata()) == [0.0, 2.0, 4.0, 6.0]
    assert explorer.redraws == 3                       # once at start, once per change


def test_a_notebook_run_without_a_frontend_keeps_the_figure_for_the_last_values():
    nb = executed(
        "%matplotlib inline\nimport ipywidgets\nfrom gclab.widgets import Explorer\n"
        "def draw(ax, n):\n    ax.plot(range(n))\n    return n\n"
        "explorer = Explorer(draw, n=ipywidgets.IntSlider(value=3, min=1, max=10))\nexplorer",
        "explorer.set(n=7)")
    kinds = [sorted(o.get("data", {})) for o in nb.cells[0].outputs]
    assert ["application/vnd.jupyter.widget-view+json", "text/plain"] in kinds
    assert ["image/png", "text/plain"] in kinds        # the static figure, updated in place
    assert nb.cells[1].outputs[0]["data"]["text/plain"] == "7"


# -- Gauge ------------------------------------------------------------------------------
class _FakeMeter:
    def __init__(self):
        self.bytes = 0

    def growth(self):
        return self.bytes


def test_gauge_follows_a_meter_and_draws_its_readings_at_the_end():
    gauge = Gauge(limit=4096, title="kept losses", every=0)
    meter = _FakeMeter()
    with gauge.following(meter):
        for step in range(3):
            meter.bytes += 1024
            gauge.update(f"step {step}")
            assert gauge.bar.value == meter.bytes               # the bar moves with every reading
    assert gauge.data == [1024, 2048, 3072]
    assert gauge.bar.max == 4096 and gauge.bar.bar_style == "warning"   # past half the budget
    assert "3.00 KiB of 4.00 KiB (75%) after step 2" in gauge.text.value
    assert list(gauge.axes.get_lines()[0].get_ydata() * 2**20) == [1024, 2048, 3072]
    assert gauge.finished


def test_gauge_says_what_stopped_the_loop_and_keeps_the_readings():
    gauge = Gauge(limit=1000, every=0)
    try:
        with gauge.following(_FakeMeter()):
            gauge.update("step 0", value=950)
            raise MemoryError("over budget")
    except MemoryError:
        pass
    assert gauge.note == "stopped by MemoryError" and "stopped by MemoryError" in gauge.text.value
    assert gauge.bar.bar_style == "danger"
    assert "stopped by MemoryError" in gauge.axes.get_title()


def test_gauge_without_a_limit_scales_to_its_largest_reading_and_throttles_the_widgets():
    gauge = Gauge(every=3600)                 # the widgets show the first reading, then wait
    gauge.update("a", value=10)
    gauge.update("b", value=40)
    assert gauge.bar.value == 10 and gauge.data == [10, 40]
    gauge.finish()
    assert gauge.bar.max == 40 and gauge.bar.value == 40


def test_gauge_needs_a_value_or_a_meter():
    with pytest.raises(ValueError, match="needs a value"):
        Gauge().update("step 0")


# -- Picker -----------------------------------------------------------------------------
def _bars(ax, results):
    names = list(results)
    means = [sum(seen) / len(seen) for seen in results.values()]
    ax.bar(names, means)
    return dict(zip(names, means))


def test_picking_an_option_runs_it_and_adds_it_to_the_comparison():
    ran = []

    def run(name, option):
        ran.append(name)
        return option * 10

    picker = Picker({"one": 1, "two": 2}, run, _bars, results={"earlier": [5]},
                    describe=lambda name, result: f"{name} gave {result}")
    assert picker.data == {"earlier": 5} and picker.redraws == 1
    assert picker.pick("two") == 20
    assert ran == ["two"] and picker.choice.value == "two"
    assert picker.data == {"earlier": 5, "two": 20}
    assert [p.get_height() for p in picker.axes.patches] == [5, 20]
    picker.choice.value = "one"                # the drop-down, then the button, as a learner does
    picker.button.click()
    assert picker.data == {"earlier": 5, "two": 20, "one": 10}
    picker.pick("two")                         # picked again: a second run of the same option
    assert picker.results["two"] == [20, 20] and picker.status.value == "added two (run 2 of it): two gave 20"
    assert not picker.button.disabled


def test_a_failed_run_is_said_in_the_status_line_and_changes_nothing():
    def run(name, option):
        raise FileNotFoundError("my_policy.py")

    picker = Picker({"yours": None}, run, _bars)
    picker.button.click()                      # a click does not raise into the front end
    assert "FileNotFoundError: my_policy.py" in picker.status.value
    assert picker.results == {} and not picker.button.disabled
    with pytest.raises(FileNotFoundError):
        picker.pick()
    with pytest.raises(KeyError, match="no option 'other'"):
        picker.pick("other")


def test_a_picker_can_draw_on_several_axes():
    def draw(axes, results):
        left, right = axes
        left.plot([len(results)])
        right.plot([0])
        return len(results)

    picker = Picker({"a": 1}, lambda name, option: option, draw, subplots=dict(ncols=2))
    picker.pick("a")
    assert picker.data == 1 and len(picker.figure.axes) == 2


def test_gauge_and_picker_in_a_notebook_run_without_a_frontend_keep_their_figures():
    nb = executed(
        "%matplotlib inline\nfrom gclab.widgets import Gauge, Picker\ngauge = Gauge(limit=100, every=0)\ngauge",
        "with gauge.following(None):\n    for i in range(5):\n        gauge.update(f'step {i}', value=20 * i)\n"
        "gauge.data",
        "def draw(ax, results):\n    ax.bar(list(results), [len(v) for v in results.values()])\n"
        "    return sorted(results)\n"
        "picker = Picker({'a': 1, 'b': 2}, lambda name, option: option, draw)\npicker",
        "picker.pick('b')\npicker.data")
    for cell in (nb.cells[0], nb.cells[2]):
        kinds = [sorted(o.get("data", {})) for o in cell.outputs]
        assert ["application/vnd.jupyter.widget-view+json", "text/plain"] in kinds
        assert ["image/png", "text/plain"] in kinds          # the static figure, updated in place
    assert nb.cells[1].outputs[0]["data"]["text/plain"] == "[0, 20, 40, 60, 80]"
    assert nb.cells[3].outputs[0]["data"]["text/plain"] == "['b']"
