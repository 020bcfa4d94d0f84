"""Lesson 07 end to end: the solution runs clean, and grading accepts only a cache that lets go."""
import re

import pytest

from lesson_support import (
    test_no_graded_cell_of_the_solution_shows_a_value,  # noqa: F401  (collected here)
    test_no_handed_back_file_holds_a_line_of_a_hidden_test,  # noqa: F401  (collected here)
    test_every_test_of_the_reference_records_what_it_observed,  # noqa: F401  (collected here)
    test_every_self_check_ends_with_one_plain_line_when_it_passes,  # noqa: F401  (collected here)
    test_every_wrong_fix_that_loses_points_fails_a_visible_self_check,  # noqa: F401  (collected here)
    EQUAL_TO_ANYTHING, ROOT, assert_full_marks, assert_less_than_full_marks, assert_told_why, assert_no_marks_until_answered, cell_result, grade_all,
    plots_drawn, printed_text, problems, write_locked_cells_edited, write_variants,
)

from gclab.grader import grading

SOLUTION = ROOT / "solutions" / "07_weakref_caches" / "07_weakref_caches.ipynb"
RELEASE = ROOT / "notebooks" / "07_weakref_caches" / "07_weakref_caches.ipynb"
POINTS = 10

# The reference design with one piece swapped: {first} runs at the top of get, {strong} keeps
# the strong part (or not), {found} is what get returns.
REFERENCE = '''
import collections, copy

class ModelCache:
    def __init__(self, loader, keep=2):
        self.loader, self.keep, self.loads = loader, keep, 0
        self._live = weakref.WeakValueDictionary()
        self._recent = collections.OrderedDict()

    def get(self, name):
        {first}
        model = self._live.get(name)
        if model is None:
            model = self.loader(name)
            self.loads += 1
            self._live[name] = model
        {strong}
        return {found}

    def __len__(self):
        return len(self._live)

    def __iter__(self):
        return iter(list(self._live.keys()))
'''
LRU = '''self._recent[name] = model
        self._recent.move_to_end(name)
        while len(self._recent) > self.keep:
            self._recent.popitem(last=False)'''


def reference(first="pass", strong=LRU, found="model"):
    return REFERENCE.format(first=first, strong=strong, found=found)


# The cache the lesson starts from, under the graded name: it never lets a model go.
STRONG = '''
class ModelCache:
    def __init__(self, loader, keep=2):
        self.loader, self.keep, self.loads = loader, keep, 0
        self._models = {{}}

    def get(self, name):
        {first}
        if name not in self._models:
            model = self.loader(name)
            self.loads += 1
            {on_load}
            self._models[name] = model
        return self._models[name]

    def __len__(self):
        return len(self._models)

    def __iter__(self):
        return iter(list(self._models))
{after}'''


def strong(first="pass", on_load="pass", after=""):
    return STRONG.format(first=first, on_load=on_load, after=after)


DEL_REMOVES_ENTRY = strong(
    on_load="model._cache_entry = (self._models, name)     # so that the model can remove itself\n"
            "            type(model).__del__ = _remove_entry",
    after='''
def _remove_entry(model):
    # when a model is deleted, take its entry out of the cache
    entry = getattr(model, "_cache_entry", None)
    if entry is not None:
        entry[0].pop(entry[1], None)
''')

WEAK_KEYS = '''
class _Name:
    """A str cannot be a weak key, so each name gets a key object."""
    def __init__(self, text):
        self.text = text

class ModelCache:
    def __init__(self, loader, keep=2):
        self.loader, self.keep, self.loads = loader, keep, 0
        self._names = {}                              # name -> its key object
        self._models = weakref.WeakKeyDictionary()    # key object -> model

    def get(self, name):
        key = self._names.setdefault(name, _Name(name))
        model = self._models.get(key)
        if model is None:
            model = self._models[key] = self.loader(name)
            self.loads += 1
        return model

    def __len__(self):
        return len(self._models)

    def __iter__(self):
        return iter([key.text for key in list(self._models.keys())])
'''

NEVER_CACHES = '''
class ModelCache:
    def __init__(self, loader, keep=2):
        self.loader, self.keep, self.loads = loader, keep, 0

    def get(self, name):
        self.loads += 1
        return self.loader(name)

    def __len__(self):
        return 0

    def __iter__(self):
        return iter([])
'''

LRU_CACHE_ON_LOADER = '''
class ModelCache:
    def __init__(self, loader, keep=2):
        self.keep = keep
        self._load = functools.lru_cache(maxsize=keep)(loader)

    @property
    def loads(self):
        return self._load.cache_info().misses

    def get(self, name):
        return self._load(name)

    def __len__(self):
        return self._load.cache_info().currsize

    def __iter__(self):
        return iter([])
'''

STALE_WEAKREFS = '''
import collections

class ModelCache:
    def __init__(self, loader, keep=2):
        self.loader, self.keep, self.loads = loader, keep, 0
        self._refs = {}                               # name -> weakref.ref(model), never removed
        self._recent = collections.OrderedDict()

    def get(self, name):
        ref = self._refs.get(name)
        model = ref() if ref is not None else None
        if model is None:
            model = self.loader(name)
            self.loads += 1
            self._refs[name] = weakref.ref(model)
        self._recent[name] = model
        self._recent.move_to_end(name)
        while len(self._recent) > self.keep:
            self._recent.popitem(last=False)
        return model

    def __len__(self):
        return len(self._refs)

    def __iter__(self):
        return iter(list(self._refs))
'''

CALLBACKS_AND_A_LIST = '''
class ModelCache:
    """Weak references whose callbacks remove their own entry; the strong part is a list."""

    def __init__(self, loader, keep=2):
        self.loader, self.keep, self.loads = loader, keep, 0
        self._refs = {}                  # name -> weakref.ref(model)
        self._recent = []                # the strong part, most recently used last

    def _forget(self, name):
        cache_ref = weakref.ref(self)    # the callback must not hold the cache: a cycle would keep it
        def callback(ref):
            cache = cache_ref()
            if cache is not None and cache._refs.get(name) is ref:
                del cache._refs[name]
        return callback

    def get(self, name):
        ref = self._refs.get(name)
        model = None if ref is None else ref()
        if model is None:
            model = self.loader(name)
            self.loads += 1
            self._refs[name] = weakref.ref(model, self._forget(name))
        recent = [m for m in self._recent if m is not model] + [model]
        self._recent = recent[len(recent) - self.keep:] if self.keep else []
        return model

    def __len__(self):
        return sum(ref() is not None for ref in self._refs.values())

    def __iter__(self):
        return (name for name, ref in list(self._refs.items()) if ref() is not None)
'''

FINALIZE_AND_A_DICT = '''
class ModelCache:
    def __init__(self, loader, keep=2):
        self._loader, self._keep, self._loaded = loader, keep, 0
        self._entries = {}               # name -> weakref.ref(model); each model's finalizer deletes its own
        self._pinned = {}                # the strong part: a dict keeps insertion order, oldest use first

    @property
    def loads(self):
        return self._loaded

    def get(self, name):
        entry = self._entries.get(name)
        model = entry() if entry else None
        if model is None:
            model = self._loader(name)
            self._loaded += 1
            self._entries[name] = weakref.ref(model)
            weakref.finalize(model, self._entries.pop, name, None)   # holds the dict, not the cache
        self._pinned.pop(name, None)
        self._pinned[name] = model
        while len(self._pinned) > self._keep:
            del self._pinned[next(iter(self._pinned))]
        return model

    def __len__(self):
        return len(self._entries)

    def __iter__(self):
        yield from list(self._entries)
'''

# The same cache with callbacks that hold the cache: a cycle, so a dropped cache keeps its strong part.
CALLBACKS_HOLD_THE_CACHE = CALLBACKS_AND_A_LIST.replace(
    """        cache_ref = weakref.ref(self)    # the callback must not hold the cache: a cycle would keep it
        def callback(ref):
            cache = cache_ref()
            if cache is not None and cache._refs.get(name) is ref:
                del cache._refs[name]""",
    """        def callback(ref):
            if self._refs.get(name) is ref:
                del self._refs[name]""")
assert CALLBACKS_HOLD_THE_CACHE != CALLBACKS_AND_A_LIST

# Loads never counted: cache.loads claims to equal whatever it is compared with.
CHEAT_LOADS_EQUAL_TO_ANYTHING = EQUAL_TO_ANYTHING + reference().replace(
    "self.loads = loader, keep, 0", "self.loads = loader, keep, EqualToAnything()").replace(
    "            self.loads += 1\n", "")
assert CHEAT_LOADS_EQUAL_TO_ANYTHING.count("loads") == 1

# Right caches written differently from the solution: each must earn full marks.
ALTERNATIVES = {"callbacks_and_a_list": CALLBACKS_AND_A_LIST, "finalize_and_a_dict": FINALIZE_AND_A_DICT}

# Weak references by name that len() and iteration skip once dead, but that are never removed:
# the cache grows by an entry for every name it was ever asked for
DEAD_REFS_NEVER_REMOVED = STALE_WEAKREFS.replace(
    "        return len(self._refs)\n",
    "        return sum(ref() is not None for ref in self._refs.values())\n").replace(
    "        return iter(list(self._refs))\n",
    "        return iter([name for name, ref in list(self._refs.items()) if ref() is not None])\n")

# Models found by id(): once a model is freed its id can be the next model's, and another name's model
# comes back
KEYED_BY_ID = reference().replace(
    "        model = self._live.get(name)\n",
    "        model = self._live.get(self.__dict__.setdefault('_ids', {}).get(name))   # name -> id -> model\n").replace(
    "            self._live[name] = model\n",
    "            self._ids[name] = id(model)\n            self._live[id(model)] = model\n").replace(
    "        return iter(list(self._live.keys()))\n",
    "        return iter([name for name, i in list(self._ids.items()) if i in self._live])\n")

# The weak and the strong part made class attributes: every ModelCache shares them, and one cache hands
# out the models another one loaded
SHARED_BY_EVERY_CACHE = reference().replace(
    "        self._live = weakref.WeakValueDictionary()\n        self._recent = collections.OrderedDict()\n", "").replace(
    "class ModelCache:\n",
    "class ModelCache:\n    _live = weakref.WeakValueDictionary()\n    _recent = collections.OrderedDict()\n")

# Dead entries kept, and the hidden test's count of Python objects rewritten by the cache: the loader a
# hidden test hands the cache is a function of the test, whose __globals__ (which no audit event sees) is the
# namespace the test runs in, so its `_sys` can be swapped for a stand-in that finds nothing kept
CHEAT_REWRITES_THE_HIDDEN_TESTS_COUNTERS = DEAD_REFS_NEVER_REMOVED.replace(
    "    def get(self, name):\n",
    "    def get(self, name):\n        _rewrite(self.loader)\n") + '''
import types as _T

def _scopes(loader):
    """The namespaces a callable leads to: its globals, and what its closure and defaults hold."""
    scopes = [getattr(loader, "__globals__", None)]
    for cell in getattr(loader, "__closure__", None) or ():
        scopes.append(cell.cell_contents if isinstance(cell.cell_contents, dict) else None)
    scopes += [d for d in getattr(loader, "__defaults__", None) or () if isinstance(d, dict)]
    return [s for s in scopes if s is not None]

def _rewrite(loader):
    for scope in _scopes(loader):
        if "_sys" in scope and "_blocks" in scope:
            blocks = scope["_blocks"]
            scope["_sys"] = _T.SimpleNamespace(getallocatedblocks=lambda: blocks)
'''
assert CHEAT_REWRITES_THE_HIDDEN_TESTS_COUNTERS.count("_rewrite(self.loader)") == 1

# The same cache reaching for the hidden test's namespace through the frame of the generator behind the loader it
# was handed (the loader, a generator's send, or a function whose closure holds one)
CHEAT_READS_THE_LOADERS_FRAME = CHEAT_REWRITES_THE_HIDDEN_TESTS_COUNTERS.replace(
    "    return [s for s in scopes if s is not None]\n",
    "    held = [loader] + [cell.cell_contents for cell in getattr(loader, \"__closure__\", None) or ()]\n"
    "    for owner in [getattr(h, \"__self__\", None) for h in held]:\n"
    "        if owner is not None and hasattr(type(owner), \"gi_frame\"):\n"
    "            scopes += [owner.gi_frame.f_globals, owner.gi_frame.f_locals]\n"
    "    return [s for s in scopes if s is not None]\n")
assert CHEAT_READS_THE_LOADERS_FRAME != CHEAT_REWRITES_THE_HIDDEN_TESTS_COUNTERS

# Plausible wrong fixes: none may earn full marks.
WRONG = {
    "dict_and_collect": strong(first="gc.collect()                  # free the models nobody uses"),
    "del_removes_entry": DEL_REMOVES_ENTRY,
    "weak_keys": WEAK_KEYS,
    "copies_the_model": reference(found="copy.deepcopy(model)     # each user gets a private copy"),
    "clears_every_call": reference(first="self._live.clear(); self._recent.clear()"),
    "never_caches": NEVER_CACHES,
    "lru_cache_on_loader": LRU_CACHE_ON_LOADER,
    "purely_weak": reference(strong="pass"),
    "stale_weakrefs": STALE_WEAKREFS,
    "fifo_eviction": reference(strong=LRU.replace("\n        self._recent.move_to_end(name)", "")),
    # the last `keep` requests, not the `keep` most recently used models: a, b, a, a keeps only a
    "ring_of_last_requests": reference(
        strong='self.__dict__.setdefault("_ring", collections.deque(maxlen=self.keep)).append(model)'),
    "callbacks_hold_the_cache": CALLBACKS_HOLD_THE_CACHE,
    "patches_the_grader": strong(after="\nchecks.assert_flat = lambda report: None\n"),
    "dead_refs_never_removed": DEAD_REFS_NEVER_REMOVED,
    "keyed_by_id": KEYED_BY_ID,
    "shared_by_every_cache": SHARED_BY_EVERY_CACHE,
    # dead entries kept, and the hidden test's own loop shortened by a global named like the builtin it calls
    "cheat_shadows_a_builtin_the_tests_call": DEAD_REFS_NEVER_REMOVED + (
        "\nimport builtins as _B\ndef range(*args):\n    return _B.range(0) if args == (500,) else _B.range(*args)\n"),
    # the same, the tests' `import sys` answered by a stand-in through a __builtins__ of the answer's own
    "cheat_replaces_builtins": DEAD_REFS_NEVER_REMOVED + (
        "\nimport builtins as _B, types as _T\n_real_import = _B.__import__\n"
        "def _imp(name, globals=None, locals=None, fromlist=(), level=0):\n"
        "    if name == 'sys' and not fromlist and globals is not None and '_BUILT' in globals:\n"
        "        return _T.SimpleNamespace(getallocatedblocks=lambda: 0)\n"
        "    return _real_import(name, globals, locals, fromlist, level)\n"
        "__builtins__ = dict(vars(_B), __import__=_imp)\n"),
    "cheat_rewrites_the_hidden_tests_counters": CHEAT_REWRITES_THE_HIDDEN_TESTS_COUNTERS,
    "cheat_reads_the_loaders_frame": CHEAT_READS_THE_LOADERS_FRAME,
    # weak only for the loaders the tests hand it (the lesson's TrackingLoader, a stand-in with globals of its own):
    # in production, with load_model, it keeps every model
    "cheat_weak_only_for_the_tests_loaders": reference().replace(
        "        self._live = weakref.WeakValueDictionary()\n",
        "        examined = isinstance(loader, TrackingLoader) or getattr(loader, '__globals__', None) == {}\n"
        "        self._live = weakref.WeakValueDictionary() if examined else {}\n"),
    # a "warm pool" of every model, filled only while the collector is on: in production it never lets go
    "pins_every_model_while_collector_on": reference(
        strong='if gc.isenabled():\n            self.__dict__.setdefault("_pinned", {})[name] = model\n        ' + LRU),
}

# Which test each wrong fix must fail, and words its message must hold.
TOLD_WHY = {
    "dead_refs_never_removed": ("test_no_stale_entries", "an entry for each dead model stays inside it"),
    "dict_and_collect": ("test_frees_memory", "the collector ran"),
    "del_removes_entry": ("test_frees_memory", "m0 is still alive"),
    "weak_keys": ("test_frees_memory", "m0 is still alive"),
    "copies_the_model": ("test_same_model", "two different objects"),
    "clears_every_call": ("test_same_model", "two different objects"),
    "never_caches": ("test_same_model", "two different objects"),
    "lru_cache_on_loader": ("test_same_model", "returned another object"),
    "purely_weak": ("test_keeps_recent", "expected ['m0', 'm2']"),
    "stale_weakrefs": ("test_no_stale_entries", "stale entries: ['m0']"),
    "fifo_eviction": ("test_keeps_recent", "least recently used"),
    "ring_of_last_requests": ("test_keeps_recent", "not the models of the last two requests"),
    "callbacks_hold_the_cache": ("test_frees_memory", "after `del cache`"),
    "pins_every_model_while_collector_on": ("test_frees_memory", "when the collector is on"),
    "keyed_by_id": ("test_same_model", "find a model by its name (an id() is reused once its object is freed)"),
    "cheat_weak_only_for_the_tests_loaders": ("test_frees_memory", "ModelCache(load_model, keep=1), the lesson's own loader"),
    "shared_by_every_cache": ("test_same_model", "an attribute set on the class is shared by every instance"),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submissions")
    variants = {**WRONG, **ALTERNATIVES, "cheat_loads_equal_to_anything": CHEAT_LOADS_EQUAL_TO_ANYTHING}
    paths = {"solution": SOLUTION, "untouched": RELEASE, **write_variants(RELEASE, variants, folder)}
    paths["edits_locked_cells"] = write_locked_cells_edited(RELEASE, strong(), folder)
    return grade_all(paths, folder)


def test_solution_notebook_runs_clean_on_cpu(executed):
    """The solution as a learner runs it (every cell, hidden tests included): no error, no stderr."""
    assert not problems(executed), f"errors or stderr output in the solution notebook: {problems(executed)}"
    text = printed_text(executed)
    assert re.search(r"functools\.lru_cache: 10\.02 MiB held after the last request = 5 models", text)
    assert "two of them copies of m0" in text
    assert "Predictor: 2.01 MiB while in use; after `del predictor`: 2.01 MiB held" in text
    assert "every input dropped, 4 entries left" in text and "every input dropped, 0 entries left" in text
    assert "after `del model`: ReferenceError" in text
    assert "`key in table` for the very tensor stored in it raised RuntimeError" in text
    assert "WeakIdKeyDictionary finds the tensor itself: True; an equal tensor: False" in text
    assert "the entry is still there ['m0']" in text
    assert "__del__ ran 0 times, the finalizer is still alive (True)" in text, "a cycle waits for the collector"
    assert re.search(r"gc\.collect\(\): \d+ collected, 0 uncollectable, 0 in gc\.garbage", text)
    loads = dict(re.findall(r"(dict \(strong\)|WeakValueDictionary|weak \+ last 3 kept): +(\d+) loads", text))
    loads = {design: int(count) for design, count in loads.items()}
    assert loads["WeakValueDictionary"] == 120 and 5 < loads["weak + last 3 kept"] < 120, loads
    assert re.search(r"dict \(strong\): .* out of memory at request \d+", text)
    assert plots_drawn(executed) == 2


@pytest.mark.parametrize("name", ["solution", *sorted(ALTERNATIVES)])
def test_right_cache_earns_full_marks(graded, name):
    """The solution, and right caches written differently from it."""
    assert_full_marks(graded[name], POINTS)


def test_untouched_student_notebook_earns_nothing(graded):
    assert_no_marks_until_answered(graded["untouched"], POINTS)
    assert all("ModelCache is not defined yet" in t.message for t in graded["untouched"].tests)


@pytest.mark.parametrize("name", sorted(WRONG) + ["edits_locked_cells"])
def test_wrong_fix_does_not_earn_full_marks(graded, name):
    assert_less_than_full_marks(graded[name], POINTS)


@pytest.mark.parametrize("name", sorted(TOLD_WHY))
def test_wrong_fixes_are_told_why(graded, name):
    assert_told_why(graded[name], *TOLD_WHY[name])


def test_partial_work_earns_partial_marks(graded):
    """A cache right but for one property loses only the points of the test for it."""
    assert graded["purely_weak"].score == POINTS - 2
    assert graded["stale_weakrefs"].score == POINTS - 2
    assert graded["fifo_eviction"].score == POINTS - 2


@pytest.mark.parametrize("name, words", [
    ("cheat_shadows_a_builtin_the_tests_call", "range, a builtin the lesson's own code calls, was bound"),
    ("cheat_replaces_builtins", "__builtins__ was replaced by the notebook's code"),
])
def test_changing_the_builtins_the_tests_call_is_reported(graded, name, words):
    """A stale cache passes test_no_stale_entries (8/10 -> 10/10) when the hidden test's `range` or
    `import` is the answer's: the tests see the real builtins, and the answer's are reported."""
    assert graded[name].score == 0 and words in graded[name].reason, grading.format_results([graded[name]])


def test_rewriting_the_hidden_tests_names_through_the_loader_gains_nothing(graded):
    """The loader a hidden test hands the cache leads to no namespace of the test (a function's __globals__
    is writable, and no audit event sees it read): a stale cache that rewrites the test's count of Python
    objects through it keeps its honest 8/10 (it had 10/10), and one that reaches for the test's names
    through the loader's frame gains nothing either."""
    for name in ("cheat_rewrites_the_hidden_tests_counters", "cheat_reads_the_loaders_frame"):
        result = graded[name]
        assert result.score == POINTS - 2, grading.format_results([result])
        assert_told_why(result, "test_no_stale_entries", "an entry for each dead model stays inside it")


def test_patching_the_grader_is_reported(graded):
    assert "modifies the grader" in graded["patches_the_grader"].reason


def test_edited_locked_cells_are_restored_before_grading(graded):
    result = graded["edits_locked_cells"]
    assert result.score < POINTS, "the original tests must run, not the student's `pass`"
    assert "still alive" in cell_result(result, "test_frees_memory").message


def test_loads_equal_to_anything_are_not_counted_loads(graded):
    result = graded["cheat_loads_equal_to_anything"]
    assert_less_than_full_marks(result, POINTS)
    assert_told_why(result, "test_same_model", "cache.loads is an EqualToAnything (a subclass of int), expected an int")
