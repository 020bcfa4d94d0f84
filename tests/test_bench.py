"""gclab bench reads each lesson's time budget from its notebook."""
from pathlib import Path

import nbformat

from gclab.tools import bench


def test_a_lesson_has_the_default_budget_unless_its_notebook_sets_one(tmp_path):
    plain, load_test = tmp_path / "plain.ipynb", tmp_path / "load_test.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), plain)
    nb = nbformat.v4.new_notebook()
    nb.metadata["gclab"] = {"execute_budget_s": 90}
    nbformat.write(nb, load_test)
    assert bench.execute_budget(plain) == bench.EXECUTE_TARGET_S == 60
    assert bench.execute_budget(load_test) == 90


def test_a_notebook_runs_without_the_kernels_warning_about_unencrypted_tcp(tmp_path, capfd):
    """Over TCP, ipykernel warns at every start that its traffic is unencrypted: nine lines of
    noise in `make bench`.  The kernel talks over Unix sockets in the scratch folder instead."""
    path, out = tmp_path / "tiny.ipynb", tmp_path / "ran.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")]), path)
    bench.execute_seconds(path, out)
    assert nbformat.read(out, 4).cells[0].outputs[0].text == "42\n"
    assert "without encryption" not in capfd.readouterr().err


def test_the_kernel_is_shut_down_when_the_notebook_has_run_and_its_exit_hooks_run(tmp_path):
    """A kernel left running lives on until this process ends, and then goes without its atexit
    hooks: a lesson's TemporaryDirectory stays in /tmp."""
    path, marker = tmp_path / "tiny.ipynb", tmp_path / "exited"
    source = f"import atexit, os\natexit.register(lambda: open({str(marker)!r}, 'w').write(str(os.getpid())))"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)]), path)
    bench.execute_seconds(path)
    assert marker.exists(), "the kernel did not exit by itself, running its atexit hooks"


def test_running_a_notebook_leaves_no_thread_behind(tmp_path):
    """The kernel client's heartbeat and zmq's I/O threads, left running after each notebook,
    took heap while later memory checks in the same process read it: those checks failed code
    that keeps nothing (seen in CI, after a worker had run six lessons)."""
    import threading

    def threads():
        return len(list((Path("/proc/self/task")).iterdir())), {t.name for t in threading.enumerate()}

    path = tmp_path / "tiny.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")]), path)
    bench.execute_seconds(path)                  # the first run may start threads that live on by design
    before = threads()
    bench.execute_seconds(path)
    bench.execute_seconds(path)
    assert threads() == before


def test_the_meters_cost_is_measured_beside_a_dispatch_mode_that_does_nothing():
    """Three kinds of run (no figure judged here: timing is the bench's, not a unit test's)."""
    plain, tracked, floor = bench.meter_overhead(steps=2, repeats=1)
    assert all(seconds > 0 for seconds in (plain, tracked, floor))
