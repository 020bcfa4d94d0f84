"""Imported once by the grading fork server (see grading._nbgrader_job), so that each
grading job, forked from it, starts with nbgrader already imported (seconds saved per
submission)."""
import nbgrader.apps  # noqa: F401
import nbgrader.converters  # noqa: F401
import traitlets.config.loader  # noqa: F401
