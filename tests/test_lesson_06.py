"""Lesson 06 end to end: the solution runs clean, and grading accepts only a GC policy that meets
the latency budget, runs no full collection inside a request and still collects the garbage.

The solution is graded alone (the hidden test times requests, and its pass must not depend on a
quiet machine); the wrong policies two at a time: noise can only slow a policy down, and each
fails by far more than noise (collecting after every request puts its P99 over 10x the budget)."""
import pytest
from lesson_support import (
    ROOT, assert_full_marks, assert_no_marks_until_answered, plots_drawn, printed_text, problems,
    write_variants,
)

from gclab import grading

LESSON = "06_gc_pauses_in_serving"
SOLUTION = ROOT / "solutions" / LESSON / f"{LESSON}.ipynb"
RELEASE = ROOT / "notebooks" / LESSON / f"{LESSON}.ipynb"


def _policy(source):
    return {"answer_policy": "%%writefile my_policy.py\nimport gc\n" + source}


# Plausible wrong policies: none may earn the points, each is told why.
WRONG = {
    "collector_off_for_good": _policy("def on_startup():\n    gc.disable()\n"),
    "collect_after_every_request": _policy("def after_request(in_flight):\n    gc.collect()\n"),
    "thresholds_so_high_nothing_is_collected": _policy(
        "def on_startup():\n    gc.set_threshold(1_000_000, 1000, 1000)\n"),
    "collect_only_when_the_load_is_over": _policy(
        "def on_startup():\n    gc.freeze()\n    gc.set_threshold(700, 10, 10**9)\n"
        "def on_idle(idle_seconds):\n    if idle_seconds > 0.2:\n        gc.collect()\n"),
    "unhooks_the_recording": _policy(
        "def before_request(in_flight):\n    gc.callbacks.clear()\n"),
}


TIMED = ("solution",)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submissions")
    paths = {"solution": SOLUTION, "untouched": RELEASE, **write_variants(RELEASE, WRONG, folder)}
    results = {}
    for names, jobs in (([n for n in paths if n in TIMED], 1), ([n for n in paths if n not in TIMED], 2)):
        graded = grading.grade([paths[n] for n in names], root=ROOT, jobs=jobs, keep_executed=folder / f"graded-{jobs}")
        results.update(zip(names, graded))
    return results


def test_solution_notebook_runs_clean_on_cpu(graded):
    executed = graded["solution"].executed
    assert not problems(executed), f"errors or stderr output in the solution notebook: {problems(executed)}"
    text = printed_text(executed)
    assert "attribution on " in text and "gen 2: 1" in text, "the feature should bring a full collection"
    assert "request(s) waited for it" in text
    assert "fewer objects (compact)" in text and "No full collection ran inside a request." in text
    assert plots_drawn(executed) >= 5, "latency before/after, the timeline, the cost curve, the fixes, the check"


def test_solution_earns_full_marks(graded):
    assert_full_marks(graded["solution"], 6)


def test_untouched_student_notebook_earns_nothing(graded):
    assert_no_marks_until_answered(graded["untouched"], 6)


@pytest.mark.parametrize("name", sorted(WRONG))
def test_wrong_policy_earns_nothing_and_is_told_why(graded, name):
    result = graded[name]
    assert result.max_score == 6 and result.score == 0, grading.format_results([result])
    assert all(t.message for t in result.tests)


def test_wrong_policies_are_told_what_failed(graded):
    def message(name):
        return graded[name].tests[0].message + graded[name].reason
    assert "over the bound" in message("collector_off_for_good")
    assert "over the bound" in message("thresholds_so_high_nothing_is_collected")
    assert "collecting only once the load is over" in message("collect_only_when_the_load_is_over")
    assert "over budget" in message("collect_after_every_request") or "no answer" in message("collect_after_every_request")
    assert "modifies the grader" in message("unhooks_the_recording")
