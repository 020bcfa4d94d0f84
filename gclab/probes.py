"""Probes a self-check puts into the code it checks: a function swapped for one that notes its calls
(`watching`), and a maker whose objects note the collector's state when they are made and freed
(`Tracked`).

    with watching(globals_of(run_job), "train_step") as calls:   # the name run_job looks up
        run_job(5)
    raised = [c.outcome for c in calls if isinstance(c.outcome, Exception)]

A probe is for a learner's self-check: the code it is put into can see and rewrite it.  A hidden test
hands the notebook's code only what `gclab.checks.sealed_call` makes.
"""
from __future__ import annotations

import contextlib
import gc
import inspect
import weakref
from dataclasses import dataclass

__all__ = ["Call", "Tracked", "globals_of", "watching"]


@dataclass
class Call:
    """One call of a watched function: its arguments, what it returned or the exception it raised
    (`outcome`), and what `before()` and `after()` returned around it (None without them)."""
    args: tuple
    kwargs: dict
    outcome: object = None
    before: object = None
    after: object = None


def globals_of(function) -> dict:
    """The namespace where `function` (the one a decorator such as @torch.no_grad() wraps) looks up its
    global names: swap a name there to change what it calls."""
    scope = getattr(inspect.unwrap(function), "__globals__", None)
    if not isinstance(scope, dict):
        raise AssertionError(f"{getattr(function, '__name__', function)!r} is not a function defined in Python: "
                             "define it with `def`")
    return scope


@contextlib.contextmanager
def watching(where, name: str, before=None, after=None, around=None):
    """While the block runs, `where`'s `name` (a key of a dict such as `globals_of(f)`, or an attribute of a
    module or object) is a function that calls the one there and notes each call; yields the list of
    `Call`s, which keeps growing until the block ends.  `before()` and `after()` are called around each
    call, and what they return is noted with it (`around`: the same function for both).  What was there
    is put back however the block ends."""
    before, after = before or around, after or around
    is_dict = isinstance(where, dict)
    if (name not in where) if is_dict else not hasattr(where, name):
        raise AssertionError(f"there is no {name!r} to watch: the code must call {name}")
    given = where[name] if is_dict else getattr(where, name)
    calls: list[Call] = []

    def noting(*args, **kwargs):
        call = Call(args, kwargs, before=before() if before is not None else None)
        calls.append(call)
        try:
            call.outcome = given(*args, **kwargs)
            return call.outcome
        except Exception as error:
            call.outcome = error
            raise
        finally:
            call.after = after() if after is not None else None

    noting.__name__ = noting.__qualname__ = getattr(given, "__name__", name)
    if is_dict:
        where[name] = noting
    else:
        setattr(where, name, noting)
    try:
        yield calls
    finally:
        if is_dict:
            where[name] = given
        else:
            setattr(where, name, given)


class Tracked:
    """`make`, wrapped: each call notes whether the collector was on when the object was made
    (`made_with_gc`) and, through `weakref.finalize`, when it was freed (`freed_with_gc`); `alive()`
    says whether the last one made is still alive.  For code whose measurements must show that
    reference counting, not a collection, freed what it made."""

    def __init__(self, make, what: str = "the object"):
        self.make, self.what = make, what
        self.made_with_gc: list[bool] = []
        self.freed_with_gc: list[bool] = []
        self._last = None
        self.__name__ = getattr(make, "__name__", "make")

    def __call__(self, *args, **kwargs):
        self.made_with_gc.append(gc.isenabled())
        made = self.make(*args, **kwargs)
        weakref.finalize(made, _note_collector, self.freed_with_gc)
        self._last = weakref.ref(made)
        return made

    def alive(self) -> bool:
        return self._last is not None and self._last() is not None

    def assert_collector_off(self, caller: str) -> None:
        """`caller` made one object, with the collector off, and it was freed with the collector still
        off; or an AssertionError that says which of these went wrong."""
        made, freed, what = self.made_with_gc, self.freed_with_gc, self.what
        assert len(made) == 1, (f"{caller} made {what} {len(made)} times: make it once, and measure it")
        assert made == [False], (f"{caller} made {what} with the collector on: make it with the collector off and "
                                 f"no collection, so that a fall at `del` shows reference counting freed it")
        assert freed, f"{caller} never let {what} go: `del` it, and read the meter after"
        assert freed == [False], (f"{caller} let {what} go with the collector on: keep the collector off until "
                                  "after the reading that follows `del`, so that a fall there shows reference "
                                  "counting freed it")


def _note_collector(into: list) -> None:
    into.append(gc.isenabled())
