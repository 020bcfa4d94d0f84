"""What the course's nbgrader config plugs into nbgrader's own commands, so that they grade and give
feedback as `make grade-class` does (autograder/nbgrader_config.py):

- `nbgrader autograde` (and the Formgrader's "Autograde" button, which runs it): `mirror_lesson`, its
  pre-convert hook, puts the lesson into the gradebook as `gclab grade` does (the course's release never
  writes the live gradebook); `GradeWithTheCourse`, its only step, grades each submission with the course's
  grader (`gclab.grader.classroom.grade_submission`: a verdict process, the hidden tests out of the learner's
  reach, the scores into the gradebook, the feedback written) and hands nbgrader the graded notebook to
  write.  The learner's code runs nowhere else: nbgrader executes nothing.
- `nbgrader generate_feedback` (the "Generate Feedback" button): `CourseFeedback` writes the course's own
  feedback page, HTML and Markdown, from the grade the graded notebook keeps and the scores set by hand in
  the gradebook now.  A notebook with no such grade (graded by another tool) gets nbgrader's page with
  `StripHiddenTests`: each test cell keeps only its visible part, and an error its type and message
  without the traceback that quotes it (nbgrader issues #917, #1363).
"""
from pathlib import Path

from nbconvert.exporters import HTMLExporter
from nbconvert.preprocessors import Preprocessor
from traitlets import Bool

from .grading import without_hidden_tests


def _is_test(cell) -> bool:
    meta = cell.metadata.get("nbgrader", {})
    return cell.cell_type == "code" and meta.get("grade") and not meta.get("solution")


class StripHiddenTests(Preprocessor):
    enabled = Bool(True).tag(config=True)     # nbconvert registers a preprocessor disabled

    def preprocess_cell(self, cell, resources, index):
        if _is_test(cell):
            cell.source = without_hidden_tests(cell.source)
            for output in cell.get("outputs", []):
                if output.output_type == "error":
                    output.traceback = [f"{output.ename}: {output.evalue}"]
        return cell, resources


def _course_of(path) -> Path:
    from .grading import find_course_root
    return find_course_root(Path(path).parent)


def mirror_lesson(assignment, student, notebooks) -> None:
    """nbgrader's pre-convert hook (Autograde): the lesson of the submission about to be graded into
    the gradebook the course's config names, as `make grade-class` puts it there."""
    from . import classroom
    for notebook in notebooks[:1]:
        root = _course_of(notebook)
        classroom.prepare_gradebook(classroom.settings_for(root), [Path(notebook).parent.name])


class GradeWithTheCourse(Preprocessor):
    """nbgrader autograde's step: the submission graded by the course's grader; the notebook it returns
    is the graded notebook (`gclab.grader.feedback.graded_notebook`), which nbgrader writes into autograded/."""
    enabled = Bool(True).tag(config=True)

    def preprocess(self, nb, resources):
        from . import _jsonschema  # noqa: F401  (before nbformat: see there)
        import nbformat
        from . import classroom
        meta = resources["nbgrader"]
        path = Path(resources["metadata"]["path"]) / f"{meta['notebook']}.ipynb"
        root = _course_of(path)
        settings = classroom.settings_for(root, db_url=meta["db_url"], force=True)
        submission = classroom.Submission(meta["student"], meta["assignment"], path)
        result = classroom.grade_submission(submission, settings)
        self.log.info("%s %s: %g / %g, graded by the course's grader", result.student, result.assignment,
                      result.score, result.max_score)
        for manual in result.by_hand:
            self.log.warning("%s %s, by hand: %s", result.student, result.assignment, manual.describe())
        graded = settings.out / "autograded" / meta["student"] / meta["assignment"] / f"{meta['notebook']}.ipynb"
        return nbformat.read(graded, 4), resources


class CourseFeedback(HTMLExporter):
    """nbgrader generate_feedback's exporter: the course's feedback page (and its Markdown twin, beside
    it) for a notebook the course's grader graded; nbgrader's own page otherwise."""

    def from_notebook_node(self, nb, resources=None, **kw):
        from . import feedback, gradebook
        result = feedback.graded_result(nb)
        meta = (resources or {}).get("nbgrader", {})
        if result is None or not meta:
            return super().from_notebook_node(nb, resources, **kw)
        resources = self._init_resources(resources)
        by_hand = gradebook.standing_manual_scores(meta["db_url"], meta["student"], meta["assignment"],
                                                   meta["notebook"])
        name = resources.get("unique_key", meta["notebook"])
        resources.setdefault("outputs", {})[f"{name}.md"] = feedback.markdown(result, nb, by_hand).encode()
        resources["output_extension"] = ".html"
        return feedback.page(result, nb, by_hand), resources
