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
