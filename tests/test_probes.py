"""gclab.probes: a function swapped for one that notes its calls, and a maker that notes the collector."""
import gc
import types

import pytest

from gclab.gcwatch import gc_disabled
from gclab.probes import Tracked, globals_of, watching


def _step(i):
    if i < 0:
        raise FloatingPointError(f"step {i}")
    return 2 * i


def _run(i):
    return _step(i)


def test_watching_a_global_notes_each_outcome_and_puts_it_back():
    with watching(globals_of(_run), "_step") as calls:
        assert _run(3) == 6
        with pytest.raises(FloatingPointError) as raised:
            _run(-1)
    assert [c.args for c in calls] == [(3,), (-1,)]
    assert calls[0].outcome == 6 and calls[1].outcome is raised.value
    assert globals()["_step"] is _step


def test_watching_an_attribute_with_readings_around_each_call():
    box, seen = types.SimpleNamespace(f=lambda: seen.append("f")), []
    given = box.f
    with watching(box, "f", before=lambda: len(seen), after=lambda: len(seen) * 10) as calls:
        box.f()
    assert box.f is given and (calls[0].before, calls[0].after) == (0, 10)
    with watching(box, "f", around=lambda: len(seen)) as calls:
        box.f()
    assert (calls[0].before, calls[0].after) == (1, 2)


def test_watching_what_is_not_there_says_so():
    with pytest.raises(AssertionError, match="no 'missing' to watch"):
        with watching({}, "missing"):
            pass
    with pytest.raises(AssertionError, match="not a function defined in Python"):
        globals_of(len)


class _Thing:
    pass


def test_tracked_notes_the_collector_when_made_and_freed():
    made = Tracked(_Thing, "the thing")
    with gc_disabled():
        thing = made()
        assert made.alive()
        del thing
    assert not made.alive()
    made.assert_collector_off("measure")


@pytest.mark.parametrize("run, message", [
    (lambda make: (make(), make()), "made the thing 2 times"),
    (lambda make: make(), "made the thing with the collector on"),
])
def test_tracked_says_what_went_wrong(run, message):
    made = Tracked(_Thing, "the thing")
    was = gc.isenabled()
    gc.enable()
    try:
        run(made)
    finally:
        if not was:
            gc.disable()
    with pytest.raises(AssertionError, match=message):
        made.assert_collector_off("measure")


def test_tracked_says_when_it_was_kept_or_freed_with_the_collector_on():
    made, kept = Tracked(_Thing, "the thing"), []
    with gc_disabled():
        kept.append(made())
    with pytest.raises(AssertionError, match="never let the thing go"):
        made.assert_collector_off("measure")
    was = gc.isenabled()
    gc.enable()
    kept.clear()
    if not was:
        gc.disable()
    with pytest.raises(AssertionError, match="let the thing go with the collector on"):
        made.assert_collector_off("measure")
