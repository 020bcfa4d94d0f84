"""What grading a notebook returns: a `TestResult` per test, a `NotebookResult` per notebook.

Plain records, read by the gradebook, the feedback and the class report; what a hidden test observed
(`TestResult.observed`) is the grader's alone and is dropped from `NotebookResult.as_dict()`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

@dataclass
class TestResult:
    id: str
    score: float
    max_score: float
    status: str           # passed, failed, error, timeout, tampered
    message: str = ""     # what was wrong, and by how much (never a line of a hidden test)
    output: str = ""      # what the test's visible self-checks printed
    measured: dict = field(default_factory=dict)   # the grader's own figures of the test (gclab.grader.measured)
    observed: list = field(default_factory=list, repr=False)   # what the test observed, for the grader alone


@dataclass
class NotebookResult:
    notebook: str
    score: float = 0.0
    max_score: float = 0.0
    tests: list[TestResult] = field(default_factory=list)
    assignment: str = ""
    reason: str = ""      # why the whole notebook scored what it did, when not the tests' own doing
    student: str = ""
    lesson_notebook: str = ""     # the lesson's notebook name (the submission's file may be named otherwise)
    # lines of the answers that read what tells a grading run from the learner's own (gclab.grader.review): for the
    # instructor's class report, never the score or the learner's feedback
    review: list[str] = field(default_factory=list)
    measured: dict = field(default_factory=dict)    # the grader's figures of the whole run
    # tests the learner's process said passed and the grader's own figures refuted: for the instructor's review
    disagreements: list[str] = field(default_factory=list)
    # what the grading machine left out of the grader's reach (no kernel's walls, no memory cgroup), and why
    unguarded: list[str] = field(default_factory=list)

    def as_dict(self):
        data = asdict(self)
        for test in data["tests"]:
            test.pop("observed", None)     # what hidden tests saw: the grader's, never handed back
            calls = test["measured"].pop("calls", None)
            if calls:
                test["measured"].update(calls=len(calls), longest_call_cpu_s=max(calls))
        return data


def _grade_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"
            and c.metadata.get("nbgrader", {}).get("grade")
            and not c.metadata.get("nbgrader", {}).get("solution")]


def _score(result: NotebookResult) -> NotebookResult:
    result.score = sum(t.score for t in result.tests)
    result.max_score = sum(t.max_score for t in result.tests)
    return result


def _all_tests(source_nb, status, message) -> list[TestResult]:
    return [TestResult(c.metadata["nbgrader"]["grade_id"], 0.0,
                       float(c.metadata["nbgrader"].get("points", 0)), status, message)
            for c in _grade_cells(source_nb)]
