# The course's commands. The first run creates .venv and installs gclab with the
# pinned course and test dependencies; later runs reinstall only when
# pyproject.toml or constraints.txt change (stamp file .venv/.installed).
#
#   make lab                      open JupyterLab on notebooks/  (LAB_ARGS=--no-browser)
#   make test                     run the test suite             (PYTEST_ARGS="-x -k meter")
#   make release                  regenerate notebooks/ from solutions/
#   make grade NB="a.ipynb b.ipynb"   grade notebooks, print the scores (GRADE_ARGS=--json)
#   make grade-class              grade submitted/STUDENT/LESSON/: gradebook, feedback/, reports/
#                                 (GRADE_ARGS="--jobs 2", or "--scheduler tcp://host:8786")
#   make clean-grades             remove autograded/, feedback/ and reports/ (submissions and
#                                 the gradebook are kept)
#   make bench                    gclab bench on this machine
#   make clean / make distclean   remove caches / also remove .venv
#
# PIP_ARGS is passed to pip install, e.g. for CPU-only torch wheels from PyTorch's index:
#   make test PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"

PYTHON      ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.installed
LAB_ARGS    ?=
PYTEST_ARGS ?=
GRADE_ARGS  ?=
PIP_ARGS    ?=
NB          ?=

.DEFAULT_GOAL := help
.DELETE_ON_ERROR:
.PHONY: help setup lab test release grade grade-class clean-grades bench clean distclean constraints

help:
	@sed -n 's/^#   //p' Makefile

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install -c constraints.txt $(PIP_ARGS) -e ".[course,test]"
	$(PY) -m ipykernel install --user --name gclab --display-name "Python (gclab)"
	touch $@

setup: $(STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab $(LAB_ARGS) notebooks/

test: $(STAMP)
	$(PY) -m pytest -q tests $(PYTEST_ARGS)

release: $(STAMP)
	$(PY) -m gclab release

grade: $(STAMP)
	$(if $(strip $(NB)),,$(error usage: make grade NB="submission.ipynb [...]"))
	$(PY) -m gclab grade $(NB) $(GRADE_ARGS)

grade-class: $(STAMP)
	$(PY) -m gclab grade --submissions submitted $(GRADE_ARGS)

clean-grades:
	rm -rf autograded feedback reports

bench: $(STAMP)
	$(PY) -m gclab bench

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
