import gc

import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "timed: times a server's latency; `make test` runs these before the rest, apart from it")


@pytest.fixture(autouse=True)
def restore_gc_state():
    """Tests switch the collector off and on: leave it as each test found it."""
    was_enabled = gc.isenabled()
    yield
    if was_enabled:
        gc.enable()
    else:
        gc.disable()


@pytest.fixture(scope="module")
def executed(request, tmp_path_factory):
    """The lesson's solution (the test module's SOLUTION) run top to bottom in a kernel."""
    from lesson_support import run_notebook
    return run_notebook(request.module.SOLUTION, tmp_path_factory.mktemp("executed"))
