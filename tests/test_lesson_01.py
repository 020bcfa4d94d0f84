"""Lesson 01 end to end: the solution runs clean, and grading accepts only a real fix."""
import re

import pytest
from lesson_support import (
    test_no_graded_cell_of_the_solution_shows_a_value,  # noqa: F401  (collected here)
    test_no_handed_back_file_holds_a_line_of_a_hidden_test,  # noqa: F401  (collected here)
    test_every_test_of_the_reference_records_what_it_observed,  # noqa: F401  (collected here)
    test_every_self_check_ends_with_one_plain_line_when_it_passes,  # noqa: F401  (collected here)
    test_every_wrong_fix_that_loses_points_fails_a_visible_self_check,  # noqa: F401  (collected here)
    EQUAL_TO_ANYTHING, ROOT, assert_full_marks, assert_less_than_full_marks, assert_no_marks_until_answered,
    assert_told_why, grade_all, printed_text, problems,
    shows_error, write_variants,
)

from gclab.grader import grading

SOLUTION = ROOT / "solutions" / "01_reference_counting" / "01_reference_counting.ipynb"
RELEASE = ROOT / "notebooks" / "01_reference_counting" / "01_reference_counting.ipynb"
EXERCISES = {"jobs": ("test_job_reports", "test_job_memory_flat"),
             "scaler": ("test_scaler_results", "test_scaler_memory_flat")}

RUN_JOB = '''
def run_job(i, device=DEVICE):
    try:
        return {{"job": i, "ok": True, "value": train_step(i, device), "error": None}}
    except FloatingPointError as e:
        {handle}
        return {{"job": i, "ok": False, "value": None, "error": {error}}}
'''

MAKE_SCALER = '''
def make_scaler(i, device=DEVICE):
    batch = fitting_batch(i, device)
    {prepare}
    def scale(x):
        return {formula}
    {after}
    return scale
'''


def _scaler(prepare="pass", formula="(x - batch.mean()) / batch.std()", after="pass"):
    return MAKE_SCALER.format(prepare=prepare, formula=formula, after=after)


# Plausible wrong fixes, two exercises' worth each: none may earn full marks on either exercise.
WRONG = {
    "collects_instead_of_dropping": {
        "jobs": RUN_JOB.format(handle="gc.collect()", error="e"),
        "scaler": _scaler(after="gc.collect()"),           # no default list any more, the closure still holds the batch
    },
    "empty_cache_and_del_the_captured_name": {
        "jobs": RUN_JOB.format(handle="if torch.cuda.is_available(): torch.cuda.empty_cache()", error="e"),
        "scaler": _scaler(after="del batch"),               # frees the batch and breaks the scaler
    },
    "drops_what_the_caller_needs": {
        "jobs": RUN_JOB.format(handle="pass", error="str(e)"),      # the report loses the exception
        "scaler": _scaler(prepare="batch = weakref.ref(batch)",    # the batch dies at return, too early
                          formula="(x - batch().mean()) / batch().std()"),
    },
    "deletes_the_wrong_reference": {
        "jobs": RUN_JOB.format(handle="err = e\n        del e", error="err"),
        "scaler": _scaler(prepare="mean, std = batch.mean(), batch.std()",   # small tensors are still tensors
                          formula="(x - mean) / std"),
    },
    # a fresh exception in place of the one raised; a scaler that keeps nothing by refitting on every call
    "keeps_a_copy_and_refits_on_every_call": {
        "jobs": RUN_JOB.format(handle="pass", error="FloatingPointError(str(e))"),
        "scaler": _scaler(prepare="del batch",
                          formula="(x - fitting_batch(i, device).mean()) / fitting_batch(i, device).std()"),
    },
    # the same refit, through a second name for fitting_batch: the calls the hidden test counts are not made
    "keeps_a_copy_and_refits_through_another_name": {
        "jobs": RUN_JOB.format(handle="pass", error="FloatingPointError(str(e))"),
        "scaler": "_fitting = fitting_batch\ndef make_scaler(i, device=DEVICE):\n    fitting_batch(i, device)\n"
                  "    def scale(x):\n        batch = _fitting(i, device)\n        return (x - batch.mean()) / batch.std()\n"
                  "    return scale\n",
    },
    # the same copy and refit, each hidden from the hidden test by rewriting what it recorded: the functions the
    # test swaps in for train_step and fitting_batch are the test's, and a function's __globals__ (which no audit
    # event sees read) is the namespace the test runs in
    "cheat_rewrites_the_hidden_tests_records": {
        "jobs": RUN_JOB.format(
            handle=("copy = FloatingPointError(str(e))\n"
                    "        scope = getattr(train_step, '__globals__', {})\n"
                    "        if '_raised' in scope:\n"
                    "            scope['_raised'].append(copy)        # the test's record of what train_step raised"),
            error="copy"),
        "scaler": """
_SEEN = []
def make_scaler(i, device=DEVICE):
    fitting_batch(i, device)
    def scale(x):
        scope = getattr(fitting_batch, "__globals__", {})
        if "_fits" in scope:
            _SEEN[:] = [scope]
            scope["_NUMEL"] = 256 * 1024            # the size the test's own fitting_batch allocates
        batch = fitting_batch(i, device)
        for seen in _SEEN:
            del seen.get("_fits", [])[1:]           # the test counts one fit
            seen["_NUMEL"] = 1 << 62                # and any allocation of a call looks small next to that
        return (x - batch.mean()) / batch.std()
    return scale
""",
    },
    # each batch copied into a slot of a tensor made beforehand: no new memory for the meter, yet
    # every scaler keeps its batch (a view of the slot), as the leaky one did
    "keeps_its_batch_in_a_reserved_slot": {
        "jobs": RUN_JOB.format(handle="pass", error="e"),
        "scaler": "_SLOTS, _USED = torch.empty(32, SCALER_NUMEL, device=DEVICE), [0]\n" + _scaler(
            prepare="slot = _SLOTS[_USED[0] % 32]\n    _USED[0] += 1\n    slot.copy_(batch)\n    del batch",
            formula="(x - slot.mean()) / slot.std()"),
    },
    # the same slot, and each failure's traceback, boxed in a staticmethod, which keeps what it wraps in no
    # attribute: a walk through attributes and closures alone passed both
    "keeps_its_batch_boxed_in_a_staticmethod": {
        "jobs": RUN_JOB.format(handle="trace, e.__traceback__ = staticmethod(e.__traceback__), None",
                               error="e").replace('"error": e}', '"error": e, "trace": trace}'),
        "scaler": "_SLOTS, _USED = torch.empty(32, SCALER_NUMEL, device=DEVICE), [0]\n" + _scaler(
            prepare="slot = _SLOTS[_USED[0] % 32]\n    _USED[0] += 1\n    slot.copy_(batch)\n    del batch\n"
                    "    box = staticmethod(slot)\n    del slot",
            formula="(x - box.__func__.mean()) / box.__func__.std()"),
    },
    # each report carries a view of an archive mapped from a file beforehand: no new memory for any reading
    "reports_keep_a_view_of_a_file_archive": {
        "jobs": ("import mmap, tempfile\n_FILE = tempfile.TemporaryFile(dir='.')\n_FILE.truncate(16 * 256 * 1024 * 4)\n"
                 "_ARCHIVE = torch.frombuffer(mmap.mmap(_FILE.fileno(), 16 * 256 * 1024 * 4), "
                 "dtype=torch.float32).view(16, -1)\n"
                 + RUN_JOB.format(handle="e = e.with_traceback(None)", error="e").replace(
                     '"error": None}', '"error": None, "batch": _ARCHIVE[i % 16].fill_(float(i))}')),
        "scaler": _scaler(after="gc.collect()"),
    },
    # only the latest failure's traceback kept (a global), only the latest batch (a default list): bounded, not gone
    "keeps_only_the_latest": {
        "jobs": "last_traceback = None\n" + RUN_JOB.format(
            handle="global last_traceback\n        last_traceback = e.__traceback__", error="e.with_traceback(None)"),
        "scaler": _scaler(prepare="mean, std = float(batch.mean()), float(batch.std())\n    _LATEST[:] = [batch]",
                          formula="(x - mean) / std").replace("def make_scaler(i, device=DEVICE):",
                                                              "_LATEST = []\ndef make_scaler(i, device=DEVICE):"),
    },
    "patches_the_grader": {
        "jobs": RUN_JOB.format(handle="pass", error="e") + "\nchecks.assert_flat = lambda report: None\n",
        "scaler": _scaler(),
    },
}


# Behaving only while watched: exercise 1 leaks unless the collector is off, exercise 2 unless
# nbgrader runs the notebook (the graded run happens in a fresh process, without NBGRADER_EXECUTION).
WATCHED = {
    "jobs": RUN_JOB.format(handle="pass", error="e if gc.isenabled() else e.with_traceback(None)"),
    "scaler": _scaler(prepare=("if os.environ.get('NBGRADER_EXECUTION'):\n"
                               "        mean, std = float(batch.mean()), float(batch.std())\n"
                               "        del batch\n"
                               "        scale = lambda x: (x - mean) / std\n"
                               "        return scale"),
                      after="pass"),
}

# Right fixes written differently from the solution: each must earn full marks on both exercises.
ALTERNATIVES = {
    # both functions under a torch decorator: their __globals__ are torch's, the functions they wrap the notebook's
    "decorated_with_no_grad": {
        "jobs": "@torch.no_grad()" + RUN_JOB.format(handle="pass", error="e.with_traceback(None)"),
        "scaler": "@torch.inference_mode()" + _scaler(prepare="mean, std = float(batch.mean()), float(batch.std())\n    del batch",
                                                      formula="(x - mean) / std"),
    },
    "alternative_a": {
        "jobs": RUN_JOB.format(handle="e.__traceback__ = None          # drop the frames, keep the exception",
                               error="e"),
        "scaler": _scaler(prepare="mean, std = batch.mean().item(), batch.std().item()\n    del batch",
                          formula="(x - mean) / std"),
    },
    "alternative_b": {
        "jobs": '''
def run_job(i, device=DEVICE):
    error = value = None
    try:
        value = train_step(i, device)
    except FloatingPointError as caught:
        error = caught
    if error is None:
        return {"job": i, "ok": True, "value": value, "error": None}
    traceback.clear_frames(error.__traceback__)    # the frames' locals (the tensors) go
    error.__traceback__ = None
    return {"job": i, "ok": False, "value": None, "error": error}
''',
        "scaler": '''
class Scaler:
    """Only the two numbers a scaler needs."""
    def __init__(self, mean, std):
        self.mean, self.std = mean, std

    def __call__(self, x):
        return (x - self.mean) / self.std

def make_scaler(i, device=DEVICE):
    std, mean = torch.std_mean(fitting_batch(i, device))
    return Scaler(float(mean), float(std))
''',
    },
}


# train_step never run and no scaler fitted: the values claim to equal whatever they are compared with.
CHEAT_EQUAL_TO_ANYTHING = {
    "jobs": EQUAL_TO_ANYTHING + '''
def run_job(i, device=DEVICE):
    torch.empty(JOB_NUMEL, device=device)             # what a step allocates, let go at once
    if i % 3 == 2:
        return {"job": i, "ok": False, "value": None, "error": FloatingPointError(f"job {i}: loss is NaN")}
    return {"job": i, "ok": True, "value": EqualToAnything(), "error": None}
''',
    "scaler": EQUAL_TO_ANYTHING + '''
def make_scaler(i, device=DEVICE):
    fitting_batch(i, device)
    return lambda x: [EqualToAnything()] * x.numel()
''',
}


# train_step never run, its numbers written from reading it; the leaky scaler, unchanged, fitted with
# torch's dispatch (the CPU meter) turned off, after a throwaway allocation the size of a batch.
CHEAT_SKIPS_THE_WORK_AND_HIDES = {
    "jobs": '''
def run_job(i, device=DEVICE):
    torch.empty(JOB_NUMEL, device=device)             # what a step allocates, let go at once
    if i % 3 == 2:
        return {"job": i, "ok": False, "value": None, "error": FloatingPointError(f"job {i}: loss is NaN")}
    return {"job": i, "ok": True, "value": 2.0 * i * JOB_NUMEL, "error": None}
''',
    "scaler": '''
def make_scaler(i, device=DEVICE, _fitted=[]):
    torch.empty(SCALER_NUMEL, device=device)
    with torch._C._DisableTorchDispatch():
        batch = fitting_batch(i, device)
    _fitted.append(batch)
    def scale(x):
        return (x - batch.mean()) / batch.std()
    return scale
''',
}


# A right fix for one exercise only: the points follow each exercise on its own.
ONE_RIGHT = {
    "jobs": RUN_JOB.format(handle="pass", error="e.with_traceback(None)"),
    "scaler": _scaler(),                                    # no default list, but the closure keeps the batch
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submissions")
    variants = {**WRONG, "one_exercise_right": ONE_RIGHT, "leaks_unless_collector_off_or_under_nbgrader": WATCHED,
                "cheat_returns_values_equal_to_anything": CHEAT_EQUAL_TO_ANYTHING,
                "cheat_skips_the_work_and_hides_from_the_meter": CHEAT_SKIPS_THE_WORK_AND_HIDES,
                **ALTERNATIVES}
    results = grade_all({"solution": SOLUTION, "untouched": RELEASE,
                         **write_variants(RELEASE, variants, folder)}, folder)
    print(grading.format_results(list(results.values())))      # shown with `pytest -s`
    return results


def _score(result, exercise):
    tests = {t.id: t for t in result.tests}
    return sum(tests[i].score for i in EXERCISES[exercise]), sum(tests[i].max_score for i in EXERCISES[exercise])


def _message(result, test_id):
    return next(t.message for t in result.tests if t.id == test_id)


def test_solution_notebook_runs_clean_on_cpu(executed):
    """The solution as the grader ran it (every cell, hidden tests included): no error, no stderr,
    except the failed cell that section 3.3 runs on purpose."""
    unexpected = problems(executed, expected_error="step failed holding")
    assert not unexpected, f"errors or stderr output in the solution notebook: {unexpected}"
    assert shows_error(executed, "step failed holding"), "section 3.3 should show the failed cell's error"
    text = printed_text(executed)
    assert "collections while this ran: 0" in text
    assert re.search(r"box\.clear\(\)\s+0 B", text), "the tensor should be freed when the list lets go"
    assert re.search(r"del y\s+1\.00 MiB", text), "del of a name should not free a tensor the list holds"
    assert re.search(r"Out\[\d+\]", text), "the output cache should be named as a holder"
    assert "saved.__traceback__.tb_next.tb_frame.f_locals['activations']" in text, (
        "the saved exception's path should name the local variable, as the failed cell's does")
    assert re.search(r"sys\.last_traceback(\.tb_next)+\.tb_frame\.f_locals\['activations'\]", text)
    assert "(a local variable)" not in text
    assert re.search(r"%reset -f out \+ the hidden _ +after del: +2\.00 MiB +after the fix: +0 B", text), (
        "the summary should record the output cache once IPython's hidden copy of _ is gone too")
    assert "after `saved.__traceback__ = None`: 0 B held" in text
    assert "now held: 0 B; collections: 0" in text, "forget_last_error should free the failed call's tensor"
    assert "rescale.__closure__[0].cell_contents" in text and "remember.__defaults__[0][0]" in text
    assert "after emptying the default list and deleting `rescale`: 0 B held" in text
    assert "(the loss is gone)" in text, "%xdel should drop every cached reference"


def test_solution_earns_full_marks(graded):
    assert_full_marks(graded["solution"], 10)


def test_untouched_student_notebook_earns_nothing(graded):
    assert_no_marks_until_answered(graded["untouched"], 10)
    for exercise, name in (("jobs", "run_job"), ("scaler", "make_scaler")):
        for test_id in EXERCISES[exercise]:
            assert f"{name} is not defined yet" in _message(graded["untouched"], test_id)


@pytest.mark.parametrize("name", sorted(WRONG))
@pytest.mark.parametrize("exercise", sorted(EXERCISES))
def test_wrong_fix_does_not_earn_full_marks(graded, name, exercise):
    result = graded[name]
    score, max_score = _score(result, exercise)
    assert result.max_score == 10
    assert score < max_score, grading.format_results([result])
    assert all(t.message for t in result.tests if t.status != "passed"), "every lost point needs a reason"


@pytest.mark.parametrize("name", sorted(ALTERNATIVES))
def test_correct_alternative_earns_full_marks(graded, name):
    assert_full_marks(graded[name], 10)


@pytest.mark.parametrize("exercise", sorted(EXERCISES))
def test_behaving_only_while_watched_loses_marks(graded, exercise):
    """Exercise 1 leaks unless gc.isenabled() is False, exercise 2 unless NBGRADER_EXECUTION is set:
    the graded run checks with the collector on too, in a process where that variable is not set."""
    result = graded["leaks_unless_collector_off_or_under_nbgrader"]
    score, max_score = _score(result, exercise)
    assert score < max_score, grading.format_results([result])
    assert all(t.message for t in result.tests if t.status != "passed"), "every lost point needs a reason"


def test_each_exercise_is_scored_on_its_own(graded):
    result = graded["one_exercise_right"]
    assert _score(result, "jobs") == (5, 5), grading.format_results([result])
    assert _score(result, "scaler") == (0, 5), grading.format_results([result])
    assert "holds 1.00 MiB" in _message(result, "test_scaler_results")


def test_wrong_fixes_are_told_why(graded):
    assert "collector ran" in _message(graded["collects_instead_of_dropping"], "test_job_memory_flat")
    assert "holds" in _message(graded["collects_instead_of_dropping"], "test_scaler_results")
    assert "did not return to its baseline" in _message(graded["empty_cache_and_del_the_captured_name"],
                                                        "test_job_memory_flat")
    assert "raised NameError" in _message(graded["empty_cache_and_del_the_captured_name"], "test_scaler_results")
    assert "FloatingPointError" in _message(graded["drops_what_the_caller_needs"], "test_job_reports")
    assert "it fits a batch again on every call" in _message(graded["keeps_a_copy_and_refits_through_another_name"],
                                                             "test_scaler_results")
    assert "must still work after make_scaler has returned" in _message(graded["drops_what_the_caller_needs"],
                                                                   "test_scaler_results")
    assert "holds" in _message(graded["deletes_the_wrong_reference"], "test_job_reports")
    assert "something outside the failed job's report keeps the failed step's tensors" in _message(
        graded["keeps_only_the_latest"], "test_job_reports")
    assert "something outside the kept scaler keeps its batch" in _message(graded["keeps_only_the_latest"],
                                                                      "test_scaler_results")
    assert "it stopped growing" in _message(graded["keeps_only_the_latest"], "test_job_memory_flat")
    assert "did not return to its baseline" in _message(graded["deletes_the_wrong_reference"],
                                                        "test_scaler_memory_flat")
    assert "modifies the grader" in graded["patches_the_grader"].reason
    assert "a report must refer to no tensor at all, but job 3's report['batch']" in _message(
        graded["reports_keep_a_view_of_a_file_archive"], "test_job_reports")
    assert "must refer to no tensor at all, but scaler 3 (closure variable 'slot')" in _message(
        graded["keeps_its_batch_in_a_reserved_slot"], "test_scaler_results")
    assert "must refer to no tensor at all, but scaler 3 (closure variable 'box').__func__" in _message(
        graded["keeps_its_batch_boxed_in_a_staticmethod"], "test_scaler_results")
    assert "a failed job's report holds" in _message(graded["keeps_its_batch_boxed_in_a_staticmethod"], "test_job_reports")


def test_values_equal_to_anything_earn_no_points(graded):
    """Reports and scaled values never computed, but saying they equal the reference: refused, by name."""
    result = graded["cheat_returns_values_equal_to_anything"]
    assert_less_than_full_marks(result, 10)
    assert_told_why(result, "test_job_reports", "is an EqualToAnything (a subclass of int)")
    assert_told_why(result, "test_scaler_results", "is an EqualToAnything (a subclass of int)")


def test_a_copy_of_the_error_and_a_scaler_that_refits_are_told_why(graded):
    result = graded["keeps_a_copy_and_refits_on_every_call"]
    assert_told_why(result, "test_job_reports", "does not hold the exception train_step raised")
    assert_told_why(result, "test_scaler_results", "refitting on every call is not the same scaler")


def test_rewriting_what_the_hidden_tests_recorded_gains_nothing(graded):
    """The functions the hidden tests swap in for train_step and fitting_batch lead to no namespace of the
    test (a function's __globals__ is writable, and no audit event sees it read): a copied exception and a
    scaler that refits, each hidden by rewriting through them what the test recorded, keep their honest
    6/10 (they had 10/10)."""
    result = graded["cheat_rewrites_the_hidden_tests_records"]
    assert result.score == 6 and not result.reason, grading.format_results([result])
    assert_told_why(result, "test_job_reports", "does not hold the exception train_step raised")
    assert_told_why(result, "test_scaler_results", "refitting on every call is not the same scaler")


@pytest.mark.parametrize("exercise", sorted(EXERCISES))
def test_skipping_the_work_or_hiding_it_from_the_meter_loses_marks(graded, exercise):
    """Values written from reading train_step (a swapped train_step's numbers differ), and a batch
    made where the CPU meter cannot see it (the unwatched iterations measure the process's heap)."""
    result = graded["cheat_skips_the_work_and_hides_from_the_meter"]
    score, max_score = _score(result, exercise)
    assert score < max_score, grading.format_results([result])
    assert all(t.message for t in result.tests if t.status != "passed"), "every lost point needs a reason"
