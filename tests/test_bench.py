"""gclab bench reads each lesson's time budget from its notebook."""
import nbformat

from gclab import bench


def test_a_lesson_has_the_default_budget_unless_its_notebook_sets_one(tmp_path):
    plain, load_test = tmp_path / "plain.ipynb", tmp_path / "load_test.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), plain)
    nb = nbformat.v4.new_notebook()
    nb.metadata["gclab"] = {"execute_budget_s": 90}
    nbformat.write(nb, load_test)
    assert bench.execute_budget(plain) == bench.EXECUTE_TARGET_S == 60
    assert bench.execute_budget(load_test) == 90
