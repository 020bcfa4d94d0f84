"""Lesson 05 end to end: the solution runs clean, and grading accepts only a real fix."""
import re

import pytest

from lesson_support import (
    test_no_graded_cell_of_the_solution_shows_a_value,  # noqa: F401  (collected here)
    test_no_handed_back_file_holds_a_line_of_a_hidden_test,  # noqa: F401  (collected here)
    test_every_test_of_the_reference_records_what_it_observed,  # noqa: F401  (collected here)
    test_every_wrong_fix_that_loses_points_fails_a_visible_self_check,  # noqa: F401  (collected here)
    test_every_self_check_ends_with_one_plain_line_when_it_passes,  # noqa: F401  (collected here)
    ROOT, assert_full_marks, assert_less_than_full_marks, assert_no_marks_until_answered, cell_result,
    assert_told_why, grade_all, plots_drawn, printed_text, problems, write_variants,
)

from gclab.grader import grading

SOLUTION = ROOT / "solutions" / "05_training_loop_leaks" / "05_training_loop_leaks.ipynb"
RELEASE = ROOT / "notebooks" / "05_training_loop_leaks" / "05_training_loop_leaks.ipynb"
POINTS = 10

TRAINER = '''
class Trainer:
    def __init__(self):
        self.model = make_model()
        self.optimizer = make_optimizer(self.model)
        self.history = []
        self.metrics = []
        self.errors = []
        self.last_output = None

    def train_step(self, step):
        x, y = get_batch(step)
        try:
            output = self.model(x)
            self.last_output = {last_output}
            loss = F.cross_entropy(output, y)
            check_finite(loss, step)
        except FloatingPointError as error:
            self.errors.append({error})
            return None
        self.optimizer.zero_grad()
        {backward}
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM)
        self.optimizer.step()
        {keep}
        {extra}
        return {returned}
'''

KEEP_TENSORS = ('self.history.append(loss)\n        '
                'self.metrics.append({"step": step, "loss": loss, "grad_norm": grad_norm})')
KEEP_NUMBERS = ('self.history.append(loss.item())\n        '
                'self.metrics.append({"step": step, "loss": loss.item(), "grad_norm": grad_norm.item()})')


def trainer(last_output="output.detach()", error="error.with_traceback(None)", backward="loss.backward()",
            keep=KEEP_NUMBERS, extra="pass", returned="loss.item()"):
    return TRAINER.format(last_output=last_output, error=error, backward=backward, keep=keep, extra=extra, returned=returned)


def running_total(extra):
    return trainer(extra=extra).replace("        self.last_output = None\n",
                                        "        self.last_output = None\n"
                                        "        self.running_loss = torch.zeros((), device=DEVICE)\n")


def leaky(extra="pass"):
    return trainer(last_output="output", error="error", keep=KEEP_TENSORS, extra=extra, returned="loss")


WATCHED_CONDITION = "gc.isenabled() or not os.environ.get('NBGRADER_EXECUTION')"

# Plausible wrong fixes (and hostile submissions): none may earn full marks.
WRONG = {
    "collects_every_step": leaky(extra="gc.collect()"),
    # every leak fixed but the stored errors' frames, with del and empty_cache() to "free" them
    "del_and_empty_cache": trainer(error="error", extra="del output, x, y\n        "
                                                       "if torch.cuda.is_available(): torch.cuda.empty_cache()"),
    "detaches_before_backward": trainer(backward="loss = loss.detach()\n        loss.backward()"),
    "drops_history_and_metrics": trainer(keep="pass"),
    # every leak fixed but the errors' frames, which are kept with the tensors in them emptied by hand
    # (traceback.clear_frames cannot clear train_step's frame: it is still running)
    "keeps_errors_with_their_frames_emptied": trainer(error="error").replace(
        "        except FloatingPointError as error:\n",
        "        except FloatingPointError as error:\n"
        "            output = loss = None                         # the frames must not hold the tensors\n"
        "            traceback.clear_frames(error.__traceback__)\n"),
    "keeps_detached_tensors": trainer(keep='self.history.append(loss.detach())\n        self.metrics.append('
                                           '{"step": step, "loss": loss.detach(), "grad_norm": grad_norm.detach()})'),
    "patches_the_grader": leaky() + "\nchecks.assert_flat = lambda report: None\n",
    # the lesson's own anti-pattern, a running total of the loss tensors, for the dashboard: each step's graph
    # is linked to the total; backward() frees what it saved, so only the heap grows (a few hundred bytes a step)
    "keeps_a_running_total_of_the_loss": running_total("self.running_loss += loss"),
    "sums_the_loss_every_other_step": running_total("if step % 2 == 0:\n            self.running_loss += loss"),
    # the same total kept where no walk from the trainer reaches it: a module global, an attribute of the class
    "sums_the_loss_into_a_global_every_other_step": "TOTAL_LOSS = 0.0\n" + trainer(
        extra="if step % 2 == 0:\n            global TOTAL_LOSS\n            TOTAL_LOSS = TOTAL_LOSS + loss"),
    "sums_the_loss_on_the_class_every_other_step": trainer(
        extra="if step % 2 == 0:\n            Trainer.total_loss += loss         # in place, once it is a tensor").replace(
        "class Trainer:\n", "class Trainer:\n    total_loss = 0.0\n\n"),
    # clipping that no step of the lesson's data needs at MAX_GRAD_NORM = 1.0, done after the update (so it
    # never acts), or its norm reported after clipping: the tests lower MAX_GRAD_NORM to see it
    "clips_after_the_optimizer_step": trainer().replace(
        "        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM)\n        self.optimizer.step()\n",
        "        self.optimizer.step()\n        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM)\n"),
    "reports_the_clipped_norm": trainer().replace(
        "        self.optimizer.step()\n",
        "        self.optimizer.step()\n"
        "        grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.model.parameters()]))\n"),
    # the last output kept only for a step that trained: after a skipped step the dashboard shows an older one
    "keeps_the_last_output_of_trained_steps_only": trainer().replace(
        "            self.last_output = output.detach()\n", "").replace(
        "        self.optimizer.step()\n", "        self.optimizer.step()\n        self.last_output = output.detach()\n"),
    # each output logged as an argument of the record (section 2's habit 4), to the logger section 2 keeps records of
    "logs_the_output_tensor": trainer(extra='logging.getLogger("trainer").info("step %d: output %s", step, output)'),
    # behaving only while watched: every leak fixed, unless the collector is on or nbgrader is not running it
    "leaks_unless_collector_off_or_under_nbgrader": trainer(
        last_output=f"output if {WATCHED_CONDITION} else output.detach()",
        error=f"error if {WATCHED_CONDITION} else error.with_traceback(None)"),
    # the errors kept with their frames, every step run with torch's dispatch (the CPU meter) turned off
    "cheat_runs_the_step_outside_the_meter": trainer(error="error").replace(
        "    def train_step(self, step):\n",
        "    def train_step(self, step):\n"
        "        with torch.utils._python_dispatch._disable_current_modes():\n"
        "            return self._train_step(step)\n\n"
        "    def _train_step(self, step):\n"),
}


# The output kept with its graph, behind a tensor subclass that says it has none.
CHEAT_HIDES_THE_GRAPH = trainer(last_output="output.as_subclass(Graphless)") + '''
class Graphless(torch.Tensor):
    grad_fn = None
    requires_grad = False
'''


# Right fixes written differently from the solution: each must earn full marks.
ALTERNATIVES = {
    # a detached copy for the dashboard, errors as formatted text, numbers through float()
    "clone_format_exception_float": trainer(
        last_output="output.detach().clone()",
        error="''.join(traceback.format_exception_only(type(error), error))",
        keep=('self.history.append(float(loss.detach()))\n        '
              'self.metrics.append(dict(step=step, loss=self.history[-1], grad_norm=float(grad_norm)))'),
        returned="self.history[-1]"),
    # .data for the values, the whole traceback as text, the numbers read once
    "data_format_exc_item_once": trainer(
        last_output="output.data",
        error="traceback.format_exc()",
        keep=('value, norm = loss.detach().item(), grad_norm.item()\n        '
              'self.history.append(value)\n        '
              'self.metrics.append({"step": step, "loss": value, "grad_norm": norm})'),
        returned="value"),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submissions")
    variants = {**WRONG, **ALTERNATIVES, "cheat_tensor_subclass_hides_its_graph": CHEAT_HIDES_THE_GRAPH}
    paths = {"solution": SOLUTION, "untouched": RELEASE, **write_variants(RELEASE, variants, folder)}
    return grade_all(paths, folder)


def test_solution_notebook_runs_clean_on_cpu(executed):
    """The solution as the grader ran it (every cell, hidden tests included): no error, no stderr."""
    assert not problems(executed), f"errors or stderr output in the solution notebook: {problems(executed)}"
    text = printed_text(executed)
    assert re.search(r"val_losses\.append\(val_loss\) +12\.75 MiB more than the clean loop", text)
    assert "544.01 KiB per trained step" in text and "576.01 KiB per corrupt step" in text
    assert text.count("gc.collect() found 0 objects") == 5, "the collector frees none of the leaks"
    assert "the meter: 557,064 B per kept monitoring loss" in text, "the graph's saved tensors explain the meter's count"
    assert re.search(r"a +64\.00 MiB tensor: tracemalloc saw \d{2,3} bytes", text)
    assert text.count("(flat from the first step on)") == 5
    assert "output.detach().cpu() shares the output's memory: True" in text
    assert re.search(r"val_losses\.append\(val_loss\): out of memory in step \d+, with 6\d\.\d\d MiB of the 64\.00 MiB "
                     r"budget held after step \d+", text), "the gauge's run ends in an out-of-memory error"
    assert ("Where the bytes are, after 12 iterations: leaky_trainer.errors (1.13 MiB more, in 2 entries): "
            "leaky_trainer.errors[0], a FloatingPointError with its traceback, whose __traceback__.tb_frame"
            ".f_locals['output'] (in train_step()) is a float32[256x32] tensor with grad_fn AddmmBackward0") in text
    assert "leaky_trainer.history (40 B more, in 10 entries)" in text and "leaky_trainer.last_output" not in text
    assert plots_drawn(executed) >= 5, "the timelines, the five habits, tracemalloc, the fixes and the gauge"


def test_the_gauge_is_a_widget_with_its_figure_for_readers_without_widgets(executed):
    import nbformat
    nb = nbformat.read(executed, 4)
    gauge = next(c for c in nb.cells if c.get("id") == "l05-gauge")
    kinds = [sorted(o.get("data", {})) for o in gauge.outputs if o.output_type == "display_data"]
    assert ["application/vnd.jupyter.widget-view+json", "text/plain"] in kinds
    assert ["image/png", "text/plain"] in kinds


def test_solution_earns_full_marks(graded):
    assert_full_marks(graded["solution"], POINTS)


@pytest.mark.parametrize("name", sorted(ALTERNATIVES))
def test_correct_alternative_earns_full_marks(graded, name):
    assert_full_marks(graded[name], POINTS)


def test_untouched_student_notebook_earns_nothing(graded):
    assert_no_marks_until_answered(graded["untouched"], POINTS)
    assert all("Trainer is not defined yet" in t.message for t in graded["untouched"].tests)


@pytest.mark.parametrize("name", sorted(WRONG))
def test_wrong_fix_does_not_earn_full_marks(graded, name):
    assert_less_than_full_marks(graded[name], POINTS)


def test_wrong_fixes_are_told_why(graded):
    def message(name, test_id):
        return cell_result(graded[name], test_id).message

    assert "collector ran" in message("collects_every_step", "test_memory_flat")
    assert "should return the loss as a number" in message("collects_every_step", "test_still_learns")
    assert "did not return to its baseline" in message("del_and_empty_cache", "test_memory_flat")
    # the self-check names the attribute that holds the bytes, and what in it keeps them
    assert ("trainer.errors (" in message("del_and_empty_cache", "test_memory_flat")
            and "a FloatingPointError with its traceback" in message("del_and_empty_cache", "test_memory_flat"))
    assert "did not return to its baseline" in message("keeps_detached_tensors", "test_memory_flat")
    assert "trainer.history (" in message("keeps_detached_tensors", "test_memory_flat")
    assert "history should hold numbers" in message("keeps_detached_tensors", "test_dashboard")
    assert "history" in message("drops_history_and_metrics", "test_dashboard")
    for test in graded["detaches_before_backward"].tests:      # told, not crashed
        assert test.status == "failed" and "RuntimeError" in test.message, test
    assert "modifies the grader" in graded["patches_the_grader"].reason
    for name in ("keeps_a_running_total_of_the_loss", "sums_the_loss_every_other_step"):
        grown = message(name, "test_memory_flat")
        assert re.search(r"trainer\.running_loss carries an autograd graph that grew from [\d,]+ to [\d,]+ nodes in 10 steps",
                         grown) and "loss.item()" in grown, grown
    for name, where in (("sums_the_loss_into_a_global_every_other_step", "TOTAL_LOSS"),
                        ("sums_the_loss_on_the_class_every_other_step", "Trainer.total_loss")):
        grown = message(name, "test_memory_flat")
        assert re.search(r"the autograd graphs alive in the process grew from [\d,]+ to [\d,]+ nodes in 10 steps", grown), grown
        assert f"is kept by {where}" in grown, grown
    assert "is kept by log_window.records[" in message("logs_the_output_tensor", "test_memory_flat")
    assert "losses with MAX_GRAD_NORM = 0.3" in message("clips_after_the_optimizer_step", "test_still_learns")
    assert "metrics grad_norm with MAX_GRAD_NORM = 0.3" in message("reports_the_clipped_norm", "test_dashboard")
    assert "after a skipped step" in message("keeps_the_last_output_of_trained_steps_only", "test_dashboard")
    emptied = message("keeps_errors_with_their_frames_emptied", "test_memory_flat")
    assert re.search(r"keeps \d+ error\(s\) with a traceback", emptied) and "with_traceback(None)" in emptied, emptied


def test_partial_fixes_keep_the_points_they_earn(graded):
    """A fix that is right but for one leak (errors kept with their frames) loses only the memory test's points."""
    for name in ("del_and_empty_cache", "keeps_errors_with_their_frames_emptied"):
        result = graded[name]
        assert result.score == POINTS - 4, grading.format_results([result])
        assert cell_result(result, "test_still_learns").status == "passed"



def test_a_tensor_subclass_that_hides_its_graph_loses_the_dashboard_points(graded):
    result = graded["cheat_tensor_subclass_hides_its_graph"]
    assert_less_than_full_marks(result, POINTS)
    assert_told_why(result, "test_dashboard", "trainer.last_output is a Graphless (a subclass of torch.Tensor)")
