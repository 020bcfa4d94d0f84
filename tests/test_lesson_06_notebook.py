"""Lesson 06's solution run top to bottom as a learner runs it (in a module of its own, apart from
the grading in tests/test_lesson_06.py: `make test` runs the two side by side)."""
import re

import pytest
from lesson_support import plots_drawn, printed_text, problems
from lesson_support import test_no_graded_cell_of_the_solution_shows_a_value  # noqa: F401  (collected here)

from test_lesson_06 import SOLUTION  # noqa: F401  (the `executed` fixture runs the module's SOLUTION)

pytestmark = pytest.mark.timed     # the notebook times a server


def test_solution_notebook_runs_clean_on_cpu(executed):
    assert not problems(executed), f"errors or stderr output in the solution notebook: {problems(executed)}"
    text = printed_text(executed)
    assert "attribution on: P99 median" in text and "collector CPU time a request waited behind" in text
    assert re.search(r"gen 2: [1-9]", text), "the feature should bring full collections"
    assert "request(s) waited for it" in text
    assert "round 3/3" in text, "the comparison cells print a line per load"
    assert "fewer objects (compact)" in text and "No full collection ran inside a request." in text
    assert "Collector time charged to a request" in text
    assert plots_drawn(executed) >= 5, "latency before/after, the timeline, the cost curve, the fixes, the check"


def test_the_comparison_of_fixes_is_a_picker_with_its_figure_for_readers_without_widgets(executed):
    import nbformat
    nb = nbformat.read(executed, 4)
    picker = next(c for c in nb.cells if c.cell_type == "code" and "Picker(" in c.source)
    kinds = [sorted(o.get("data", {})) for o in picker.outputs if o.output_type == "display_data"]
    assert ["application/vnd.jupyter.widget-view+json", "text/plain"] in kinds
    assert ["image/png", "text/plain"] in kinds
    assert "your policy (my_policy.py)" in picker.source
