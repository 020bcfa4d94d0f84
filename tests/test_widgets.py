"""gclab.widgets: controls that redraw a figure, with the figure always in the output."""
import ipywidgets
import nbclient
import nbformat

from gclab.widgets import Explorer


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
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(
            "%matplotlib inline\nimport ipywidgets\nfrom gclab.widgets import Explorer\n"
            "def draw(ax, n):\n    ax.plot(range(n))\n    return n\n"
            "explorer = Explorer(draw, n=ipywidgets.IntSlider(value=3, min=1, max=10))\nexplorer"),
        nbformat.v4.new_code_cell("explorer.set(n=7)"),
    ])
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=120).execute()
    kinds = [sorted(o.get("data", {})) for o in nb.cells[0].outputs]
    assert ["application/vnd.jupyter.widget-view+json", "text/plain"] in kinds
    assert ["image/png", "text/plain"] in kinds        # the static figure, updated in place
    assert nb.cells[1].outputs[0]["data"]["text/plain"] == "7"
