"""nbconvert preprocessors the course's nbgrader config adds to nbgrader's own commands.

`StripHiddenTests` runs in `nbgrader generate_feedback`: nbgrader's feedback shows each
test cell as it ran, hidden tests and the tracebacks that quote them included (nbgrader
issues #917, #1363).  Here a test cell keeps only its visible part, and an error keeps
its type and message (what was wrong) without the traceback (which quotes the line).

`RefuseAutograde` runs first in `nbgrader autograde`: in this course a grade comes from
`gclab grade` (the hidden tests run in a verdict process of their own, and the gradebook
never holds them), so nbgrader's autograde would grade without them.
"""
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


class RefuseAutograde(Preprocessor):
    enabled = Bool(True).tag(config=True)

    def preprocess(self, nb, resources):
        raise RuntimeError("this course is graded with `make grade-class` (gclab grade), which runs the hidden "
                           "tests out of the learner's reach; nbgrader autograde would grade without them")
