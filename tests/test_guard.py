"""gclab.guard gives reasons a learner can read: it refuses what the graded code may not do to the
machine or to the grader's tools (processes, files outside the grading folder, the course's own
files, a process's memory as a file, a guarded module's attribute) and lists every tool replaced.
It is not a wall, and no grade rests on it (see tests/test_forgery.py): what the learner's code may
do for itself (read frames, walk the collector's objects, trace) it may do while graded.

A guard cannot be removed once installed, so each scenario runs in a fresh Python: the grader
installs the guard, then runs "learner" code compiled from a file in the grading folder."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

GRADER = textwrap.dedent('''
    import json, sys
    import gclab.checks, gclab.memory, gclab.serving
    from gclab import guard
    workdir, hidden = sys.argv[1], sys.argv[2:]          # the grading folder, the course's
    grader = sys._getframe(0).f_code
    keeper = guard.install(workdir, processes=False, files=True, hidden=hidden)
    keeper.trust(grader)
    outcomes = {}
    learner = open(workdir + "/learner.py").read()
    exec(compile(learner, workdir + "/learner.py", "exec"), {"outcomes": outcomes})
    try:                          # code of the grader's own (a hidden test), where there is one
        test = open(workdir + "/hidden.py").read()
    except FileNotFoundError:
        test = None
    if test is not None:
        try:
            exec(keeper.trust(compile(test, workdir + "/hidden.py", "exec")), {})
        except Exception as error:
            outcomes["the grader's own code"] = f"{type(error).__name__}: {error}"
    print(json.dumps({"outcomes": outcomes, "problems": keeper.problems()}))
''')

# What the learner's code runs first: `attempt` records whether an action was allowed, or its refusal.
ATTEMPT = textwrap.dedent('''
    def attempt(name, action):
        try:
            action()
            outcomes[name] = "allowed"
        except Exception as error:
            outcomes[name] = f"{type(error).__name__}: {error}"
''')

LEARNER = ATTEMPT + textwrap.dedent('''
    import gc, os, subprocess, sys, types
    import gclab.guard, gclab.memory

    attempt("processes", lambda: subprocess.run(["true"]))
    attempt("writing outside", lambda: open(outside, "w"))
    attempt("reading its own memory", lambda: open("/proc/self/mem", "rb"))
    attempt("reading the grader's memory", lambda: os.open(f"/proc/{os.getppid()}/task/{os.getppid()}/mem", os.O_RDONLY))
    attempt("writing shared memory", lambda: open("/dev/shm/gclab-guard-test", "w"))
    attempt("writing to /dev/null", lambda: open("/dev/null", "w").write("fine"))
    attempt("reading the course's files", lambda: open(course_file).read())
    put = setattr
    attempt("unlocking gc through its class", lambda: put(gc, "__class__", types.ModuleType))
    attempt("replacing gc.collect", lambda: put(gc, "collect", lambda *args: 0))
    attempt("deleting gc.collect", lambda: delattr(gc, "collect"))
    # what the in-process numbers pass through inside libraries: the P99 a budget is judged by, a storage's size
    import numpy.lib._function_base_impl as quantiles, torch
    attempt("replacing numpy's quantile", lambda: put(quantiles, "_quantile_unchecked", lambda *args, **kw: 0.0))

    # what a learner may do for itself, graded or not: no grade rests on the process keeping it from them
    import traceback
    attempt("reading frames", lambda: sys._getframe(0).f_back)
    attempt("walking the collector's objects", lambda: len(gc.get_objects()))
    attempt("a summary of the stack with its locals",
            lambda: traceback.StackSummary.extract(traceback.walk_stack(None), capture_locals=True))
    attempt("tracing", lambda: (sys.settrace(lambda *args: None), sys.settrace(None)))
    attempt("writing in the grading folder", lambda: open(workdir_file + ".note", "w").write("fine"))

    # replacements, by routes no assignment refuses: listed
    put(gclab.memory.Meter, "describe", lambda self: "exact, trust me")
    gclab.guard.Guard._judge = lambda self, event, args, frame: None
    vars(gc)["isenabled"] = lambda: False
    vars(quantiles)["_ureduce"] = lambda *args, **kwargs: 0.0
    put(torch.UntypedStorage, "nbytes", lambda self: 0)
''')

# The grader's own code (a hidden test, compiled and trusted by the grader) may do what the learner's may not
HIDDEN_TEST = "open(outside + '.graders', 'w').write('the grader may')\n"


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("grading")
    outside = tmp_path_factory.mktemp("elsewhere") / "note.txt"
    course = tmp_path_factory.mktemp("course")
    (course / "solution.py").write_text("ANSWER = 42\n")
    prelude = (f"workdir_file = {str(workdir / 'learner.py')!r}\noutside = {str(outside)!r}\n"
               f"course_file = {str(course / 'solution.py')!r}\n")
    (workdir / "learner.py").write_text(prelude + LEARNER)
    (workdir / "hidden.py").write_text(f"outside = {str(outside)!r}\n" + HIDDEN_TEST)
    done = subprocess.run([sys.executable, "-c", GRADER, str(workdir), str(course)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout.splitlines()[-1]), "outside": outside}


@pytest.mark.parametrize("action, refusal", [
    ("processes", "subprocess.Popen (a submission may not start processes or send signals while graded)"),
    ("writing outside", "(outside the grading folder)"),
    ("reading its own memory", "(a process's memory)"),
    ("reading the grader's memory", "(a process's memory)"),
    ("writing shared memory", "writing /dev/shm/gclab-guard-test (outside the grading folder)"),
    ("reading the course's files", "(the course's own files)"),
    ("unlocking gc through its class", "replacing gc.__class__ (one of the grader's tools)"),
    ("replacing gc.collect", "replacing gc.collect (one of the grader's tools)"),
    ("deleting gc.collect", "deleting gc.collect (one of the grader's tools)"),
    ("replacing numpy's quantile", "numpy.lib._function_base_impl._quantile_unchecked"),
])
def test_what_the_learners_code_may_not_do_is_refused_with_a_reason(attacked, action, refusal):
    assert attacked["outcomes"][action].startswith(("PermissionError: refused while grading: ",
                                                    "RuntimeError: refused while grading: ",
                                                    "AttributeError: refused while grading: "))
    assert refusal in attacked["outcomes"][action], attacked["outcomes"][action]
    assert any(refusal in problem for problem in attacked["problems"]), attacked["problems"]
    assert not attacked["outside"].exists()


@pytest.mark.parametrize("action", ["writing to /dev/null", "reading frames", "walking the collector's objects",
                                    "a summary of the stack with its locals", "tracing",
                                    "writing in the grading folder"])
def test_what_a_learner_may_do_for_itself_is_not_refused_while_graded(attacked, action):
    assert attacked["outcomes"][action] == "allowed", attacked["outcomes"][action]


def test_the_graders_own_code_may_do_what_the_learners_may_not(attacked):
    assert "the grader's own code" not in attacked["outcomes"], attacked["outcomes"]
    assert attacked["outside"].with_name("note.txt.graders").read_text() == "the grader may"


@pytest.mark.parametrize("replaced", [
    "gclab.memory.Meter.describe", "gclab.guard.Guard._judge", "gc.isenabled",
    "numpy.lib._function_base_impl._ureduce",   # a library's internals, which the in-process statistics run through
    "torch.UntypedStorage.nbytes",              # inherited from torch's C base, shadowed on the class
])
def test_every_replacement_is_listed_by_the_installers_handle(attacked, replaced):
    assert f"{replaced} was replaced" in attacked["problems"]


def test_a_library_wrapping_its_own_function_is_no_replacement(tmp_path):
    """torch._dynamo wraps torch.manual_seed the first time an optimizer runs: library code whose
    `__wrapped__` is the tool is still the tool; the same wrapper made by the notebook's code is not."""
    (tmp_path / "learner.py").write_text(ATTEMPT + textwrap.dedent('''
        import functools, torch
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1).step()
        seed = torch.cuda.manual_seed
        @functools.wraps(seed)
        def mine(*args):
            return seed(*args)
        vars(torch.cuda)["manual_seed"] = mine
    '''))
    done = subprocess.run([sys.executable, "-c", GRADER, str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TMPDIR": str(tmp_path)})     # torch._dynamo's caches, as a verdict's
    assert done.returncode == 0, done.stderr
    problems = json.loads(done.stdout.splitlines()[-1])["problems"]
    assert "torch.manual_seed was replaced" not in problems, problems
    assert "torch.cuda.manual_seed was replaced" in problems, problems
