"""A class report for an instructor: scores and failure causes per lesson, from the grader's results.

`cause_of` turns a failed test's message (what the checks and hidden tests assert, or what the
grader says about a submission it could not grade) into a short cause, the same for every
submission that failed the same way whatever the numbers in its message; `class_report` writes
`report.html` (one self-contained page: first a table of the students by lessons, each cell a score and
its causes, then per lesson the scores, their histogram and the causes with the students behind each,
and the answers worth reading by hand: see `gclab.grader.review`), `scores.csv`, `causes.csv` and `review.csv`.
"""
from __future__ import annotations

import base64
import csv
import datetime
import html
import io
import os
import re
import shutil
import socket
import statistics
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CAUSES", "cause_of", "class_report", "message_shape"]

UNREADABLE = "not a notebook of the course / unreadable"
TAMPERING = "tampering"
INCONCLUSIVE = "inconclusive: machine too busy to judge, grade again"
TIMEOUT = "timeout"
ANSWER_STOPPED = "an answer cell ran past the time limit and was stopped (an endless loop?)"
DIED = "kernel/process died (crash, exit, out of memory)"
ANSWER_CELL_MISSING = "answer cell missing (deleted, or its metadata removed)"
NOT_WRITTEN = "answer not written yet"
OUT_OF_MEMORY = "ran out of (simulated) device memory"
ANSWER_RAISED = "answer raised an error"
SERVER_FAILED = "the server did not start or did not report its record"
UNANSWERED = "requests unanswered or failed"
FULL_COLLECTION_IN_REQUEST = "a full collection ran inside a request"
OVER_BUDGET = "P99 over budget: requests waited behind the collector"
GARBAGE_UNBOUNDED = "cyclic garbage not bounded"
COLLECTOR_REENABLED = "the answer switched the collector on during the check"
COLLECTOR_LEFT_OFF = "collector left off"
HELD_ELSEWHERE = "still referenced from elsewhere (a registry, cache, global)"
FREED_TOO_EARLY = "objects freed too early (a reference too weak)"
COPY_NOT_VIEW = "returned a copy instead of a view"
GROWS_WITH_COLLECTOR_ON = "memory grows with the collector on"
CYCLE = "objects kept in a reference cycle"
NOT_BACK_TO_BASELINE = "memory not back to baseline"
COLLECTION_DURING_CHECK = "gc.collect() in the step: collections ran during the check (a band-aid)"
WRONG_RESULT = "results differ from what is expected"
REFUTED = "the process said passed, the grader's own figures did not (flagged for review)"

# (pattern, cause), in order: the first pattern found in a message's shape (numbers written #,
# see `message_shape`) names its cause.  A message that says several things (a FlatReport's or a
# PolicyReport's explanation) is filed under the first of them in this order.
CAUSES = [(re.compile(pattern), cause) for pattern, cause in [
    # the grader about a whole submission (gclab.grader.grading), and a notebook's `reason`
    (r"not a readable notebook|not a notebook of this course|unreadable", UNREADABLE),
    ((r"tamper|grader's tools|was replaced|refused while grading|result channel|cannot vouch"
      r"|budget was changed"), TAMPERING),
    (r"your process reported that", REFUTED),
    (r"inconclusive", INCONCLUSIVE),
    (r"answer cell \S+ ran past # seconds and was stopped", ANSWER_STOPPED),
    (r"time limit|took longer than", TIMEOUT),
    (r"ended the process|grading process ended|kernel died|DeadKernel", DIED),
    (r"has no answer cell", ANSWER_CELL_MISSING),
    # the answer itself
    (r"is not defined yet|NotImplementedError|no policy file", NOT_WRITTEN),
    (r"\b(?:OutOfMemoryError|MemoryError)\b|budget exceeded", OUT_OF_MEMORY),
    (r"your answer cell raised|\braised [A-Z]\w*|\b(?:on_idle|after_request|before_request): [A-Z]\w*",
     ANSWER_RAISED),
    # a GC policy served under load (gclab.checks.PolicyReport, gclab.serving)
    (r"did not report its (?:record|trace)|server did not start|load generator failed", SERVER_FAILED),
    (r"request\(s\) got no answer|every request\b.*\bmust be answered", UNANSWERED),
    (r"collection\(s\) ran while requests|\ba full collection ran inside", FULL_COLLECTION_IN_REQUEST),
    (r"over budget", OVER_BUDGET),
    (r"over the bound|garbage not bounded", GARBAGE_UNBOUNDED),
    # the collector and memory (gclab.checks.FlatReport, hidden tests with Meter and GCWatch)
    (r"switched the automatic collector back on", COLLECTOR_REENABLED),
    (r"collector back on|collector must be left on", COLLECTOR_LEFT_OFF),
    # with the collector off only the step's own gc.collect() collects: memory left by it is its doing
    (r"collector ran|collections? ran during", COLLECTION_DURING_CHECK),
    (r"did not return to its baseline", NOT_BACK_TO_BASELINE),   # it goes on "Something still refers to ..."
    (r"still refers to|something outside the \w+ keeps", HELD_ELSEWHERE),
    (r"died too early|must stay alive", FREED_TOO_EARLY),
    (r"returned a copy", COPY_NOT_VIEW),
    (r"with the collector (?:switched )?on\b", GROWS_WITH_COLLECTOR_ON),
    (r"\bcycles? holding|\bin (?:a |reference )?cycles?\b|\bforms? a cycle|a collection\b[^.:]*\bfound #",
     CYCLE),
    (r"\bshould hold\b", WRONG_RESULT),      # "should hold its # tensors ...; it holds # MiB": not a leak
    ((r"still held|\bleft # \w*B held|\bholds? -?# \w*B|kept -?# \w*B alive"
      r"|were not freed"), NOT_BACK_TO_BASELINE),
]]
# What a failed assertion says about the answer's results when nothing above names a cause
# (gclab.checks.compare: "... values differ from the reference ...", a test's "should"/"must").
# Only for a test that failed: an exception's own text ("TypeError: expected Tensor") is no such claim.
ASSERTED_RESULTS = re.compile(r"differ|changed|wrong|expected|\bshould\b|\bmust\b|\breturned\b|did not|does not"
                              r"|is False|\bbelow\b")

# a number standing alone: not the digits of a name ("03_node_leak.ipynb", "test_2", "/tmp/tmpab12")
_NUMBER = re.compile(r"(?<![\w.])(?:0x[0-9a-f]+|\d+(?:\.\d+)?(?:e[-+]?\d+)?)(?![\w])", re.IGNORECASE)
_EXCEPTION_NAME = re.compile(r"^([A-Za-z_][\w.]*)(?::|$)")


def message_shape(text: str) -> str:
    """A message with its numbers written # and its white space collapsed: "memory grew by 3.1 MB"
    and "memory grew by 9.0 MB" have the same shape; the digits inside a name or a path stay."""
    return " ".join(_NUMBER.sub("#", text or "").split())


def _matching_cause(text: str) -> str | None:
    shape = message_shape(text)
    return next((cause for pattern, cause in CAUSES if pattern.search(shape)), None)


def _cause_from_status(test) -> str:
    if test.status == "error":
        name = _EXCEPTION_NAME.match((test.message or "").strip())
        return f"error: {name.group(1)}" if name else "error: other"
    if test.status == "failed":
        return WRONG_RESULT if ASSERTED_RESULTS.search(test.message or "") else "failed: other"
    return {"tampered": TAMPERING, "timeout": TIMEOUT}.get(test.status, test.status)


def cause_of(test, reason: str = "") -> str:
    """The cause of a failed test, short and the same for every submission that failed the same
    way; "" for a test that passed.  `reason` is the notebook's (NotebookResult.reason): it names
    the cause when the test's own message does not, or says only that the answer is not there
    (the notebook's answer cell was deleted, say); what the grader adds about an answer cell
    that raised ("(your answer cell raised ...)") names it only when nothing before does."""
    if test.status == "passed":
        return ""
    message, answer_errors = _split_answer_errors(test.message)
    own = _matching_cause(message)
    if own in (None, NOT_WRITTEN):
        return _matching_cause(reason) or own or _matching_cause(answer_errors) or _cause_from_status(test)
    return own


def _split_answer_errors(message: str) -> tuple[str, str]:
    """A test's own message, and what the grader added about the answer cells that raised
    (" (your answer cell raised answer_b: NotImplementedError)"): an error of another answer
    cell than the one the test checks must not hide the test's own cause."""
    own, added, rest = (message or "").partition(" (your answer cell raised ")
    return own, (f"your answer cell raised {rest}" if added else "")


# -- the results, per lesson ------------------------------------------------------------
def student_of(result) -> str:
    """The student of a result: its `student` field, else what the submission's path says
    (alice-LESSON.ipynb, alice/LESSON.ipynb, submitted/alice/LESSON/LESSON.ipynb, where LESSON is the
    lesson's notebook name)."""
    named = getattr(result, "student", "")
    if named:
        return named
    path = Path(result.notebook)
    lesson = Path(getattr(result, "lesson_notebook", "") or result.assignment).stem
    for separator in "-_":
        suffix = separator + lesson
        if path.stem.endswith(suffix) and len(path.stem) > len(suffix):
            return path.stem[:-len(suffix)]
    if path.stem != lesson:
        return path.stem
    return next((folder.name for folder in path.parents if folder.name not in ("", lesson, result.assignment)),
                path.stem)


@dataclass
class CauseGroup:
    """The failed test cells of one lesson that share a cause."""
    cause: str
    count: int = 0
    students: list[str] = field(default_factory=list)
    tests: list[str] = field(default_factory=list)
    example: str = ""

    def add(self, student: str, test_id: str, message: str) -> None:
        self.count += 1
        for names, name in ((self.students, student), (self.tests, test_id)):
            if name not in names:
                names.append(name)
        self.example = self.example or message_shape(message)


def _failures(result):
    """(test id, cause, message) of each failed test cell of a result; a result without test
    cells that has a reason fails once, for that reason."""
    if not result.tests and result.reason:
        yield "", _matching_cause(result.reason) or "failed: other", result.reason
    for test in result.tests:
        if test.status != "passed":
            yield test.id, cause_of(test, result.reason), test.message or result.reason


def failure_groups(results) -> list[CauseGroup]:
    """One lesson's failures grouped by cause, the most frequent first."""
    groups: dict[str, CauseGroup] = {}
    for result in results:
        for test_id, cause, message in _failures(result):
            groups.setdefault(cause, CauseGroup(cause)).add(student_of(result), test_id, message)
    for group in groups.values():
        group.students.sort()
    return sorted(groups.values(), key=lambda g: (-g.count, g.cause))


def by_lesson(results) -> dict[str, list]:
    lessons: dict[str, list] = {}
    for result in sorted(results, key=lambda r: (r.assignment, student_of(r))):
        lessons.setdefault(result.assignment, []).append(result)
    return lessons


# -- the page ------------------------------------------------------------------------------
def _number(value: float) -> str:
    return format(round(value, 2), "g")


def score_histogram(scores, max_score: float, title: str) -> str:
    """A histogram of the scores as a base64 PNG (matplotlib's Agg canvas, no pyplot state)."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    top = max([max_score, *scores, 1])
    whole = all(float(s).is_integer() for s in scores) and float(top).is_integer() and top <= 50
    bins = np.arange(-0.5, top + 1) if whole else np.linspace(0, top, 11)
    figure = Figure(figsize=(5, 2.6), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.hist(scores, bins=bins, color="tab:blue", edgecolor="white")
    axes.set(xlabel=f"score (out of {_number(max_score)})", ylabel="submissions", title=title)
    axes.yaxis.get_major_locator().set_params(integer=True)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _cause_rows(groups) -> str:
    e = html.escape
    rows = "".join(
        f"<tr><td>{e(g.cause)}</td><td class='n'>{g.count}</td><td>{e(', '.join(g.students))}</td>"
        f"<td>{e(', '.join(t for t in g.tests if t))}</td><td class='example'>{e(g.example[:300])}</td></tr>"
        for g in groups)
    return ("<table><tr><th>cause</th><th>failed test cells</th><th>students</th><th>test cells</th>"
            f"<th>an example message</th></tr>{rows}</table>")


def lesson_section(assignment: str, results) -> str:
    scores = [r.score for r in results]
    max_score = max((r.max_score for r in results), default=0.0)
    groups = failure_groups(results)
    e = html.escape
    summary = (f"{len(results)} submission(s); mean {_number(statistics.mean(scores))}, median "
               f"{_number(statistics.median(scores))} (out of {_number(max_score)})")
    image = score_histogram(scores, max_score, assignment)
    causes = _cause_rows(groups) if groups else "<p>No failures: every test passed.</p>"
    return (f"<section><h2>{e(assignment)}</h2><p>{e(summary)}</p>"
            f"<img src=\"data:image/png;base64,{image}\" alt=\"{e('histogram of scores, ' + assignment)}\">"
            f"<h3>Failure causes</h3>{causes}{_review_rows(results)}</section>")


def _review_rows(results) -> str:
    """The submissions to look at by hand: those whose process said a test passed where the grader's own
    figures said otherwise, and answers with lines that look at what tells a grading run from the
    learner's own."""
    return _refuted_rows(results) + _environment_rows(results)


def _refuted_rows(results) -> str:
    return _flagged_table(
        results, "disagreements", "Refuted by the grader's figures", "what was refuted", 300,
        "The process that ran these answers said a test passed; the grader's own figures (outputs compared with "
        "the reference solution's, what the system reports about the process) did not, and the test scored 0. "
        "Worth a look: an answer that tampers with grading, or one that needs far more memory than the reference.")


def _environment_rows(results) -> str:
    return _flagged_table(
        results, "review", "Answers to read", "the lines", 200,
        "These answers read what a grading run and the learner's own run can differ in (whether the collector is "
        "on, which modules are loaded, ...). That is not wrong in itself, and their scores stand; but code that "
        "behaves well only where it is measured would read such things: worth a look.")


def _flagged_table(results, field: str, title: str, column: str, width: int, why: str) -> str:
    """A table of the students whose results list lines in `field`, with their scores and those lines."""
    flagged = [(student_of(r), r.score, r.max_score, getattr(r, field)) for r in results if getattr(r, field, None)]
    if not flagged:
        return ""
    e = html.escape
    rows = "".join(f"<tr><td>{e(student)}</td><td class='n'>{_number(score)} / {_number(max_score)}</td>"
                   f"<td class='example'>{'<br>'.join(e(line[:width]) for line in lines[:5])}</td></tr>"
                   for student, score, max_score, lines in flagged)
    return (f"<h3>{e(title, quote=False)}</h3><p>{e(why, quote=False)}</p>"
            f"<table><tr><th>student</th><th>score</th><th>{e(column)}</th></tr>"
            f"{rows}</table>")


def causes_of(result) -> list[str]:
    """The causes of a result's failed test cells, each once, in the order of its cells."""
    return list(dict.fromkeys(cause for _, cause, _ in _failures(result)))


def students_by_lessons(lessons: dict[str, list]) -> str:
    """The table an instructor reads first: a row per student, a column per lesson, each cell the
    score and the causes of what failed."""
    e = html.escape
    graded = {(student_of(r), name): r for name, results in lessons.items() for r in results}
    students = sorted({student for student, _ in graded})
    header = "".join(f"<th>{e(name)}</th>" for name in lessons)
    rows = "".join(f"<tr><th>{e(student)}</th>{''.join(_score_cell(graded.get((student, name))) for name in lessons)}"
                   "</tr>" for student in students)
    return f"<table class='overview'><tr><th>student</th>{header}</tr>{rows}</table>"


def _score_cell(result) -> str:
    if result is None:
        return "<td class='none'>no submission</td>"
    e = html.escape
    full = "full" if result.score >= result.max_score > 0 else "short"
    causes = "".join(f"<li>{e(cause)}</li>" for cause in causes_of(result))
    return (f"<td class='{full}'><span class='score'>{_number(result.score)} / {_number(result.max_score)}</span>"
            + (f"<ul class='causes'>{causes}</ul>" if causes else "") + "</td>")


def _by_hand_lines(result) -> list[str]:
    """What the scores set by hand (gradebook.ManualScore) did to a result's grade, in words."""
    return [m.describe() for m in getattr(result, "by_hand", [])]


def _by_hand_rows(lessons: dict[str, list]) -> str:
    flagged = [(student_of(r), name, line) for name, results in lessons.items() for r in results
               for line in _by_hand_lines(r)]
    if not flagged:
        return ""
    e = html.escape
    rows = "".join(f"<tr><td>{e(student)}</td><td>{e(name)}</td><td>{e(line)}</td></tr>"
                   for student, name, line in flagged)
    return ("<h2>Scores set by hand</h2><p>A score set by hand in the Formgrader stands while the automatic score "
            "under it stays the same (the gradebook, its export and the feedback all show it); where a new answer "
            "changed the automatic score, it was cleared.</p>"
            f"<table><tr><th>student</th><th>lesson</th><th>what happened</th></tr>{rows}</table>")


def _run_line(results) -> str:
    """How many of the results this run graded again, where it says (`regraded`)."""
    kept = [r for r in results if getattr(r, "regraded", True) is False]
    if not kept:
        return ""
    return (f" {len(results) - len(kept)} graded in this run; {len(kept)} unchanged since their last grading "
            "(submission and lesson the same), whose grades stand.")


def _unguarded_line(results) -> str:
    """What the machines that graded left out of the grader's reach, and for how many submissions (`unguarded`):
    a grader's own warning goes to its terminal, which a cluster's workers do not show."""
    counts: dict[str, int] = {}
    for result in results:
        for note in getattr(result, "unguarded", []):
            counts[note] = counts.get(note, 0) + 1
    if not counts:
        return ""
    said = "; ".join(f"{count} graded {note}" for note, count in counts.items())
    return (f" Some submissions were graded where the machine kept part of what decides a grade out of the grader's "
            f"reach, so that a forged grade could stand: {said} (README: What decides a grade).")


_STYLE = ("body{font-family:sans-serif;margin:2em;max-width:80em}table{border-collapse:collapse}"
          "td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left;vertical-align:top}"
          "td.n{text-align:right}td.example{font-size:.85em;color:#555}section{margin-bottom:3em}"
          "table.overview td.full{background:#eef7ee}table.overview td.short{background:#fbf1f1}"
          "table.overview td.none{color:#888}ul.causes{margin:.2em 0 0 1em;padding:0;font-size:.85em}")


def report_html(lessons: dict[str, list]) -> str:
    results = [r for lesson in lessons.values() for r in lesson]
    sections = "".join(lesson_section(name, results) for name, results in lessons.items())
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>Class report</title>"
            f"<style>{_STYLE}</style></head><body><h1>Class report</h1>"
            f"<p>{len(results)} submission(s) in {len(lessons)} lesson(s).{html.escape(_run_line(results))}"
            f"{html.escape(_unguarded_line(results))} "
            f"Failures are counted per test cell; a student is listed once per cause.</p>"
            f"<h2>Students by lessons</h2>{students_by_lessons(lessons)}{_by_hand_rows(lessons)}"
            f"{sections}</body></html>")


# -- the files -------------------------------------------------------------------------------
FILES = ("report.html", "scores.csv", "causes.csv", "review.csv")
PREVIOUS = "previous"
_UNFINISHED = '<meta name="gclab-report" content="unfinished">'


def set_aside(folder: Path) -> None:
    """Before a grading run: the last finished report moves into folder/previous/, and report.html
    says that a run is under way, until `class_report` writes the new one.  A run stopped before
    its end (killed, a closed terminal) so leaves no report that looks current."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    page = folder / "report.html"
    if page.is_file() and _UNFINISHED not in page.read_text(encoding="utf-8", errors="replace"):
        shutil.rmtree(folder / PREVIOUS, ignore_errors=True)
        (folder / PREVIOUS).mkdir()
        for name in FILES:
            if (folder / name).is_file():
                (folder / name).rename(folder / PREVIOUS / name)
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    previous = (f"<p>The report of the last run that finished: <a href='{PREVIOUS}/report.html'>{PREVIOUS}/report.html"
                "</a>.</p>" if (folder / PREVIOUS / "report.html").is_file() else "")
    page.write_text(
        f"<!doctype html><html><head><meta charset=\"utf-8\">{_UNFINISHED}<title>Class report: not written yet"
        f"</title><style>{_STYLE}</style></head><body><h1>Class report: not written yet</h1>"
        f"<p>A grading run started at {html.escape(started)} (process {os.getpid()} on "
        f"{html.escape(socket.gethostname())}) writes the class report here when it ends. If that run is no longer "
        "going, it was stopped before its end: run the same command again (what was graded and did not change "
        f"is not graded again).</p>{previous}</body></html>", encoding="utf-8")


def unfinished(folder: Path) -> bool:
    """Does folder/report.html say that its run has not finished?"""
    page = Path(folder) / "report.html"
    return page.is_file() and _UNFINISHED in page.read_text(encoding="utf-8", errors="replace")


def _write_csv(path: Path, header, rows) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def class_report(results, out_dir: Path) -> dict[str, Path]:
    """Write report.html, scores.csv, causes.csv and review.csv into `out_dir` (made if missing) for the
    grader's results (gclab.grader.grading.NotebookResult); return their paths by kind."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lessons = by_lesson(results)
    page = out_dir / "report.html"
    page.write_text(report_html(lessons), encoding="utf-8")
    scores = _write_csv(out_dir / "scores.csv", ["student", "assignment", "score", "max_score"],
                        [[student_of(r), r.assignment, _number(r.score), _number(r.max_score)]
                         for lesson in lessons.values() for r in lesson])
    causes = _write_csv(out_dir / "causes.csv", ["assignment", "cause", "count", "students"],
                        [[name, g.cause, g.count, " ".join(g.students)]
                         for name, lesson in lessons.items() for g in failure_groups(lesson)])
    to_read = _write_csv(out_dir / "review.csv", ["student", "assignment", "score", "line"],
                         [[student_of(r), r.assignment, _number(r.score), line]
                          for lesson in lessons.values() for r in lesson
                          for line in [*(f"refuted: {d}" for d in getattr(r, "disagreements", [])),
                                       *(f"by hand: {m}" for m in _by_hand_lines(r)),
                                       *getattr(r, "review", [])]])
    shutil.rmtree(out_dir / PREVIOUS, ignore_errors=True)      # set aside while this run went on: now replaced
    return {"html": page, "scores": scores, "causes": causes, "review": to_read}
