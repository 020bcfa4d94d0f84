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
