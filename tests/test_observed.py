"""gclab.observed: results compared with the expected ones, with messages that say what differs."""
import pytest

from gclab.observed import assert_cases, assert_fields, assert_same_results, returned


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


def test_assert_same_results_compares_each_function():
    assert_same_results({"double": lambda x: 2 * x}, [1, 2], [1, 2])
    with pytest.raises(AssertionError, match="square of every input: 1 of 2 values differ"):
        assert_same_results({"double": lambda x: 2 * (x > 0), "square": lambda x: x * x}, [1, 3], [1, 2])


def test_returned_turns_an_exception_into_what_went_wrong():
    assert returned(lambda: 5, "five") == 5
    with pytest.raises(AssertionError, match=r"^calling it raised ZeroDivisionError: division by zero\. Divide by 1$"):
        returned(lambda: 1 / 0, "calling it", "Divide by 1")
