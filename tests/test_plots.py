"""gclab.plots draws what the meter and the watcher recorded."""
import gc

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from gclab.gcwatch import GCWatch  # noqa: E402
from gclab.memory import MiB, Meter  # noqa: E402
from gclab.plots import plot_timeline  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_timeline_shows_memory_budget_collections_and_the_oom():
    kept = []
    with Meter("cpu", budget=MiB) as meter, GCWatch() as watch:
        try:
            for i in range(10):
                kept.append(torch.zeros(64 * 1024))        # 256 KiB each: the 4th passes 1 MiB
                if i == 1:
                    gc.collect()
                meter.record(f"step {i}")
        except torch.OutOfMemoryError:
            meter.record("OOM")
    ax = plot_timeline(meter, watch.collections)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["live tensor memory", "simulated budget", "gen 2 collection", "out of memory"]
    memory_line = ax.get_lines()[0]
    assert list(memory_line.get_ydata()) == [0.25, 0.5, 0.75, 1.0, 1.0]
    collection_line = next(line for line in ax.get_lines() if line.get_label() == "gen 2 collection")
    assert collection_line.get_xdata()[0] == pytest.approx(0.5)   # after step 0 was recorded, before step 1


def test_flat_zero_timeline_is_drawn_above_the_axis():
    with Meter("cpu") as meter:
        for _ in range(3):
            meter.record()
    ax = plot_timeline(meter, title="flat")
    assert ax.get_ylim()[0] < 0 < ax.get_ylim()[1]
    assert ax.get_title() == "flat"


def _load_and_trace():
    from gclab.gcwatch import Collection
    from gclab.serving import LoadResult, Trace
    load = LoadResult(scheduled=[0.0, 0.001, 0.010], sent=[0.0, 0.001, 0.010],
                      done=[0.004, 0.006, 0.012], status=[200, 200, 200])
    trace = Trace(requests=[(0, 0.0005, 0.004), (1, 0.003, 0.006), (2, 0.0101, 0.012)],
                  collections=[Collection(2, 0.001, 0.002, 10, 0), Collection(0, 0.011, 0.0001, 0, 0)])
    return load, trace


def test_latency_plot_has_one_bar_group_per_percentile_and_the_budget():
    from gclab.plots import plot_latency
    load, _ = _load_and_trace()
    ax = plot_latency({"default": load, "frozen": load}, budget_ms=5.0)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["P50", "P95", "P99", "max"]
    assert len(ax.patches) == 8
    assert max(p.get_height() for p in ax.patches) == pytest.approx(5.0)   # request 1: due at 1 ms, done at 6
    assert "P99 budget" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_request_timeline_stacks_overlapping_requests_and_marks_collections():
    from gclab.plots import _lanes, plot_requests
    assert _lanes([(0, 4), (3, 6), (5, 7), (10, 12)]) == [0, 1, 0, 0]
    load, trace = _load_and_trace()
    ax = plot_requests(trace, load)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["gen 2 collection", "gen 0 collection"]
    lanes = sorted({line.get_ydata()[0] for line in ax.get_lines()})
    assert lanes == [0, 1], "the two requests in flight together get two lanes"
    waiting = [line for line in ax.get_lines() if line.get_alpha() == 0.3]
    assert len(waiting) == 3, "each request waited between its due time and the server's start"


def _ratchet_run(stranded_per_stretch=1, stretches=3, steps=4):
    """A timeline with a known floor: per step one 256 KiB tensor of garbage; a gen 0 collection
    (explicit) at the end of each stretch frees all but `stranded_per_stretch` of them, and they stay."""
    from gclab.gcwatch import gc_disabled
    held, stranded = [], []
    with gc_disabled(), Meter("cpu") as meter, GCWatch() as watch:
        for stretch in range(stretches):
            for _ in range(steps):
                held.append(torch.zeros(64 * 1024))
                meter.record()
            stranded += held[:stranded_per_stretch]
            held.clear()
            gc.collect(1)
    return meter, watch.collections, stranded


def test_held_after_collections_reads_the_point_after_each_collection():
    from gclab.plots import held_after_collections
    meter, collections, _ = _ratchet_run()
    held = held_after_collections(meter, collections)
    assert [g for _, _, g in held] == [1, 1]            # the last collection came after the last point
    assert [x for x, _, _ in held] == [3.5, 7.5]
    assert [b / MiB for _, b, _ in held] == [0.5, 0.75]  # 1 stranded + the new step's, then 2 + 1


def test_ratchet_plot_has_a_floor_panel_under_the_timeline():
    from gclab.plots import plot_ratchet
    meter, collections, _ = _ratchet_run(stranded_per_stretch=2)
    top, below = plot_ratchet(meter, collections, title="ratchet")
    assert top.figure is below.figure and len(top.figure.axes) == 2
    assert below.get_shared_x_axes().joined(top, below)
    floor = next(line for line in below.get_lines() if line.get_label().startswith("floor"))
    assert list(floor.get_ydata()) == [0.0, 0.75, 1.25, 1.25]
    assert "gen 1 collection" in [t.get_text() for t in top.get_legend().get_texts()]


def test_a_redrawn_ratchet_figure_keeps_two_panels_and_shows_the_new_values():
    """As lesson 03's explorer uses it: Explorer clears its Axes and calls plot_ratchet again."""
    import ipywidgets
    from gclab.plots import held_after_collections, plot_ratchet
    from gclab.widgets import Explorer

    def draw(ax, stranded):
        meter, collections, _ = _ratchet_run(stranded_per_stretch=stranded)
        _, below = plot_ratchet(meter, collections, ax=ax)
        return [b for _, b, _ in held_after_collections(meter, collections)], below

    explorer = Explorer(draw, stranded=ipywidgets.IntSlider(value=1, min=0, max=3))
    floors, below = explorer.data
    explorer.set(stranded=3)
    new_floors, new_below = explorer.data
    assert new_below is below and len(explorer.figure.axes) == 2, "the lower panel is reused, not stacked"
    assert new_floors != floors and new_floors[-1] > floors[-1]
    floor = next(line for line in new_below.get_lines() if line.get_label().startswith("floor"))
    assert max(floor.get_ydata()) == new_floors[-1] / MiB


def test_floors_of_several_runs_ring_the_full_collections():
    from gclab.gcwatch import Collection
    from gclab.plots import plot_floors
    meter, collections, _ = _ratchet_run()
    full = [Collection(2, c.start, c.duration, c.collected, 0) for c in collections]
    ax = plot_floors({"kept": (meter, collections), "collected": (meter, full)})
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["kept", "collected", "full collection"]
    rings = [line for line in ax.get_lines() if line.get_label() == "full collection"]
    assert len(rings) == 1 and len(rings[0].get_xdata()) == 2


def test_the_out_of_memory_cross_sits_at_the_budget():
    with Meter("cpu", budget=MiB) as meter:
        meter.record()
        meter.record("OOM")                           # as recorded after an error, once memory was freed
    ax = plot_timeline(meter)
    cross = next(line for line in ax.get_lines() if line.get_label() == "out of memory")
    assert list(cross.get_ydata()) == [1.0]


def test_timeline_draws_memory_held_above_the_meters_start_as_its_budget_counts():
    """On CUDA a meter reads the whole device (the data and models of earlier cells too), from its
    `baseline`; the budget counts from the meter's start: the line must too, or it would cross the
    budget long before memory ran out."""
    import types
    from gclab.memory import MeterPoint
    points = [MeterPoint(f"step {i}", float(i), 10 * MiB + i * MiB) for i in range(3)]
    meter = types.SimpleNamespace(timeline=points, baseline=10 * MiB, budget=2 * MiB, simulated=False, started=0.0,
                                  device=torch.device("cuda", 0))
    ax = plot_timeline(meter)
    assert list(ax.get_lines()[0].get_ydata()) == [0.0, 1.0, 2.0]


# -- the figures lessons draw through gclab (named for what they show, not for a lesson) ----------------
def _meter_with(sizes, label_last=None):
    kept = []
    with Meter("cpu") as meter:
        for i, numel in enumerate(sizes):
            kept.append(torch.zeros(numel))
            meter.record(label_last if label_last and i == len(sizes) - 1 else f"step {i}")
    return meter


def test_runs_side_by_side_mark_an_out_of_memory_end_and_the_budget():
    from gclab.plots import plot_counts, plot_held_by_run
    runs = {"kept": _meter_with([256 * 1024] * 3), "ran out": _meter_with([256 * 1024] * 2, label_last="OOM")}
    ax, colours = plot_held_by_run(runs, budget=2 * MiB, simulated=True, xticks=["a", "b", "c"])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["kept", "ran out", "simulated budget"]
    assert list(ax.get_lines()[0].get_ydata()) == [1.0, 2.0, 3.0]
    crosses = [line for line in ax.get_lines() if line.get_marker() == "x"]
    assert len(crosses) == 1 and crosses[0].get_color() == colours["ran out"]
    counts = plot_counts({"kept": [1, 1, 2], "ran out": [1, 2]})
    assert [list(line.get_ydata()) for line in counts.get_lines()] == [[1, 1, 2], [1, 2]]


def test_collector_counts_draw_both_thresholds_and_each_collection():
    from gclab.plots import plot_collector_counts, plot_durations
    from types import SimpleNamespace
    collections = [SimpleNamespace(generation=0, start=1.5), SimpleNamespace(generation=1, start=2.5)]
    fig = plot_collector_counts(([1, 2, 0, 1], [0, 0, 1, 1], [0, 0, 0, 0]), [1, 2, 3, 4], collections, (2, 10))
    top, bottom = fig.axes
    assert [t.get_text() for t in top.get_legend().get_texts()] == [
        "generation 0 count", "first threshold (2)", "gen 0 collection", "gen 1 collection"]
    assert sum(line.get_xdata()[0] == 1 for line in bottom.get_lines()) == 1     # the first collection, at x=1
    ax = plot_durations({"full": 5000.0, "young": 12.5})
    assert [t.get_text() for t in ax.texts] == ["5,000 µs", "12.5 µs"] and ax.get_yscale() == "log"


def test_panels_pairs_readings_and_time_and_peak():
    from gclab.plots import plot_paired_bars, plot_panels, plot_readings, plot_time_and_peak
    fig = plot_panels({"a": [1, 2, 3], "b": [0, 4, 1]}, last_label="after gc.collect()")
    assert len(fig.axes) == 2 and list(fig.axes[1].get_lines()[1].get_ydata()) == [1]
    ax = plot_paired_bars(["x(1)", "y"], ("left", [10, 20], "red"), ("right", [1, 2], "green"),
                          annotate_second=lambda v: f"{v} B")
    assert len(ax.patches) == 4 and [t.get_text() for t in ax.texts] == ["1 B", "2 B"]
    ax = plot_readings(["start", "x = ones"], {"live": ([0, MiB], None)})
    assert list(ax.get_lines()[0].get_ydata()) == [0.0, 1.0]
    fig = plot_time_and_peak({"never": (1.0, 3 * MiB, True), "every 10": (2.0, MiB, False)}, budget=2 * MiB)
    assert [t.get_text() for t in fig.axes[1].texts] == ["OOM"]
