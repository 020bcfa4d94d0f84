"""Controls a learner moves to redraw a figure (core ipywidgets, 7.7 on Colab and 8.x).

* `Explorer`: controls that redraw a figure whenever one of them changes;
* `Gauge`: a live reading of a `gclab.memory.Meter` while a loop runs (a bar and a line of
  text), then the readings drawn as a figure;
* `Picker`: choose one of several configurations, run it, and add its result to a
  comparison that is redrawn.

Each figure is shown through an IPython display handle that each change updates, so
the picture for the current state is always in the notebook's output: where widgets
cannot render (nbconvert, CI, a viewer on GitHub) the static figure is what a reader
sees.  Each can be driven from Python (`Explorer.set`, `Gauge.update`, `Picker.pick`),
as a test does.
"""
from __future__ import annotations

import html
import time
from contextlib import contextmanager

from matplotlib.figure import Figure

__all__ = ["Explorer", "Gauge", "Picker", "saved_without_live_widgets"]

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def saved_without_live_widgets(model, **_):
    """A Jupyter server's pre-save hook (lab/jupyter_server_config.json: `ContentsManager.pre_save_hook`):
    a notebook is saved without the outputs that show a live widget.  Their state lives in the kernel, so a
    notebook reopened without it would show "Error displaying widget: model not found" where each control
    was; every widget here also leaves its figure in the output as a static image, which is kept, so the
    reopened lesson shows that figure alone.  What the open notebook shows is not touched."""
    if model.get("type") != "notebook" or not isinstance(model.get("content"), dict):
        return
    for cell in model["content"].get("cells", []):
        if cell.get("cell_type") == "code" and cell.get("outputs"):
            cell["outputs"] = [output for output in cell["outputs"] if WIDGET_VIEW not in output.get("data", {})]


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


class _Shown:
    """A figure kept in the output through a display handle, updated in place."""

    def _init_figure(self, figsize, **subplots):
        # not a pyplot figure: the inline backend would show it a second time
        self.figure = Figure(figsize=figsize, layout="constrained")
        self.axes = self.figure.subplots(**subplots) if subplots else self.figure.add_subplot()
        self._handle = None

    def _show_figure(self):
        if self._handle is not None:
            self._handle.update(self.figure)

    def _display(self, controls):
        from IPython.display import display

        display(controls)
        self._handle = display(self.figure, display_id=True)


class Gauge(_Shown):
    """Tensor memory while a loop runs: a bar (full at `limit`, a budget) and a line of text,
    updated as the loop calls `update`, and at the end (`finish`) the readings drawn as a figure.

        gauge = Gauge(limit=budget, title="val_losses.append(val_loss)")
        display(gauge)
        with Meter(device, budget=budget) as meter, gauge.following(meter):
            for step in range(steps):
                train_step(step)
                gauge.update(f"step {step}")

    A reading is the meter's growth (bytes above its baseline).  The widgets are updated at most
    every `every` seconds (and always by `finish`), so a fast loop is not slowed by them; the
    figure is drawn once, by `finish` (which `following` calls on the way out, an error included).
    """

    def __init__(self, limit: int | None = None, title: str = "tensor memory", every: float = 0.05,
                 figsize=(9, 2.6), xlabel: str = "reading"):
        import ipywidgets

        self.limit = limit
        self.title = title
        self.xlabel = xlabel
        self.every = every
        self.meter = None
        self.labels: list[str] = []
        self.readings: list[int] = []
        self.note = ""
        self.finished = False
        self._shown_at = float("-inf")
        self.bar = ipywidgets.FloatProgress(value=0.0, min=0.0, max=1.0, description="memory",
                                            bar_style="info")
        self.text = ipywidgets.HTML(value=html.escape(f"{title}: waiting for the first reading"))
        self._init_figure(figsize)
        self.redraw()

    @property
    def data(self) -> list[int]:
        return list(self.readings)

    @contextmanager
    def following(self, meter):
        """Read `meter` on each `update`, and `finish` on the way out (saying what stopped the loop)."""
        self.meter = meter
        try:
            yield self
        except BaseException as exc:
            self.finish(f"stopped by {type(exc).__name__}")
            raise
        self.finish()

    def update(self, label: str = "", value: int | None = None) -> int:
        """Record a reading (`value`, or the meter's growth now) and show it."""
        if value is None:
            if self.meter is None:
                raise ValueError("Gauge.update needs a value, or a meter (Gauge.following(meter))")
            value = self.meter.growth()
        self.labels.append(label)
        self.readings.append(int(value))
        now = time.perf_counter()
        if now - self._shown_at >= self.every:
            self._shown_at = now
            self._show_reading()
        return int(value)

    def _scale(self) -> float:
        return float(self.limit or max(max(self.readings, default=0), 1))

    def _show_reading(self):
        from .memory import format_bytes

        value = self.readings[-1] if self.readings else 0
        scale = self._scale()
        self.bar.max = scale
        self.bar.value = float(min(max(value, 0), scale))
        fraction = value / self.limit if self.limit else None
        self.bar.bar_style = ("danger" if fraction is not None and fraction >= 0.9 else
                              "warning" if fraction is not None and fraction >= 0.5 else "info")
        of = f" of {format_bytes(self.limit)} ({fraction:.0%})" if self.limit else ""
        where = f" after {self.labels[-1]}" if self.labels and self.labels[-1] else ""
        note = f"; {self.note}" if self.note else ""
        self.text.value = html.escape(f"{self.title}: {format_bytes(value)}{of}{where}{note}")

    def finish(self, note: str = "") -> None:
        """Show the last reading and draw every reading as a figure."""
        self.note = note
        self.finished = True
        self._show_reading()
        self.redraw()

    def redraw(self):
        from .memory import MiB

        ax = self.axes
        ax.clear()
        mib = [r / MiB for r in self.readings]
        ax.plot(range(len(mib)), mib, color="tab:red" if self.note else "tab:blue", lw=1.5)
        if self.limit:
            ax.axhline(self.limit / MiB, color="black", ls="--", lw=1, label="budget")
            ax.legend(loc="upper left", fontsize="small")
        ax.set_xlabel(self.xlabel)
        ax.set_ylabel("MiB above the baseline")
        ax.set_ylim(bottom=0, top=max(self._scale() / MiB * 1.05, 1e-3))
        title = self.title + (f" ({self.note})" if self.note else "")
        ax.set_title(title if self.readings else f"{self.title}: no reading yet", fontsize="medium")
        self._show_figure()

    def _ipython_display_(self):
        import ipywidgets

        self._display(ipywidgets.VBox([self.bar, self.text]))


class Picker(_Shown):
    """Choose one of `options` (name -> whatever `run` needs), press the button (or call `pick`):
    `run(name, option)` runs it, its result is added to `results` (name -> list of results, a
    name picked again adds a run to its list) and `draw(axes, results)` redraws the comparison.

    `results` may start with earlier runs (they are compared with the new ones).  `subplots`
    (keyword arguments of `Figure.subplots`) gives `draw` several axes.  While a run goes on the
    button is disabled and the line of text says what runs; then what `describe(name, result)`
    says about the new result, or the error the run raised.
    """

    def __init__(self, options: dict, run, draw, results: dict | None = None, figsize=(9, 3.5),
                 button: str = "Run and add", subplots: dict | None = None, describe=None):
        import ipywidgets

        if not options:
            raise ValueError("a Picker needs at least one option")
        self.options = dict(options)
        self.run = run
        self.draw = draw
        self.describe = describe
        self.results = {name: list(seen) for name, seen in (results or {}).items()}
        self.choice = ipywidgets.Dropdown(options=list(self.options), description="run")
        self.button = ipywidgets.Button(description=button)
        self.status = ipywidgets.HTML(value="")
        self.data = None
        self.redraws = 0
        self.button.on_click(self._clicked)
        self._init_figure(figsize, **(subplots or {}))
        self.redraw()

    def pick(self, name: str | None = None):
        """Run `name` (default: the option chosen in the drop-down), add its result, redraw."""
        if name is not None:
            if name not in self.options:
                raise KeyError(f"no option {name!r}; the options are {', '.join(self.options)}")
            self.choice.value = name
        name = self.choice.value
        self.button.disabled = True
        self.status.value = html.escape(f"running {name} ...")
        try:
            result = self.run(name, self.options[name])
        except Exception as exc:
            self.status.value = html.escape(f"{name}: {type(exc).__name__}: {exc}")
            raise
        finally:
            self.button.disabled = False
        self.results.setdefault(name, []).append(result)
        said = f": {self.describe(name, result)}" if self.describe is not None else ""
        self.status.value = html.escape(f"added {name} (run {len(self.results[name])} of it){said}")
        self.redraw()
        return result

    def _clicked(self, _button):
        try:
            self.pick()
        except Exception:        # said in the status line; a click must not raise into the front end
            pass

    def redraw(self):
        for ax in self.figure.axes:
            ax.clear()
        self.data = self.draw(self.axes, self.results)
        self.redraws += 1
        self._show_figure()

    def _ipython_display_(self):
        import ipywidgets

        self._display(ipywidgets.VBox([ipywidgets.HBox([self.choice, self.button]), self.status]))
