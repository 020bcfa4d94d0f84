"""jsonschema, imported without the IRI grammars of rfc3987-syntax: import this before nbformat,
nbclient or nbgrader.

nbformat validates notebooks with jsonschema, whose format checkers import rfc3987-syntax where it
is installed (jupyter-events asks for `jsonschema[format-nongpl]`), and that package compiles 38
Lark grammars as it is imported: 2.3 s of CPU on a quiet 2-core machine, paid again by every
process that reads a notebook (each `gclab grade`, each grader's zygote, each lesson kernel whose
hidden tests import gclab.grader.grading), python-jsonschema/jsonschema#1428.  No schema of nbformat,
nbgrader or Jupyter's events has an `iri` format, the only one that package checks.  So jsonschema
is imported here with it hidden, as where it is not installed; after that it imports as usual for
anyone who asks for it by name.
"""
import sys

_HIDDEN = "rfc3987_syntax"

if "jsonschema" not in sys.modules and _HIDDEN not in sys.modules:
    sys.modules[_HIDDEN] = None                  # `import` raises ImportError, which jsonschema expects
    try:
        import jsonschema  # noqa: F401
    finally:
        if sys.modules.get(_HIDDEN, 0) is None:
            del sys.modules[_HIDDEN]
