# The course's commands. The first run creates .venv and installs gclab with the
# pinned course and test dependencies; later runs reinstall only when
# pyproject.toml or constraints.txt change (stamp file .venv/.installed).
#
#   make lab                      open a learner's JupyterLab on notebooks/  (LAB_ARGS=--no-browser)
#   make lab AUTHOR=1             JupyterLab on the course with nbgrader's author tools
#   make test                     run the test suite             (PYTEST_ARGS="-x -k meter", TEST_JOBS=2)
#   make release                  regenerate notebooks/ from solutions/, and README's Colab links
#   make release SOURCE=URL       the same, first keeping URL as where the course lives (Colab;
#                                 autograder/course.toml), e.g. https://github.com/OWNER/REPO@main
#   make grade NB="a.ipynb b.ipynb"   grade notebooks, print the scores (GRADE_ARGS=--json)
#   make grade-class              grade submitted/STUDENT/LESSON/: gradebook, feedback/, reports/; again, only
#                                 what changed (GRADE_ARGS="--jobs 2", "--force" for all, "--scheduler tcp://host:8786")
#   make clean-grades             remove autograded/, feedback/ and reports/ (submissions and
#                                 the gradebook are kept)
#   make bench                    gclab bench on this machine
#   make gpu-check                on a CUDA GPU: run and grade every lesson on CUDA and on CPU, compare
#   make clean / make distclean   remove caches / also remove .venv
#
# PIP_ARGS is passed to pip install, e.g. for CPU-only torch wheels from PyTorch's index
# (on Linux, PyPI's torch brings several GB of CUDA packages):
#   make setup PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
#
# The Jupyter kernel "python3" ("Python 3 (gclab)", the one every notebook names) is
# registered inside .venv (stamp .venv/.kernel), never for the whole user: each checkout
# has its own. `make lab` finds it through JUPYTER_PATH and takes its Jupyter settings from
# lab/ (a learner's lab: nbgrader's author tools off), or autograder/ with AUTHOR=1.

PYTHON      ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.installed
KERNEL      := $(VENV)/.kernel
LAB_ARGS    ?=
PYTEST_ARGS ?=
GRADE_ARGS  ?=
PIP_ARGS    ?=
NB          ?=
SOURCE      ?=
AUTHOR      ?=

.DEFAULT_GOAL := help
.DELETE_ON_ERROR:
.PHONY: help setup lab test release grade grade-class clean-grades bench gpu-check clean distclean constraints

help:
	@sed -n 's/^#   //p' Makefile

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install -c constraints.txt $(PIP_ARGS) -e ".[course,test]"
	touch $@

# The notebooks' kernel, in this checkout's .venv only (gclab.grader.course.KERNELSPEC).
$(KERNEL): $(STAMP) Makefile
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (gclab)"
	touch $@

setup: $(STAMP) $(KERNEL)

lab: $(STAMP) $(KERNEL)
	JUPYTER_PATH="$(CURDIR)/$(VENV)/share/jupyter" \
	JUPYTER_CONFIG_PATH="$(CURDIR)/$(if $(AUTHOR),autograder,lab)" \
	  $(VENV)/bin/jupyter lab $(LAB_ARGS) $(if $(AUTHOR),.,notebooks/)

# One pass, TEST_JOBS modules at a time (pytest-xdist), the longest modules first (tests/conftest.py;
# --no-loadscope-reorder: not xdist's own order, by number of tests), so that no worker is left alone
# with a long one at the end. Three modules at a time on 2 cores: a grading waits for part of its time
# (one of lesson 06's keeps 0.6 of a core busy), and a third worker fills some of the waits (measured
# 2026-11-29: a fresh clone's `.ci/run` 14:12 where two took 14:50; `make test` again 11:47 where two
# took 15:04). The tests that time a server (marked `timed`) run beside
# the rest: their verdicts are judged in CPU time and hold beside two CPU hogs, and a pass that only the
# CPU time refutes is graded once more (gclab.grader.grading._judge).
# A pass that selects no test (exit 5, PYTEST_ARGS="-k meter") is not a failure.
TEST_JOBS ?= 3

test: $(STAMP) $(KERNEL)
	$(PY) -m pytest -q tests -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS) || [ $$? -eq 5 ]

release: $(STAMP)
	$(PY) -m gclab release $(if $(SOURCE),--source "$(SOURCE)")

grade: $(STAMP)
	$(if $(strip $(NB)),,$(error usage: make grade NB="submission.ipynb [...]"))
	$(PY) -m gclab grade $(NB) $(GRADE_ARGS)

grade-class: $(STAMP)
	$(PY) -m gclab grade --submissions submitted $(GRADE_ARGS)

clean-grades:
	rm -rf autograded feedback reports

bench: $(STAMP)
	$(PY) -m gclab bench

gpu-check: $(STAMP) $(KERNEL)
	$(PY) -m gclab gpu-check

# Rewrite constraints.txt from the installed .venv (see the header of constraints.txt).
constraints: $(STAMP)
	{ sed -n '/^#/p' constraints.txt; \
	  $(PY) -m pip freeze --exclude-editable \
	    | grep -vE '^(#|gclab([=@ ]|$$))' \
	    | sed -E 's/^(torch==[^+]+)\+.*/\1/'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	find . -path ./$(VENV) -prune -o \( -name __pycache__ -o -name .ipynb_checkpoints \) \
	  -type d -print0 | xargs -0 rm -rf
	rm -rf .pytest_cache build *.egg-info autograder/work

distclean: clean
	rm -rf $(VENV)
