"""gclab.observed: results compared, two implementations side by side, messages that say what differs."""
from __future__ import annotations

import pytest
import torch

from gclab import checks
from gclab.observed import (assert_cases, assert_fields, assert_functions_agree, assert_numbers, assert_same_results,
                            error_line, globals_set, returned, side_by_side)


# -- assert_numbers -------------------------------------------------------------------
def test_numbers_pass_and_anything_else_is_named_with_its_type():
    assert_numbers("history", [1, 2.5, 3])
    assert_numbers("history", [])
    with pytest.raises(AssertionError, match=r"history should hold numbers, it holds \['Tensor', 'float'\]"):
        assert_numbers("history", [1.0, torch.tensor(2.0)])
    with pytest.raises(AssertionError, match=r"it holds \['bool'\]"):
        assert_numbers("flags", [True])


# -- error_line -----------------------------------------------------------------------
def test_an_error_reads_as_type_and_message_from_the_exception_or_its_formatted_text():
    assert error_line(FloatingPointError("step 3: loss is nan")) == "FloatingPointError: step 3: loss is nan"
    text = "Traceback (most recent call last):\n  File ...\nValueError: bad\n"
    assert error_line(text) == "ValueError: bad"
    assert error_line("   ") == ""


# -- side_by_side ---------------------------------------------------------------------
class Counter:
    def __init__(self, fail_at=None):
        self.seen, self.fail_at = [], fail_at

    def step(self, i, scale=1):
        if i == self.fail_at:
            raise ValueError(f"no step {i}")
        self.seen.append(i * scale)


def test_both_objects_get_every_argument_in_turn_and_come_back():
    order = []
    a, b = Counter(), Counter()
    a.step = lambda i: order.append(("a", i))
    b.step = lambda i: order.append(("b", i))
    assert side_by_side([a, b], "step", range(2)) == [a, b]
    assert order == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    mine, given = side_by_side([Counter(), Counter()], "step", [(1, 10), (2, 10)])
    assert mine.seen == given.seen == [10, 20]


def test_a_call_that_raises_is_named_with_its_class_method_and_argument():
    with pytest.raises(AssertionError, match=r"^Counter.step\(3\) raised ValueError: no step 3$"):
        side_by_side([Counter(fail_at=3), Counter()], "step", range(5))


# -- assert_same_results --------------------------------------------------------------
def test_same_results_pass_and_each_difference_is_named_with_its_label_and_hint():
    t = torch.arange(6.0)
    assert_same_results({"first": (lambda: t.view(2, 3), lambda: t.view(2, 3)), "second": (lambda: 1, lambda: 1)})
    with pytest.raises(AssertionError, match=r"^second returned shape \(3, 2\), expected shape \(2, 3\): keep your own$"):
        assert_same_results({"first": (lambda: 1, lambda: 1), "second": (lambda: t.view(3, 2), lambda: t.view(2, 3))},
                            differs="keep your own")
    with pytest.raises(AssertionError, match=r"shape \(2, 3\) as expected, but other values"):
        assert_same_results({"values": (lambda: t.view(2, 3) + 1, lambda: t.view(2, 3))})
    with pytest.raises(AssertionError, match=r"returned 1.0, expected 1"):
        assert_same_results({"kind": (lambda: 1.0, lambda: 1)})


def test_a_call_that_raises_is_named_with_its_label_and_the_hint_for_errors():
    def wait():
        raise RuntimeError("shape is invalid")
    with pytest.raises(AssertionError, match=r"^older: wait\(\) raised RuntimeError: shape is invalid; any batch$"):
        assert_same_results({"older": (wait, lambda: 1)}, raised="any batch", differs="not this")


# -- globals_set ----------------------------------------------------------------------
LIMIT = 1.0


def _limit():
    return LIMIT


def test_a_module_constant_is_set_for_the_block_and_put_back_however_it_ends():
    with globals_set(_limit, _limit, LIMIT=0.3, EXTRA=5):
        assert _limit() == 0.3 and globals()["EXTRA"] == 5
    assert _limit() == 1.0 and "EXTRA" not in globals()
    with pytest.raises(KeyError):
        with globals_set(_limit, LIMIT=0.5):
            raise KeyError("inside")
    assert _limit() == 1.0


def test_checks_reexports_them():
    assert checks.side_by_side is side_by_side and checks.globals_set is globals_set
    assert checks.assert_numbers is assert_numbers and checks.error_line is error_line
    assert checks.assert_same_results is assert_same_results


# -- assert_fields, assert_cases, assert_functions_agree, returned ---------------------------


def test_assert_fields_names_each_key_that_differs_and_why():
    assert_fields("readings", {"a": 1, "b": [2, 3], "extra": 0}, {"a": 1, "b": [2, 3]})
    with pytest.raises(AssertionError) as failed:
        assert_fields("readings", {"a": 1, "b": [2, 4]}, {"a": 2, "b": [2, 3]}, why={"b": "b fell"})
    assert str(failed.value) == ("readings: 2 of 2 differ from what was expected: a: got 1, expected 2; "
                                 "b: got [2, 4], expected [2, 3] (b fell)")
    with pytest.raises(AssertionError, match="expected a dict with keys"):
        assert_fields("readings", [1], {"a": 1})


def test_assert_cases_names_the_case_and_the_rule():
    def judge(x):
        return {"big": x > 10, "odd": x % 2}
    assert_cases("judge", judge, [(11, [True, True], "eleven"), (4, [False, False], "four")], ["big", "odd"])
    with pytest.raises(AssertionError, match=r"judge when twelve \(12\): big means over 10"):
        assert_cases("judge", judge, [(12, [False, False], "twelve")], ["big", "odd"], rule="big means over 10")
    with pytest.raises(AssertionError, match="should return a dict with keys"):
        assert_cases("judge", lambda x: None, [(1, [True], "one")], ["big"])


def test_assert_functions_agree_compares_each_function():
    assert_functions_agree({"double": lambda x: 2 * x}, [1, 2], [1, 2])
    with pytest.raises(AssertionError, match="square of every input: 1 of 2 values differ"):
        assert_functions_agree({"double": lambda x: 2 * (x > 0), "square": lambda x: x * x}, [1, 3], [1, 2])


def test_returned_turns_an_exception_into_what_went_wrong():
    assert returned(lambda: 5, "five") == 5
    with pytest.raises(AssertionError, match=r"^calling it raised ZeroDivisionError: division by zero\. Divide by 1$"):
        returned(lambda: 1 / 0, "calling it", "Divide by 1")
    with pytest.raises(AssertionError, match=r"^get\(1\) raised KeyError\. Keep it$"):   # an error with no message
        returned(lambda: _raise(KeyError()), "get(1)", "Keep it")


def _raise(error):
    raise error

