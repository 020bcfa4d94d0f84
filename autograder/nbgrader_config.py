"""nbgrader settings of the course.

The course root is the repository: `solutions/` is nbgrader's source folder (one
assignment folder per lesson) and `notebooks/` its release folder.  Run nbgrader from
this folder (`cd autograder && nbgrader generate_assignment 03_node_leak --force`) or
use the `gclab release` / `gclab grade` commands, which load this file.
"""
import os
import sys

c = get_config()  # noqa: F821  (provided by traitlets when it loads this file)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

c.CourseDirectory.course_id = "gc-gpu-memory"
c.CourseDirectory.root = ROOT
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "notebooks"
# nbgrader creates a gradebook by running `alembic` from PATH: find it beside this Python,
# so that `.venv/bin/nbgrader ...` works without activating .venv (once: the grader loads this file
# for every grading).
if os.path.dirname(sys.executable) not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(ROOT, "autograder", "gradebook.db")
# The course's own exchange folder (nbgrader's default, /usr/local/share/nbgrader/exchange,
# needs root to create).  On a shared server, point this at a folder every user can write.
c.Exchange.root = os.path.join(ROOT, "exchange")
# Files never released or graded: caches, and what lessons write when they run (lesson 06
# writes the learner's policy to my_policy.py).  gclab's release and grade honour this list.
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "*.png", "*.pickle", "my_policy.py"]

# Lessons run loops and plots in single cells; 30 s (nbgrader's default) is too short on
# a 2-core machine, and a runaway cell must still be stopped.
c.Execute.timeout = 180
c.Execute.interrupt_on_timeout = True

# The student's stub: what an answer cell holds between ### BEGIN SOLUTION and ### END SOLUTION
# is replaced by this text in the release.  What the exercise asks for is the cell's first
# line, above ### BEGIN SOLUTION (every lesson's answer cell has one).
c.ClearSolutions.code_stub = {
    "python": "# YOUR CODE HERE\n"
              "raise NotImplementedError()",
}

# Any stderr output scores a test cell 0.  Library warnings are not the student's
# fault: drop stderr text that is only Python warnings (the checks themselves raise
# AssertionError for real failures).
c.IgnorePattern.enabled = True
c.IgnorePattern.pattern = r"^(\S+:\d+: \w*Warning: .*\n?(  .*\n?)*)+$"

c.ExecutePreprocessor.kernel_name = "python3"

# nbgrader's autograde (and the Formgrader's "Autograde" button) grades with the course's grader, as
# `make grade-class` does: the lesson mirrored into the gradebook first, then each submission graded in a
# verdict process of its own (the hidden tests out of the learner's reach); nbgrader writes the graded
# notebook the grader returns, and executes nothing itself (gclab.grader.preprocessors).
def _mirror_lesson(**submission):
    from gclab.grader.preprocessors import mirror_lesson      # imported when autograde runs, not for every command
    mirror_lesson(**submission)


c.Autograde.pre_convert_hook = _mirror_lesson
c.Autograde.sanitize_preprocessors = ["gclab.grader.preprocessors.GradeWithTheCourse"]
c.Autograde.autograde_preprocessors = []
c.Autograde.permissions = 644            # nbgrader's default (444) would stop `make grade-class` regrading it
# nbgrader's generate_feedback (the "Generate Feedback" button) writes the course's own feedback pages, HTML
# and Markdown, with the scores set by hand in the Formgrader; a notebook graded otherwise keeps no hidden line.
c.GenerateFeedback.exporter_class = "gclab.grader.preprocessors.CourseFeedback"
c.GenerateFeedback.preprocessors = ["nbgrader.preprocessors.GetGrades", "gclab.grader.preprocessors.StripHiddenTests",
                                    "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor"]
