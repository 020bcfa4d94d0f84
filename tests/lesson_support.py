"""What the lessons' end-to-end tests share: student variants of a released notebook,
one grading run for all of them, and reading the notebooks as the grader ran them."""
import html
from pathlib import Path

import nbformat

from gclab.grader import classroom, grading
from gclab.tools import bench

ROOT = Path(__file__).resolve().parent.parent


# A learner's value that says it equals whatever it is compared with (reflected comparison
# makes `expected == value` ask it too): 0 where arithmetic and printing need a number, and no
# float, so that math.isclose gives up and falls back on ==.  Hidden tests must refuse it.
EQUAL_TO_ANYTHING = '''
class EqualToAnything(int):
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = int.__hash__
    def __float__(self):
        raise TypeError("no float here")
    def __sub__(self, other):
        return self
    __rsub__ = __add__ = __radd__ = __sub__
'''


def is_answer(cell) -> bool:
    return bool(cell.metadata.get("nbgrader", {}).get("solution"))


def student_variant(release: Path, answers) -> nbformat.NotebookNode:
    """The released notebook with its answer cells filled in and the unlocked demo cells
    deleted, as a student may do; the graded cells are all still there.  `answers` is one
    source, a list of sources (one per answer cell, in order), or a dict keyed by the answer
    cells' grade_id with or without its "answer_" prefix."""
    nb = nbformat.read(release, 4)
    sources = iter([answers] if isinstance(answers, str) else [] if isinstance(answers, dict) else answers)
    for cell in nb.cells:
        if is_answer(cell):
            grade_id = cell.metadata["nbgrader"]["grade_id"]
            if isinstance(answers, dict):
                cell.source = answers.get(grade_id, answers.get(grade_id.removeprefix("answer_")))
            else:
                cell.source = next(sources)
    nb.cells = [c for c in nb.cells if c.cell_type == "markdown" or "nbgrader" in c.metadata]
    return nb


class Graded(dict):
    """name -> NotebookResult, and the folder where what the students get back was written."""

    def __init__(self, results, folder: Path):
        super().__init__(results)
        self.folder = folder


def grade_all(paths: dict, folder: Path) -> Graded:
    """Grade every notebook as a class is graded (two at a time; a timed lesson alone),
    each name a student: gradebook, feedback and report written under folder/graded."""
    names = list(paths)
    submissions = [classroom.Submission(name, grading.assignment_of(paths[name], ROOT)[0], paths[name])
                   for name in names]
    settings = classroom.settings_for(ROOT, out=folder / "graded", db_url=f"sqlite:///{folder / 'gradebook.db'}")
    return Graded(zip(names, classroom.grade_class(submissions, settings, jobs=2)), folder / "graded")


def passed_visibly(test) -> bool:
    """Whether a graded test's visible self-check passed, read from the grading itself: the grader runs a
    test cell's visible part first, as a learner's kernel runs it, and keeps what it prints (the hidden part
    runs after it, only if it passed, its output dropped); a visible part that passes ends by printing its
    one "OK:" line (test_every_self_check_ends_with_one_plain_line_when_it_passes)."""
    lines = test.output.strip().splitlines()
    return bool(lines) and lines[-1].startswith("OK: ")


def refused_for_tampering(result) -> bool:
    """The grader refused the submission for rewriting its tools (read from its source, or seen while
    it ran): no self-check run in that learner's own kernel can be believed, so none is asked to fail."""
    return ("modifies the grader" in result.reason or "tampers with grading" in result.reason
            or any(t.status == "tampered" for t in result.tests))


def test_every_wrong_fix_that_loses_points_fails_a_visible_self_check(graded, request):
    """Every lesson's test module imports this test: every graded submission that lost points (its wrong
    fixes and hostile variants, the untouched release aside) also failed at least one of the visible
    self-checks, which ran in its grading as they run in a learner's kernel (`passed_visibly`).  The hidden
    tests may use other inputs and sizes, never other rules.  A module may name, in NOT_YET_CAUGHT_VISIBLY
    (name -> why), wrong fixes its self-checks cannot catch yet: those must still pass visibly, so that the
    list is taken down as soon as a self-check catches one.  Its KNOWN_GAPS (wrong fixes the grading is known to
    give full marks, in an xfail test of their own) are not judged here: where the grader's figures happen to
    refute one, no visible self-check was meant to (lesson 06's waits for more idle time than the load's lulls
    leave on a busy machine, now and then)."""
    assert all(passed_visibly(t) for t in graded["solution"].tests), "the solution fails a visible self-check"
    known = getattr(request.module, "NOT_YET_CAUGHT_VISIBLY", {})
    gaps = getattr(request.module, "KNOWN_GAPS", {})
    passed, caught_now = {}, []
    for name, result in graded.items():
        if (name in ("solution", "untouched", *gaps) or result.score >= result.max_score
                or refused_for_tampering(result)):
            continue
        if all(passed_visibly(t) for t in result.tests):
            lost = [f"{t.id}: {t.message[:200]}" for t in result.tests if t.status != "passed"]
            if name not in known:
                passed[name] = f"{result.score:g}/{result.max_score:g}; lost {lost}"
        elif name in known:
            caught_now.append(name)
    assert not passed, f"wrong fixes that pass every visible self-check yet lose points: {passed}"
    assert not caught_now, f"a self-check now catches these: take them off NOT_YET_CAUGHT_VISIBLY: {caught_now}"


def test_no_graded_cell_of_the_solution_shows_a_value(executed):
    """Every lesson's test module imports this test: the solution run top to bottom (hidden tests included)
    displays no value in a test cell, which nbgrader validate would read as a partial score."""
    nb = nbformat.read(executed, 4)
    shown = [c.metadata["nbgrader"]["grade_id"] for c in nb.cells if c.cell_type == "code"
             and c.metadata.get("nbgrader", {}).get("grade") and not c.metadata["nbgrader"].get("solution")
             and any(o.output_type == "execute_result" for o in c.outputs)]
    assert not shown, f"test cells that display a value: {shown}"

def test_every_self_check_ends_with_one_plain_line_when_it_passes(graded):
    """Every lesson's test module imports this test: run with the reference solution, the visible part of
    each test prints, as its last line, one plain sentence that starts with "OK:"."""
    for test in graded["solution"].tests:
        lines = test.output.strip().splitlines()
        assert lines and lines[-1].startswith("OK: ") and len(lines[-1]) < 400, (test.id, lines[-3:])


def hidden_lines(source: Path, release: Path) -> list[str]:
    """The lines of a lesson's hidden tests that appear nowhere in its release."""
    source_nb, released = nbformat.read(source, 4), nbformat.read(release, 4)
    released_text = "\n".join(c.source for c in released.cells)
    every_line = {line.strip() for c in source_nb.cells if c.cell_type == "code" for line in c.source.splitlines()}
    visible = {line.strip() for c in source_nb.cells if c.cell_type == "code"
               for line in grading.without_hidden_tests(c.source).splitlines()}
    return sorted(line for line in every_line - visible
                  if len(line) > 8 and line not in released_text and "HIDDEN TESTS" not in line)


def handed_back_text(path: Path) -> str:
    """A handed-back file's text as its reader sees it (a notebook's sources and outputs, but
    not the learner's own answer cells, which may hold any line; a page without its HTML
    escapes)."""
    if path.suffix == ".ipynb":
        nb = nbformat.read(path, 4)
        return "\n".join(c.source + "".join(o.get("text", "") + str(o.get("traceback", "")) + str(o.get("data", ""))
                                            for o in c.get("outputs", [])) for c in nb.cells if not is_answer(c))
    return html.unescape(path.read_text(errors="replace"))


def leaked_lines(folder: Path, source: Path, release: Path) -> list[tuple[str, str]]:
    """(file, line) for each line of the lesson's hidden tests found in a file under `folder`."""
    lines = hidden_lines(source, release)
    assert lines, "the lesson has no hidden test line to look for"
    texts = {path: handed_back_text(path) for path in sorted(folder.rglob("*"))
             if path.is_file() and path.suffix in (".ipynb", ".html", ".md", ".csv")}
    return [(str(path.relative_to(folder)), line) for path, text in texts.items() for line in lines if line in text]


def run_notebook(path: Path, folder: Path) -> Path:
    """The notebook as a learner runs it top to bottom (hidden tests included when it is the
    solution), outputs kept: the path of the executed copy."""
    out = folder / f"executed-{path.name}"
    bench.execute_seconds(path, out)
    return out


def write_variants(release: Path, variants: dict, folder: Path) -> dict:
    """Write each variant (name -> answers) next to the others; returns name -> path."""
    paths = {}
    for name, answers in variants.items():
        paths[name] = folder / f"{name}-{release.name}"
        nbformat.write(student_variant(release, answers), paths[name])
    return paths


def code_outputs(path):
    nb = nbformat.read(path, 4)
    return [(i, o) for i, c in enumerate(nb.cells) if c.cell_type == "code" for o in c.outputs]


def problems(path, expected_error=None) -> list:
    """Errors and stderr output in a notebook's cells, as (cell index, what); an error whose
    message contains `expected_error` is one the lesson shows on purpose."""
    return [(i, o.get("ename") or o.get("text", "")[:200]) for i, o in code_outputs(path)
            if (o.output_type == "error" and not (expected_error and expected_error in o.get("evalue", "")))
            or (o.output_type == "stream" and o.name == "stderr")]


def shows_error(path, message) -> bool:
    return any(o.output_type == "error" and message in o.get("evalue", "") for _, o in code_outputs(path))


def printed_text(path) -> str:
    return "".join(o.get("text", "") for _, o in code_outputs(path))


def plots_drawn(path) -> int:
    return sum(o.output_type == "display_data" and "image/png" in o.get("data", {}) for _, o in code_outputs(path))


def cell_result(result, test_id):
    return next(t for t in result.tests if t.id == test_id)


def assert_told_why(result, test_id, words):
    """A wrong fix fails `test_id` with a message that holds `words`, or one of them where `words` is
    a tuple: a submission with two faults may be told either first (which check fires first can
    depend on how busy the machine is), and each reason must name a fault that is there."""
    failed = cell_result(result, test_id)
    reasons = (words,) if isinstance(words, str) else tuple(words)
    assert failed.status == "failed" and any(w in failed.message for w in reasons), (failed.status, failed.message)


def assert_full_marks(result, max_score):
    assert result.max_score == max_score, grading.format_results([result])
    assert result.score == max_score, grading.format_results([result])


def assert_no_marks_until_answered(result, max_score):
    """The untouched release: 0 points, every test failing because the answer is not written yet."""
    assert result.max_score == max_score and result.score == 0, grading.format_results([result])
    assert all(t.status == "failed" and "is not defined yet" in t.message for t in result.tests), (
        grading.format_results([result]))


def assert_less_than_full_marks(result, max_score):
    """A wrong fix: some points lost, and a reason for every point lost."""
    assert result.max_score == max_score, grading.format_results([result])
    assert result.score < max_score, grading.format_results([result])
    assert all(t.message for t in result.tests if t.status != "passed"), "every lost point needs a reason"


def write_locked_cells_edited(release: Path, answers, folder: Path) -> Path:
    """A student variant whose locked test cells were replaced by `pass` (the grader must
    restore them); returns its path."""
    edited = student_variant(release, answers)
    for cell in edited.cells:
        if cell.metadata.get("nbgrader", {}).get("grade"):
            cell.source = "pass"
    path = folder / f"edits_locked_cells-{release.name}"
    nbformat.write(edited, path)
    return path


def test_no_handed_back_file_holds_a_line_of_a_hidden_test(graded, request):
    """Every lesson's test module imports this test: the graded notebooks, feedback pages and
    class report of all its submissions hold no line of the lesson's hidden tests."""
    assert not leaked_lines(graded.folder, request.module.SOLUTION, request.module.RELEASE)


def test_every_test_of_the_reference_records_what_it_observed(graded, request):
    """Every lesson's test module imports this test: running the reference solution, each of the lesson's
    tests passes and records outputs for the grader to compare (a bare "passed" is never accepted), and
    the grader has its own figures of it."""
    lesson = request.module.SOLUTION.parent.name
    reference = grading.reference_of(ROOT, lesson)
    assert reference["tests"], lesson
    for test_id, test in reference["tests"].items():
        assert test["status"] == "passed" and test["observed"] and test["measured"], (test_id, test["status"])
