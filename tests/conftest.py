import gc

import pytest

import gclab.grader._jsonschema  # noqa: F401  (before any test module imports nbformat: see there)


# The modules that take longest (each grades a lesson's submissions, or many small courses, minutes on 2
# cores), in that order (measured: `pytest --durations=0`, summed per module): collected first, so pytest-xdist
# (--dist loadfile) starts them first and the short ones fill in around them, instead of one worker being left
# with a long one at the end.
LONGEST_FIRST = ("test_lesson_06.py", "test_lesson_08.py", "test_grading.py", "test_lesson_03.py", "test_serving.py",
                 "test_lesson_05.py", "test_lesson_06_notebook.py", "test_cluster.py", "test_checks.py",
                 "test_lesson_07.py", "test_lesson_04.py", "test_lesson_02.py", "test_lesson_01.py", "test_lesson_00.py",
                 # after every lesson's module: their gradings fill the cache of generated releases, which the
                 # guide's `make release` in a scratch copy then takes (in a fresh clone it takes twice as long)
                 "test_guide.py", "test_classroom.py")


def pytest_configure(config):
    config.addinivalue_line("markers", "timed: times a server's latency (judged in CPU time: it holds beside "
                                       "the rest of the suite)")


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)            # stable: each module's tests keep their order


@pytest.fixture(autouse=True)
def restore_gc_state():
    """Tests switch the collector off and on: leave it as each test found it."""
    was_enabled = gc.isenabled()
    yield
    if was_enabled:
        gc.enable()
    else:
        gc.disable()


@pytest.fixture(autouse=True)
def dumpable_as_a_process_starts():
    """Grading in the test's own process shields it for good (not dumpable: gclab.grader.sandbox.shield), and a
    process forked from it inherits that: a test's own probes would then be unreadable to it where the suite
    runs without root (no CAP_SYS_PTRACE). Each test starts, and leaves its process, dumpable."""
    _set_dumpable()
    yield
    _set_dumpable()


def _set_dumpable() -> None:
    from gclab import zygote
    if zygote._LIBC is not None:
        zygote._LIBC.prctl(zygote._PR_SET_DUMPABLE, 1, 0, 0, 0)


@pytest.fixture(scope="module")
def executed(request, tmp_path_factory):
    """The lesson's solution (the test module's SOLUTION) run top to bottom in a kernel."""
    from lesson_support import run_notebook
    return run_notebook(request.module.SOLUTION, tmp_path_factory.mktemp("executed"))
