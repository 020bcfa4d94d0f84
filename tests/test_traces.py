"""gclab.traces: recording a workload, saving and loading it, and the GPU recordings in data/."""
import gzip
import re
from pathlib import Path

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from gclab import traces  # noqa: E402
from gclab.memory import MiB  # noqa: E402
from gclab.plots import plot_allocated_reserved, plot_ratchet, plot_timeline  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "data"
RECORDINGS = sorted(DATA.glob("*.json.gz"))
# what each lesson draws from its recording
LESSON_RUNS = {"00_allocated_vs_reserved.json.gz": ["line_by_line", "without_empty_cache", "with_empty_cache"],
               "03_node_leak_oom.json.gz": ["crash", "ratchet"],
               "04_awaitable_oom.json.gz": ["awaitable"]}


def _two_tensors_then_too_many(mark):
    kept = [torch.zeros(1024)]
    mark("one")
    kept.append(torch.zeros(1024))
    mark("two")
    while True:
        kept.append(torch.zeros(1024))
        mark("")


def test_a_recorded_run_keeps_each_mark_and_ends_at_the_out_of_memory_error():
    run = traces.record(_two_tensors_then_too_many, "grow", device="cpu", budget=8 * 4096)
    assert run.labels[:2] == ["one", "two"] and run.allocated[:2] == [4096, 8192]
    assert run.oom_mark == 8 and run.labels[-1] == "OOM" and "budget" in run.oom
    assert run.reserved == run.allocated           # the CPU meter has no cache
    assert [p.allocated for p in run.timeline] == run.allocated


def test_a_trace_is_saved_small_and_read_back_the_same(tmp_path):
    run = traces.record(_two_tensors_then_too_many, "grow", device="cpu", budget=8 * 4096, note="a test")
    path = tmp_path / "t.json.gz"
    saved = traces.save([run], path, device="cpu", command="pytest")
    back = traces.load(path)
    assert back.provenance == saved.provenance and back.provenance["command"] == "pytest"
    assert back.runs["grow"] == run
    assert not back.recorded_on_gpu and path.stat().st_size < 4096


def test_a_file_that_is_not_a_trace_is_refused_with_its_name(tmp_path):
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="bad.json.gz is not a gclab trace"):
        traces.load(bad)
    newer = tmp_path / "newer.json.gz"
    with gzip.open(newer, "wt") as f:
        f.write('{"provenance": {"format": 99}, "runs": {}}')
    with pytest.raises(ValueError, match="format 99"):
        traces.load(newer)


def test_collections_during_a_recording_are_kept_on_its_clock():
    class Cycle:
        def __init__(self):
            self.me, self.tensor = self, torch.zeros(256)

    def workload(mark):
        for _ in range(3000):
            Cycle()
            mark()
    run = traces.record(workload, "cycles", device="cpu")
    assert run.collections and all(0 <= c.start <= run.seconds[-1] for c in run.collections)


def test_every_lesson_recording_is_in_data():
    assert sorted(p.name for p in RECORDINGS) == sorted(LESSON_RUNS)


@pytest.mark.parametrize("path", RECORDINGS, ids=[p.name for p in RECORDINGS])
def test_each_recording_was_made_on_a_gpu_and_data_readme_gives_its_provenance(path):
    trace = traces.load(path)
    p = trace.provenance
    assert trace.recorded_on_gpu and p["driver"] not in ("", "none", "unknown") and p["cuda"] != "none"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", p["date"]) and p["command"].startswith("python ")
    readme = (DATA / "README.md").read_text()
    assert f"`{path.name}`: {trace.line()}" in readme
    assert path.stat().st_size < 2 * MiB
    assert set(LESSON_RUNS[path.name]) <= set(trace.runs)


@pytest.mark.parametrize("path", RECORDINGS, ids=[p.name for p in RECORDINGS])
def test_each_recording_can_be_drawn_as_its_lesson_draws_it(path):
    trace = traces.load_recorded(path.name)
    for name in LESSON_RUNS[path.name]:
        run = trace.runs[name]
        fig, ax = plt.subplots()
        if path.name.startswith("00"):
            plot_allocated_reserved(run, ax=ax, title=trace.label())
            assert len(ax.lines) == 2
        elif name == "ratchet":
            top, below = plot_ratchet(run, run.collections, ax=ax)
            assert below.lines
        else:
            plot_timeline(run, run.collections, ax=ax)
            assert any(line.get_label() == "out of memory" for line in ax.lines)
        plt.close(fig)


def test_the_gpu_recordings_show_what_the_lessons_say():
    lesson00 = traces.load_recorded("00_allocated_vs_reserved.json.gz").runs
    line = dict(zip(lesson00["line_by_line"].labels, zip(lesson00["line_by_line"].allocated,
                                                         lesson00["line_by_line"].reserved)))
    assert line["del b"] == (1 * MiB, 4 * MiB) and line["empty_cache()"] == (1 * MiB, 2 * MiB)
    assert lesson00["without_empty_cache"].event_counts["segment_alloc"] == 2
    assert lesson00["with_empty_cache"].event_counts["segment_alloc"] == 38
    lesson03 = traces.load_recorded("03_node_leak_oom.json.gz").runs
    assert lesson03["crash"].oom_mark == 95 and lesson03["ratchet"].oom_mark == 8336
    assert "Tried to allocate 2.00 MiB" in lesson03["ratchet"].oom
    lesson04 = traces.load_recorded("04_awaitable_oom.json.gz").runs["awaitable"]
    assert lesson04.oom_mark == 96 and not lesson04.collections
