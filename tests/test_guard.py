"""gclab.guard keeps its own state out of the graded code's reach: what the learner's code does
to the guard's module, class or settings changes nothing installed, and every replacement it
makes is still listed by the installer's handle.

A guard cannot be removed once installed, so the scenario runs in a fresh Python: the grader
installs the guard, then runs "learner" code compiled from a file in the grading folder."""
import json
import subprocess
import sys
import textwrap

import pytest

GRADER = textwrap.dedent('''
    import json, sys
    import gclab.checks, gclab.memory, gclab.serving
    from gclab import guard
    workdir = sys.argv[1]
    keeper = guard.install(workdir, processes=False, files=True)
    outcomes = {}
    learner = open(workdir + "/learner.py").read()
    exec(compile(learner, workdir + "/learner.py", "exec"), {"outcomes": outcomes})
    print(json.dumps({"outcomes": outcomes, "problems": keeper.problems()}))
''')

LEARNER = textwrap.dedent('''
    import gc, os, subprocess, sys, types
    import gclab.guard, gclab.memory

    def attempt(name, action):
        try:
            action()
            outcomes[name] = "allowed"
        except Exception as error:
            outcomes[name] = f"{type(error).__name__}: {error}"

    outcomes["a handle on the installed guard"] = [n for n in ("current", "_current") if hasattr(gclab.guard, n)]
    mine = gclab.guard.install()                    # a guard of its own: its hook is refused
    getattr(mine, "_manifest").clear()
    mine.refused.clear()
    mine.processes, mine.files = True, False
    mine.trust(compile("", workdir_file, "exec"))
    gclab.guard.Guard._judge = lambda self, event, args, frame: None
    gclab.guard.Guard.replaced = lambda self: []
    vars(gclab.guard)["_same_tool"] = lambda *args, **kwargs: True
    put = setattr
    put(gclab.memory.Meter, "describe", lambda self: "exact, trust me")
    vars(gc)["isenabled"] = lambda: False
    attempt("frames", lambda: sys._getframe(0))
    attempt("processes", lambda: subprocess.run(["true"]))
    attempt("writing outside", lambda: open(outside, "w"))
    attempt("reading its own memory", lambda: open("/proc/self/mem", "rb"))
    attempt("reading the grader's memory", lambda: os.open(f"/proc/{os.getppid()}/task/{os.getppid()}/mem", os.O_RDONLY))
    attempt("writing shared memory", lambda: open("/dev/shm/gclab-guard-test", "w"))
    attempt("writing to /dev/null", lambda: open("/dev/null", "w").write("fine"))
    attempt("unlocking gc through its class", lambda: put(gc, "__class__", types.ModuleType))
    attempt("replacing gc.collect", lambda: put(gc, "collect", lambda *args: 0))
''')


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("grading")
    outside = tmp_path_factory.mktemp("elsewhere") / "note.txt"
    prelude = f"workdir_file = {str(workdir / 'learner.py')!r}\noutside = {str(outside)!r}\n"
    (workdir / "learner.py").write_text(prelude + LEARNER)
    done = subprocess.run([sys.executable, "-c", GRADER, str(workdir)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout.splitlines()[-1]), "outside": outside}


def test_the_learners_code_finds_no_handle_on_the_installed_guard(attacked):
    assert attacked["outcomes"]["a handle on the installed guard"] == []
    assert "sys.addaudithook (a hook of the learner's own)" in attacked["problems"]


@pytest.mark.parametrize("action, refusal", [
    ("frames", "sys._getframe"),
    ("processes", "subprocess.Popen"),
    ("writing outside", "outside the grading folder"),
    ("reading its own memory", "(a process's memory)"),
    ("reading the grader's memory", "(a process's memory)"),
    ("writing shared memory", "writing /dev/shm/gclab-guard-test (outside the grading folder)"),
    ("unlocking gc through its class", "gc.__class__"),
    ("replacing gc.collect", "gc.collect"),
])
def test_refusals_hold_after_the_learner_rewrote_the_guard_class_and_its_own_guard(attacked, action, refusal):
    assert attacked["outcomes"][action] != "allowed" and refusal in attacked["outcomes"][action]
    assert any(refusal in problem for problem in attacked["problems"]), attacked["problems"]
    assert not attacked["outside"].exists()


def test_devices_that_are_not_memory_may_still_be_written(attacked):
    assert attacked["outcomes"]["writing to /dev/null"] == "allowed"


@pytest.mark.parametrize("replaced", [
    "gclab.memory.Meter.describe", "gclab.guard.Guard._judge", "gclab.guard.Guard.replaced",
    "gclab.guard._same_tool", "gc.isenabled",
])
def test_every_replacement_is_listed_by_the_installers_handle(attacked, replaced):
    assert f"{replaced} was replaced" in attacked["problems"]
