"""Lesson 06's visible self-check is as strict as its hidden test: every wrong policy of
tests/test_lesson_06.py (each of which that module shows earns 0 of 6) fails the self-check a learner
runs, its release's test cell with the hidden part removed.  A module of its own, so that `make test`
runs it beside the grading: each policy serves its loads (183 s in all on the 2 shared cores of the
test machine, which one module would add to the suite's longest)."""
import pytest
from lesson_support import self_checks, write_variants

from test_lesson_06 import REFERENCE, RELEASE, WRONG

pytestmark = pytest.mark.timed     # the self-check times a server

# cheats aimed at the grader's own figures: in a learner's own kernel nothing is graded, so the self-check
# has nothing to catch (the grader refuses them: tests/test_lesson_06.py)
AIMED_AT_THE_GRADER = {name for name in WRONG if name.startswith("cheat_")}


@pytest.fixture(scope="module")
def wrong_policies(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wrong_policies")
    names = sorted(set(WRONG) - AIMED_AT_THE_GRADER)
    return folder, write_variants(RELEASE, {"reference": REFERENCE, **{name: WRONG[name] for name in names}}, folder)


def test_every_wrong_policy_fails_the_visible_self_check(wrong_policies):
    folder, paths = wrong_policies
    reference = self_checks(RELEASE, paths.pop("reference"), folder)["test_policy"]
    assert reference.status == "passed", f"the reference policy fails the self-check: {reference.message}"
    passed_visibly = {}
    for name, path in paths.items():
        result = self_checks(RELEASE, path, folder)["test_policy"]
        if result.status == "passed":
            passed_visibly[name] = result.output[-300:]
    assert not passed_visibly, f"wrong policies the visible self-check lets through: {passed_visibly}"
