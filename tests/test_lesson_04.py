"""Lesson 04 end to end: the solution runs clean, and grading accepts only a broken cycle."""
import re

import pytest

from lesson_support import (
    test_no_graded_cell_of_the_solution_shows_a_value,  # noqa: F401  (collected here)
    test_no_handed_back_file_holds_a_line_of_a_hidden_test,  # noqa: F401  (collected here)
    test_every_test_of_the_reference_records_what_it_observed,  # noqa: F401  (collected here)
    test_every_wrong_fix_that_loses_points_fails_a_visible_self_check,  # noqa: F401  (collected here)
    test_every_self_check_ends_with_one_plain_line_when_it_passes,  # noqa: F401  (collected here)
    ROOT, assert_full_marks, assert_less_than_full_marks, assert_no_marks_until_answered, cell_result,
    assert_told_why, grade_all, plots_drawn, printed_text, problems, write_variants,
)

from gclab.grader import grading

SOLUTION = ROOT / "solutions" / "04_awaitable_callback_oom" / "04_awaitable_callback_oom.ipynb"
RELEASE = ROOT / "notebooks" / "04_awaitable_callback_oom" / "04_awaitable_callback_oom.ipynb"

VIEW = '''
class BatchView:
    def __init__(self, pending, rows, keep_columns):
        self._pending = pending
        self.rows = rows
        self.keep_columns = keep_columns
        self._callbacks = {callbacks}

    def wait(self):
        out = self._pending.wait()
        for callback in self._callbacks:
            out = callback(out)
        {after}
        return out
{extra}
'''


def view(callbacks="[lambda t: t.view(self.rows, -1), lambda t: t[:, : self.keep_columns]]", after="", extra=""):
    return VIEW.format(callbacks=callbacks, after=after, extra=extra)


# Plausible wrong fixes (and a hostile submission): none may earn full marks.
WRONG = {
    "collect_in_wait": view(after="gc.collect()"),
    "empty_cache_in_wait": view(after="if torch.cuda.is_available(): torch.cuda.empty_cache()"),
    "bound_methods": view(callbacks="[self._rows, self._first_columns]", extra=(
        "    def _rows(self, t):\n        return t.view(self.rows, -1)\n"
        "    def _first_columns(self, t):\n        return t[:, : self.keep_columns]\n")),
    "clears_callbacks_after_wait": view(after="self._callbacks = []"),
    "drops_pending_after_wait": view(after="self._pending = None"),
    "copies_the_result": view(callbacks="[lambda t: t.view(rows, -1), lambda t: t[:, :keep_columns]]",
                              after="out = out.clone()"),
    "patches_the_detector": view(extra="\ncycles.find_tensor_cycles = lambda *args, **kwargs: []\n"
                                       "checks.assert_flat = lambda report: None\n"),
    # the cycle is kept and a finaliser breaks it: it runs only once the collector has found the cycle
    "del_clears_callbacks": view(extra="    def __del__(self):\n        self._callbacks = []\n"),
    # behaving only while watched: the cycle is built unless the collector is off and nbgrader runs the notebook
    "leaks_unless_collector_off_or_under_nbgrader": view(
        callbacks=("[lambda t: t.view(self.rows, -1), lambda t: t[:, : self.keep_columns]]\n"
                   "        if gc.isenabled() or not os.environ.get('NBGRADER_EXECUTION'):\n"
                   "            self._keep = self\n"
                   "        else:\n"
                   "            self._callbacks = [lambda t: t.view(rows, -1), lambda t: t[:, :keep_columns]]")),
    # the cycle is built unless the collector is off or a meter's dispatch mode is on: the collector-on
    # iterations that run with nothing of the grader's in the process see it
    "leaks_unless_collector_off_or_metered": view(
        callbacks=("[lambda t: t.view(rows, -1), lambda t: t[:, :keep_columns]]\n"
                   "        if gc.isenabled() and not torch._C._len_torch_dispatch_stack():\n"
                   "            self._callbacks = [lambda t: t.view(self.rows, -1), lambda t: t[:, : self.keep_columns]]")),
    # no cycle (values captured), but the pending batch is dropped after the first wait(): a second one fails
    # no cycle, but the class keeps the last view waited on (and its batch): not a cycle, the message says so
    "keeps_the_last_view_on_the_class": view(callbacks="[lambda t: t.view(rows, -1), lambda t: t[:, :keep_columns]]",
                                             after="BatchView.last = self"),
    # the lambdas capture the numbers, not self, but are kept on the class: every view uses the last one's
    "callbacks_kept_on_the_class": view(callbacks="[lambda t: t.view(rows, -1), lambda t: t[:, :keep_columns]]").replace(
        "        self._callbacks = [", "        BatchView._callbacks = ["),
    # the columns worked out from the lesson's batch shape, not the batch's: a batch of another shape breaks it
    "columns_from_the_lessons_shape": view(
        callbacks="[lambda t: t.view(rows, ROWS * COLUMNS // rows), lambda t: t[:, :keep_columns]]"),
    "waits_only_once": view(callbacks="[lambda t: t.view(rows, -1), lambda t: t[:, :keep_columns]]",
                            after="self._pending = None"),
}

# Right fixes written differently from the solution: each must earn full marks.
ALTERNATIVES = {
    "weakref_to_self": view(callbacks=(
        "[lambda t, this=weakref.ref(self): t.view(this().rows, -1),\n"
        "                           lambda t, this=weakref.ref(self): t[:, : this().keep_columns]]")),
    "partial_of_module_functions": (
        "import functools\n\n"
        "def _reshape(rows, t):\n    return t.view(rows, -1)\n\n"
        "def _first_columns(keep_columns, t):\n    return t[:, :keep_columns]\n"
        + view(callbacks="[functools.partial(_reshape, rows), functools.partial(_first_columns, keep_columns)]")),
}


# A copy, not a view of the batch, behind a tensor subclass that names the batch's storage as its own.
CHEAT_COPY_CLAIMS_THE_BATCH = '''
class ClaimsStorage(torch.Tensor):
    def untyped_storage(self):
        return self.claimed.untyped_storage()

class BatchView:
    def __init__(self, pending, rows, keep_columns):
        self._pending, self.rows, self.keep_columns = pending, rows, keep_columns

    def wait(self):
        buffer = self._pending.wait()
        copy = buffer.view(self.rows, -1)[:, :self.keep_columns].clone().as_subclass(ClaimsStorage)
        copy.claimed = buffer
        return copy
'''


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submissions")
    variants = {**WRONG, **ALTERNATIVES, "cheat_copy_claims_the_batch": CHEAT_COPY_CLAIMS_THE_BATCH}
    paths = {"solution": SOLUTION, "untouched": RELEASE, **write_variants(RELEASE, variants, folder)}
    return grade_all(paths, folder)


def test_solution_notebook_runs_clean_on_cpu(executed):
    """The solution as the grader ran it (every cell, hidden tests included): no error, no stderr."""
    assert not problems(executed), f"errors or stderr output in the solution notebook: {problems(executed)}"
    text = printed_text(executed)
    sizes = dict(re.findall(r"([\d.]+ [KM]iB) per call: (collection|out of memory) at call \d+", text))
    assert sizes["32.00 KiB"] == "collection" and sizes["1.00 MiB"] == "out of memory", sizes
    assert sizes["256.00 KiB"] == "out of memory", "the lesson's size hits the budget before the first collection"
    assert "torch.OutOfMemoryError: Simulated CPU budget exceeded" in text
    assert text.count("Tensor-cycle detector on") == 1, "the detector's notice is printed once"
    assert "--closure cell 'self'--> cell" in text, "the detector should name the closure cell that holds self"
    assert re.search(r"LambdaOverValue:\s+0 B held,\s+0 objects", text)
    assert re.search(r"BoundMethod:\s+12\.50 MiB held", text), "a stored bound method is still a cycle"
    assert plots_drawn(executed) >= 3, "the timeline, the cycle and the five ways are drawn"


def test_solution_earns_full_marks(graded):
    assert_full_marks(graded["solution"], 8)


@pytest.mark.parametrize("name", sorted(ALTERNATIVES))
def test_correct_alternative_earns_full_marks(graded, name):
    assert_full_marks(graded[name], 8)


def test_untouched_student_notebook_earns_nothing(graded):
    assert_no_marks_until_answered(graded["untouched"], 8)
    assert all("BatchView is not defined yet" in t.message for t in graded["untouched"].tests)


@pytest.mark.parametrize("name", sorted(WRONG))
def test_wrong_fix_does_not_earn_full_marks(graded, name):
    assert_less_than_full_marks(graded[name], 8)


def test_leaving_any_cycle_loses_the_memory_and_cycle_marks(graded):
    """Fixes that keep a cycle, on any path, keep only the views' 3 points; those that break it
    after the first wait() lose those too (a second wait() fails)."""
    for name in ("collect_in_wait", "empty_cache_in_wait", "bound_methods", "del_clears_callbacks"):
        result = graded[name]
        assert result.score == 3, grading.format_results([result])
        assert cell_result(result, "test_same_views").status == "passed"
    for name in ("clears_callbacks_after_wait", "drops_pending_after_wait"):
        result = graded[name]
        assert result.score == 0, grading.format_results([result])
        assert "a second wait() on the same view" in cell_result(result, "test_same_views").message


def test_wrong_fixes_are_told_why(graded):
    def message(name, test_id):
        return cell_result(graded[name], test_id).message

    assert "collector ran" in message("collect_in_wait", "test_memory_flat")
    assert "did not return to its baseline" in message("clears_callbacks_after_wait", "test_memory_flat")
    assert "detector found reference cycles" in message("bound_methods", "test_no_cycle")
    assert "a copy" in message("copies_the_result", "test_same_views")
    assert graded["copies_the_result"].score == 5, ("a copy is the only thing wrong with it: "
                                                    + grading.format_results([graded["copies_the_result"]]))
    assert "modifies the grader" in graded["patches_the_detector"].reason
    finaliser = message("del_clears_callbacks", "test_no_cycle")
    assert "were not freed" in finaliser and "__del__" in finaliser, finaliser
    assert graded["patches_the_detector"].score == 0
    assert "a second wait() on the same view" in message("waits_only_once", "test_same_views")
    assert "with two views alive, the older one" in message("callbacks_kept_on_the_class", "test_same_views")
    assert "the columns follow from the batch's size" in message("columns_from_the_lessons_shape", "test_same_views")
    kept = message("keeps_the_last_view_on_the_class", "test_no_cycle")
    assert "1 of them is still alive after a full collection too, so no cycle keeps them" in kept, kept


def test_a_copy_claiming_the_batch_storage_is_not_a_view(graded):
    """A tensor subclass that names the batch's storage as its own: refused before its storage is read."""
    result = graded["cheat_copy_claims_the_batch"]
    assert_less_than_full_marks(result, 8)
    assert_told_why(result, "test_same_views", "wait()'s result is a ClaimsStorage (a subclass of torch.Tensor)")
