"""Lesson 06's grading: it accepts only a GC policy whose collector
pauses stay within budget (in CPU time, which a busy machine does not inflate), that runs no full
collection inside a request, still collects the garbage, and leaves the server's record alone.

Each notebook is graded alone (two gradings at once would be a busy machine for each other); then
once more each, the solution's policy and a wrong policy, with two CPU-bound processes running
beside the grading: the verdict must not move.  The solution run as a learner runs it is
tests/test_lesson_06_notebook.py: a module of its own, so that `make test` runs it beside this one."""
import subprocess
import sys

import pytest
from lesson_support import (
    test_no_handed_back_file_holds_a_line_of_a_hidden_test,  # noqa: F401  (collected here)
    test_every_test_of_the_reference_records_what_it_observed,  # noqa: F401  (collected here)
    test_every_self_check_ends_with_one_plain_line_when_it_passes,  # noqa: F401  (collected here)
    test_every_wrong_fix_that_loses_points_fails_a_visible_self_check,  # noqa: F401  (collected here)
    ROOT, assert_full_marks, grade_all, assert_no_marks_until_answered, write_variants,
)

from gclab.grader import grading

pytestmark = pytest.mark.timed     # run alone by `make test`: it times a server

LESSON = "06_gc_pauses_in_serving"
SOLUTION = ROOT / "solutions" / LESSON / f"{LESSON}.ipynb"
RELEASE = ROOT / "notebooks" / LESSON / f"{LESSON}.ipynb"


def _policy(source):
    return {"answer_policy": "%%writefile my_policy.py\nimport gc\n" + source}


REFERENCE = _policy("def on_startup():\n    gc.freeze()\n    young, middle, _ = gc.get_threshold()\n"
                    "    gc.set_threshold(young, middle, 10**9)\n"
                    "def on_idle(idle_seconds):\n    if gc.get_count()[2] > 0:\n        gc.collect()\n")

SHADOWING_UVICORN = """
import importlib, os, sys
sys.path[:] = [p for p in sys.path if p not in ('', os.getcwd())]
del sys.modules['uvicorn']
sys.modules['uvicorn'] = importlib.import_module('uvicorn')
server = sys.modules['__main__']
if hasattr(server, 'ServerState'):
    server.ServerState.postprocess = lambda self, seed, tokens, label, scores: {'label': int(label)}
"""
# Plausible wrong policies: none may earn the points, each is told why.
WRONG = {
    "default_collector": _policy(""),
    "collector_off_for_good": _policy("def on_startup():\n    gc.disable()\n"),
    "collect_after_every_request": _policy("def after_request(in_flight):\n    gc.collect()\n"),
    "thresholds_so_high_nothing_is_collected": _policy(
        "def on_startup():\n    gc.set_threshold(1_000_000, 1000, 1000)\n"),
    # the pause postponed, not removed: no full collection in a load this short; the next comes in a request
    "thresholds_raised_alone": _policy("def on_startup():\n    gc.set_threshold(50_000)\n"),
    # young collections only: what survives them is never collected once it dies
    "young_collections_only": _policy("def on_startup():\n    gc.set_threshold(100_000, 10**9, 10**9)\n"),
    "collect_only_when_the_load_is_over": _policy(
        "def on_startup():\n    gc.freeze()\n    gc.set_threshold(700, 10, 10**9)\n"
        "def on_idle(idle_seconds):\n    if idle_seconds > 0.2:\n        gc.collect()\n"),
    # what survived an idle collection frozen too: responses cached then are never collected once evicted
    "refreezes_after_every_idle_collection": _policy(
        "def on_startup():\n    gc.freeze()\n    young, middle, _ = gc.get_threshold()\n"
        "    gc.set_threshold(young, middle, 10**9)\n"
        "def on_idle(idle_seconds):\n    if gc.get_count()[2] > 0:\n        gc.collect()\n        gc.freeze()\n"),
    # frozen and collected whenever idle, but the third threshold left as it is: the lulls between the load's
    # bursts let it collect before the collector starts a full collection by itself; at the busier load, never
    # idle, the collector does, in a request
    "freezes_and_collects_when_idle_without_raising_threshold": _policy(
        "def on_startup():\n    gc.freeze()\n"
        "def on_idle(idle_seconds):\n    gc.collect()\n"),
    # the reference policy with the collector's statistics left on: every young collection then counts the
    # objects of every generation, the frozen heap included (24 ms each, measured), and a request waits behind
    # twenty of them
    "debug_stats_left_on": _policy(
        "def on_startup():\n    gc.set_debug(gc.DEBUG_STATS)\n    gc.freeze()\n"
        "    young, middle, _ = gc.get_threshold()\n    gc.set_threshold(young, middle, 10**9)\n"
        "def on_idle(idle_seconds):\n    if gc.get_count()[2] > 0:\n        gc.collect()\n"),
    "unhooks_the_recording": _policy(
        "def before_request(in_flight):\n    gc.callbacks.clear()\n"),
    # the server's state, reached through uvicorn's signal handler: its set of live explanations
    # swapped for one that never counts them, with the collector off for good
    "cheat_blinds_the_servers_garbage_count": _policy(
        "import signal\n"
        "class _Blind(set):\n"
        "    def add(self, item):\n"
        "        pass\n"
        "def on_startup():\n"
        "    gc.disable()\n"
        "_done = []\n"
        "def before_request(in_flight):\n"
        "    if not _done:\n"
        "        app = signal.getsignal(signal.SIGTERM).__self__.config.loaded_app\n"
        "        while getattr(app, '__closure__', None) is None:\n"
        "            app = app.app\n"
        "        dict(zip(app.__code__.co_freevars, (c.cell_contents for c in app.__closure__)))['state']"
        ".explanations = _Blind()\n"
        "        _done.append(1)\n"),
    # the grade's P99 comes from np.percentile, whose work numpy's own module does by name: zeroed there (the
    # module's dict written directly, which no reading of the source sees), with young collections so large
    # that every request pays for one (over budget, measured: P99 202 ms of CPU against 106 ms)
    "cheat_zeroes_numpys_p99": {"answer_policy": (
        "open('my_policy.py', 'w').write('import gc\\ndef on_startup():\\n    gc.set_threshold(200_000, 10**9, 10**9)\\n"
        "def on_idle(idle_seconds):\\n    gc.collect()\\n')\n"
        "import importlib\n"
        "_impl = importlib.import_module('numpy.lib._function_base_impl')\n"
        "_quantile = _impl._quantile_unchecked\n"
        "vars(_impl)['_quantile_unchecked'] = lambda a, q, *args, **kw: _quantile(a, q, *args, **kw) * (float(q) != 0.99)\n")},
    # the server imports uvicorn once it has started: a uvicorn.py beside the notebook that
    # deletes the feature (no per-token objects) would let the default collector pass
    "cheat_shadows_the_servers_imports": {"answer_policy": (
        f"open('uvicorn.py', 'w').write({SHADOWING_UVICORN!r})\n"
        "open('my_policy.py', 'w').write('import gc\\n')\n")},
}
# Correct policies written differently from the reference: each earns full marks.
CORRECT = {
    "freeze_and_collect_whenever_idle": _policy(
        "def on_startup():\n    gc.freeze()\n    gc.set_threshold(700, 10, 10**9)\n"
        "def on_idle(idle_seconds):\n    gc.collect()\n"),
    "paused_in_requests_collected_when_idle": _policy(
        "def on_startup():\n    gc.freeze()\n"
        "def before_request(in_flight):\n    gc.disable()\n"
        "def after_request(in_flight):\n    if in_flight == 0:\n        gc.enable()\n"
        "def on_idle(idle_seconds):\n    gc.collect()\n"),
}
# Wrong, and still given full marks: a known gap in the grading (see the test below).
KNOWN_GAPS = {
    # waits for 20 ms of idle time before it collects: the 50 ms lulls between the load's bursts give it enough;
    # at 350 requests per second with no lull, where no gap in the load is long enough, it collects nothing while
    # serving (1,125 responses' worth of garbage against a bound of 796, measured)
    "collects_only_after_20ms_idle": _policy(
        "def on_startup():\n    gc.freeze()\n    young, middle, _ = gc.get_threshold()\n"
        "    gc.set_threshold(young, middle, 10**9)\n"
        "def on_idle(idle_seconds):\n    if idle_seconds > 0.02:\n        gc.collect()\n"),
}
CONTENDED = {"contended_solution": REFERENCE,
             "contended_freezes_without_raising_threshold":
                 WRONG["freezes_and_collects_when_idle_without_raising_threshold"]}


class CpuHogs:
    """Two CPU-bound processes beside the grading, killed after it."""

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
        return self

    def __exit__(self, *exc):
        for proc in self.procs:
            proc.kill()
            proc.wait()
        return False


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submissions")
    paths = {"solution": SOLUTION, "untouched": RELEASE, **write_variants(RELEASE, {**WRONG, **CORRECT, **KNOWN_GAPS, **CONTENDED}, folder)}
    quiet = {n: paths[n] for n in paths if n not in CONTENDED}
    results = grade_all(quiet, folder)            # a timed lesson: one at a time, whatever the jobs
    for name in CONTENDED:
        with CpuHogs():
            results[name], = grading.grade([paths[name]], root=ROOT)
    return results


def test_the_answer_cell_says_what_to_write():
    import nbformat
    nb = nbformat.read(RELEASE, 4)
    answer = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "answer_policy")
    assert answer.source.startswith("%%writefile my_policy.py\n# Exercise: the server's GC policy")


def test_solution_earns_full_marks(graded):
    assert_full_marks(graded["solution"], 6)


def test_untouched_student_notebook_earns_nothing(graded):
    assert_no_marks_until_answered(graded["untouched"], 6)


@pytest.mark.parametrize("name", sorted(CORRECT))
def test_a_correct_policy_written_differently_earns_full_marks(graded, name):
    assert_full_marks(graded[name], 6)


@pytest.mark.parametrize("name", sorted(WRONG))
def test_wrong_policy_earns_nothing_and_is_told_why(graded, name):
    result = graded[name]
    assert result.max_score == 6 and result.score == 0, grading.format_results([result])
    assert all(t.message for t in result.tests)
    assert not any(t.message.startswith("inconclusive:") for t in result.tests), grading.format_results([result])


def _message(result):
    return result.tests[0].message + result.reason


def test_wrong_policies_are_told_what_failed(graded):
    def message(name):
        return _message(graded[name])
    assert "full (generation 2) collection(s) ran while requests were in flight" in message("default_collector")
    assert "over the bound" in message("collector_off_for_good")
    assert "over the bound" in message("thresholds_so_high_nothing_is_collected")
    assert "collecting only once the load is over" in message("collect_only_when_the_load_is_over")
    for name in ("thresholds_raised_alone", "young_collections_only"):
        assert "No full (generation 2) collection ran while the load was served" in message(name), message(name)
    assert "full (generation 2) collection(s) ran while requests" in message("collect_after_every_request")
    assert "full (generation 2) collection(s) ran while requests" in message("cheat_shadows_the_servers_imports")
    assert "numpy.lib._function_base_impl._quantile_unchecked was replaced" in message("cheat_zeroes_numpys_p99")
    # pauses over budget, diagnosed as many slow collections in a row (DEBUG_STATS); on a busy machine each of
    # them can take longer than half the limit, and the diagnosis names long collections instead: both true
    debug_stats = message("debug_stats_left_on")
    assert "over budget" in debug_stats and ("DEBUG_STATS" in debug_stats
                                             or "Requests waited behind collections" in debug_stats), debug_stats
    # refused before it runs (the grader reads the policy's source), or caught by the server; the server's other
    # instruments, rebound by a policy, are tests/test_serving.py's (a short load each)
    unhooks = message("unhooks_the_recording")
    assert "modifies the grader's tools" in unhooks or (
        "tampered" in unhooks and "gc.callbacks hook was removed" in unhooks), unhooks
    # caught at the busier load on a quiet machine; on a busy one (the rest of the suite beside it) the first
    # load may already leave the server too few idle moments, and catches it there
    busier = message("freezes_and_collects_when_idle_without_raising_threshold")
    assert _told_of_a_full_collection_inside_requests(busier), busier
    assert "at a busier load" not in busier.lower() or "raise the third threshold" in busier, busier


def test_freezing_while_serving_is_told_its_garbage_is_never_freed(graded):
    message = _message(graded["refreezes_after_every_idle_collection"])
    assert "still alive after the server's own full collection at the end" in message, message


@pytest.mark.parametrize("name, replaced", [
    ("cheat_blinds_the_servers_garbage_count", "the server's state.explanations was replaced"),
])
def test_a_policy_that_rebinds_the_servers_instruments_is_caught(graded, name, replaced):
    message = _message(graded[name])
    assert "tampered" in message and replaced in message, message


def test_contended_verdicts_do_not_move(graded):
    """Two CPU-bound processes beside the grading: the solution still passes, a borderline wrong policy still
    fails.  (A policy that fails on a count, garbage over its bound, fails whatever the machine: not graded again.)"""
    solution = graded["contended_solution"]
    assert solution.score == 6, grading.format_results([solution])
    # on a busy machine the server is idle less often within the load's bursts too: the first load may catch it
    busier = graded["contended_freezes_without_raising_threshold"]
    assert busier.score == 0 and _told_of_a_full_collection_inside_requests(_message(busier)), (
        grading.format_results([busier]))


def _told_of_a_full_collection_inside_requests(message: str) -> bool:
    """At the graded load, or at the self-check's busier one (never idle)."""
    return ("full (generation 2) collection(s) ran while requests were in flight" in message
            or ("At a busier load" in message and "full collection(s) ran inside requests" in message))


@pytest.mark.xfail(strict=False, reason=(
    "known gap: a policy that waits for more idle time than on_idle's 10 ms differs from the solution only by how "
    "long the idle moments are, and on a shared machine a busier load leaves the solution itself none (at 350 "
    "requests per second both collected nothing while serving, quiet and with two CPU hogs): no load found yet "
    "separates them whatever the machine"))
@pytest.mark.parametrize("name", sorted(KNOWN_GAPS))
def test_a_policy_that_waits_for_long_idle_moments_loses_marks(graded, name):
    result = graded[name]
    assert result.score < 6, grading.format_results([result])
    assert "garbage" in _message(result), _message(result)
