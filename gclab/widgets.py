"""Controls a learner moves to redraw a figure (core ipywidgets, 7.7 on Colab and 8.x).

The figure is shown through an IPython display handle that each change updates, so
the picture for the controls' current values is always in the notebook's output:
where widgets cannot render (nbconvert, CI, a viewer on GitHub) the static figure
is what a reader sees.
"""
from __future__ import annotations

from matplotlib.figure import Figure

__all__ = ["Explorer"]


class Explorer:
    """`draw(ax, **values)` redrawn whenever one of `controls` (name -> widget) changes.

    `draw` returns whatever it measured or computed (kept as `.data`) so that a test
    can drive the controls through `.set(...)` and assert on what changed.
    """

    def __init__(self, draw, figsize=(9, 3.5), **controls):
        self.draw = draw
        self.controls = controls
        # not a pyplot figure: the inline backend would show it a second time
        self.figure = Figure(figsize=figsize, layout="constrained")
        self.ax = self.figure.add_subplot()
        self.data = None
        self.redraws = 0
        self._handle = None
        for control in controls.values():
            control.observe(self._changed, names="value")
        self.redraw()

    @property
    def values(self):
        return {name: control.value for name, control in self.controls.items()}

    def set(self, **values):
        """Move controls as a learner would; each change redraws once."""
        for name, value in values.items():
            self.controls[name].value = value
        return self.data

    def redraw(self):
        self.ax.clear()
        self.data = self.draw(self.ax, **self.values)
        self.redraws += 1
        if self._handle is not None:
            self._handle.update(self.figure)

    def _changed(self, _change):
        self.redraw()

    def _ipython_display_(self):
        import ipywidgets
        from IPython.display import display

        display(ipywidgets.HBox(list(self.controls.values())))
        self._handle = display(self.figure, display_id=True)
