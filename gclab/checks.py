"""Checks that self-check cells and hidden tests share.

Each check returns a report that can say, in a sentence, what went wrong and by how
much; the `assert_*` helpers turn a failed report into an AssertionError with that
sentence, which is what a learner (and nbgrader's feedback) sees.  Smaller helpers check one
property in one sentence (`assert_view_of`, `assert_same_again`, `returned`, `assert_raises`,
`assert_frees_alike`), so that a self-check reads as the rules it applies.
"""
from __future__ import annotations

import gc
import time
import types
import weakref

import torch

from .flat_check import (UNWATCHED_AT_LEAST, FlatReport, _heap_read_from, _kept_as_data,  # noqa: F401
                         assert_flat, assert_graphs_do_not_grow, run_flat_check)
from .memory import format_bytes, held_while_and_after
from .observed import (OBSERVED_VALUES_LIMIT, Comparison, _same, _shown, assert_cases,  # noqa: F401
                       assert_fields, assert_functions_agree, assert_matches, assert_numbers,
                       assert_same_results, compare, error_line, globals_set, observations, observe,
                       plain, returned, side_by_side)
from .policy_check import (GARBAGE_FRACTION, LOAD_BURST, LOAD_LULL, MIN_IDLE_MOMENTS, PAUSE_BUDGET,  # noqa: F401
                           PolicyReport, assert_policy, run_policy_check)


__all__ = ["FlatReport", "run_flat_check", "assert_flat", "Comparison", "compare",
           "assert_matches", "plain", "integrity_problems", "assert_untampered", "PolicyReport",
           "run_policy_check", "assert_policy", "assert_graphs_do_not_grow", "sealed_call", "assert_numbers",
           "error_line", "side_by_side", "assert_same_results", "globals_set", "assert_view_of", "assert_same_again",
           "assert_raises", "assert_frees_alike", "assert_fields", "assert_cases",
           "assert_functions_agree", "returned"]

# What the grading relies on, as it was when gclab.checks was first imported (the
# notebook's locked set-up cell imports it before any student code runs); read-only, so that
# no entry can be changed in place to match a replacement.
_ORIGINALS = types.MappingProxyType({
    "gc.collect": gc.collect, "gc.disable": gc.disable, "gc.enable": gc.enable,
    "gc.isenabled": gc.isenabled, "gc.get_count": gc.get_count,
    "gc.get_threshold": gc.get_threshold, "gc.set_threshold": gc.set_threshold,
    "gc.set_debug": gc.set_debug, "gc.get_debug": gc.get_debug, "gc.garbage": gc.garbage,
    "gc.callbacks": gc.callbacks, "time.perf_counter": time.perf_counter,
    "weakref.finalize": weakref.finalize, "torch.OutOfMemoryError": torch.OutOfMemoryError,
})
_OWN = types.MappingProxyType({})   # set at the end of the module: this module's own functions


def _current(name):
    module, attr = name.split(".", 1)
    return getattr({"gc": gc, "time": time, "weakref": weakref, "torch": torch}[module], attr)


def integrity_problems() -> list[str]:
    """Names of the functions the checks rely on that no longer are what they were."""
    problems = [name for name, original in _ORIGINALS.items() if _current(name) is not original]
    problems += [f"gclab.checks.{name}" for name, fn in _OWN.items() if globals().get(name) is not fn]
    return problems


def assert_untampered() -> None:
    problems = integrity_problems()
    assert not problems, ("the grader's tools were replaced by the notebook's code: "
                          + ", ".join(problems) + ". Restore them (restart the kernel) and run again.")



# -- one property, one sentence -----------------------------------------------------------
def assert_view_of(result, base, what: str = "the result", of: str = "its input") -> None:
    """`result` is a tensor that shares `base`'s storage (a view of it, not a copy), or an AssertionError
    says which of the two it is not."""
    assert isinstance(result, torch.Tensor), f"{what} is {type(result).__name__}, not a tensor"
    assert result.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(), (
        f"{what} is a copy: it must be a view of {of}")


def assert_same_again(call, first, what: str = "call", hint: str = "") -> None:
    """`call()` made once more returns what it returned the first time (`first`: a tensor of the same
    shape, dtype, device and values; anything else of the same type and ==), and raises nothing; else an
    AssertionError about "a second {what}", ending with `hint`."""
    try:
        again = call()
    except Exception as error:
        raise AssertionError(f"a second {what} raised {type(error).__name__}: {error}"
                             + (f"; {hint}" if hint else "")) from None
    assert _same(again, first), (f"a second {what} returned {_shown(again)}, not what the first returned "
                                 f"({_shown(first)})" + (f": {hint}" if hint else ""))


def assert_raises(error, call, *args, message: str) -> None:
    """`call(*args)` raises `error` (an exception type); if it returns instead, AssertionError(message).
    Any other exception goes through as it is."""
    try:
        call(*args)
    except error:
        return
    raise AssertionError(message)


def assert_frees_alike(make, use, most: int, what: str, name: str = "it", device=None) -> None:
    """`obj = make(); use(obj)`, measured with the automatic collector off, then on
    (`gclab.memory.held_while_and_after`): with either, at most `most` bytes held once `use` returned;
    with it off, nothing left once `obj` is dropped (`del {name}`).  Each message starts with `what`."""
    for collector in (False, True):
        kept, left = held_while_and_after(make, use, device, collector=collector)
        state = "on" if collector else "off"
        assert kept <= most, (f"{what}, with the collector {state}: {format_bytes(kept)} held; expected at most "
                              f"{format_bytes(most)}" + (f": {name} must free alike when the collector is on"
                                                         if collector else ""))
        assert collector or left == 0, (
            f"{what}: after `del {name}`, {format_bytes(left)} is still held with the collector off: something keeps "
            f"{name} or what it holds alive (a callback that refers to {name}?)")


# -- a test's function handed to the notebook's code ------------------------------------
# A function defined in a hidden test leads whoever holds it to the test's namespace: its __globals__ (and
# any closure cell) is writable, and no audit event sees it read, so code handed one could rewrite what the
# test counts.  `sealed_call` hands over a stand-in that leads nowhere of the test's.
def sealed_call(function, note=None, *, name=None):
    """`call, record = sealed_call(function, note)`: `call` to hand the notebook's code in place of
    `function` (a function of the test's own), `record` for the test alone.

    `call(*args, **kwargs)` runs `function(*args, **kwargs)` and returns what it returned, or raises the
    exception it raised (its traceback dropped: the frames in it are the test's).  `call` leads its holder
    to none of the test's state: its __globals__ is an empty dict of its own, its closure cells (its own)
    hold a generator's `send` and a message, and `function`, `note` and what was recorded live in that
    generator's locals, which the grading guard lets no learner code read (generator.gi_frame, a
    traceback's frames and the collector's object graph are refused).  Whatever the holder rewrites in
    `call` changes what its own calls through `call` do, never what `record` returns.

    `note(args, kwargs, outcome)`, called after each call with what the call was given and what `function`
    returned or the exception it raised (`isinstance(outcome, BaseException)` tells them apart when
    `function` may raise), returns the entry `record()` lists for that call; keep in an entry only what the
    test needs (a weakref.ref to a result keeps it no longer alive than its holder does).  Without a note,
    each call's entry is None: `len(record())` is the number of calls.  An exception that `note` raises is
    raised to the caller in place of the outcome, and nothing is recorded for that call.

    `record()` returns the entries so far, in order, as a new list; when the notebook's code stopped the
    generator behind `call` (through `send.__self__`: close(), throw()), it raises an AssertionError that
    says so.  `name`: `call`'s __name__ (the one the notebook's code sees; default `function.__name__`).

    Calls do not nest: a call made while another call of the same `call` runs (from `function`, or from
    another thread) raises ValueError ("generator already executing")."""
    name = name if name is not None else getattr(function, "__name__", "call")
    key = object()                 # what `record` sends: no holder of `call` can send it
    running = _sealed_running(function, note, key)
    next(running)
    send = running.send
    stopped = (f"the notebook's code stopped {name}, the function the test handed it (through its generator's "
               "close() or throw()): leave it to run")
    made = _sealed_caller(send, stopped)     # its cells are its own: `record` shares none of them
    call = types.FunctionType(made.__code__, {}, name, None, made.__closure__)
    call.__qualname__ = name

    def record() -> list:
        try:
            return send(key)
        except StopIteration:
            raise AssertionError(stopped) from None
    return call, record


def _sealed_running(function, note, key):
    """The generator behind a sealed call: it runs `function` for each (args, kwargs) sent, and answers
    `key` with the entries noted so far.  Nothing it was sent or answered stays in its locals between calls."""
    entries, out = [], [None]
    while True:
        message = yield out.pop()              # popped: what it answers stays no longer in its locals
        if message is key:
            out.append(list(entries))
            continue
        if type(message) is not tuple or len(message) != 2 or type(message[1]) is not dict:
            message = None
            out.append((False, TypeError("a sealed call is sent (args, kwargs)")))
            continue
        args, kwargs = message
        message = None
        try:
            outcome = (True, function(*args, **kwargs))
        except BaseException as error:         # whatever it raised goes to the caller, KeyboardInterrupt included
            outcome = (False, BaseException.with_traceback(error, None))
        try:
            entries.append(None if note is None else note(args, kwargs, outcome[1]))
        except BaseException as error:
            outcome = (False, BaseException.with_traceback(error, None))
        out.append(outcome)
        args = kwargs = outcome = None


def _sealed_caller(send, stopped):
    """Only the code of `call` is used, with globals of its own: see `sealed_call`."""
    def call(*args, **kwargs):
        try:
            returned, value = send((args, kwargs))
        except StopIteration:
            raise RuntimeError(stopped) from None
        if returned:
            return value
        try:
            raise value
        finally:
            value = None                       # no cycle: the exception's traceback holds this frame
    return call


_OWN = types.MappingProxyType({name: globals()[name] for name in
                               ("run_flat_check", "assert_flat", "compare", "assert_matches", "plain",
                                "integrity_problems", "assert_untampered", "run_policy_check", "assert_policy",
                                "sealed_call", "assert_numbers", "error_line", "side_by_side",
                                "assert_same_results", "globals_set", "assert_view_of", "assert_same_again",
                                "assert_raises", "assert_frees_alike", "assert_fields",
                                "assert_cases", "assert_functions_agree", "returned")})
