"""gclab.grader._jsonschema: reading a notebook does not pay for rfc3987-syntax's grammars."""
import subprocess
import sys

import pytest


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("module", ["gclab.grader.grading", "gclab.grader.classroom", "gclab.grader.feedback"])
def test_a_module_that_reads_notebooks_imports_jsonschema_without_the_iri_grammars(module):
    assert _run(f"import {module}, sys; print('jsonschema' in sys.modules, 'rfc3987_syntax' in sys.modules)") == (
        "True False")


def test_the_hidden_module_imports_again_for_whoever_asks():
    out = _run("import gclab.grader._jsonschema, rfc3987_syntax; print(rfc3987_syntax.__name__)")
    assert out == "rfc3987_syntax"


def test_notebooks_are_still_validated():
    out = _run("import gclab.grader._jsonschema, nbformat\n"
               "nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell('1')])\n"
               "nb.cells[0]['execution_count'] = 'not a number'\n"
               "try:\n    nbformat.validate(nb)\nexcept nbformat.ValidationError:\n    print('refused')\n")
    assert out == "refused"


def test_an_earlier_jsonschema_is_left_as_it_was():
    out = _run("import jsonschema, gclab.grader._jsonschema, sys; print('rfc3987_syntax' in sys.modules)")
    assert out == "True"
