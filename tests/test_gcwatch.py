"""Tests for gclab.gcwatch: collections seen through gc.callbacks, and gc_disabled."""
from __future__ import annotations

import gc
import itertools

import sys

import pytest

from gclab.gcwatch import (Collection, GCWatch, collector_design, gc_disabled, generation_size,
                           oldest_generation)


class Node:
    def __init__(self):
        self.other = None


def make_cycles(n: int) -> None:
    """Create `n` unreachable two-object cycles."""
    for _ in range(n):
        a, b = Node(), Node()
        a.other, b.other = b, a


def test_explicit_collections_are_recorded_with_their_generation():
    with gc_disabled():
        with GCWatch() as watch:
            gc.collect(0)
            gc.collect(1)
            gc.collect(2)
            gc.collect()
    assert [c.generation for c in watch.collections] == [0, 1, 2, 2]
    assert all(c.duration > 0 for c in watch.collections)
    assert all(c.start >= watch.started for c in watch.collections)
    starts = [c.start for c in watch.collections]
    assert starts == sorted(starts)


def test_collection_times_come_from_the_given_clock():
    ticks = itertools.count(10)                       # 10, 11, 12, ...
    with gc_disabled():
        with GCWatch(clock=lambda: next(ticks)) as watch:
            gc.collect(0)
            gc.collect(1)
    assert watch.started == 10
    assert watch.collections[0].start == 11 and watch.collections[0].duration == 1
    assert watch.collections[1].start == 13 and watch.collections[1].duration == 1


def test_collected_counts_the_unreachable_cyclic_objects():
    with gc_disabled():
        make_cycles(100)          # with gc off, they all stay in the youngest generation
        with GCWatch() as watch:
            found = gc.collect(0)
    (collection,) = watch.collections
    assert collection.collected >= 200
    assert collection.collected == found
    assert collection.uncollectable == 0


def test_a_collection_with_nothing_to_free_collects_nothing():
    with gc_disabled():
        gc.collect(0)
        with GCWatch() as watch:
            gc.collect(0)
    assert watch.collections[0].collected == 0


def test_automatic_collections_are_recorded_when_gc_is_enabled():
    gc.enable()
    with GCWatch() as watch:
        make_cycles(5000)                             # 10000 tracked objects: many gen-0 runs
    assert watch.count() >= 5
    assert watch.count(0) >= 1
    assert {c.generation for c in watch.collections} <= {0, 1, 2}
    assert sum(c.collected for c in watch.collections) > 0


def test_no_automatic_collection_is_recorded_while_gc_is_disabled():
    with gc_disabled():
        with GCWatch() as watch:
            make_cycles(5000)
    assert watch.collections == []


def test_nothing_is_recorded_after_exit():
    with gc_disabled():
        with GCWatch() as watch:
            gc.collect(0)
        assert watch._on_gc not in gc.callbacks
        gc.collect(0)
        gc.collect(1)
    assert len(watch.collections) == 1


def test_callback_is_removed_when_the_block_raises():
    callbacks_before = list(gc.callbacks)
    with pytest.raises(ZeroDivisionError):
        with GCWatch():
            1 / 0
    assert gc.callbacks == callbacks_before


def test_nested_watches_both_record():
    with gc_disabled():
        with GCWatch() as outer:
            gc.collect(0)
            with GCWatch() as inner:
                gc.collect(1)
    assert [c.generation for c in outer.collections] == [0, 1]
    assert [c.generation for c in inner.collections] == [1]


def _watch_with(*collections):
    watch = GCWatch()
    watch.collections.extend(collections)
    return watch


def test_count_by_generation():
    watch = _watch_with(Collection(0, 0.0, 0.001, 1, 0), Collection(0, 1.0, 0.001, 1, 0),
                        Collection(2, 2.0, 0.002, 1, 0))
    assert watch.count() == 3
    assert watch.count(0) == 2
    assert watch.count(1) == 0
    assert watch.count(2) == 1


def test_total_and_longest_pause():
    watch = _watch_with(Collection(0, 0.0, 0.001, 5, 0), Collection(1, 1.0, 0.004, 0, 0),
                        Collection(0, 2.0, 0.002, 7, 0))
    assert watch.total_pause() == pytest.approx(0.007)
    assert watch.longest_pause() == 0.004


def test_pauses_of_an_empty_watch_are_zero():
    watch = GCWatch()
    assert watch.count() == 0
    assert watch.total_pause() == 0
    assert watch.longest_pause() == 0.0


def test_summary_gives_counts_by_generation_pauses_and_objects_freed():
    watch = _watch_with(Collection(0, 0.0, 0.001, 5, 0), Collection(2, 1.0, 0.002, 0, 0),
                        Collection(0, 2.0, 0.001, 7, 0))
    assert watch.summary() == ("3 collections (gen 0: 2, gen 2: 1); 4.0 ms in total, "
                               "longest 2.00 ms; 12 objects freed")
    assert GCWatch().summary() == "no collections"


def test_summary_of_real_collections_mentions_them():
    with gc_disabled():
        make_cycles(10)
        with GCWatch() as watch:
            gc.collect(0)
    assert watch.summary().startswith("1 collections (gen 0: 1)")
    assert "objects freed" in watch.summary()


@pytest.mark.parametrize("start, end, expected", [
    (0.0, 1.2, True),      # the window ends during the collection
    (1.2, 1.3, True),      # the window lies inside the collection
    (1.4, 3.0, True),      # the window starts during the collection
    (0.0, 3.0, True),      # the window contains the collection
    (0.0, 1.0, False),     # ends the instant it starts
    (1.5, 2.0, False),     # starts the instant it ends
    (0.0, 0.5, False),     # entirely before
    (1.6, 2.0, False),     # entirely after
])
def test_collection_overlaps_a_time_window(start, end, expected):
    collection = Collection(generation=0, start=1.0, duration=0.5, collected=0, uncollectable=0)
    assert collection.overlaps(start, end) is expected


def test_gc_disabled_turns_gc_off_and_restores_it_on():
    gc.enable()
    with gc_disabled():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_gc_disabled_leaves_gc_off_when_it_was_off():
    gc.disable()
    with gc_disabled():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_gc_disabled_restores_the_state_when_the_block_raises():
    gc.enable()
    with pytest.raises(KeyError):
        with gc_disabled():
            raise KeyError("x")
    assert gc.isenabled()



# -- survivors, the quarter rule, the collector's design -------------------------------------
def test_survivors_count_what_each_collection_moved_up():
    with gc_disabled():
        gc.collect()
        kept = [[] for _ in range(50)]          # alive: survive
        make_cycles(20)                        # garbage: 40 objects found unreachable
        with GCWatch(count_survivors=True) as watch:
            gc.collect(0)
    (collection,) = watch.collections
    assert collection.collected >= 40
    assert watch.survivors[0] >= len(kept) + 1   # the lists and the list holding them
    assert len(watch.survivors) == len(watch.collections)


def test_survivors_are_only_counted_when_asked():
    with gc_disabled():
        with GCWatch() as watch:
            gc.collect(0)
    assert watch.survivors == []
    with pytest.raises(ValueError, match="count_survivors"):
        watch.survived_into_oldest()


def test_survived_into_oldest_adds_the_generation_1_survivors_since_the_last_full_collection():
    watch = GCWatch(count_survivors=True)
    watch.collections.extend([Collection(1, 0.0, 0.001, 0, 0), Collection(2, 1.0, 0.001, 0, 0),
                              Collection(0, 2.0, 0.001, 0, 0), Collection(1, 3.0, 0.001, 0, 0),
                              Collection(1, 4.0, 0.001, 0, 0)])
    watch.survivors.extend([100, 5000, 7, 30, 12])
    assert watch.survived_into_oldest() == 42    # after the full one, gen 0's survivors went to gen 1


class Pair:
    def __init__(self):
        self.other = None


def _leaky_steps(n):
    """Each step links a pair into a cycle, then allocates while it is in use (as lesson 03's step does);
    the previous pair stays bound to `a` and `b` until the next one is made, so a collection may see two."""
    for _ in range(n):
        a, b = Pair(), Pair()
        a.other, b.other = b, a
        scratch = [[] for _ in range(8)]       # the step's work: objects alive while the pair is in use
        del scratch


def _steps_for(older_collections):
    """Enough steps for `older_collections` generation-1 collections (counted, not guessed: what a
    step leaves for the collector differs between versions)."""
    with gc_disabled():
        gc.collect()
        _leaky_steps(100)
        per_step = gc.get_count()[0] / 100
    gc.collect()
    threshold0, threshold1, _ = gc.get_threshold()
    return int(1.3 * older_collections * (threshold1 + 1) * threshold0 / per_step)


def _pairs_in(generation):
    return sum(type(o) is Pair for o in gc.get_objects(generation=generation)) // 2


@pytest.mark.skipif(not collector_design().quarter_rule, reason="needs CPython's generational collector")
def test_pairs_in_use_during_generation_1_collections_are_stranded_in_the_oldest_generation():
    """The ratchet, on the running interpreter: a large long-lived heap, generation-1 collections
    past the oldest generation's threshold, and no full collection; one pair stranded per collection."""
    gc.enable()
    steps = _steps_for(gc.get_threshold()[2] + 2)
    long_lived = [[i] for i in range(150_000)]  # a large heap, moved to the oldest generation by the next line
    gc.collect()
    threshold2 = gc.get_threshold()[2]
    with GCWatch(count_survivors=True) as watch:
        _leaky_steps(steps)
    older = watch.count(1)
    assert older > threshold2, "the count rule alone would have run a full collection"
    assert watch.count(2) == 0
    assert watch.survived_into_oldest() < generation_size(2) / 4
    assert _pairs_in(2) >= older - 1, f"{_pairs_in(2)} pairs stranded after {older} generation-1 collections"
    gc.collect()
    assert _pairs_in(2) == 0, "a full collection frees them all"
    del long_lived


@pytest.mark.skipif(not collector_design().quarter_rule, reason="needs CPython's generational collector")
def test_with_a_small_oldest_generation_a_full_collection_comes_and_frees_them():
    gc.enable()
    steps = _steps_for(gc.get_threshold()[2] + 2)
    gc.collect()
    gc.freeze()                                # the oldest generation: nearly empty
    try:
        gc.collect()
        with GCWatch(count_survivors=True) as watch:
            _leaky_steps(steps)
        assert watch.count(2) >= 1
        last_full = max(i for i, c in enumerate(watch.collections) if c.generation == 2)
        since = sum(c.generation == 1 for c in watch.collections[last_full:])
        assert watch.count(1) > since + 1
        assert _pairs_in(2) <= 2 * (since + 1), "the full collection freed the pairs stranded before it"
    finally:
        gc.unfreeze()
        gc.collect()


def test_collector_design_by_version():
    assert collector_design((3, 11, 7), "cpython", True).design == "generational"
    assert collector_design((3, 13, 0), "cpython", True).quarter_rule
    assert collector_design((3, 14, 2), "cpython", True).design == "incremental"
    assert not collector_design((3, 14, 2), "cpython", True).quarter_rule
    assert collector_design((3, 14, 5), "cpython", True).design == "generational"
    assert collector_design((3, 13, 1), "cpython", False).design == "free-threaded"
    assert collector_design((3, 10, 0), "pypy", True).design == "other"
    here = collector_design()
    assert here.version == ".".join(map(str, sys.version_info[:3]))
    assert here.thresholds == gc.get_threshold()
    assert str(gc.get_threshold()[0]) in here.describe()


def test_generation_sizes():
    assert oldest_generation() == 2
    gc.collect()
    assert generation_size(2) > 1000
    assert generation_size(0) < gc.get_threshold()[0] + 50


def test_collector_design_reads_the_build_not_whether_the_gil_is_on_now(monkeypatch):
    """A free-threaded build run with PYTHON_GIL=1 has its GIL on and still the free-threaded collector: the
    design follows sysconfig's Py_GIL_DISABLED, never sys._is_gil_enabled()."""
    import sysconfig
    build = sysconfig.get_config_var
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: False, raising=False)     # a GIL build, GIL said off
    monkeypatch.setattr(sysconfig, "get_config_var", lambda name: 0 if name == "Py_GIL_DISABLED" else build(name))
    assert collector_design((3, 13, 1), "cpython").design == "generational"
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: True, raising=False)      # free-threaded, PYTHON_GIL=1
    monkeypatch.setattr(sysconfig, "get_config_var", lambda name: 1 if name == "Py_GIL_DISABLED" else build(name))
    assert collector_design((3, 13, 1), "cpython").design == "free-threaded"
