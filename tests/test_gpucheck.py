"""`gclab gpu-check`: what it does where there is no GPU, and how it reads and shows a lesson's results."""
import nbformat
import pytest
import torch

from gclab.tools import gpucheck
from gclab.__main__ import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_a_gpu_it_says_so_and_runs_nothing(capsys):
    assert main(["gpu-check", "00_measuring_memory"]) == 2
    assert "gpu-check needs a CUDA GPU" in capsys.readouterr().err


def _lesson(execute_error="", solution="8/8", release="0/8", figures="OOM at step 95\n"):
    return {"lesson": "03_node_leak",
            "execute": {"seconds": None if execute_error else 12.3, "error": execute_error,
                        "outputs": [{"index": 3, "tags": ["key-figures"], "text": figures},
                                    {"index": 4, "tags": [], "text": "not a key figure\n"}]},
            "solution": {"score": solution, "reason": "", "failed": []},
            "release": {"score": release, "reason": "", "failed": []}}


def test_a_lesson_table_puts_cuda_beside_cpu_with_the_key_figures():
    text = gpucheck.format_lesson(_lesson(figures="OOM at step 95\n"), _lesson(figures="OOM at step 96\n"))
    assert "VERDICTS DIFFER" not in text
    assert "solution score             8/8           8/8" in text
    assert "key figures, CUDA:\n    OOM at step 95\n  key figures, CPU:\n    OOM at step 96" in text
    assert "not a key figure" not in text


def test_a_verdict_that_differs_between_the_devices_is_flagged():
    text = gpucheck.format_lesson(_lesson(solution="6/10", execute_error="AssertionError: kept 2 MiB"),
                                  _lesson(solution="10/10"))
    assert "VERDICTS DIFFER" in text and "FAILED" in text and "CUDA execution failed: AssertionError: kept 2 MiB" in text


def test_the_key_figures_are_the_text_of_the_cells_a_lesson_tags():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(1)", metadata={"tags": ["key-figures"]}),
                                         nbformat.v4.new_code_cell("print(2)")])
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="budget 48 MiB\n")]
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="other\n")]
    assert gpucheck.key_figures(gpucheck.notebook_outputs(nb)) == "budget 48 MiB\n"


def test_lessons_that_print_key_figures_tag_them():
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    tagged = {p.parent.name for p in root.glob("solutions/*/*.ipynb")
              if any(gpucheck.KEY_FIGURES_TAG in c.metadata.get("tags", []) for c in nbformat.read(p, 4).cells)}
    assert {"00_measuring_memory", "03_node_leak", "04_awaitable_callback_oom", "06_gc_pauses_in_serving"} <= tagged
