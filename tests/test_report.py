"""The class report: failure causes from the checks' real messages, grouped per lesson, and the
files written for the instructor (no grading runs here: the results are made up)."""
from types import SimpleNamespace
import csv

import pytest

from gclab.grader import grading, report
from gclab.grader.grading import NotebookResult

# Messages as gclab.checks (FlatReport.explain, PolicyReport.explain, compare), the lessons' test
# cells and gclab.grader.grading word them, with the cause each must get.
FLAT_LEAK = ("memory did not return to its baseline: {a} MiB above it after iteration 1, {b} MiB after iteration 20 "
             "(about 51.20 KiB per iteration). Something still refers to the tensors each step creates.")
COLLECTOR_ON = ("with the collector switched on, memory was {a} MiB above its baseline after iteration 2 of 5: "
                "the code keeps tensors alive when the collector is on (does it behave differently depending on "
                "gc.isenabled()?). A fix must free memory by reference counting whether the collector is on or off.")
POLICY_SLOW = ("Wall-clock latency with your policy: P50 {a} ms, P99 {b} ms; on a busy machine these grow whatever the "
               "policy, so the grade uses CPU time.\nCollector time charged to a request (the longest collection it "
               "waited behind, in CPU time): P99 {b} ms; budget 0.75 x one full collection of the server's heap "
               "(20.0 ms of CPU) = 15.0 ms: over budget. Requests waited behind collections that walk the whole "
               "long-lived heap: make a full collection cheap before it runs, and run it when it delays no one.\n"
               "No full collection ran inside a request.\nCyclic garbage (responses' worth, uncollected): at most 40 "
               "at any time, 3 left at the end; bound 568.")

REAL_MESSAGES = [
    ("failed", FLAT_LEAK.format(a="1.00", b="3.10"), report.NOT_BACK_TO_BASELINE),
    ("failed", COLLECTOR_ON.format(a="2.00"), report.GROWS_WITH_COLLECTOR_ON),
    ("failed", ("the collector ran 3 time(s) during the check (generation 0, 2): a fix must free memory by reference "
                "counting alone, without gc.collect() or the automatic collector."), report.COLLECTION_DURING_CHECK),
    ("failed", "the collector ran during the check", report.COLLECTION_DURING_CHECK),
    ("failed", "the step switched the automatic collector back on (gc.enable()).", report.COLLECTOR_REENABLED),
    ("failed", "the collector must be left on after the check", report.COLLECTOR_LEFT_OFF),
    ("failed", "the step raised ValueError: bad shape (after 3 of 20 iterations)", report.ANSWER_RAISED),
    ("failed", ("the step raised OutOfMemoryError: Simulated CPU budget exceeded: aten::empty tried to allocate "
                "4.00 MiB (after 7 of 20 iterations)"), report.OUT_OF_MEMORY),
    ("failed", "job 2's report holds 1.00 MiB with the collector off", report.NOT_BACK_TO_BASELINE),
    ("failed", "a dropped pair left 512.00 KiB held with the collector off", report.NOT_BACK_TO_BASELINE),
    ("failed", ("2.00 MiB was still held after run_job(5) returned, 2.00 MiB of it even once its report was deleted: "
                "something outside the report keeps the failed step's tensors (a global, a default argument, a "
                "traceback kept somewhere else)"), report.HELD_ELSEWHERE),
    ("failed", ("memory did not return to its baseline: 2.00 MiB above it after iteration 3, 2.00 MiB after iteration "
                "12, never more than 2.00 MiB in between: it stopped growing. Something keeps the latest step's "
                "tensors (a global, a default argument, an attribute that each step replaces), not every step's; a "
                "fix keeps none of them once the step is done."), report.NOT_BACK_TO_BASELINE),
    ("failed", ("after `del head` 512.00 KiB of the pair's 512.00 KiB is still held with the collector off: "
                "something still refers to the nodes"), report.HELD_ELSEWHERE),
    ("failed", ("a dropped tree left 448.00 KiB held with the collector off: its nodes were still in a cycle, which "
                "only a collection freed"), report.CYCLE),
    ("failed", ("the detector found reference cycles holding tensors:\n2 reference cycle(s) holding tensors "
                "(512.00 KiB) in 1 collection(s)"), report.CYCLE),
    ("failed", "a collection after the check found 16 TreeNode objects", report.CYCLE),
    ("failed", ("while the root is held the tree should hold its 15 tensors (960.00 KiB); it holds 64.00 KiB: nodes "
                "died too early (weak where it must be strong?)"), report.FREED_TOO_EARLY),
    ("failed", "wait() returned a copy: the result must be a view of the pending batch's buffer",
     report.COPY_NOT_VIEW),
    ("failed", ("scores: 3 of 20 values differ from the reference; first at position 4: got 1.5, expected 2.0 "
                "(off by 0.5)"), report.WRONG_RESULT),
    ("failed", "Trainer is not defined yet: write it in the answer cell and run it", report.NOT_WRITTEN),
    ("failed", ("the grader's tools were replaced by the notebook's code: gc.collect. Restore them (restart the "
                "kernel) and run again."), report.TAMPERING),
    ("failed", POLICY_SLOW.format(a="11.2", b="31.4"), report.OVER_BUDGET),
    ("failed", ("collector pauses over budget: requests waited behind collections of 31 ms of CPU (P99), budget "
                "15 ms"), report.OVER_BUDGET),
    ("failed", "a full collection ran inside a request", report.FULL_COLLECTION_IN_REQUEST),
    ("failed", ("inconclusive: with the collector off, the same server's P99 was 95 ms (a quiet machine: about 10 "
                "ms, expected at most 40 ms): the machine was too busy to judge; grade again on a quieter machine"),
     report.INCONCLUSIVE),
    ("error", "not graded: the file is not a readable notebook (Notebook does not appear to be JSON)",
     report.UNREADABLE),
    ("error", "not graded: the submission modifies the grader's tools: gc.collect = lambda *a: 0", report.TAMPERING),
    ("error", "not graded: grading took longer than 900 s and was stopped", report.TIMEOUT),
    ("timeout", "the test ran past the time limit (180 s) and was interrupted", report.TIMEOUT),
    ("error", "the test ended the process that ran it (it crashed, exited, was killed or ran out of memory)",
     report.DIED),
    ("error", "RuntimeError: the model server did not start: SyntaxError in my_policy.py", report.SERVER_FAILED),
    ("error", "AttributeError: 'Trainer' object has no attribute 'history'", "error: AttributeError"),
    ("error", "TypeError: expected Tensor as element 0 in argument 0", "error: TypeError"),
    ("failed", "a failed job has no value", "failed: other"),
    # lesson 03's "gc.collect() every step", as its hidden test words it: the leak it leaves is its doing
    ("failed", ("memory did not return to its baseline: 512.00 KiB above it after iteration 1, 512.00 KiB after "
                "iteration 20, never more than 512.00 KiB in between: it stopped growing. Something keeps the latest "
                "step's tensors (a global, a default argument, an attribute that each step replaces), not every "
                "step's; a fix keeps none of them once the step is done. the collector ran 20 time(s) during the "
                "check (generation 2): a fix must free memory by reference counting alone, without gc.collect() or "
                "the automatic collector."), report.COLLECTION_DURING_CHECK),
    # an answer cell that never ends (gclab.grader.grading), whatever the test then said
    ("failed", ("your answer cell answer_pair ran past 180 seconds and was stopped (does it loop forever?), so what "
                "it defines after that point was never run; then the test said: make_pair is not defined yet: write "
                "Node and make_pair in the answer cell and run it"), report.ANSWER_STOPPED),
    ("timeout", ("not graded: your answer cell answer_pair ran past 180 seconds and was stopped (does it loop "
                 "forever?): it did not stop when interrupted, so its process was ended"), report.ANSWER_STOPPED),
]


def _test(status, message, test_id="test_memory_flat", points=4.0):
    return grading.TestResult(test_id, points if status == "passed" else 0.0, points, status, message)


def _result(student, assignment, *tests, reason=""):
    result = NotebookResult(f"submitted/{student}-{assignment}.ipynb", score=sum(t.score for t in tests),
                            max_score=sum(t.max_score for t in tests), tests=list(tests), assignment=assignment,
                            reason=reason)
    result.student = student
    return result


@pytest.mark.parametrize("status, message, cause", REAL_MESSAGES)
def test_each_real_message_gets_its_cause(status, message, cause):
    assert report.cause_of(_test(status, message)) == cause


@pytest.mark.parametrize("fields, cause", [
    ({"growth": [1 << 20] * 20}, report.NOT_BACK_TO_BASELINE),
    ({"growth": [0] * 20, "growth_collector_on": [0, 2 << 20, 0, 0, 0]}, report.GROWS_WITH_COLLECTOR_ON),
    ({"growth": [0] * 20, "reenabled_gc": True}, report.COLLECTOR_REENABLED),
    ({"growth": [0] * 3, "error": ValueError("bad shape")}, report.ANSWER_RAISED),
])
def test_the_flat_checks_own_explanations_get_their_cause(fields, cause):
    """From gclab.checks itself, so that a change of its wording shows here."""
    torch = pytest.importorskip("torch")
    from gclab.checks import FlatReport
    flat = FlatReport(torch.device("cpu"), 20, collector_on=5, **fields)
    assert report.cause_of(_test("failed", flat.explain())) == cause


def test_the_same_failure_with_other_numbers_is_the_same_cause():
    leaks = [_test("failed", FLAT_LEAK.format(a=a, b=b)) for a, b in [("1.00", "3.10"), ("9.00", "180.25")]]
    causes = {report.cause_of(leak) for leak in leaks}
    assert causes == {report.NOT_BACK_TO_BASELINE}
    assert report.message_shape("grew by 3.1 MB in 20 steps") == report.message_shape("grew by 9.0 MB in 7 steps")


def test_the_shape_of_a_message_keeps_the_digits_of_names_and_paths():
    shape = report.message_shape("submitted/ada/03_node_leak/03_node_leak.ipynb: test_2 failed after 20 steps")
    assert shape == "submitted/ada/03_node_leak/03_node_leak.ipynb: test_2 failed after # steps"


def test_a_passed_test_has_no_cause():
    assert report.cause_of(_test("passed", "")) == ""


def test_the_notebooks_reason_names_what_the_test_cannot():
    missing = "the submission has no answer cell answer (deleted, or its cell metadata removed): a fresh copy ..."
    not_there = _test("failed", "make_pair is not defined yet: write Node and make_pair in the answer cell and run it")
    assert report.cause_of(not_there, missing) == report.ANSWER_CELL_MISSING
    assert report.cause_of(_test("error", ""), "unreadable notebook") == report.UNREADABLE
    leak = _test("failed", FLAT_LEAK.format(a="1.00", b="2.00"))
    assert report.cause_of(leak, missing) == report.NOT_BACK_TO_BASELINE


def test_an_other_answer_cells_error_does_not_hide_the_tests_own_cause():
    suffix = " (your answer cell raised answer_b: NotImplementedError)"
    leak = _test("failed", FLAT_LEAK.format(a="1.00", b="2.00") + suffix)
    assert report.cause_of(leak) == report.NOT_BACK_TO_BASELINE
    raised = " (your answer cell raised answer: ValueError: bad)"
    assert report.cause_of(_test("error", "NameError: name 'helper' is not defined" + raised)) == report.ANSWER_RAISED


def test_student_comes_from_the_field_or_the_path():
    result = NotebookResult("submitted/alice/03_node_leak/03_node_leak.ipynb", assignment="03_node_leak")
    assert report.student_of(result) == "alice"
    assert report.student_of(NotebookResult("in/bob-03_node_leak.ipynb", assignment="03_node_leak")) == "bob"
    renamed = NotebookResult("in/erin-leak.ipynb", assignment="03_node_leak")
    renamed.lesson_notebook = "leak"
    assert report.student_of(renamed) == "erin"
    result.student = "carol"
    assert report.student_of(result) == "carol"


@pytest.fixture
def class_results():
    leak = "03_node_leak"
    flat, links = "test_memory_flat", "test_pair_links"
    return [
        _result("alice", leak, _test("failed", FLAT_LEAK.format(a="1.00", b="3.10"), flat),
                _test("failed", "a dropped pair left 512.00 KiB held with the collector off", links, 2.0)),
        _result("bob", leak, _test("failed", FLAT_LEAK.format(a="9.00", b="180.25"), flat),
                _test("passed", "", links, 2.0)),
        _result("<script>", leak, _test("failed", "the collector ran during the check", flat),
                _test("passed", "", links, 2.0)),
        _result("dave", leak, _test("passed", "", flat), _test("passed", "", links, 2.0)),
        _result("alice", "01_reference_counting", _test("passed", "", "test_scaler_results", 2.0)),
        _result("bob", "01_reference_counting", _test("passed", "", "test_scaler_results", 2.0)),
    ]


def test_failures_are_grouped_per_cause_with_counts_and_students(class_results):
    groups = report.failure_groups([r for r in class_results if r.assignment == "03_node_leak"])
    assert [(g.cause, g.count, g.students) for g in groups] == [
        (report.NOT_BACK_TO_BASELINE, 3, ["alice", "bob"]),       # alice twice (two test cells), listed once
        (report.COLLECTION_DURING_CHECK, 1, ["<script>"]),
    ]
    assert groups[0].tests == ["test_memory_flat", "test_pair_links"]


def _rows(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def test_class_report_writes_the_csv_files(class_results, tmp_path):
    paths = report.class_report(class_results, tmp_path / "out")
    assert set(paths) == {"html", "scores", "causes", "review"} and all(p.is_file() for p in paths.values())
    assert _rows(paths["scores"]) == [
        ["student", "assignment", "score", "max_score"],
        ["alice", "01_reference_counting", "2", "2"], ["bob", "01_reference_counting", "2", "2"],
        ["<script>", "03_node_leak", "2", "6"], ["alice", "03_node_leak", "0", "6"],
        ["bob", "03_node_leak", "2", "6"], ["dave", "03_node_leak", "6", "6"],
    ]
    assert _rows(paths["causes"]) == [
        ["assignment", "cause", "count", "students"],
        ["03_node_leak", report.NOT_BACK_TO_BASELINE, "3", "alice bob"],
        ["03_node_leak", report.COLLECTION_DURING_CHECK, "1", "<script>"],
    ]


def test_the_page_is_one_file_with_its_histograms_and_escapes_what_it_shows(class_results, tmp_path):
    page = report.class_report(class_results, tmp_path)["html"].read_text(encoding="utf-8")
    assert page.count('<img src="data:image/png;base64,') == 2
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "4 submission(s); mean 2.5, median 2 (out of 6)" in page


def test_the_page_opens_with_the_students_by_lessons_each_with_their_scores_and_causes(class_results, tmp_path):
    page = report.class_report(class_results, tmp_path)["html"].read_text(encoding="utf-8")
    table = page.split("<h2>Students by lessons</h2>")[1].split("</table>")[0]
    assert page.index("<h2>Students by lessons</h2>") < page.index("<section>")
    assert "<th>01_reference_counting</th><th>03_node_leak</th>" in table
    alice = table.split("<tr><th>alice</th>")[1].split("</tr>")[0]
    assert alice.count("<td") == 2 and "2 / 2" in alice and "0 / 6" in alice
    assert f"<li>{report.NOT_BACK_TO_BASELINE}</li>" in alice
    dave = table.split("<tr><th>dave</th>")[1].split("</tr>")[0]
    assert "no submission" in dave and "6 / 6" in dave and "<li>" not in dave


def test_a_lesson_where_everyone_passed_shows_no_causes(class_results, tmp_path):
    page = report.class_report(class_results, tmp_path)["html"].read_text(encoding="utf-8")
    passed = page.split("<h2>01_reference_counting</h2>")[1].split("</section>")[0]
    assert "No failures: every test passed." in passed and "<table>" not in passed
    assert report.failure_groups([r for r in class_results if r.assignment == "01_reference_counting"]) == []


def test_answers_that_look_at_how_they_run_are_listed_to_read_not_marked_down(class_results, tmp_path):
    dave = next(r for r in class_results if r.student == "dave")
    dave.review = ["if gc.isenabled():  (whether the collector is on (a check switches it off))"]
    paths = report.class_report(class_results, tmp_path)
    section = paths["html"].read_text(encoding="utf-8").split("<h2>03_node_leak</h2>")[1].split("</section>")[0]
    assert "<h3>Answers to read</h3>" in section and "if gc.isenabled():" in section and "6 / 6" in section
    assert _rows(paths["review"]) == [["student", "assignment", "score", "line"],
                                      ["dave", "03_node_leak", "6", dave.review[0]]]
    passed = paths["html"].read_text(encoding="utf-8").split("<h2>01_reference_counting</h2>")[1]
    assert "Answers to read" not in passed.split("</section>")[0]



def test_a_submission_the_graders_figures_refuted_is_flagged_for_review(class_results, tmp_path):
    dave = next(r for r in class_results if r.student == "dave")
    refuted = ("test_memory_flat: your process reported that the test passed; the system measured 200.0 MiB more "
               "resident memory over the test, where the reference solution's grew 0.3 MiB (allowed: 24.4 MiB)")
    dave.disagreements = [refuted]
    paths = report.class_report(class_results, tmp_path)
    section = paths["html"].read_text(encoding="utf-8").split("<h2>03_node_leak</h2>")[1].split("</section>")[0]
    assert "<h3>Refuted by the grader's figures</h3>" in section and "200.0 MiB more" in section
    assert ["dave", "03_node_leak", "6", f"refuted: {refuted}"] in _rows(paths["review"])
    assert report.cause_of(SimpleNamespace(status="failed", message=refuted.split(": ", 1)[1])) == report.REFUTED


def test_submissions_graded_without_the_walls_or_a_memory_cgroup_are_counted_on_the_page(class_results, tmp_path):
    # a grader's warning goes to its terminal, which a Dask worker's is not: the report says it
    for result in class_results[:3]:
        result.unguarded = ["without a memory cgroup (this machine has no cgroup v1 memory hierarchy)"]
    class_results[0].unguarded.append("without the kernel's walls (user namespaces refused)")
    page = report.class_report(class_results, tmp_path)["html"].read_text(encoding="utf-8")
    assert ("3 graded without a memory cgroup (this machine has no cgroup v1 memory hierarchy); "
            "1 graded without the kernel&#x27;s walls (user namespaces refused)") in page
    for result in class_results:
        result.unguarded = []
    assert "graded without" not in report.class_report(class_results, tmp_path / "again")["html"].read_text()

