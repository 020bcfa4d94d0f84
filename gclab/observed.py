"""Results compared with the expected ones (`compare`, `assert_matches`, `plain`, `assert_numbers`), two
implementations run side by side (`side_by_side`, `assert_same_results`, `globals_set`, `error_line`), and
what a running test saw (`observe`), which the grader compares with what the same test saw running the
reference solution.
"""
from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass

import torch

__all__ = ["Comparison", "compare", "assert_matches", "plain", "observe", "observations", "OBSERVED_VALUES_LIMIT",
           "assert_numbers", "error_line", "side_by_side", "assert_same_results", "globals_set",
           "assert_fields", "assert_cases", "assert_functions_agree", "returned"]


# -- results equal the reference -----------------------------------------------------
@dataclass
class Comparison:
    name: str
    ok: bool
    text: str

    def __str__(self):
        return self.text


def _flatten(value):
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist()
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            out.extend(_flatten(v))
        return out
    return [value]


_PLAIN_SCALARS = (bool, int, float, str, type(None))
_PLAIN_NAMES = {bool: "bool", int: "int", float: "float", str: "str", list: "list", tuple: "tuple", dict: "dict",
                torch.Tensor: "torch.Tensor"}


def _a(name: str) -> str:
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def _type_name(kind) -> str:
    return kind.__qualname__ if kind.__module__ in ("builtins", "__main__") else f"{kind.__module__}.{kind.__qualname__}"


def _is_numpy_scalar(value) -> bool:
    """One of numpy's own scalar types (np.float64, np.int64, np.bool_), not a subclass made elsewhere."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.generic) and type(value).__module__ == "numpy"


def plain(value, name: str = "the value"):
    """`value`, checked to be plain data before a test compares it: a bool, int, float, str or
    None (numpy's own scalars become these), an exact torch.Tensor, or a list, tuple or dict of
    plain data, each of exactly that type.
    A subclass or another object could answer ==, float() or len() with whatever the test hopes
    to see, so it is refused with an AssertionError that says what `name` is and what was expected."""
    kind = type(value)
    if kind in _PLAIN_SCALARS or kind is torch.Tensor:
        return value
    if _is_numpy_scalar(value):
        return value.item()             # np.float64 from a numpy sum: numpy's own type, its Python value
    if kind is dict:
        return {plain(key, f"a key of {name}"): plain(item, f"{name}[{key!r}]") for key, item in value.items()}
    if kind in (list, tuple):
        return kind(plain(item, f"{name}[{i}]") for i, item in enumerate(value))
    base = next((t for t in _PLAIN_NAMES if isinstance(value, t)), None)
    if base is None:
        raise AssertionError(f"{name} is {_a(_type_name(kind))}, expected plain data (a number, a str, None, "
                             "a list, tuple or dict of them, or a torch.Tensor)")
    raise AssertionError(f"{name} is {_a(_type_name(kind))} (a subclass of {_PLAIN_NAMES[base]}), "
                         f"expected {_a(_PLAIN_NAMES[base])}")


def compare(name: str, got, expected, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> Comparison:
    """Compare two results element by element and say what matched and by how much it did not."""
    got_flat, exp_flat = _flatten(got), _flatten(expected)
    if len(got_flat) != len(exp_flat):
        return Comparison(name, False, f"{name}: expected {len(exp_flat)} values, got {len(got_flat)}")
    bad = []
    for i, (g, e) in enumerate(zip(got_flat, exp_flat)):
        try:
            same = math.isclose(g, e, rel_tol=rel_tol, abs_tol=abs_tol)
        except TypeError:
            same = g == e
        if not same:
            bad.append((i, g, e))
    if not bad:
        return Comparison(name, True, f"{name}: all {len(exp_flat)} values match the reference")
    i, g, e = bad[0]
    try:
        off = abs(g - e)
        diff = f" (off by {off})" if isinstance(off, int) else f" (off by {off:.6g})"
    except TypeError:
        diff = ""
    return Comparison(name, False, f"{name}: {len(bad)} of {len(exp_flat)} values differ from the "
                      f"reference; first at position {i}: got {g!r}, expected {e!r}{diff}")


def assert_matches(name: str, got, expected, **tolerances) -> None:
    observe(name, got)
    result = compare(name, got, expected, **tolerances)
    assert result.ok, result.text


def assert_numbers(name: str, values) -> None:
    """Every one of `values` is a number (an int or a float, not a bool, a tensor or a str), or an
    AssertionError names `name` and the types it holds instead."""
    values = list(values)
    wrong = sorted({type(v).__name__ for v in values if type(v) is bool or not isinstance(v, (int, float))})
    assert not wrong, f"{name} should hold numbers, it holds {sorted({type(v).__name__ for v in values})}"


def error_line(error) -> str:
    """An error as a dashboard shows it, "Type: message": from an exception, or from its formatted text
    (a traceback's last line); "" for empty text."""
    if isinstance(error, BaseException):
        return f"{type(error).__name__}: {error}"
    text = str(error).strip()
    return text.splitlines()[-1] if text else ""


# -- two implementations side by side ---------------------------------------------------
def side_by_side(objects, method: str, arguments) -> list:
    """Call `method` of each of `objects` (say, the learner's trainer and the reference's) with each of
    `arguments` in turn, interleaved as a loop running both would call them: the first object's with the
    first argument, the second's with it, then the next argument (a tuple is unpacked).  Returns `objects`.
    An exception in any call becomes an AssertionError naming the object's class, the method, its argument
    and the error."""
    objects = list(objects)
    for argument in arguments:
        args = argument if isinstance(argument, tuple) else (argument,)
        for obj in objects:
            try:
                getattr(obj, method)(*args)
            except Exception as error:
                shown = ", ".join(map(repr, args))
                raise AssertionError(f"{type(obj).__name__}.{method}({shown}) raised {type(error).__name__}: "
                                     f"{error}") from None
    return objects


def _shown(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)}"
    return repr(value) if len(repr(value)) <= 80 else f"{_a(type(value).__name__)}"


def _same(got, expected) -> bool:
    if isinstance(expected, torch.Tensor):
        return (isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dtype == expected.dtype
                and got.device == expected.device and torch.equal(got, expected))
    return type(got) is type(expected) and got == expected


def assert_same_results(pairs: dict, *, raised: str = "", differs: str = "") -> None:
    """`pairs`: {label: (call, reference)}, calls of no argument, all made before this runs (so that the
    objects behind them are alive at once).  Each call runs, then its reference, in order; a call that
    raises, or returns what its reference does not (a tensor: its shape, dtype, device and values; anything
    else: its type and ==), fails with an AssertionError that starts with the label and ends with the hint
    (`raised` or `differs`)."""
    for label, (call, reference) in pairs.items():
        try:
            got = call()
        except Exception as error:
            raise AssertionError(f"{label}: {getattr(call, '__name__', 'the call')}() raised {type(error).__name__}: "
                                 f"{error}" + (f"; {raised}" if raised else "")) from None
        expected = reference()
        if not _same(got, expected):
            what = (f"{_shown(got)}, expected {_shown(expected)}" if _shown(got) != _shown(expected)
                    else f"{_shown(got)} as expected, but other values")
            raise AssertionError(f"{label} returned {what}" + (f": {differs}" if differs else ""))


@contextlib.contextmanager
def globals_set(*functions, **values):
    """`with globals_set(f, g, LIMIT=0.3):` sets each name to its value in the module namespace of each of
    `functions` (its __globals__: a notebook's functions share one), and puts back what was there, or
    removes a name that was not, when the block ends, however it ends."""
    scopes = {id(f.__globals__): f.__globals__ for f in functions}
    missing = object()
    saved = [(scope, name, scope.get(name, missing)) for scope in scopes.values() for name in values]
    try:
        for scope in scopes.values():
            scope.update(values)
        yield
    finally:
        for scope, name, old in reversed(saved):
            if old is missing:
                scope.pop(name, None)
            else:
                scope[name] = old


def assert_fields(name: str, got: dict, expected: dict, why: dict | None = None, **tolerances) -> None:
    """`got[key]` matches `expected[key]` for every key of `expected` (as `assert_matches` compares); the
    message of a mismatch adds, for each key that differs, `why[key]` (what the values behind it show)."""
    keys = list(expected)
    assert isinstance(got, dict) and set(keys) <= set(got), f"{name}: expected a dict with keys {keys}; got {got!r}"
    observe(name, [got[key] for key in keys])
    differ = [key for key in keys if not compare(key, got[key], expected[key], **tolerances).ok]
    assert not differ, (f"{name}: {len(differ)} of {len(keys)} differ from what was expected: " + "; ".join(
        f"{key}: got {got[key]!r}, expected {expected[key]!r}" + (f" ({why[key]})" if why and why.get(key) else "")
        for key in differ))


def assert_cases(name: str, function, cases, keys, rule: str = "") -> None:
    """For each `(given, expected, what)` of `cases`: `function(given)` returns a dict whose `keys`, read
    as bools, are `expected`.  A failure names `what` the case shows, `given`, and the `rule` it breaks."""
    for given, expected, what in cases:
        said = function(given)
        assert isinstance(said, dict) and set(keys) <= set(said), (
            f"{name} should return a dict with keys {list(keys)}; for {given!r} it returned {said!r}")
        assert_matches(f"{name} when {what} ({given!r})" + (f": {rule}" if rule else ""),
                       [bool(said[key]) for key in keys], [bool(e) for e in expected])


def assert_functions_agree(functions: dict, got_inputs, expected_inputs, of: str = "every input", **tolerances) -> None:
    """For each `name: function` of `functions`, `function` gives on `got_inputs` what it gives on
    `expected_inputs` (the reference's), compared as `assert_matches` does."""
    got_inputs, expected_inputs = list(got_inputs), list(expected_inputs)
    for name, function in functions.items():
        assert_matches(f"{name} of {of}", [function(x) for x in got_inputs], [function(x) for x in expected_inputs],
                       **tolerances)


def returned(call, what: str, hint: str = ""):
    """`call()`'s result; an exception it raises becomes an AssertionError that says `what` raised what
    (its traceback dropped: it points into the check), and `hint`, what should have happened."""
    try:
        return call()
    except Exception as error:
        message = f"{what} raised {type(error).__name__}" + (f": {error}" if str(error) else "") + (
            f". {hint}" if hint else "")
    raise AssertionError(message)


# -- what a test saw, for the grader to compare with the reference solution's ------------------
# The grader does not take a test's "passed" on the word of the process that ran it: it compares what
# the test observed (the values compared above, what a flat check's steps returned, what a test
# records with `observe`) with what the same test observed running the reference solution.
_OBSERVED: list = []
OBSERVED_VALUES_LIMIT = 2000        # values kept per observation


def observe(name: str, value) -> None:
    """Record `value` (plain data, tensors, or lists of them) as something the running test saw."""
    _OBSERVED.append([str.__str__(name) if type(name) is str else "?", _observable(value)])


def observations(clear: bool = True) -> list:
    """[[name, [values]], ...] recorded since the last call (`clear`: start afresh)."""
    seen = list(_OBSERVED)
    if clear:
        _OBSERVED.clear()
    return seen


def _observable(value) -> list:
    """`value` flattened to at most OBSERVED_VALUES_LIMIT JSON values: a number, str, bool or None as
    it is (NaN and infinities as text), anything else as "<object>" (two right answers may return
    objects of different classes)."""
    try:
        flat = _flatten(value)
    except Exception:
        flat = [value]
    out = []
    for item in flat[:OBSERVED_VALUES_LIMIT]:
        kind = type(item)
        if kind is float and not math.isfinite(item):
            out.append(repr(item))
        elif kind in (bool, int, float, str, type(None)):
            out.append(item)
        elif _is_numpy_scalar(item):
            out.append(_observable(item.item())[0])
        else:
            out.append("<object>")
    return out


