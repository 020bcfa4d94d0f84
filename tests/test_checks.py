"""Tests for gclab.checks: the flat-memory check, result comparison, and the integrity check."""
from __future__ import annotations

import gc
import re

import pytest
import torch

from gclab import checks
from gclab.checks import (FlatReport, assert_flat, assert_matches, assert_untampered, compare,
                          integrity_problems, run_flat_check)
from gclab.memory import format_bytes, process_memory


class Node:
    def __init__(self, tensor):
        self.tensor = tensor
        self.other = None


@pytest.fixture(autouse=True)
def measured_on_the_cpu(monkeypatch):
    """The steps here make CPU tensors (torch.zeros with no device), so the checks measure the CPU,
    also on a machine with CUDA, where the default device would be the GPU and a CPU tensor kept
    would go unseen: the CUDA path is checked by every lesson under `gclab gpu-check`."""
    import gclab.memory
    monkeypatch.setattr(gclab.memory, "default_device", lambda: torch.device("cpu"))


@pytest.fixture
def collect_after():
    yield
    gc.collect()                  # the cycles a leaking step left behind go now, not later


def leaking_step(i):
    a, b = Node(torch.zeros(256)), Node(torch.zeros(256))     # 2 x 1 KiB
    a.other, b.other = b, a
    return float(a.tensor.sum())


def fixed_step(i):
    a, b = Node(torch.zeros(256)), Node(torch.zeros(256))
    a.other, b.other = b, a
    b.other = None                # the cycle is broken: reference counting frees both
    return float(a.tensor.sum())


# -- run_flat_check -------------------------------------------------------------------
def test_leaking_step_is_not_ok_and_says_how_many_bytes_per_iteration(collect_after):
    report = run_flat_check(leaking_step, iterations=5)
    assert not report.ok
    assert report.growth == [2048 * i for i in range(1, 6)]
    assert report.leaked == 5 * 2048
    assert report.collections == []
    assert report.error is None
    text = report.explain()
    assert "per iteration" in text
    assert f"about {format_bytes(2048)} per iteration" in text
    assert "after iteration 1" in text
    with pytest.raises(AssertionError, match="per iteration"):
        assert_flat(report)


LATEST = []


def keeps_the_latest_step(i):
    LATEST[:] = [torch.zeros(512)]          # 2 KiB, replaced by the next step's
    return float(LATEST[0].sum())


def test_memory_held_at_a_level_is_told_so_not_as_a_growth_per_iteration():
    report = run_flat_check(keeps_the_latest_step, iterations=8)
    LATEST.clear()
    assert report.growth == [2048] * 8
    text = report.explain()
    assert f"{format_bytes(2048)} after iteration 8, never more than {format_bytes(2048)} in between: it stopped growing" in text
    assert "the latest step's tensors" in text and "per iteration" not in text


def test_a_leak_that_starts_late_is_told_per_iteration_from_where_it_started():
    """4 bytes a step, from the second iteration on: told as 4 B per iteration, not the total spread over every
    iteration (3 B)."""
    from gclab.checks import FlatReport
    report = FlatReport(device=torch.device("cpu"), iterations=4, growth=[0, 4, 8, 12])
    assert "about 4 B per iteration" in report.explain(), report.explain()


def collects_then_makes_a_cycle(i):
    gc.collect()                            # frees the earlier steps' cycles, never this one's
    a, b = Node(torch.zeros(512)), Node(torch.zeros(512))
    a.other, b.other = b, a
    return float(a.tensor.sum())


def test_a_level_held_by_collections_in_the_step_is_told_as_cycles_not_as_a_kept_reference():
    report = run_flat_check(collects_then_makes_a_cycle, iterations=6)
    text = report.explain()
    assert not report.ok and text.startswith("the collector ran 6 time(s) during the check"), text
    assert "each collection during the check freed what the steps before had left" in text, text
    assert "a global, a default argument" not in text, text
    gc.collect()


def test_fixed_step_is_ok():
    report = run_flat_check(fixed_step, iterations=10)
    assert report.ok, report.explain()
    assert report.growth == [0] * 10
    assert report.leaked == 0
    assert report.results == [0.0] * 10
    assert "baseline" in report.explain()
    assert_flat(report)


def test_report_names_the_device_and_iterations():
    report = run_flat_check(fixed_step, iterations=3, device="cpu")
    assert isinstance(report, FlatReport)
    assert report.device == torch.device("cpu")
    assert report.iterations == 3
    assert "3 iterations" in report.explain()


def test_step_that_calls_the_collector_is_not_ok_and_the_report_mentions_the_collector():
    def step(i):
        leaking_step(i)
        gc.collect()              # frees the cycle, so memory is flat, but only thanks to gc

    report = run_flat_check(step, iterations=3)
    assert report.growth == [0] * 3
    assert not report.ok
    assert len(report.collections) == 3
    assert {c.generation for c in report.collections} == {2}
    text = report.explain()
    assert "collector" in text and "gc.collect()" in text
    assert "3 time(s)" in text


def test_step_that_reenables_gc_is_reported():
    def step(i):
        gc.enable()
        return i

    report = run_flat_check(step, iterations=3)
    assert report.reenabled_gc
    assert not report.ok
    assert "gc.enable()" in report.explain()


def test_step_runs_with_the_collector_off():
    seen = []
    run_flat_check(lambda i: seen.append(gc.isenabled()), iterations=3, warmup=2, collector_on=4)
    assert seen == [False] * 13 + [True] * 2, "warm-up, measured and 8 unwatched iterations off, then two with it on"


def test_leaks_unless_collector_off_is_caught_with_the_collector_on():
    kept = []

    def step(i):
        pair = [torch.zeros(16 * 1024)]
        if gc.isenabled():
            kept.append(pair)             # behaves only while the check has the collector off
        return float(pair[0].sum())

    report = run_flat_check(step, iterations=8, collector_on=4)
    assert not report.ok and report.growth == [0] * 8 and report.unwatched == 8
    # measured by the process's heap, whose reading after one step moves with what else the process frees
    # (seen 24 KiB after the first 64 KiB kept, in a worker that had graded lessons): judged after both
    first, second = report.heap_collector_on
    assert second >= 2 * 48 * 1024 and second > first, report.heap_collector_on
    assert "with the collector switched on, memory was 64" in report.explain()
    assert "gc.isenabled()" in report.explain()


def test_a_cycle_freed_by_an_automatic_collection_is_fine_with_the_collector_on():
    report = run_flat_check(fixed_step, iterations=4, collector_on=6)
    assert report.ok, report.explain()
    assert report.unwatched == 8 and len(report.growth_collector_on) == 3
    assert "then after 8 more with nothing of the check's watching" in report.explain()
    assert "and after each of 3 more with the collector on" in report.explain()


# -- the unwatched iterations: code that behaves only while measured, or hides from the meter --
BIG = 64 * 1024          # floats: 256 KiB, far above what a leak-free step moves the heap


def _kept_unless(watched, kept):
    def step(i):
        x = torch.ones(BIG)
        if not watched():
            kept.append(x)
        return float(x[0])
    return step


def test_leaks_unless_a_dispatch_mode_is_active_is_caught_unwatched(collect_after):
    kept = []
    report = run_flat_check(_kept_unless(lambda: torch._C._len_torch_dispatch_stack() > 0, kept), iterations=8)
    assert report.growth == [0] * 8 and not report.ok
    assert report.heap_unwatched[-1] >= report.unwatched * BIG * 4
    text = report.explain()
    assert "run with nothing of the check's in the process" in text and "the process's memory grew by" in text


def test_leaks_unless_a_hook_is_in_gc_callbacks_is_caught_unwatched(collect_after):
    kept = []
    report = run_flat_check(_kept_unless(lambda: bool(gc.callbacks), kept), iterations=8)
    assert report.growth == [0] * 8 and not report.ok, report.explain()


def test_tensors_made_in_another_thread_are_caught_unwatched(collect_after):
    import concurrent.futures
    pool, kept = concurrent.futures.ThreadPoolExecutor(1), []

    def step(i):
        kept.append(pool.submit(torch.ones, BIG).result())      # the meter's dispatch mode is per thread
        return i

    report = run_flat_check(step, iterations=8)
    pool.shutdown()
    assert report.growth == [0] * 8 and not report.ok
    assert "another thread" in report.explain()


def test_tensors_made_with_dispatch_turned_off_are_caught_unwatched(collect_after):
    kept = []

    def step(i):
        with torch._C._DisableTorchDispatch():
            kept.append(torch.ones(BIG))
        return i

    report = run_flat_check(step, iterations=8)
    assert report.growth == [0] * 8 and not report.ok


def test_collecting_only_while_unwatched_is_caught(collect_after):
    def step(i):
        fixed_step(i)
        if not gc.callbacks:
            gc.collect()          # where no hook would see it
        return i

    report = run_flat_check(step, iterations=8)
    assert not report.ok and report.collections_unwatched >= 1
    assert "the collector ran" in report.explain()


def test_the_watched_iterations_are_the_same_with_an_unwatched_part():
    seen = []
    report = run_flat_check(lambda i: seen.append(i) or float(i), iterations=5, warmup=1, collector_on=4)
    assert seen == list(range(16)) and report.results == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert report.results_collector_on == [14.0, 15.0]    # the unwatched iterations' results are not kept



def test_step_that_raises_is_reported_not_raised():
    def step(i):
        if i == 3:
            raise ValueError("boom at 3")
        return i

    report = run_flat_check(step, iterations=10)
    assert isinstance(report.error, ValueError)
    assert report.error.__traceback__ is None          # its frames would keep tensors alive
    assert report.growth == [0, 0, 0]
    assert report.results == [0, 1, 2]
    assert not report.ok
    text = report.explain()
    assert "ValueError" in text and "boom at 3" in text
    assert "after 3 of 10 iterations" in text


def test_out_of_memory_in_the_step_is_reported():
    def step(i):
        raise torch.OutOfMemoryError("simulated")

    report = run_flat_check(step, iterations=2)
    assert isinstance(report.error, torch.OutOfMemoryError)
    assert not report.ok


def test_step_returning_a_tensor_keeps_no_tensor_alive():
    def step(i):
        return torch.full((2, 3), float(i)), (torch.tensor(i), "label")

    report = run_flat_check(step, iterations=4)
    assert report.ok, report.explain()
    assert report.results[2] == ([[2.0] * 3] * 2, (2, "label"))

    def tensors_in(value):
        if isinstance(value, torch.Tensor):
            return 1
        if isinstance(value, (list, tuple)):
            return sum(tensors_in(v) for v in value)
        return 0

    assert tensors_in(report.results) == 0


def test_warmup_iterations_are_excluded_from_the_baseline():
    def make_step():
        cache = {}

        def step(i):
            cache.setdefault("weights", torch.zeros(100))     # allocated once, on first call
            return (cache["weights"] + i).sum()
        return step

    calls = []
    unwarmed = run_flat_check(make_step(), iterations=3)
    assert unwarmed.growth == [400, 400, 400]
    assert not unwarmed.ok

    step = make_step()
    warmed = run_flat_check(lambda i: calls.append(i) or step(i), iterations=3, warmup=1)
    assert warmed.ok, warmed.explain()
    assert calls == list(range(13)), "one warm-up, three measured, eight unwatched, one with the collector on"
    assert warmed.results == [100.0, 200.0, 300.0]
    assert len(warmed.growth) == 3


@pytest.mark.parametrize("enabled", [True, False])
def test_gc_state_is_restored_after_the_check(enabled, collect_after):
    def reenable(i):
        gc.enable()

    for step in (fixed_step, leaking_step, reenable):
        if enabled:
            gc.enable()
        else:
            gc.disable()
        run_flat_check(step, iterations=2)
        assert gc.isenabled() is enabled


def test_a_warmup_error_is_reported_and_the_collector_state_restored():
    gc.enable()

    def step(i):
        raise RuntimeError("warm-up failure")

    report = run_flat_check(step, iterations=2, warmup=1)
    assert not report.ok and isinstance(report.error, RuntimeError)
    assert "warm-up failure" in report.explain()
    assert gc.isenabled()


def test_collections_before_an_error_are_still_reported():
    def step(i):
        if i == 0:
            gc.collect()
        else:
            raise RuntimeError("second step fails")

    report = run_flat_check(step, iterations=2)
    assert report.error is not None and len(report.collections) == 1


# -- compare / assert_matches ------------------------------------------------------------
def test_compare_matching_values():
    result = compare("loss", [1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert result.ok
    assert result.name == "loss"
    assert str(result) == result.text == "loss: all 3 values match the reference"


def test_compare_accepts_tensors_and_nested_lists():
    assert compare("t", torch.tensor([[1.0, 2.0], [3.0, 4.0]]), [[1, 2], [3, 4]]).ok
    assert compare("t", (torch.tensor(1.5), [2, 3]), [1.5, 2, 3]).ok


def test_compare_within_tolerance_matches():
    assert compare("x", [1.0 + 1e-9], [1.0]).ok
    assert not compare("x", [1.001], [1.0]).ok
    assert compare("x", [1.001], [1.0], rel_tol=1e-2).ok


def test_compare_mismatch_says_where_what_and_by_how_much():
    result = compare("grad", [1.0, 2.0, 3.5, 9.0], [1.0, 2.0, 3.0, 4.0])
    assert not result.ok
    assert "position 2" in result.text
    assert "got 3.5" in result.text
    assert "expected 3.0" in result.text
    assert "off by 0.5" in result.text
    assert "2 of 4 values differ" in result.text


def test_compare_mismatch_of_byte_counts_is_exact():
    result = compare("bytes", [1_048_576 + 336_896], [1_048_576], rel_tol=0, abs_tol=0)
    assert "off by 336896)" in result.text


def test_compare_mismatch_of_non_numbers_has_no_difference():
    result = compare("labels", ["a", "b"], ["a", "c"])
    assert not result.ok
    assert "position 1" in result.text and "got 'b'" in result.text and "expected 'c'" in result.text
    assert "off by" not in result.text


def test_compare_length_mismatch():
    result = compare("out", [1, 2], [1, 2, 3])
    assert not result.ok
    assert result.text == "out: expected 3 values, got 2"


def test_assert_matches_passes_silently_on_a_match():
    assert_matches("x", torch.arange(3), [0, 1, 2])


def test_assert_matches_raises_with_the_comparison_text():
    with pytest.raises(AssertionError) as info:
        assert_matches("x", [1.0, 5.0], [1.0, 2.0])
    message = str(info.value)
    assert "position 1" in message and "got 5.0" in message and "expected 2.0" in message
    assert "off by 3" in message


def test_assert_matches_passes_tolerances_on():
    assert_matches("x", [1.001], [1.0], rel_tol=1e-2)
    with pytest.raises(AssertionError):
        assert_matches("x", [1.001], [1.0])


# -- integrity ------------------------------------------------------------------------
def test_integrity_problems_is_empty_normally():
    assert integrity_problems() == []
    assert_untampered()


def test_integrity_problems_names_a_replaced_gc_collect(monkeypatch):
    monkeypatch.setattr(gc, "collect", lambda *args: 0)
    assert integrity_problems() == ["gc.collect"]
    with pytest.raises(AssertionError, match="gc.collect"):
        assert_untampered()


def test_integrity_problems_names_a_replaced_callbacks_list(monkeypatch):
    monkeypatch.setattr(gc, "callbacks", [])
    assert integrity_problems() == ["gc.callbacks"]


def test_integrity_problems_names_a_replaced_checks_function(monkeypatch):
    monkeypatch.setattr(checks, "compare", lambda *args, **kwargs: None)
    assert integrity_problems() == ["gclab.checks.compare"]
    monkeypatch.setattr(checks, "run_flat_check", lambda *args, **kwargs: None)
    assert set(integrity_problems()) == {"gclab.checks.compare", "gclab.checks.run_flat_check"}


def test_integrity_problems_names_several_replacements(monkeypatch):
    monkeypatch.setattr(gc, "disable", lambda: None)
    monkeypatch.setattr(torch, "OutOfMemoryError", RuntimeError)
    assert set(integrity_problems()) == {"gc.disable", "torch.OutOfMemoryError"}


def test_what_integrity_is_judged_against_cannot_be_changed_to_match_a_replacement(monkeypatch):
    fake = lambda *args: 0
    monkeypatch.setattr(gc, "collect", fake)
    with pytest.raises(TypeError):
        checks._ORIGINALS["gc.collect"] = fake
    with pytest.raises(TypeError):
        checks._OWN["compare"] = None
    assert integrity_problems() == ["gc.collect"]

# run_policy_check's verdict is tested in tests/test_serving.py, beside the server it reads.


# -- naming the holder: which attribute of the learner's object keeps the bytes --------
class Keeper:
    """A trainer-like object with one leak of each kind and one attribute that is only replaced."""

    def __init__(self, leak=("kept", "errors", "graphs")):
        self.leak = leak
        self.weight = torch.ones(64, requires_grad=True)
        self.data = torch.zeros(8, 64)           # made before the check: never growth
        self.kept, self.errors, self.graphs = [], [], {}
        self.last = None

    def step(self, i):
        x = self.data[i % 8] + 1                  # 256 B
        self.last = x * 2                         # replaced every step: a plateau, not growth
        if "kept" in self.leak:
            self.kept.append(x)
        if "graphs" in self.leak:
            self.graphs[i] = (self.weight * (x + 1)).sum()  # its graph saves x + 1 and the weight
        if "errors" in self.leak and i % 2:
            try:
                hidden = torch.zeros(1024)        # 4 KiB, held by the frame through the traceback
                raise ValueError(f"step {i}: {hidden.shape}")
            except ValueError as error:
                self.errors.append(error)
        return i


def test_a_flat_check_given_the_holder_names_the_attributes_that_grew(collect_after):
    keeper = Keeper()
    plain = run_flat_check(Keeper().step, iterations=6, warmup=1)
    report = run_flat_check(keeper.step, iterations=6, warmup=1, holder=keeper, holder_name="keeper")
    assert report.growth == plain.growth          # naming the holder does not change the measurement
    held = report.held
    assert [h.path for h in held.holdings] == ["keeper.errors", "keeper.graphs", "keeper.kept"]   # most first
    errors, graphs, kept = held.holdings
    assert errors.grew == 3 * 4096 and errors.new_entries == 3     # steps 1, 3, 5 (x counts for kept)
    assert "keeper.errors[0], a ValueError with its traceback, whose __traceback__.tb_frame" in errors.example
    assert "(in step())" in errors.example
    assert kept.grew == 6 * 256 and kept.new_entries == 6
    assert kept.example == "keeper.kept[1], a float32[64] tensor: 256 B"     # kept[0]: the warm-up's
    assert graphs.grew == 6 * (4 + 256)           # the sum, and the x + 1 its graph saved (the weight is old)
    assert graphs.example.startswith("keeper.graphs[1], a float32[scalar] tensor with grad_fn SumBackward0")
    assert "256 B of it saved by its autograd graph" in graphs.example
    assert held.accounted == report.growth[-1]
    text = report.explain()
    assert "Where the bytes are, after 6 iterations: keeper.errors (12.00 KiB more, in 3 entries)" in text
    assert "keeper.last" not in text and "keeper.data" not in text and "keeper.weight" not in text


def test_the_holder_is_named_as_the_notebook_names_it(monkeypatch, collect_after):
    import sys
    keeper = Keeper(leak=("kept",))
    monkeypatch.setattr(sys.modules["__main__"], "trainer", keeper, raising=False)   # a notebook's global
    report = run_flat_check(keeper.step, iterations=3, warmup=1, holder=keeper)
    assert report.held.name == "trainer", report.explain()
    assert "trainer.kept (768 B more, in 3 entries)" in report.explain()
    monkeypatch.delattr(sys.modules["__main__"], "trainer")
    report = run_flat_check(keeper.step, iterations=3, warmup=1, holder=keeper)
    assert "the Keeper.kept (768 B more, in 3 entries)" in report.explain()   # no name: its type


def test_a_flat_step_with_a_holder_is_ok_and_names_nothing():
    keeper = Keeper(leak=())
    report = run_flat_check(keeper.step, iterations=5, warmup=1, holder=keeper, holder_name="keeper")
    assert report.ok, report.explain()
    assert report.held is None


def test_bytes_held_outside_the_holder_are_said_to_be_elsewhere(collect_after):
    outside = []

    def step(i):
        outside.append(torch.zeros(64))

    keeper = Keeper(leak=())
    report = run_flat_check(step, iterations=3, warmup=1, holder=keeper, holder_name="keeper")
    assert not report.ok and report.held.holdings == []
    assert "Nothing reachable from keeper" in report.explain()
    assert "gclab.cycles.watch_tensor_cycles" in report.explain()


def test_naming_the_holder_never_breaks_the_check(monkeypatch, collect_after):
    monkeypatch.setattr("gclab.held._walk", lambda *a, **k: 1 / 0)
    keeper = Keeper(leak=("kept",))
    report = run_flat_check(keeper.step, iterations=3, holder=keeper, holder_name="keeper")
    assert not report.ok and report.held is None and report.error is None
    assert "did not return to its baseline" in report.explain()


def test_bytes_held_by_a_closure_on_the_holder_are_found_through_its_variable(collect_after):
    class Trainer:
        def __init__(self):
            outputs = []
            self.on_step = lambda output: outputs.append(output)    # a callback that keeps every output

        def step(self, i):
            self.on_step(torch.zeros(32) + i)

    trainer = Trainer()
    report = run_flat_check(trainer.step, iterations=3, warmup=1, holder=trainer, holder_name="trainer")
    [holding] = report.held.holdings
    assert holding.path == "trainer.on_step" and holding.grew == 3 * 128
    assert holding.example == ("trainer.on_step (closure variable 'outputs'), a list of 4, whose [1] is a "
                               "float32[32] tensor: 384 B")


# -- plain: what a hidden test compares is plain data, not an object that answers as it likes
class _EqualToAnything:
    def __eq__(self, other):
        return True

    __hash__ = object.__hash__


class _LyingFloat(float):
    def __eq__(self, other):
        return True

    __hash__ = float.__hash__


def test_plain_accepts_plain_data_as_it_is():
    tensor = torch.arange(3)
    data = {"job": 1, "ok": True, "value": 2.5, "error": None, "name": "a", "rows": [(1, 2.0), []], "t": tensor}
    assert checks.plain(data) == data
    assert checks.plain(data)["t"] is tensor
    assert type(checks.plain((1, 2))) is tuple


@pytest.mark.parametrize("value, words", [
    (_EqualToAnything(), "_EqualToAnything, expected plain data"),
    (_LyingFloat(1.0), "_LyingFloat (a subclass of float), expected a float"),
    (torch.zeros(2).as_subclass(type("Quiet", (torch.Tensor,), {})),
     "Quiet (a subclass of torch.Tensor), expected a torch.Tensor"),
    (type("Rows", (list,), {})([1]), "Rows (a subclass of list), expected a list"),
])
def test_plain_refuses_subclasses_and_lying_objects_by_name(value, words):
    """The message names the value and its type (module and name, as a notebook's class: __main__'s
    name alone), and what a test expected in its place."""
    with pytest.raises(AssertionError) as refused:
        checks.plain(value, "report['value']")
    assert str(refused.value).startswith("report['value'] is a test_checks.") and words in str(refused.value)


def test_plain_takes_numpys_own_scalars_as_their_python_values_but_not_a_subclass():
    import numpy as np
    got = checks.plain({"mean": np.float64(2.5), "count": np.int64(3), "ok": np.bool_(True)})
    assert got == {"mean": 2.5, "count": 3, "ok": True}
    assert [type(v) for v in got.values()] == [float, int, bool]
    sneaky = type("Sneaky", (np.float64,), {"__eq__": lambda self, other: True})
    with pytest.raises(AssertionError, match="Sneaky"):
        checks.plain(sneaky(1.0))


def test_plain_names_where_in_a_container_the_lie_is():
    with pytest.raises(AssertionError, match=r"answer\['labels'\]\[1\] is a test_checks\._LyingFloat \(a subclass of float\)"):
        checks.plain({"labels": [0.5, _LyingFloat(2.0)]}, "answer")


def test_plain_is_one_of_the_functions_the_checks_vouch_for():
    assert "plain" in checks.__all__ and "gclab.checks.plain" not in checks.integrity_problems()
    original, checks.plain = checks.plain, lambda value, name="": value
    try:
        assert "gclab.checks.plain" in checks.integrity_problems()
    finally:
        checks.plain = original


def test_tensors_hidden_from_the_meter_only_while_it_watches_are_caught(collect_after):
    import concurrent.futures
    pool, kept = concurrent.futures.ThreadPoolExecutor(1), []

    def step(i):
        if torch._C._len_torch_dispatch_stack():               # a meter is on: hide from it
            kept.append(pool.submit(torch.ones, BIG).result())
        return i                                                # and behave when nothing watches

    report = run_flat_check(step, iterations=8)
    pool.shutdown()
    assert report.growth == [0] * 8 and not report.ok and report.heap_watched >= 8 * BIG * 4
    assert not report.heap_unwatched, "judged before the unwatched iterations"
    assert "the meter saw memory come back after each of 8 iterations, yet the process's memory grew" in report.explain()


@pytest.mark.parametrize("mapping", ["shared", "private"])
def test_tensors_kept_over_memory_the_step_maps_itself_are_caught(collect_after, mapping):
    """torch.frombuffer over an mmap: no allocation the meter sees, nothing in the C heap."""
    import mmap
    flags = mmap.MAP_SHARED if mapping == "shared" else mmap.MAP_PRIVATE
    kept = []

    def step(i):
        unseen = torch.frombuffer(mmap.mmap(-1, BIG, flags=flags), dtype=torch.uint8)
        unseen.fill_(1)
        kept.append(unseen)
        return i

    report = run_flat_check(step, iterations=8)
    assert report.growth == [0] * 8 and not report.ok and report.heap_watched >= 8 * BIG - 64 * 1024, report
    assert "the meter saw memory come back after each of 8 iterations, yet the process's memory grew" in report.explain()


def test_a_few_kib_kept_only_while_unwatched_is_caught_with_few_iterations_asked(collect_after):
    """collector_on=3 still runs UNWATCHED_AT_LEAST unwatched iterations: 8 KiB a step shows."""
    kept = []

    def step(i):
        features = torch.ones(2048)                            # 8 KiB
        if not torch._C._len_torch_dispatch_stack():
            kept.append(features)
        return i

    report = run_flat_check(step, iterations=4, collector_on=3)
    assert report.unwatched == checks.UNWATCHED_AT_LEAST and not report.ok
    assert "the process's memory grew by" in report.explain()


def test_tensors_kept_over_a_file_the_step_maps_are_caught(collect_after, tmp_path):
    import mmap
    kept = []

    def step(i):
        backing = open(tmp_path / f"unseen-{i}", "w+b")
        backing.truncate(BIG)
        unseen = torch.frombuffer(mmap.mmap(backing.fileno(), BIG), dtype=torch.uint8)
        unseen.fill_(1)
        kept.append((backing, unseen))
        return i

    report = run_flat_check(step, iterations=8)
    assert not report.ok and report.heap_watched >= 8 * BIG - 64 * 1024, report
    for backing, _ in kept:
        backing.close()


def test_keeping_every_result_is_not_taken_for_hidden_tensors():
    report = run_flat_check(lambda i: {"step": i, "values": [float(i)] * 100, "label": f"step {i}"}, iterations=40)
    assert report.ok, report.explain()
    assert report.heap_watched <= report.HEAP_SLACK + report.HEAP_PER_WATCHED_ITERATION * 40


def test_tensor_results_kept_as_numbers_are_not_taken_for_hidden_tensors():
    report = run_flat_check(lambda i: torch.full((4096,), float(i)), iterations=20)   # each kept as 4,096 floats
    assert report.ok, report.explain()


def test_garbage_collected_while_a_result_is_converted_is_not_credited_to_the_step(collect_after):
    """With the collector on, converting a result (thousands of tuples) may run a collection that
    frees older garbage: that frees memory, but is no credit the step may spend."""
    from gclab.checks import _kept_as_data
    if process_memory() is None:
        pytest.skip("the C library cannot report its heap (not glibc 2.33 or later)")

    def step(i):
        result = tuple((n,) for n in range(5000))
        garbage = [torch.ones(BIG * 4)]
        garbage.append(garbage)                   # a cycle: only a collection frees its 1 MiB
        return result

    gc.collect()
    gc.enable()
    try:
        result, cost = _kept_as_data(step, 0)
    finally:
        gc.disable()
    assert len(result) == 5000 and cost == 0


def test_memory_kept_while_a_result_is_converted_is_not_taken_for_the_conversion(collect_after):
    kept = []

    class Sneaky(torch.Tensor):
        def tolist(self):
            with torch._C._DisableTorchDispatch():
                kept.append(torch.ones(BIG))          # kept while the check converts the result
            return super().tolist()

    report = run_flat_check(lambda i: torch.zeros(4).as_subclass(Sneaky), iterations=8)
    assert not report.ok and report.heap_watched >= 8 * BIG * 4 - 64 * 1024, report


def test_keeping_a_copy_of_each_steps_outputs_as_numbers_is_caught():
    kept = []

    def step(i):
        kept.append([[float(i + k) for k in range(10)] for _ in range(40)])   # small objects: no tensor, no heap
        return i

    report = run_flat_check(step, iterations=8)
    assert report.growth == [0] * 8 and not report.ok
    assert "more Python objects" in report.explain()


def test_keeping_each_steps_outputs_as_a_long_list_is_caught():
    kept = []
    report = run_flat_check(lambda i: kept.append(torch.full((4096,), float(i)).tolist()), iterations=8)
    assert report.growth == [0] * 8 and not report.ok
    assert "copies of their data (lists of numbers" in report.explain()


def test_a_history_entry_per_step_is_fine():
    history = []
    report = run_flat_check(lambda i: history.append({"step": i, "loss": float(i) / 3, "note": f"step {i}"}),
                            iterations=40)
    assert report.ok, report.explain()


def test_a_result_that_runs_code_while_converted_is_not_credited(collect_after):
    reserve, kept = [], []

    class Loss(float):
        @property
        def __class__(self):                    # runs while the check converts the result
            kept.append(torch.ones(BIG))
            return float

    report = run_flat_check(lambda i: Loss(i), iterations=8)
    assert not report.ok, report


def test_tensors_made_with_dispatch_off_while_a_reserve_is_freed_are_caught(collect_after):
    """Invisible to the meter, and the process's heap stays level: memory reserved beforehand is
    given back as much as is kept. torch's allocator still hands the kept bytes out."""
    reserve, kept = [bytearray(BIG * 4) for _ in range(40)], []

    def step(i):
        with torch._C._DisableTorchDispatch():
            kept.append(torch.ones(BIG))
        reserve.pop()
        return i

    report = run_flat_check(step, iterations=8)
    assert report.growth == [0] * 8 and not report.ok
    assert report.allocated_watched == [BIG * 4 * n for n in range(1, 9)]
    assert ("the meter saw memory come back after each of 8 iterations, yet torch's allocator handed out 2.00 MiB"
            in report.explain())


def test_a_step_that_replaces_what_its_warm_up_made_keeps_nothing_by_the_census(collect_after):
    state = {}

    def step(i):
        state["last"] = torch.full((BIG,), float(i))       # the previous one is freed: no growth
        return i

    report = run_flat_check(step, iterations=8, warmup=1)
    assert report.ok, report.explain()
    assert report.allocated_watched == [0] * 8


def test_a_step_that_stops_the_census_profiler_fails_the_check(collect_after):
    report = run_flat_check(lambda i: torch.autograd._disable_profiler() and i, iterations=4)
    assert not report.ok
    # torch 2.13 lets the step stop it; torch 2.11 refuses the call (the step raises): fails either way
    assert ("stopped the profiler that counts allocations" in report.explain()
            or "Can't disable Kineto profiler when it's not running" in report.explain()), report.explain()


def test_a_check_started_under_a_running_profiler_says_it_cannot_count(collect_after):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        report = run_flat_check(lambda i: torch.ones(8).sum().item(), iterations=4)
    assert not report.ok
    assert "torch's profiler was already running" in report.explain()


def _kept_unwatched_behind_a_freed_reserve(then=lambda: None):
    """A step that keeps its tensor while no meter and no profiler watch, each time giving back as much
    memory reserved beforehand (the process's memory stays level), then does `then()`."""
    reserve, kept = [bytearray(BIG * 4) for _ in range(40)], []

    def step(i):
        features = torch.ones(BIG)
        if not torch._C._len_torch_dispatch_stack() and not torch._C._autograd._profiler_enabled():
            kept.append(features)
            reserve.pop()
            then()
        return i
    return step


def test_tensors_kept_only_while_unwatched_behind_a_freed_reserve_are_caught(collect_after):
    """No meter and no profiler to see it, and the process's memory level. The tensors are still there
    to be found."""
    report = run_flat_check(_kept_unwatched_behind_a_freed_reserve(), iterations=8)
    assert report.growth == [0] * 8 and report.allocated_watched == [0] * 8 and not report.ok
    assert report.tensors_kept_unwatched == report.unwatched * BIG * 4
    assert "tensors holding 2.00 MiB (about 256.00 KiB per iteration) were left alive" in report.explain()


def test_tensors_kept_only_while_unwatched_and_frozen_are_caught(collect_after):
    """The same, the kept tensors then frozen (gc.freeze()): gc.get_objects() lists nothing frozen, so the
    census would not find them. A step that freezes anything while checked fails the check."""
    try:
        report = run_flat_check(_kept_unwatched_behind_a_freed_reserve(then=gc.freeze), iterations=8)
    finally:
        gc.unfreeze()
    assert report.growth == [0] * 8 and report.tensors_kept_unwatched == 0 and not report.ok
    assert report.frozen
    assert "the step froze objects while it was checked (gc.freeze())" in report.explain()


def test_unfreezing_and_freezing_again_with_fewer_objects_frozen_is_caught(collect_after):
    """What is frozen counted (gc.get_freeze_count()) would not tell: the step unfreezes what was frozen
    before the check, lets go of most of it, and freezes again, fewer objects than at the start."""
    ballast = [[] for _ in range(100_000)]
    gc.freeze()

    def refreeze():
        gc.unfreeze()
        ballast.clear()
        gc.freeze()

    try:
        frozen_at_the_start = gc.get_freeze_count()
        report = run_flat_check(_kept_unwatched_behind_a_freed_reserve(then=refreeze), iterations=8)
        assert gc.get_freeze_count() < frozen_at_the_start
    finally:
        gc.unfreeze()
    assert report.frozen and not report.ok, report.explain()


def test_objects_frozen_before_the_check_are_no_reason_to_fail_it(collect_after):
    gc.freeze()                             # a server's warm-up: what exists now is never collected
    try:
        report = run_flat_check(fixed_step, iterations=4)
    finally:
        gc.unfreeze()
    assert report.ok and not report.frozen, report.explain()


def test_state_a_step_replaces_while_unwatched_is_not_taken_for_kept_tensors(collect_after):
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = {}

    def step(i):
        optimizer.zero_grad(set_to_none=True)                # new gradients every step, the old ones freed
        loss = model(torch.ones(4, 256)).square().mean()
        loss.backward()
        optimizer.step()
        state["last"] = torch.full((BIG,), float(i))         # replaces the previous step's
        return loss.item()

    report = run_flat_check(step, iterations=8, warmup=1)
    assert report.ok, report.explain()
    assert report.tensors_kept_unwatched == 0


def test_tensors_kept_only_while_the_collector_is_on_behind_a_freed_reserve_are_caught(collect_after):
    reserve, kept = [bytearray(BIG * 4) for _ in range(40)], []

    def step(i):
        features = torch.ones(BIG)
        if gc.isenabled() and not torch._C._len_torch_dispatch_stack():
            kept.append(features)
            reserve.pop()
        return i

    report = run_flat_check(step, iterations=8, collector_on=4)
    assert report.tensors_kept_unwatched == 0 and not report.ok
    assert report.tensors_kept_collector_on == report.with_collector_on * BIG * 4
    assert "with the collector on and nothing of the check's watching, tensors holding 512.00 KiB" in report.explain()


def test_a_torch_without_the_census_profiler_api_is_judged_without_that_count(collect_after, monkeypatch):
    """Colab's torch may lay its profiler out otherwise: the check then counts less, and fails no one for it."""
    import gclab.census
    monkeypatch.setattr(gclab.census, "_PROFILER", None)
    report = run_flat_check(lambda i: torch.ones(8).sum().item(), iterations=4)
    assert report.ok and report.allocated_watched == [], report.explain()


@pytest.mark.parametrize("keep", ["storage", "numpy_view", "autograd_graph"])
def test_tensor_memory_kept_unwatched_in_another_form_is_still_found(collect_after, keep):
    weight = torch.ones(BIG, requires_grad=True)
    forms = {"storage": lambda t: t.untyped_storage(), "numpy_view": lambda t: t.numpy(),
             "autograd_graph": lambda t: (weight * t).sum()}           # the graph saves t
    reserve, kept = [bytearray(BIG * 4) for _ in range(40)], []

    def step(i):
        features = torch.full((BIG,), float(i))
        if not torch._C._len_torch_dispatch_stack() and not torch._C._autograd._profiler_enabled():
            kept.append(forms[keep](features))
            reserve.pop()
        return i

    report = run_flat_check(step, iterations=4)
    assert not report.ok and report.tensors_kept_unwatched >= report.unwatched * BIG * 4, report.explain()


KEPT_ON_SOME_STEPS = []


def keeps_a_tensor_on_even_steps(i):
    if i % 2 == 0:
        KEPT_ON_SOME_STEPS[:] = [torch.zeros(512)]
    else:
        KEPT_ON_SOME_STEPS.clear()                 # an odd step lets go of what the step before kept
    return 0.0


def test_memory_below_the_baseline_is_told_as_a_step_that_let_go_not_as_a_leak():
    report = run_flat_check(keeps_a_tensor_on_even_steps, iterations=6, warmup=1)    # the warm-up step keeps one
    KEPT_ON_SOME_STEPS.clear()
    text = report.explain()
    assert not report.ok and report.growth[0] == -2048, report.growth
    assert f"{format_bytes(2048)} below it after iteration 1" in text and "Something still refers" not in text, text


class _Accumulates:
    """A loop step that keeps `total += loss` (the graph grows), or only the latest loss (it does not)."""

    def __init__(self, running: bool):
        self.weight = torch.ones(4, requires_grad=True)
        self.total, self.running = torch.zeros(()), running

    def step(self, i):
        loss = (self.weight * i).sum()
        loss.backward()
        self.total = self.total + loss if self.running else loss


def test_a_graph_that_every_step_extends_is_caught_by_its_node_count():
    with pytest.raises(AssertionError, match=r"loop\.total carries an autograd graph that grew from [\d,]+ to [\d,]+ "
                                             r"nodes in 10 steps.*loss\.item\(\)"):
        loop = _Accumulates(running=True)
        checks.assert_graphs_do_not_grow(loop.step, loop, "loop")


def test_a_graph_replaced_every_step_is_not_growth():
    loop = _Accumulates(running=False)
    checks.assert_graphs_do_not_grow(loop.step, loop, "loop")


RUNNING_TOTALS = {}                 # where a step may keep its running total, out of the loop's reach


class _KeepsItsTotalElsewhere(_Accumulates):
    """The running total kept in a module global, or on the class, changed in place: no walk from the loop sees it."""
    total_on_the_class = torch.zeros(())

    def step(self, i):
        loss = (self.weight * i).sum()
        loss.backward()
        if self.running == "global":
            RUNNING_TOTALS["total"] = RUNNING_TOTALS.get("total", 0.0) + loss
        else:
            type(self).total_on_the_class += loss


@pytest.mark.parametrize("where, kept_by", [("global", "test_checks.RUNNING_TOTALS['total']"),
                                            ("class", "test_checks._KeepsItsTotalElsewhere.total_on_the_class")])
def test_a_graph_extended_out_of_the_holders_reach_is_caught_and_found(where, kept_by):
    loop = _KeepsItsTotalElsewhere(running=where)
    try:
        with pytest.raises(AssertionError, match=r"the autograd graphs alive in the process grew from [\d,]+ to "
                                                 r"[\d,]+ nodes in 10 steps, though nothing loop holds grew"):
            checks.assert_graphs_do_not_grow(loop.step, loop, "loop")
        with pytest.raises(AssertionError, match=re.escape(f"is kept by {kept_by}")):
            checks.assert_graphs_do_not_grow(loop.step, loop, "loop")
    finally:
        RUNNING_TOTALS.clear()
        _KeepsItsTotalElsewhere.total_on_the_class = torch.zeros(())


def test_a_step_that_raises_is_told_as_a_failed_check():
    def step(i):
        raise RuntimeError("element 0 of tensors does not require grad")

    with pytest.raises(AssertionError, match=r"the step raised RuntimeError: element 0 .* \(step 0\)"):
        checks.assert_graphs_do_not_grow(step, _Accumulates(running=False), "loop")


# -- sealed_call: a test's function handed to the notebook's code ----------------------
_TEST_STATE = {"calls": 0}          # what the test counts, in the namespace its functions' __globals__ is


def _test_step(i, scale=2):
    _TEST_STATE["calls"] += 1
    if i < 0:
        raise FloatingPointError(f"job {i}: loss is NaN")
    return i * scale


def _reachable_from(call):
    """What the notebook's code reaches from `call` without reading a frame (the guard refuses that):
    its __globals__, its closure cells' contents, its defaults, and the __self__ of a callable in C."""
    seen, todo = [], [call]
    while todo:
        value = todo.pop()
        if any(value is s for s in seen):
            continue
        seen.append(value)
        todo += [getattr(value, "__globals__", None), getattr(value, "__self__", None),
                 *(getattr(value, "__defaults__", None) or ()), *(getattr(value, "__kwdefaults__", None) or {}).values(),
                 *(cell.cell_contents for cell in getattr(value, "__closure__", None) or ())]
        if isinstance(value, dict):
            todo += list(value.values())
        todo = [v for v in todo if v is not None]
    return seen


def test_a_sealed_call_passes_results_and_exceptions_through():
    call, record = checks.sealed_call(_test_step)
    assert call(3) == 6 and call(3, scale=5) == 15 and call(i=4) == 8
    with pytest.raises(FloatingPointError, match="job -1: loss is NaN") as raised:
        call(-1)
    frames = []
    tb = raised.value.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    assert not any(f.f_globals is globals() for f in frames[1:]), "the exception's traceback leads to the test's frames"
    with pytest.raises(TypeError):
        call(1, 2, 3)
    assert record() == [None] * 5, "without a note each call is listed as None"
    assert call.__name__ == "_test_step" and checks.sealed_call(_test_step, name="train_step")[0].__name__ == "train_step"


def test_a_sealed_call_records_what_its_note_keeps_and_keeps_no_result_alive():
    import weakref

    class Model:
        pass

    def load(name):
        return Model()

    load, built = checks.sealed_call(load, note=lambda args, kwargs, model: (args[0], weakref.ref(model)))
    kept = load("a")
    load("b")
    assert [(name, ref() is not None) for name, ref in built()] == [("a", True), ("b", False)]
    assert built()[0][1]() is kept
    first = built()
    first.clear()
    assert len(built()) == 2, "record() hands out a copy"

    raised, outcomes = checks.sealed_call(_test_step, note=lambda args, kwargs, outcome: outcome)
    with pytest.raises(FloatingPointError) as error:
        raised(-2)
    assert raised(1) == 2 and outcomes() == [error.value, 2], "the exception raised is the one noted"


def test_an_exception_its_note_raises_goes_to_the_caller_and_nothing_is_recorded():
    call, record = checks.sealed_call(_test_step, note=lambda args, kwargs, outcome: args[0] // outcome)
    with pytest.raises(ZeroDivisionError):
        call(0)
    assert call(2, scale=1) == 2 and record() == [1]


def test_nothing_reachable_from_a_sealed_call_holds_the_tests_state():
    entries_note = lambda args, kwargs, outcome: outcome           # noqa: E731
    call, record = checks.sealed_call(_test_step, note=entries_note)
    call(1)
    reached = _reachable_from(call)
    for secret, what in ((globals(), "the test's globals"), (_TEST_STATE, "the test's state"),
                         (_test_step, "the test's function"), (entries_note, "the note"), (record, "record")):
        assert not any(r is secret for r in reached), f"{what} is reachable from the sealed call"
    assert call.__globals__ == {} and call.__defaults__ is None and call.__kwdefaults__ is None
    assert type(call.__closure__[0].cell_contents.__self__).__name__ == "generator"
    assert record() == [2]
    # Rewriting what `call` holds changes what calls through it do, never what the test recorded
    call.__globals__["send"] = call.__closure__[0].cell_contents = lambda message: (True, "forged")
    assert call(5) == "forged" and record() == [2]


def test_a_stopped_sealed_call_says_so():
    call, record = checks.sealed_call(_test_step, name="train_step")
    call.__closure__[0].cell_contents.__self__.close()          # the notebook's code stops its generator
    with pytest.raises(AssertionError, match="the notebook's code stopped train_step, the function the test handed it"):
        record()
    with pytest.raises(RuntimeError, match="stopped train_step"):
        call(1)


def test_a_sealed_call_is_one_of_the_functions_the_checks_vouch_for(monkeypatch):
    assert "sealed_call" in checks.__all__ and "gclab.checks.sealed_call" not in checks.integrity_problems()
    monkeypatch.setattr(checks, "sealed_call", lambda function, note=None, name=None: (function, list))
    assert "gclab.checks.sealed_call" in checks.integrity_problems()


GUARDED_SEALED_CALL = '''
import json, sys
from gclab import checks
from gclab import guard
keeper = guard.install(sys.argv[1], processes=False, files=True)
_counted = []
def _count(i):
    _counted.append(i)
    return i
call, record = checks.sealed_call(_count)
outcomes = {}
learner = """
def attempt(name, action):
    try:
        outcomes[name] = repr(action())
    except Exception as error:
        outcomes[name] = f"{type(error).__name__}: {error}"
attempt("call", lambda: call(7))
attempt("globals", lambda: sorted(call.__globals__))
"""
exec(compile(learner, sys.argv[1] + "/learner.py", "exec"), {"outcomes": outcomes, "call": call})
print(json.dumps({"outcomes": outcomes, "counted": _counted, "recorded": len(record())}))
'''


def test_a_sealed_call_hands_the_notebook_none_of_the_tests_names_under_the_guard(tmp_path):
    """Under the grading guard, as outside it: `call` runs the test's function and records the call, and its
    globals hold nothing of the test's."""
    import json
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", GUARDED_SEALED_CALL, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    outcomes = found["outcomes"]
    assert outcomes["call"] == "7" and outcomes["globals"] == "[]", outcomes
    assert found["counted"] == [7] and found["recorded"] == 1


def test_on_cuda_the_heap_is_compared_over_the_second_half_of_the_watched_iterations():
    """The CUDA driver loads a kernel's code into the process's heap the first time it runs (tens of
    MiB): memory a step's first calls take that is not the step's.  What it keeps still shows after."""
    from gclab.checks import FlatReport, _heap_read_from
    assert _heap_read_from(torch.device("cpu"), 12) == 0 and _heap_read_from(torch.device("cuda", 0), 12) == 6
    report = FlatReport(device=torch.device("cuda", 0), iterations=12, collector_on=0, unwatched=0,
                        growth=[0] * 12, heap_watched=6 * 1024 * 1024, heap_watched_over=6)
    assert not report.ok and "grew by 6.00 MiB over the last 6 of them (about 1.00 MiB per iteration)" in report.explain()


# -- one property, one sentence -----------------------------------------------------------
def test_a_view_passes_and_a_copy_is_called_one():
    base = torch.arange(12.0)
    checks.assert_view_of(base.view(3, 4)[:, :2], base, "wait()'s result", of="the batch")
    with pytest.raises(AssertionError, match=r"^wait\(\)'s result is a copy: it must be a view of the batch$"):
        checks.assert_view_of(base.clone(), base, "wait()'s result", of="the batch")
    with pytest.raises(AssertionError, match="is list, not a tensor"):
        checks.assert_view_of([1], base)


def test_a_second_call_must_return_the_same_and_not_raise():
    base = torch.arange(4.0)
    checks.assert_same_again(lambda: base.view(2, 2), base.view(2, 2), "wait()", hint="as before")
    with pytest.raises(AssertionError, match=r"^a second wait\(\) raised KeyError: 'gone'; it can be called again$"):
        checks.assert_same_again(lambda: {}["gone"], base, "wait()", hint="it can be called again")
    with pytest.raises(AssertionError, match=r"a second wait\(\) returned shape \(4,\), not what the first returned "
                                             r"\(shape \(2, 2\)\): as before"):
        checks.assert_same_again(lambda: base, base.view(2, 2), "wait()", hint="as before")


def test_assert_raises_passes_on_the_error_and_fails_with_the_message_otherwise():
    checks.assert_raises(KeyError, {}.__getitem__, "x", message="unused")
    with pytest.raises(AssertionError, match="^should raise$"):
        checks.assert_raises(KeyError, {"x": 1}.__getitem__, "x", message="should raise")


class Holder:
    """Keeps the tensors it is given; with `pinned`, keeps them in a list of the class too while the collector is on."""
    pinned: list = []

    def __init__(self, pin=False, cycle=False):
        self.kept, self.pin = [], pin
        if cycle:
            self.me = self

    def take(self, tensor):
        self.kept[:] = [tensor]                     # only the latest
        if self.pin and gc.isenabled():
            Holder.pinned.append(tensor)


def _use(holder):
    for _ in range(3):
        holder.take(torch.zeros(256))               # 1 KiB each


def test_frees_alike_passes_a_holder_that_keeps_one_and_frees_it(collect_after):
    checks.assert_frees_alike(Holder, _use, most=1024, what="a holder", name="holder")


def test_frees_alike_names_a_holder_that_keeps_more_when_the_collector_is_on(collect_after):
    try:
        with pytest.raises(AssertionError, match=r"^a holder, with the collector on: 3.00 KiB held; expected at "
                                                 r"most 1.00 KiB: holder must free alike when the collector is on$"):
            checks.assert_frees_alike(lambda: Holder(pin=True), _use, most=1024, what="a holder", name="holder")
    finally:
        Holder.pinned.clear()


def test_frees_alike_names_what_is_left_after_del_with_the_collector_off(collect_after):
    with pytest.raises(AssertionError, match=r"^a holder: after `del holder`, 1.00 KiB is still held with the "
                                             r"collector off: something keeps holder"):
        checks.assert_frees_alike(lambda: Holder(cycle=True), _use, most=1024, what="a holder", name="holder")
    assert gc.isenabled()
