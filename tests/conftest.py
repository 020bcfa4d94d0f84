import gc

import pytest


@pytest.fixture(autouse=True)
def restore_gc_state():
    """Tests switch the collector off and on: leave it as each test found it."""
    was_enabled = gc.isenabled()
    yield
    if was_enabled:
        gc.enable()
    else:
        gc.disable()
