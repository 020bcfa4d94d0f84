"""gclab.grader.review lists the lines of an answer that read what tells a grading run from the learner's own."""
from gclab.grader.review import environment_reads


def test_each_way_to_tell_a_grading_run_is_listed_with_what_it_reads():
    source = ("import sys\n_GRADED = 'gclab.verdict' in sys.modules\n"
              "def make_pair(i):\n"
              "    if gc.isenabled() and not torch._C._len_torch_dispatch_stack():\n        pass\n"
              "    seen = getattr(loader, '__globals__', None) == {}\n"
              "    shell = get_ipython().showtraceback\n"
              "    demo_ran = 'leaky_step' in globals()\n"
              "    graded = os.environ.get('NBGRADER_EXECUTION')\n")
    assert environment_reads(source) == [
        "_GRADED = 'gclab.verdict' in sys.modules  (which modules are loaded)",
        "if gc.isenabled() and not torch._C._len_torch_dispatch_stack():  "
        "(whether the collector is on (a check switches it off))",
        "seen = getattr(loader, '__globals__', None) == {}  (another function's globals)",
        "shell = get_ipython().showtraceback  (the notebook's shell (how the grader runs cells))",
        "demo_ran = 'leaky_step' in globals()  (which names the notebook defined (the grader runs no example cell))",
        "graded = os.environ.get('NBGRADER_EXECUTION')  (whether nbgrader runs it)",
    ]


def test_an_ordinary_fix_is_not_listed():
    assert environment_reads("class Node:\n    def __init__(self, tensor):\n        self.tensor = tensor\n"
                             "        self._prev = None\n    @property\n    def prev(self):\n"
                             "        return None if self._prev is None else self._prev()\n"
                             "gc.collect()\nweakref.ref(x)\n") == []


def test_a_cell_that_does_not_parse_lists_nothing():
    assert environment_reads("def broken(:\n    sys.modules") == []
