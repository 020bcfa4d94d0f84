"""gclab.grader.pinning: pinned code looks up none of its global names while it runs, and does what it did."""
import builtins
import gc
import sys
import textwrap
import traceback
import types

import pytest

from gclab.grader import pinning

pytestmark = pytest.mark.skipif(not pinning.SUPPORTED, reason="pinning changes nothing on this Python")

SOURCE = textwrap.dedent('''
    import gc, functools, math

    LIMIT = 3

    def helper(x):
        return x + 1

    def uses_globals(items):
        return all(items), helper(LIMIT), len(items)

    def calls_module_functions():
        gc.collect()
        return math.floor(2.5), gc.isenabled()

    def with_nested(values):
        def inner(v):
            return helper(v)
        squares = [helper(v) for v in values]
        return [inner(v) for v in values], squares, list(x for x in map(helper, values))

    def generator(n):
        for i in range(n):
            yield helper(i)

    def raises():
        value = helper(1)
        raise ValueError(value)

    def branches(x):
        total = 0
        for i in range(x):
            if i % 2 and helper(i) > LIMIT:
                total += len(str(i))
            else:
                continue
        try:
            1 / x
        except ZeroDivisionError:
            return helper(-1)
        return total

    def late():
        return DEFINED_LATER

    def decorated_by(function):
        @functools.wraps(function)
        def wrapper(*args):
            return function(*args)
        return wrapper

    @decorated_by
    def wrapped(x):
        return helper(x)

    class Thing:
        def method(self):
            return helper(1)

        @property
        def prop(self):
            return helper(2)

        @staticmethod
        def static():
            return helper(3)

        @classmethod
        def cls(cls):
            return helper(4)

    def many_constants(x):
        values = [x, CONSTANTS]
        return len(values), helper(0)
''').replace("CONSTANTS", ", ".join(f"'c{i}'" for i in range(300)))


def _module(name="pinned_sample"):
    module = types.ModuleType(name)
    module.__file__ = f"<{name}>"
    exec(compile(SOURCE, module.__file__, "exec"), vars(module))
    sys.modules[name] = module
    return module


@pytest.fixture
def sample():
    module = _module()
    yield module
    del sys.modules[module.__name__]


def _results(module):
    thing = module.Thing()
    return (module.uses_globals([1, 2]), module.calls_module_functions()[0], module.with_nested([1, 2]),
            list(module.generator(3)), module.branches(7), module.branches(0), module.wrapped(5),
            thing.method(), thing.prop, thing.static(), module.Thing.cls(), module.many_constants(0))


def test_pinned_code_returns_what_it_returned(sample):
    before = _results(sample)
    assert pinning.pin([sample]) > 0
    assert _results(sample) == before


def test_a_constant_past_the_256th_is_loaded_through_extended_arg(sample):
    pinning.pin([sample])
    vars(sample)["helper"] = lambda x: "the stand-in"
    assert len(sample.many_constants.__code__.co_consts) > 256
    assert sample.many_constants(0) == (301, 1)


def test_a_builtin_rebound_after_pinning_is_never_asked(sample):
    pinning.pin([sample])
    real = builtins.all
    vars(builtins)["all"] = lambda items: "the stand-in"
    try:
        assert sample.uses_globals([0])[0] is False
    finally:
        vars(builtins)["all"] = real


def test_a_module_name_rebound_or_shadowing_a_builtin_after_pinning_is_never_asked(sample):
    pinning.pin([sample])
    vars(sample)["helper"] = lambda x: "the stand-in"
    vars(sample)["len"] = lambda x: "the stand-in"
    vars(sample)["LIMIT"] = 100
    assert sample.uses_globals([1]) == (True, 4, 1)
    assert sample.Thing().prop == 3 and sample.wrapped(1) == 2 and sample.with_nested([1])[0] == [2]


def test_a_module_attribute_it_reads_is_pinned_only_where_allowed(sample):
    pinning.pin([sample], pinned_attributes=lambda module, name: module is gc)
    real_floor, real_collect = sample.math.floor, gc.collect
    vars(gc)["collect"] = lambda: "the stand-in"
    vars(sample.math)["floor"] = lambda x: "read live"
    try:
        assert sample.calls_module_functions()[0] == "read live"
    finally:
        vars(gc)["collect"], vars(sample.math)["floor"] = real_collect, real_floor


def test_a_name_defined_after_pinning_is_still_found(sample):
    pinning.pin([sample])
    with pytest.raises(NameError):
        sample.late()
    vars(sample)["DEFINED_LATER"] = 42
    assert sample.late() == 42


def test_a_hook_libraries_rebind_is_read_live():
    module = types.ModuleType("reads_a_hook")
    exec("import sys\ndef hook():\n    return sys.excepthook\n", vars(module))
    pinning.pin([module])
    real = sys.excepthook
    sys.excepthook = replaced = lambda *args: None
    try:
        assert module.hook() is replaced
    finally:
        sys.excepthook = real


def test_a_modules_data_is_read_live():
    module = types.ModuleType("reads_data")
    exec("import sys\ndef stream():\n    return sys.stdout\n", vars(module))
    pinning.pin([module])
    real = sys.stdout
    sys.stdout = replaced = types.SimpleNamespace()
    try:
        assert module.stream() is replaced
    finally:
        sys.stdout = real


def test_tracebacks_still_name_the_line(sample):
    pinning.pin([sample])
    with pytest.raises(ValueError) as caught:
        sample.raises()
    frame = traceback.extract_tb(caught.value.__traceback__)[-1]
    assert frame.name == "raises" and frame.lineno == SOURCE.splitlines().index("    raise ValueError(value)") + 1


def test_functions_keep_their_identity_and_pinning_twice_changes_nothing(sample):
    method = sample.Thing.__dict__["method"]
    assert pinning.pin([sample]) > 0
    assert sample.Thing.__dict__["method"] is method
    assert pinning.pin([sample]) == 0


def test_nothing_is_pinned_where_the_bytecode_is_not_known(sample, monkeypatch):
    monkeypatch.setattr(pinning, "SUPPORTED", False)
    assert pinning.pin([sample]) == 0
    vars(sample)["helper"] = lambda x: "read live"
    assert sample.uses_globals([1])[1] == "read live"
