"""Lesson 08 end to end: the solution runs clean, and each fix of the program earns its own points."""
import re

import nbformat
import pytest

from lesson_support import (
    test_no_graded_cell_of_the_solution_shows_a_value,  # noqa: F401  (collected here)
    test_no_handed_back_file_holds_a_line_of_a_hidden_test,  # noqa: F401  (collected here)
    test_every_test_of_the_reference_records_what_it_observed,  # noqa: F401  (collected here)
    test_every_wrong_fix_that_loses_points_fails_a_visible_self_check,  # noqa: F401  (collected here)
    test_every_self_check_ends_with_one_plain_line_when_it_passes,  # noqa: F401  (collected here)
    EQUAL_TO_ANYTHING, ROOT, assert_full_marks, assert_less_than_full_marks, assert_told_why, cell_result, grade_all,
    plots_drawn, printed_text, problems, write_locked_cells_edited, write_variants,
)

from gclab.grader import grading

SOLUTION = ROOT / "solutions" / "08_capstone" / "08_capstone.ipynb"
RELEASE = ROOT / "notebooks" / "08_capstone" / "08_capstone.ipynb"
POINTS = 12
TESTS = ["test_batches", "test_trainer", "test_registry", "test_errors", "test_serving", "test_job"]


def given_program() -> str:
    """The program as the lesson gives it: the code a learner copies into the answer cell."""
    nb = nbformat.read(SOLUTION, 4)
    return next(c.source for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "given_program")


# The given server's collection in every request.
SERVE_COLLECTS = "        gc.collect()                       # keeps the server's memory flat between requests"

# Each planted problem's smallest fix: (what the given program says, what the fix says).
FIXES = {
    "batches": [("self.on_ready = lambda x: x.clamp(-self.limit, self.limit)",
                 "self.on_ready = functools.partial(torch.clamp, min=-limit, max=limit)")],
    "trainer": [("        return F.cross_entropy(self.model(VAL_X), VAL_Y)",
                 "        with torch.no_grad():\n            return F.cross_entropy(self.model(VAL_X), VAL_Y).item()")],
    "registry": [("        self.versions = {}", "        self.versions = weakref.WeakValueDictionary()"),
                 ("        self.versions[self.latest] = snapshot",
                  "        self.versions[self.latest] = self._current = snapshot")],
    "errors": [("self.errors.append(error)", 'self.errors.append(f"{type(error).__name__}: {error}")')],
    "serving": [(SERVE_COLLECTS, "        pass")],
}


def program(fixed=(), extra=()) -> str:
    """The given program with the fixes named in `fixed`, then the (old, new) edits in `extra`."""
    source = "import functools\n" + given_program()
    for old, new in [edit for name in fixed for edit in FIXES[name]] + list(extra):
        assert source.count(old) == 1, f"{old!r} is not in the program once"
        source = source.replace(old, new)
    return source


EVERY_FIX = list(FIXES)
MEMORY_FIXES_BUT_STEPS = ["registry", "errors", "serving"]
BATCH_RETURN = "        return self.inputs, DATA_Y[self.step % N_BATCHES]"
TRAINER_RETURN = "        return loss.item()"
SERVER_INIT = "        self.errors = []                                     # rejected requests, for the health page"

# Right programs written differently from the solution: each must earn full marks.
ALTERNATIVES = {
    "smallest_fixes": program(EVERY_FIX),
    "fixes_written_differently": program(extra=[
        ("self.on_ready = lambda x: x.clamp(-self.limit, self.limit)",
         "self.on_ready = lambda x, limit=limit: x.clamp(-limit, limit)     # the value, not self"),
        ("        return F.cross_entropy(self.model(VAL_X), VAL_Y)",
         "        return F.cross_entropy(self.model(VAL_X).detach(), VAL_Y).item()"),
        ("        self.versions[self.latest] = snapshot",
         "        self.versions[self.latest] = weakref.ref(snapshot)\n        self._latest_model = snapshot"),
        ("        return self.versions[version or self.latest]",
         "        model = self.versions[version or self.latest]()\n"
         "        if model is None:\n            raise KeyError(version)\n        return model"),
        ("self.errors.append(error)", "self.errors.append(error.with_traceback(None))"),
        (SERVER_INIT, SERVER_INIT + "\n        gc.freeze()                   # the long-lived heap: never walked again"),
        (SERVE_COLLECTS, "        pass"),
    ]),
}

# Plausible wrong fixes: none may earn full marks.
WRONG = {
    "unchanged_program": program(),
    "collects_every_step": program(MEMORY_FIXES_BUT_STEPS, [
        (BATCH_RETURN, "        gc.collect()\n" + BATCH_RETURN),
        (TRAINER_RETURN, "        gc.collect()\n" + TRAINER_RETURN)]),
    "empty_cache_every_step": program(MEMORY_FIXES_BUT_STEPS, [
        (BATCH_RETURN, "        torch.cuda.empty_cache()\n" + BATCH_RETURN),
        (TRAINER_RETURN, "        torch.cuda.empty_cache()\n" + TRAINER_RETURN)]),
    "drops_what_leaks": program(["serving"], [
        ("        self.inputs = self.on_ready(x)\n        return self.inputs,", "        return self.on_ready(x),"),
        ('{"step": step, "loss": loss.item(), "val_loss": self.validate()}', '{"step": step, "loss": loss.item()}'),
        ("        self.versions[self.latest] = snapshot", "        self.versions = {self.latest: snapshot}"),
        ("            self.errors.append(error)\n", "")]),
    "collector_off_for_good": program(EVERY_FIX, [(SERVER_INIT, SERVER_INIT + "\n        gc.disable()")]),
    "thresholds_sky_high": program(EVERY_FIX, [(SERVER_INIT, SERVER_INIT + "\n        gc.set_threshold(10**9)")]),
    # a cheap collection in every request, of the young generation only: an explanation the audit page
    # drops has moved to an older generation by then, and no automatic collection comes to free it
    "collects_the_young_generation_every_request": program(["batches", "trainer", "registry", "errors"], [
        (SERVE_COLLECTS, "        gc.collect(0)                      # only the young generation: cheap")]),
    "collects_every_50_requests": program(["batches", "trainer", "registry", "errors"], [
        (SERVE_COLLECTS,
         "        self.served = getattr(self, 'served', 0) + 1\n"
         "        if self.served % 50 == 0:\n            gc.collect()")]),
    # a band-aid that waits: the first collection comes after 1,000 requests, more than a short test serves
    "collects_every_1000_requests": program(["batches", "trainer", "registry", "errors"], [
        (SERVE_COLLECTS,
         "        self.served = getattr(self, 'served', 0) + 1\n"
         "        if self.served % 1000 == 0:\n            gc.collect()")]),
    # rarer still: its pauses fit the P99 budget, but with the collector off the program still collects
    "collects_every_200_requests": program(["batches", "trainer", "registry", "errors"], [
        (SERVE_COLLECTS,
         "        self.served = getattr(self, 'served', 0) + 1\n"
         "        if self.served % 200 == 0:\n            gc.collect()")]),
    # the same, leaving alone a caller that switched the collector off (the job): a full collection of its own in
    # a request every 200, which the P99 budget lets through
    "collects_every_200_requests_while_the_collector_is_on": program(["batches", "trainer", "registry", "errors"], [
        (SERVE_COLLECTS,
         "        self.served = getattr(self, 'served', 0) + 1\n"
         "        if gc.isenabled() and self.served % 200 == 0:\n            gc.collect()")]),
    # the batch's cycle broken by unlinking the callback once it has run: a batch dropped unready keeps its cycle
    # freezing taught as a good thing, done after every request: each explanation the audit page lets go of has
    # been frozen by then, and is never collected (the garbage left reads 0: no collection sees it)
    "freezes_after_every_request": program(["batches", "trainer", "registry", "errors"], [
        (SERVE_COLLECTS, "        gc.freeze()                        # what survived this request is long-lived")]),
    "unlinks_the_callback_after_first_use": program(["trainer", "registry", "errors", "serving"], [
        ("        self.inputs = self.on_ready(x)\n",
         "        self.inputs = self.on_ready(x)\n        self.on_ready = None                 # break the cycle once it has run\n")]),
    # the collection in every request made rarer by a clock: the job, with the collector off, still collects
    "collects_at_most_once_a_second": "import time\n" + program(["batches", "trainer", "registry", "errors"], [
        (SERVE_COLLECTS,
         "        now = time.monotonic()\n"
         "        if now - getattr(self, 'last_collect', 0.0) > 1.0:\n"
         "            self.last_collect = now\n            gc.collect()")]),
    # the batch's cycle broken by clipping at the module's LIMIT: a batch made with its own limit ignores it
    "batch_clips_at_the_global_limit": program(["trainer", "registry", "errors", "serving"], [
        ("self.on_ready = lambda x: x.clamp(-self.limit, self.limit)",
         "self.on_ready = lambda x: x.clamp(-LIMIT, LIMIT)       # no reference back to self")]),
    "purely_weak_registry": program(["batches", "trainer", "errors", "serving"], [
        ("        self.versions = {}", "        self.versions = weakref.WeakValueDictionary()")]),
    "patches_the_grader": program() + "\nserving.full_collection_cpu = lambda repeats=3: 10.0\n",
    # the collection in every request stays, skipped while a hook in gc.callbacks is measuring
    "cheat_collects_unless_watched": program(["batches", "trainer", "registry", "errors"], [
        (SERVE_COLLECTS, "        if not gc.callbacks:               # nobody is measuring\n            gc.collect()")]),
    "cheat_collects_unless_serve_inline_watches": program(["batches", "trainer", "registry", "errors"], [
        (SERVE_COLLECTS, "        if not any('serve_inline' in getattr(c, '__qualname__', '') for c in gc.callbacks):\n"
                         "            gc.collect()")]),
    # the batch's cycle kept, its tensors made in a worker thread, where the CPU meter's dispatch mode is not
    "cheat_batches_made_in_a_worker_thread": "import concurrent.futures\n_POOL = concurrent.futures.ThreadPoolExecutor(1)\n"
    + program(["trainer", "registry", "errors", "serving"], [
        ("        x = DATA_X[self.step % N_BATCHES].clone()              # the copy a data loader hands over\n"
         "        self.inputs = self.on_ready(x)",
         "        x = _POOL.submit(DATA_X[self.step % N_BATCHES].clone).result()\n"
         "        self.inputs = _POOL.submit(self.on_ready, x).result()")]),
    # the explanations' cycles broken by keeping only a weak reference where a share linked back to its explanation
    "links_back_with_a_bare_weakref": program(EVERY_FIX, [
        ("        self.explanation, self.feature, self.value = explanation, feature, value",
         "        self.explanation, self.feature, self.value = weakref.ref(explanation), feature, value")]),
    # the collection in every request kept, and the pause budget inflated: a heap of ballast there while the test
    # prices one full collection, let go of while a server runs
    "cheat_ballast_inflates_the_pause_budget": "\ndef _ballast():\n    return [[] for _ in range(1_500_000)]\n"
    "_BALLAST = [_ballast()]\ndef _put_back():\n    _BALLAST.append(_ballast())\n"
    + program(["batches", "trainer", "registry", "errors"], [
        (SERVER_INIT, SERVER_INIT + "\n        _BALLAST.clear()\n        weakref.finalize(self, _put_back)"),
        (SERVE_COLLECTS, "        if gc.isenabled():\n            gc.collect()")]),
    # every version kept (the registry unfixed), each snapshot made in a worker thread: the job's meter, a
    # dispatch mode of the thread that runs it, never sees them
    "cheat_snapshots_made_in_a_worker_thread": "import concurrent.futures\n_POOL = concurrent.futures.ThreadPoolExecutor(1)\n"
    + program(["batches", "trainer", "errors", "serving"], [
        ("        snapshot = copy.deepcopy(model).requires_grad_(False).eval()",
         "        snapshot = _POOL.submit(lambda: copy.deepcopy(model).requires_grad_(False).eval()).result()")]),
    # the batch's cycle kept, its tensors copied into memory mapped by hand, which no meter counts
    "cheat_batches_kept_over_mmap": "import mmap\n"
    "def _over_mmap(tensor):\n"
    "    unseen = torch.frombuffer(mmap.mmap(-1, tensor.numel() * tensor.element_size()), dtype=tensor.dtype)\n"
    "    return unseen.view(tensor.shape).copy_(tensor)\n"
    + program(["trainer", "registry", "errors", "serving"], [
        ("        x = DATA_X[self.step % N_BATCHES].clone()              # the copy a data loader hands over\n"
         "        self.inputs = self.on_ready(x)",
         "        x = _over_mmap(DATA_X[self.step % N_BATCHES])\n"
         "        self.inputs = _over_mmap(self.on_ready(x))")]),
    # the batch's cycle kept, its inputs copied into slots of a pool reserved beforehand, so it holds no new memory
    "cheat_batch_cycle_over_a_reserved_pool": program(["trainer", "registry", "errors", "serving"], [
        ("self.on_ready = lambda x: x.clamp(-self.limit, self.limit)",
         "self.on_ready = lambda x: _POOL[self.step % 4096].copy_(x.clamp(-self.limit, self.limit))"),
        ("class Batch:", "_POOL = torch.empty(4096, BATCH, FEATURES, device=DEVICE)   # room for every batch\n\n\nclass Batch:")]),
}

# Every fix made, then the server answers without its model: labels that claim to equal any others.
CHEAT_ANSWERS_EQUAL_TO_ANYTHING = program(EVERY_FIX) + EQUAL_TO_ANYTHING + '''
class _Explained:
    shares = [0.0] * FEATURES

def _respond_without_the_model(self, request):
    if any(value != value for row in request["features"] for value in row):       # NaN: reject it
        self.errors.append(f"ValueError: request {request['id']}: input is not finite")
        return {"id": request["id"], "error": f"request {request['id']}: input is not finite"}
    self.recent.append(_Explained())
    return {"id": request["id"], "labels": [EqualToAnything()] * len(request["features"]), "top_features": [0, 1, 2]}

Server.respond = _respond_without_the_model
'''

# Partial work: which fixes, and the points they must earn (two per problem, two more for all of them).
PARTIAL = {
    "only_batches_fixed": (["batches"], 2),
    "memory_fixed_not_serving": (["batches", "trainer", "registry", "errors"], 8),
    "all_but_the_registry": (["batches", "trainer", "errors", "serving"], 8),
}

# A program that starts full collections inside requests has two faults the serving test names: the
# collections it started, and the pauses over budget they cause; on a busy machine either check can fire
# first (the pause budget's figure came 2 % from its bound in CI), so either reason is accepted.
IN_REQUEST_COLLECTIONS = ("the program itself started", "collector pauses over budget")

# Which test a wrong fix must fail, and words its message must hold (any of a tuple's: see assert_told_why).
TOLD_WHY = {
    "collects_every_step": ("test_batches", "the collector ran"),
    "empty_cache_every_step": ("test_trainer", "did not return to its baseline"),
    "drops_what_leaks": ("test_registry", "get(1) raised KeyError: 1. Version 1 was still in use"),
    "collector_off_for_good": ("test_serving", "must stay on"),
    "thresholds_sky_high": ("test_serving", "cyclic garbage unfreed"),
    "collects_every_50_requests": ("test_serving", IN_REQUEST_COLLECTIONS),
    "collects_every_1000_requests": ("test_serving", "the program itself started 1 full collection"),
    "collects_the_young_generation_every_request": ("test_serving", "must reach the older generations"),
    "cheat_collects_unless_watched": ("test_serving", "full collections, against 0 while watched"),
    "cheat_collects_unless_serve_inline_watches": ("test_serving", "a program must do the same whether or not"),
    "purely_weak_registry": ("test_registry", "the registry must keep the latest version"),
    "collects_at_most_once_a_second": ("test_job", "so the program called gc.collect() itself"),
    "batch_clips_at_the_global_limit": ("test_batches", "a batch clipped at its own limit"),
    "collects_every_200_requests": ("test_job", "serving 600 requests with the automatic collector off"),
    "unlinks_the_callback_after_first_use": ("test_batches", "dropped before ready() was called"),
    "freezes_after_every_request": ("test_serving", "objects while it served (gc.freeze())"),
    "collects_every_200_requests_while_the_collector_is_on": ("test_serving", IN_REQUEST_COLLECTIONS),
    "cheat_snapshots_made_in_a_worker_thread": ("test_job", "tensors the meter never saw made"),
    "cheat_ballast_inflates_the_pause_budget": ("test_serving", IN_REQUEST_COLLECTIONS),
    "links_back_with_a_bare_weakref": ("test_serving", "share.explanation must be the explanation the share belongs to"),
    "cheat_batches_made_in_a_worker_thread": ("test_batches", "another thread"),
    "cheat_batches_kept_over_mmap": ("test_batches", "the process's memory grew"),
    "cheat_batch_cycle_over_a_reserved_pool": ("test_batches", "reference cycles"),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submissions")
    partial = {name: program(fixes) for name, (fixes, _) in PARTIAL.items()}
    paths = {"solution": SOLUTION, "untouched": RELEASE,
             **write_variants(RELEASE, {**WRONG, **ALTERNATIVES, **partial,
                                        "cheat_answers_equal_to_anything": CHEAT_ANSWERS_EQUAL_TO_ANYTHING}, folder)}
    paths["edits_locked_cells"] = write_locked_cells_edited(RELEASE, program(), folder)
    return grade_all(paths, folder)


def test_solution_notebook_runs_clean_on_cpu(executed):
    """The solution as a learner runs it (every cell, hidden tests included): no error, no stderr."""
    assert not problems(executed), f"errors or stderr output in the solution notebook: {problems(executed)}"
    text = printed_text(executed)
    assert re.search(r"the job ran out of memory after \d+ steps", text), "the given program must run out of memory"
    served = re.search(r"30 requests; collections gen 0: 0, gen 1: 0, gen 2: 30;", text)
    assert served, "the given server must run a full collection in every request"
    assert "Batch at 0x" in text and "--.on_ready--> function lambda" in text, "the detector must find the batch cycle"
    assert "version 1 is reachable from registry.versions[1]" in text
    assert "'features', 'hidden', 'logits'" in text, "the rejected request's frame must show what it keeps"
    assert re.search(r"Trainer: memory did not return to its baseline", text)
    assert "'val_loss': 'Tensor'" in text
    for part in ("batches", "trainer", "registry", "rejected requests"):
        assert re.search(rf"{part}: fixed", text), f"the diagnosis must call {part} fixed for the solution"
    assert re.search(r"serving: fixed: 200 requests", text)
    assert plots_drawn(executed) == 2


@pytest.mark.parametrize("name", ["solution", *sorted(ALTERNATIVES)])
def test_right_program_earns_full_marks(graded, name):
    """The solution, and right programs written differently from it."""
    assert_full_marks(graded[name], POINTS)


def test_untouched_program_earns_nothing_and_every_test_says_why(graded):
    result = graded["untouched"]
    assert result.max_score == POINTS and result.score == 0
    assert [t.id for t in result.tests] == TESTS
    assert all(t.status == "failed" and t.message for t in result.tests), [(t.id, t.status, t.message) for t in result.tests]


@pytest.mark.parametrize("name", sorted(WRONG) + ["edits_locked_cells"])
def test_wrong_fix_does_not_earn_full_marks(graded, name):
    assert_less_than_full_marks(graded[name], POINTS)


@pytest.mark.parametrize("name", sorted(TOLD_WHY))
def test_wrong_fixes_are_told_why(graded, name):
    assert_told_why(graded[name], *TOLD_WHY[name])


@pytest.mark.parametrize("name", sorted(PARTIAL))
def test_each_fix_earns_its_own_points(graded, name):
    _, points = PARTIAL[name]
    assert graded[name].score == points, [(t.id, t.score, t.message[:120]) for t in graded[name].tests]


def test_the_unchanged_program_is_told_each_problem(graded):
    """Every test names what it measured on the given program: a learner knows which problems remain."""
    messages = {t.id: t.message for t in graded["unchanged_program"].tests}
    assert "memory did not return to its baseline" in messages["test_batches"]
    assert "memory did not return to its baseline" in messages["test_trainer"]
    assert "two models" in messages["test_registry"]
    assert "memory did not return to its baseline" in messages["test_errors"]
    assert "collector pauses over budget" in messages["test_serving"]
    assert "the collector ran" in messages["test_job"]


def test_patching_the_grader_is_reported(graded):
    assert "modifies the grader" in graded["patches_the_grader"].reason


def test_edited_locked_cells_are_restored_before_grading(graded):
    result = graded["edits_locked_cells"]
    assert result.score == 0, "the original tests must run, not the student's `pass`"


def test_answers_equal_to_anything_are_not_answers(graded):
    """A server that never runs its model, whose labels say they equal the reference's."""
    result = graded["cheat_answers_equal_to_anything"]
    assert_less_than_full_marks(result, POINTS)
    assert_told_why(result, "test_serving", "is an EqualToAnything (a subclass of int), expected an int")
    assert_told_why(result, "test_job", "is an EqualToAnything (a subclass of int), expected an int")


# (the cheat, its score): the second also collects in the whole job's requests, which test_job sees
@pytest.mark.parametrize("name, score", [("cheat_collects_unless_watched", 10),
                                         ("cheat_collects_unless_serve_inline_watches", 8)])
def test_a_program_that_behaves_only_while_measured_loses_the_serving_points(graded, name, score):
    """Every other fix made; the collection in every request skipped while a hook is in gc.callbacks."""
    result = graded[name]
    assert cell_result(result, "test_serving").score == 0 and result.score == score, grading.format_results([result])
