"""Lesson 00 end to end: the solution runs clean, and grading accepts only accounting and
verdicts that come from the meter."""
import re

import pytest
from lesson_support import (
    test_no_graded_cell_of_the_solution_shows_a_value,  # noqa: F401  (collected here)
    test_no_handed_back_file_holds_a_line_of_a_hidden_test,  # noqa: F401  (collected here)
    test_every_test_of_the_reference_records_what_it_observed,  # noqa: F401  (collected here)
    test_every_self_check_ends_with_one_plain_line_when_it_passes,  # noqa: F401  (collected here)
    test_every_wrong_fix_that_loses_points_fails_a_visible_self_check,  # noqa: F401  (collected here)
    EQUAL_TO_ANYTHING, ROOT, assert_full_marks, assert_less_than_full_marks, assert_no_marks_until_answered,
    assert_told_why, cell_result, grade_all, plots_drawn, printed_text, problems, write_variants,
)

from gclab.grader import grading

SOLUTION = ROOT / "solutions" / "00_measuring_memory" / "00_measuring_memory.ipynb"
RELEASE = ROOT / "notebooks" / "00_measuring_memory" / "00_measuring_memory.ipynb"
MAX_SCORE = 8

# -- answers for exercise 1 (storage_bytes, account) ---------------------------------------
STORAGE_RIGHT = '''
def storage_bytes(tensors):
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())
'''
STORAGE_NUMEL = '''
def storage_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)
'''
STORAGE_NOT_DEDUPLICATED = '''
def storage_bytes(tensors):
    return sum(t.untyped_storage().nbytes() for t in tensors)
'''
STORAGE_BY_TENSOR_ADDRESS = '''
def storage_bytes(tensors):
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}
    return sum(seen.values())
'''
ACCOUNT_RIGHT = '''
def account(workload, device=DEVICE):
    with Meter(device) as meter:
        before = meter.allocated()
        result = workload()
        readings = {"before": before, "after": meter.allocated(), "peak": meter.peak(),
                    "reserved": meter.reserved()}
        del result
    return readings
'''
ACCOUNT_CUDA_COUNTERS = '''
def account(workload, device=DEVICE):
    before = torch.cuda.memory_allocated()
    result = workload()
    readings = {"before": before, "after": torch.cuda.memory_allocated(),
                "peak": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.memory_reserved()}
    del result
    return readings
'''
ACCOUNT_RESULT_DROPPED = '''
def account(workload, device=DEVICE):
    with Meter(device) as meter:
        before = meter.allocated()
        workload()
        return {"before": before, "after": meter.allocated(), "peak": meter.peak(),
                "reserved": meter.reserved()}
'''
ACCOUNT_NO_PEAK = '''
def account(workload, device=DEVICE):
    with Meter(device) as meter:
        before = meter.allocated()
        result = workload()
        after = meter.allocated()
        del result
    return {"before": before, "after": after, "peak": after, "reserved": after}
'''

# -- answers for exercise 2 (measure_release, verdicts) ------------------------------------
MEASURE_RIGHT = '''
def measure_release(make_tensor, device=DEVICE):
    with gc_disabled(), Meter(device) as meter:
        start = meter.reserved()
        tensor = make_tensor()
        alive, r_alive = meter.growth(), meter.reserved() - start
        torch.cuda.empty_cache()
        alive_after_empty_cache, r_alive_after = meter.growth(), meter.reserved() - start
        del tensor
        after_del, r_after_del = meter.growth(), meter.reserved() - start
        torch.cuda.empty_cache()
        last, r_last = meter.growth(), meter.reserved() - start
    return {"alive": alive, "alive_after_empty_cache": alive_after_empty_cache,
            "after_del": after_del, "after_del_and_empty_cache": last,
            "reserved": {"alive": r_alive, "alive_after_empty_cache": r_alive_after,
                         "after_del": r_after_del, "after_del_and_empty_cache": r_last}}
'''
MEASURE_CUDA_COUNTERS = '''
def measure_release(make_tensor, device=DEVICE):
    tensor = make_tensor()
    alive = torch.cuda.memory_allocated()
    torch.cuda.empty_cache()
    alive_after_empty_cache = torch.cuda.memory_allocated()
    del tensor
    after_del = torch.cuda.memory_allocated()
    torch.cuda.empty_cache()
    last = torch.cuda.memory_allocated()
    return {"alive": alive, "alive_after_empty_cache": alive_after_empty_cache,
            "after_del": after_del, "after_del_and_empty_cache": last,
            "reserved": {"alive": alive, "alive_after_empty_cache": alive_after_empty_cache,
                         "after_del": after_del, "after_del_and_empty_cache": last}}
'''
MEASURE_WITHOUT_METER = '''
def measure_release(make_tensor, device=DEVICE):
    size = make_tensor().untyped_storage().nbytes()
    readings = {"alive": size, "alive_after_empty_cache": size, "after_del": 0, "after_del_and_empty_cache": 0}
    return {**readings, "reserved": dict(readings)}
'''
VERDICTS_RIGHT = '''
def verdicts(readings):
    def waits(f):
        return f["after_del"] >= f["alive_after_empty_cache"] and f["after_del_and_empty_cache"] < f["after_del"]
    return {"allocated_until_empty_cache": waits(readings),
            "reserved_until_empty_cache": waits(readings["reserved"]),
            "empty_cache_spares_live_tensors": readings["alive_after_empty_cache"] == readings["alive"]}
'''
VERDICTS_SEED = '''
def verdicts(readings):
    return {"allocated_until_empty_cache": True, "reserved_until_empty_cache": True,
            "empty_cache_spares_live_tensors": readings["alive_after_empty_cache"] == readings["alive"]}
'''
VERDICTS_LITERAL = '''
def verdicts(readings):     # what a GPU shows, written down instead of measured
    return {"allocated_until_empty_cache": False, "reserved_until_empty_cache": True,
            "empty_cache_spares_live_tensors": True}
'''
VERDICTS_HELD_AFTER_DEL = '''
def verdicts(readings):
    r = readings["reserved"]
    return {"allocated_until_empty_cache": readings["after_del"] > 0,
            "reserved_until_empty_cache": r["after_del"] > 0,
            "empty_cache_spares_live_tensors": readings["alive_after_empty_cache"] == readings["alive"]}
'''

# -- held-out wrong answers (issue 10) -------------------------------------------------------
STORAGE_BY_BASE = '''
def storage_bytes(tensors):
    owners = {}                                   # a view counted through the tensor it views (._base)
    for t in tensors:
        owner = t if t._base is None else t._base
        owners[id(owner)] = owner.untyped_storage().nbytes()
    return sum(owners.values())
'''
ACCOUNT_RESERVED_AS_ALLOCATED = ACCOUNT_RIGHT.replace('"reserved": meter.reserved()', '"reserved": meter.allocated()')
ACCOUNT_BEFORE_ZERO = ACCOUNT_RIGHT.replace("before = meter.allocated()", "before = 0   # the meter starts at 0")
MEASURE_NO_EMPTY_CACHE = MEASURE_RIGHT.replace("torch.cuda.empty_cache()", "pass   # empty_cache() is a no-op here")
MEASURE_RESERVED_ABSOLUTE = MEASURE_RIGHT.replace("start = meter.reserved()", "start = 0")
VERDICTS_FROM_RESERVED = '''
def verdicts(readings):
    r = readings["reserved"]                      # what nvidia-smi shows, for every claim
    waits = r["after_del"] >= r["alive_after_empty_cache"] and r["after_del_and_empty_cache"] < r["after_del"]
    return {"allocated_until_empty_cache": waits, "reserved_until_empty_cache": waits,
            "empty_cache_spares_live_tensors": r["alive_after_empty_cache"] == r["alive"]}
'''
# The lesson's verdict before issue 13: both halves of claim 1 judged from allocated memory, which
# empty_cache() never changes, so the reserved half could never come out true on a GPU.
VERDICTS_FROM_ALLOCATED = '''
def verdicts(readings):
    waits = readings["after_del_and_empty_cache"] < readings["after_del"]
    return {"allocated_until_empty_cache": waits, "reserved_until_empty_cache": waits,
            "empty_cache_spares_live_tensors": readings["alive_after_empty_cache"] == readings["alive"]}
'''
# Looks only at the fall at empty_cache(): a figure that already fell at `del` did not wait for it.
VERDICTS_FALL_ONLY = '''
def verdicts(readings):
    r = readings["reserved"]
    return {"allocated_until_empty_cache": readings["after_del_and_empty_cache"] < readings["after_del"],
            "reserved_until_empty_cache": r["after_del_and_empty_cache"] < r["after_del"],
            "empty_cache_spares_live_tensors": readings["alive_after_empty_cache"] == readings["alive"]}
'''

# -- correct answers written differently from the solution: full marks -----------------------
STORAGE_PAIRS = '''
def storage_bytes(tensors):
    return sum(nbytes for _, nbytes in {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                                        for t in tensors})
'''
STORAGE_SEEN_LIST = '''
def storage_bytes(tensors):
    seen, total = [], 0
    for t in tensors:
        s = t.untyped_storage()
        if any(s.data_ptr() == other.data_ptr() for other in seen):
            continue
        seen.append(s)
        total += s.nbytes()
    return total
'''
ACCOUNT_BASELINE_AND_LATE_RESERVED = '''
def account(workload, device=DEVICE):
    meter = Meter(device)
    with meter:
        before = meter.baseline           # allocated() when the meter started
        out = workload()
        after, reserved = meter.allocated(), meter.reserved()
        del out
        peak = meter.peak()               # the most allocated so far: dropping the result does not lower it
    return dict(before=before, after=after, peak=peak, reserved=reserved)
'''
ACCOUNT_DEL_OUTSIDE = '''
def account(workload, device=DEVICE):
    with Meter(device) as m:
        readings = {"before": m.allocated()}
        kept = workload()
        readings.update(after=m.allocated(), reserved=m.reserved(), peak=m.peak())
    del kept
    return readings
'''
MEASURE_TRY_FINALLY = '''
def measure_release(make_tensor, device=DEVICE):
    gc.disable()
    try:
        with Meter(device) as m:
            r0 = m.reserved()
            got, res = {}, {}
            t = make_tensor()
            got["alive"], res["alive"] = m.allocated() - m.baseline, m.reserved() - r0
            torch.cuda.empty_cache()
            got["alive_after_empty_cache"], res["alive_after_empty_cache"] = m.allocated() - m.baseline, m.reserved() - r0
            del t
            got["after_del"], res["after_del"] = m.allocated() - m.baseline, m.reserved() - r0
            torch.cuda.empty_cache()
            got["after_del_and_empty_cache"], res["after_del_and_empty_cache"] = m.allocated() - m.baseline, m.reserved() - r0
    finally:
        gc.enable()
    got["reserved"] = res
    return got
'''
MEASURE_STEPS = '''
def measure_release(make_tensor, device=DEVICE):
    held = [make_tensor]
    steps = [("alive", lambda: held.__setitem__(0, held[0]())),
             ("alive_after_empty_cache", torch.cuda.empty_cache),
             ("after_del", held.clear),
             ("after_del_and_empty_cache", torch.cuda.empty_cache)]
    out = {"reserved": {}}
    with gc_disabled(), Meter(device) as meter:
        start = meter.reserved()
        for name, action in steps:
            action()
            out[name] = meter.growth()
            out["reserved"][name] = meter.reserved() - start
    return out
'''
VERDICTS_EXPLICIT = '''
def verdicts(readings):
    out = {"empty_cache_spares_live_tensors": readings["alive"] - readings["alive_after_empty_cache"] == 0}
    for claim, figure in (("allocated_until_empty_cache", readings),
                          ("reserved_until_empty_cache", readings["reserved"])):
        kept_through_del = figure["after_del"] - figure["alive_after_empty_cache"] >= 0
        released_by_empty_cache = figure["after_del"] - figure["after_del_and_empty_cache"] > 0
        out[claim] = kept_through_del and released_by_empty_cache
    return out
'''
VERDICTS_WITH_BOTH_FIGURES = '''
def verdicts(readings):
    a, r = readings, readings["reserved"]
    fell_at_del = [f["after_del"] < f["alive_after_empty_cache"] for f in (a, r)]
    fell_at_empty_cache = [f["after_del_and_empty_cache"] < f["after_del"] for f in (a, r)]
    allocated, reserved = [not d and e for d, e in zip(fell_at_del, fell_at_empty_cache)]
    return dict(allocated_until_empty_cache=allocated, reserved_until_empty_cache=reserved,
                empty_cache_spares_live_tensors=a["alive_after_empty_cache"] >= a["alive"])
'''

# Each submission fills both answer cells: one plausible wrong answer per exercise, or two.
ACCOUNT_RESERVED_AS_PEAK = ACCOUNT_RIGHT.replace('"reserved": meter.reserved()', '"reserved": meter.peak()')
MEASURE_COLLECTOR_ON = MEASURE_RIGHT.replace("with gc_disabled(), Meter(device) as meter:", "with Meter(device) as meter:"
                                             ).replace("        tensor = make_tensor()\n",
                                                       "        tensor = make_tensor()\n        gc.collect()\n")
MEASURE_SKIPS_FIRST_EMPTY_CACHE = MEASURE_RIGHT.replace("torch.cuda.empty_cache()", "pass", 1)
MEASURE_RESERVED_MINUS_BASELINE = MEASURE_RIGHT.replace("start = meter.reserved()", "start = meter.baseline")
VERDICTS_SPARES_IF_ANYTHING_LEFT = VERDICTS_RIGHT.replace(
    'readings["alive_after_empty_cache"] == readings["alive"]', 'readings["alive_after_empty_cache"] > 0')

# the collector off only while the tensor is made: the `del` reading is taken with it on again# "Before del" read as the first reading: the figure is compared with "alive", before the first
# empty_cache(), which may already have handed cached blocks back.
VERDICTS_FROM_THE_FIRST_READING = VERDICTS_RIGHT.replace('f["after_del"] >= f["alive_after_empty_cache"]',
                                                          'f["after_del"] >= f["alive"]')

MEASURE_COLLECTOR_OFF_ONLY_WHILE_MAKING = MEASURE_RIGHT.replace(
    "with gc_disabled(), Meter(device) as meter:", "with Meter(device) as meter:").replace(
    "        tensor = make_tensor()\n", "        with gc_disabled():\n            tensor = make_tensor()\n")

SUBMISSIONS = {
    "releases_with_the_collector_on": (STORAGE_RIGHT + ACCOUNT_RIGHT,
                                       MEASURE_COLLECTOR_OFF_ONLY_WHILE_MAKING + VERDICTS_RIGHT),
    "reserved_as_peak_collector_on_spares_if_anything_left": (
        STORAGE_RIGHT + ACCOUNT_RESERVED_AS_PEAK, MEASURE_COLLECTOR_ON + VERDICTS_SPARES_IF_ANYTHING_LEFT),
    "skips_the_first_empty_cache": (STORAGE_RIGHT + ACCOUNT_RIGHT, MEASURE_SKIPS_FIRST_EMPTY_CACHE + VERDICTS_RIGHT),
    "reserved_minus_the_meters_baseline": (STORAGE_RIGHT + ACCOUNT_RIGHT, MEASURE_RESERVED_MINUS_BASELINE + VERDICTS_RIGHT),
    "numel_count_and_seed_verdict": (STORAGE_NUMEL + ACCOUNT_RIGHT, MEASURE_RIGHT + VERDICTS_SEED),
    "reads_torch_cuda_directly": (STORAGE_NOT_DEDUPLICATED + ACCOUNT_CUDA_COUNTERS,
                                  MEASURE_CUDA_COUNTERS + VERDICTS_RIGHT),
    "literal_answers_without_measuring": (STORAGE_RIGHT + ACCOUNT_RESULT_DROPPED,
                                          MEASURE_WITHOUT_METER + VERDICTS_LITERAL),
    "tensor_addresses_and_no_peak": (STORAGE_BY_TENSOR_ADDRESS + ACCOUNT_NO_PEAK,
                                     MEASURE_RIGHT + VERDICTS_HELD_AFTER_DEL),
    "dedupes_storages_by_base_reads_allocated_as_reserved_never_calls_empty_cache_verdict_from_reserved": (
        STORAGE_BY_BASE + ACCOUNT_RESERVED_AS_ALLOCATED, MEASURE_NO_EMPTY_CACHE + VERDICTS_FROM_RESERVED),
    "before_hard_wired_to_zero_reserved_not_minus_start": (
        STORAGE_RIGHT + ACCOUNT_BEFORE_ZERO, MEASURE_RESERVED_ABSOLUTE + VERDICTS_RIGHT),
    "verdict_from_allocated_only": (STORAGE_RIGHT + ACCOUNT_RIGHT, MEASURE_RIGHT + VERDICTS_FROM_ALLOCATED),
    "verdict_from_the_fall_at_empty_cache_only": (STORAGE_RIGHT + ACCOUNT_RIGHT, MEASURE_RIGHT + VERDICTS_FALL_ONLY),
    "compares_after_del_with_the_first_reading": (STORAGE_RIGHT + ACCOUNT_RIGHT,
                                                  MEASURE_RIGHT + VERDICTS_FROM_THE_FIRST_READING),
}

# Nothing measured: every reading claims to equal whatever a test compares it with.
CHEAT_EQUAL_TO_ANYTHING = (EQUAL_TO_ANYTHING + '''
def storage_bytes(tensors):
    return EqualToAnything()

def account(workload, device=DEVICE):
    return dict.fromkeys(("before", "after", "peak", "reserved"), EqualToAnything())
''', EQUAL_TO_ANYTHING + '''
def measure_release(make_tensor, device=DEVICE):
    readings = dict.fromkeys(READINGS, EqualToAnything())
    return {**readings, "reserved": dict(readings)}
''' + VERDICTS_RIGHT)

# Two wrong answers (before read as 0; the collector back on before `del`), each hidden from the hidden test by
# rewriting its names through what it hands the answer: a function of the test's own has the test's namespace as
# its __globals__ (writable, and no audit event sees it read), and so do the methods a test sets on the meter's
# class and the torch.cuda.empty_cache it swaps in (its model of a caching allocator).
CHEAT_REWRITES_THE_HIDDEN_TESTS_NAMES = (STORAGE_RIGHT + ACCOUNT_BEFORE_ZERO + '''
_account = account
def account(workload, device=DEVICE):
    for handed in (workload, Meter.allocated, Meter.reserved, torch.cuda.empty_cache):   # what a hidden test handed
        scope = getattr(handed, "__globals__", {})
        if "_reference_account" in scope:
            scope["_reference_account"] = _account             # the test's reference made to agree with this one
    return _account(workload, device)
''', MEASURE_COLLECTOR_OFF_ONLY_WHILE_MAKING + VERDICTS_RIGHT + '''
_measure_release = measure_release
def measure_release(make_tensor, device=DEVICE):
    readings = _measure_release(make_tensor, device)
    scope = getattr(make_tensor, "__globals__", {})
    if "_collector_on_when_freed" in scope:
        scope["_collector_on_when_freed"] = [False]            # what the test saw when the tensor was freed
    return readings
''')

# Right answers written differently from the solution: each must earn full marks.
ALTERNATIVES = {
    "alternative_a": (STORAGE_PAIRS + ACCOUNT_BASELINE_AND_LATE_RESERVED, MEASURE_TRY_FINALLY + VERDICTS_EXPLICIT),
    "alternative_b": (STORAGE_SEEN_LIST + ACCOUNT_DEL_OUTSIDE, MEASURE_STEPS + VERDICTS_WITH_BOTH_FIGURES),
}

# What each wrong answer must lose: (submission, test cell that must fail).
WRONG_ANSWERS = {
    "the collector back on before `del`": ("releases_with_the_collector_on", "test_release_readings"),
    "views counted as new memory (numel x element_size)": ("numel_count_and_seed_verdict", "test_storage_bytes"),
    "seed's verdict: freed only by empty_cache()": ("numel_count_and_seed_verdict", "test_claim_verdicts"),
    "one storage counted once per view": ("reads_torch_cuda_directly", "test_storage_bytes"),
    "account reads torch.cuda counters (0 on CPU)": ("reads_torch_cuda_directly", "test_account"),
    "measure_release reads torch.cuda counters (0 on CPU)": ("reads_torch_cuda_directly", "test_release_readings"),
    "account drops the result before reading": ("literal_answers_without_measuring", "test_account"),
    "readings computed from nbytes, not measured": ("literal_answers_without_measuring", "test_release_readings"),
    "literal verdicts without measurement": ("literal_answers_without_measuring", "test_claim_verdicts"),
    "storages keyed by the tensor's own address": ("tensor_addresses_and_no_peak", "test_storage_bytes"),
    "peak not measured (after used as peak)": ("tensor_addresses_and_no_peak", "test_account"),
    "verdict 'held after del' ignores what empty_cache() did": ("tensor_addresses_and_no_peak", "test_claim_verdicts"),
    "storages de-duplicated by ._base (x.detach() shares x's storage)": (
        "dedupes_storages_by_base_reads_allocated_as_reserved_never_calls_empty_cache_verdict_from_reserved",
        "test_storage_bytes"),
    "reserved read as allocated": (
        "dedupes_storages_by_base_reads_allocated_as_reserved_never_calls_empty_cache_verdict_from_reserved",
        "test_account"),
    "measure_release never calls empty_cache()": (
        "dedupes_storages_by_base_reads_allocated_as_reserved_never_calls_empty_cache_verdict_from_reserved",
        "test_release_readings"),
    "verdicts judged from reserved memory": (
        "dedupes_storages_by_base_reads_allocated_as_reserved_never_calls_empty_cache_verdict_from_reserved",
        "test_claim_verdicts"),
    "before hard-wired to 0": ("before_hard_wired_to_zero_reserved_not_minus_start", "test_account"),
    "reserved readings not taken from the meter's start": (
        "before_hard_wired_to_zero_reserved_not_minus_start", "test_release_readings"),
    "reserved half of the claim judged from allocated memory": ("verdict_from_allocated_only", "test_claim_verdicts"),
    "a figure that fell at del counted as waiting for empty_cache()": (
        "verdict_from_the_fall_at_empty_cache_only", "test_claim_verdicts"),
    "the reading after del compared with the first one, not the one just before del": (
        "compares_after_del_with_the_first_reading", "test_claim_verdicts"),
    "reserved read as peak (the same until something empties the cache)": (
        "reserved_as_peak_collector_on_spares_if_anything_left", "test_account"),
    "measured with the collector on, collecting before each reading": (
        "reserved_as_peak_collector_on_spares_if_anything_left", "test_release_readings"),
    "empty_cache() judged to spare live tensors if anything is left": (
        "reserved_as_peak_collector_on_spares_if_anything_left", "test_claim_verdicts"),
    "no empty_cache() while the tensor is alive": ("skips_the_first_empty_cache", "test_release_readings"),
    "reserved readings taken from the meter's baseline (allocated)": (
        "reserved_minus_the_meters_baseline", "test_release_readings"),
}

# Right answers inside a wrong submission still earn their points.
EARNED = {
    "releases_with_the_collector_on": {"test_storage_bytes", "test_account", "test_claim_verdicts"},
    "reserved_as_peak_collector_on_spares_if_anything_left": {"test_storage_bytes"},
    "skips_the_first_empty_cache": {"test_storage_bytes", "test_account", "test_claim_verdicts"},
    "reserved_minus_the_meters_baseline": {"test_storage_bytes", "test_account", "test_claim_verdicts"},
    "numel_count_and_seed_verdict": {"test_account", "test_release_readings"},
    "reads_torch_cuda_directly": {"test_claim_verdicts"},
    "literal_answers_without_measuring": {"test_storage_bytes"},
    "tensor_addresses_and_no_peak": {"test_release_readings"},
    "dedupes_storages_by_base_reads_allocated_as_reserved_never_calls_empty_cache_verdict_from_reserved": set(),
    "before_hard_wired_to_zero_reserved_not_minus_start": {"test_storage_bytes", "test_claim_verdicts"},
    "verdict_from_allocated_only": {"test_storage_bytes", "test_account", "test_release_readings"},
    "verdict_from_the_fall_at_empty_cache_only": {"test_storage_bytes", "test_account", "test_release_readings"},
    "compares_after_del_with_the_first_reading": {"test_storage_bytes", "test_account", "test_release_readings"},
}


# Wrong fixes that only a device shared with other tensors, whose allocator caches freed blocks, tells apart
# (reserved minus meter.baseline; `before` hard-wired to 0) are caught visibly too: self-check 3 measures on
# gclab.memory.CachingDevice (simulated on a CPU), as the hidden test does.  None is left to catch.
NOT_YET_CAUGHT_VISIBLY: dict = {}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submissions")
    return grade_all({"solution": SOLUTION, "untouched": RELEASE,
                      **write_variants(RELEASE, {**SUBMISSIONS, **ALTERNATIVES,
                                                 "cheat_returns_values_equal_to_anything": CHEAT_EQUAL_TO_ANYTHING,
                                                 "cheat_rewrites_the_hidden_tests_names":
                                                     CHEAT_REWRITES_THE_HIDDEN_TESTS_NAMES},
                                        folder)}, folder)


def test_solution_notebook_runs_clean_on_cpu(executed):
    """The solution as the grader ran it (every cell, hidden tests included): no error, no stderr."""
    assert not problems(executed), f"errors or stderr output in the solution notebook: {problems(executed)}"
    text = printed_text(executed)
    assert "differs" not in text, "a dtype's predicted size should match the meter"
    assert "sum of numel x element_size: 26.00 MiB; the meter: 4.00 MiB" in text
    assert "the 4 KiB row keeps 4.00 MiB alive" in text
    assert "`del a; del b` freed 2.00 MiB of allocated memory at once" in text
    assert re.search(r"del c +0 B +0 B\n", text), "claim 1: allocated and reserved read 0 after `del c` on CPU"
    assert "collections during all this: 0" in text
    assert ("The seed's claim 1, measured on cpu: false of allocated memory (freed at `del`); false of reserved "
            "memory too: the CPU meter has no cache. On a GPU the reserved half holds.") in text
    assert re.search(r"10 losses kept as floats \(\.item\(\)\) hold 0 B", text)
    assert "this measures a no-op" in text, "on CPU the empty_cache() timing must say it times a no-op"
    assert plots_drawn(executed), "the lesson should draw its plot"


def test_solution_earns_full_marks(graded):
    assert_full_marks(graded["solution"], MAX_SCORE)


@pytest.mark.parametrize("name", sorted(ALTERNATIVES))
def test_correct_alternative_earns_full_marks(graded, name):
    assert_full_marks(graded[name], MAX_SCORE)


def test_untouched_student_notebook_earns_nothing(graded):
    assert_no_marks_until_answered(graded["untouched"], MAX_SCORE)


@pytest.mark.parametrize("wrong_answer", sorted(WRONG_ANSWERS))
def test_wrong_answer_loses_its_points_with_a_reason(graded, wrong_answer):
    submission, test_id = WRONG_ANSWERS[wrong_answer]
    result = graded[submission]
    failed = cell_result(result, test_id)
    assert failed.score == 0 and failed.status == "failed", grading.format_results([result])
    assert failed.message, "a lost point needs a reason"


@pytest.mark.parametrize("submission", sorted(SUBMISSIONS))
def test_wrong_submission_earns_less_than_full_marks(graded, submission):
    result = graded[submission]
    assert result.max_score == MAX_SCORE
    assert result.score < MAX_SCORE, grading.format_results([result])
    passed = {t.id for t in result.tests if t.status == "passed"}
    assert passed == EARNED[submission], grading.format_results([result])


# what the visible self-check says of verdicts judged from the wrong figures (it fails before the hidden test)
VISIBLE_VERDICT_HINT = "judge allocated from the allocated figures, reserved from readings['reserved']"


def test_wrong_answers_are_told_by_how_much(graded):
    numel = cell_result(graded["numel_count_and_seed_verdict"], "test_storage_bytes").message
    assert "649" in numel or "664576" in numel, numel          # the naive count of the example tensors
    assert "off by" in numel
    cuda = cell_result(graded["reads_torch_cuda_directly"], "test_account").message
    assert "after - before" in cuda and "got 0" in cuda, cuda
    literal = cell_result(graded["literal_answers_without_measuring"], "test_release_readings").message
    assert "_still_referenced" in literal or "with the collector on" in literal, literal
    held_out = graded["dedupes_storages_by_base_reads_allocated_as_reserved_never_calls_empty_cache_verdict_from_reserved"]
    base = cell_result(held_out, "test_storage_bytes").message
    assert "detach" in base and "off by" in base, base
    reserved = cell_result(held_out, "test_account").message
    assert "reserved is" in reserved and "cached" in reserved, reserved
    no_empty = cell_result(held_out, "test_release_readings").message
    assert "did not drop at the last empty_cache()" in no_empty or "empty_cache() 0 time(s)" in no_empty, no_empty
    from_reserved = cell_result(held_out, "test_claim_verdicts").message
    assert "follow the reserved figures" in from_reserved or VISIBLE_VERDICT_HINT in from_reserved, from_reserved
    from_allocated = cell_result(graded["verdict_from_allocated_only"], "test_claim_verdicts").message
    assert ("reserved verdict follows the allocated figures" in from_allocated
            or VISIBLE_VERDICT_HINT in from_allocated), from_allocated
    fall_only = cell_result(graded["verdict_from_the_fall_at_empty_cache_only"], "test_claim_verdicts").message
    assert "already fell at `del`" in fall_only or "did not fall at `del`" in fall_only, fall_only
    first = cell_result(graded["compares_after_del_with_the_first_reading"], "test_claim_verdicts").message
    assert "alive_after_empty_cache" in first and "follows the allocated" not in first, first
    zero = cell_result(graded["before_hard_wired_to_zero_reserved_not_minus_start"], "test_account").message
    assert "before is 0 B, expected 3.00 MiB" in zero, zero


def test_values_equal_to_anything_earn_no_points(graded):
    """Readings that were never measured but say they equal the meter's: refused, by name."""
    result = graded["cheat_returns_values_equal_to_anything"]
    assert_less_than_full_marks(result, MAX_SCORE)
    for test_id in ("test_storage_bytes", "test_account", "test_release_readings"):
        assert_told_why(result, test_id, "is an EqualToAnything (a subclass of int), expected an int")


def test_rewriting_the_hidden_tests_names_through_what_they_hand_over_gains_nothing(graded):
    """What the hidden tests hand the answer (workloads, tensor makers, the meter's methods and the empty_cache of
    their model of a caching allocator) leads to no namespace of the test: wrong answers that rewrote the test's
    reference and its record of the collector through them (8/8 before) keep their honest 4/8, told why."""
    result = graded["cheat_rewrites_the_hidden_tests_names"]
    assert result.score == MAX_SCORE - 4 and not result.reason, grading.format_results([result])
    assert_told_why(result, "test_account", "before is 0 B, expected 3.00 MiB")
    assert_told_why(result, "test_release_readings", "let the tensor go with the collector on")
