"""Tests for gclab.refs: readable paths to what keeps an object alive, and forgetting the last error."""
from __future__ import annotations

import gc
import sys
import traceback
import types
import weakref

import pytest

from gclab.refs import direct_referrers, forget_last_error, reference_paths


class Thing:
    """A small object that weak references can point at."""


@pytest.fixture
def module():
    """A throwaway module in sys.modules, so that its globals are a root of the search."""
    mod = types.ModuleType("refs_demo")
    sys.modules["refs_demo"] = mod
    yield mod
    del sys.modules["refs_demo"]


def _fail_holding(thing):
    local_thing = thing
    raise ValueError("failed")


def test_a_module_global_and_a_list_item_are_both_named(module):
    obj = Thing()
    module.kept = obj
    module.box = [1, obj]
    paths = reference_paths(obj)
    assert "refs_demo.kept" in paths
    assert "refs_demo.box[1]" in paths


def test_dict_keys_attributes_closures_and_defaults_read_as_python(module):
    obj = Thing()
    holder = Thing()
    holder.payload = obj
    module.holder = holder
    module.table = {"weights": obj}

    def make():
        def inner():
            return obj
        return inner

    def with_default(x=obj):
        return x

    module.inner = make()
    module.with_default = with_default
    paths = set(reference_paths(obj))
    assert {"refs_demo.holder.payload", "refs_demo.table['weights']",
            "refs_demo.inner.__closure__[0].cell_contents", "refs_demo.with_default.__defaults__[0]"} <= paths


def _save_a_failure(module):
    """Store in `module.saved` an exception whose traceback's frame holds a Thing; return that Thing."""
    try:
        _fail_holding(Thing())
    except ValueError as e:
        module.saved = e
    frame = module.saved.__traceback__.tb_next.tb_frame
    return next(o for o in gc.get_referents(frame) if isinstance(o, Thing))


def test_a_stored_exception_leads_through_its_traceback_to_the_frame(module):
    paths = reference_paths(_save_a_failure(module))
    assert any(p.startswith("refs_demo.saved.__traceback__.tb_next.tb_frame") and "_fail_holding()" in p
               for p in paths), paths


def test_the_search_itself_leaves_no_reference_behind(module):
    # Reading frame.f_locals on Python <= 3.12 stores a copy of the locals that
    # traceback.clear_frames leaves alone: the search must not do that.
    probe = weakref.ref(_save_a_failure(module))
    assert reference_paths(probe())
    gc.disable()            # the conftest fixture restores the collector's state
    traceback.clear_frames(module.saved.__traceback__)
    assert probe() is None, "the object should be freed by clearing the frames, with no collection"


def test_a_frame_local_is_named_the_same_way_whether_or_not_its_locals_were_read(module):
    # Up to 3.12 a frame keeps a snapshot of its locals once something reads f_locals (IPython's
    # traceback printer does): the path names the local variable with or without one.
    # (The frame is reached through the traceback or through a local of the catching frame,
    # whichever the search meets first: either way the local is named the same.)
    thing = _save_a_failure(module)
    frame = module.saved.__traceback__.tb_next.tb_frame

    def names_the_local(paths):
        return any(p.startswith("refs_demo.saved.__traceback__") and ".f_locals['local_thing']" in p
                   and "_fail_holding()" in p for p in paths)
    assert names_the_local(reference_paths(thing))
    assert frame.f_locals["local_thing"] is thing           # a reader keeps a snapshot (up to 3.12)
    assert names_the_local(reference_paths(thing))
    assert frame.f_locals["local_thing"] is thing, "a snapshot that was there must be left as it was"


def test_naming_a_local_leaves_no_snapshot_holding_it(module):
    probe = weakref.ref(_save_a_failure(module))
    frame = module.saved.__traceback__.tb_next.tb_frame
    assert any(".f_locals['local_thing']" in p for p in reference_paths(probe()))
    assert not [d for d in gc.get_referents(frame) if isinstance(d, dict) and "local_thing" in d]
    del frame


def test_an_object_only_the_caller_holds_has_no_path():
    obj = Thing()
    assert reference_paths(obj) == []


def test_direct_referrers_names_the_container(module):
    obj = Thing()
    module.box = [obj]
    assert "list[0]" in direct_referrers(obj)


def test_forget_last_error_deletes_the_last_error_and_frees_its_frames():
    try:
        _fail_holding(Thing())
    except ValueError as e:
        error = e
    probe = weakref.ref(next(o for o in gc.get_referents(error.__traceback__.tb_next.tb_frame)
                             if isinstance(o, Thing)))
    sys.last_type, sys.last_value, sys.last_traceback = type(error), error, error.__traceback__
    del error
    gc.disable()
    cleared = forget_last_error()
    assert {"sys.last_value", "sys.last_traceback", "sys.last_type"} <= set(cleared)
    assert not hasattr(sys, "last_value") and not hasattr(sys, "last_traceback")
    assert probe() is None, "the failed call's locals should be freed with no collection"
    assert forget_last_error() == []


def test_lifetimes_say_how_many_objects_still_live_without_keeping_them():
    from gclab.refs import Lifetimes

    class Weak:
        pass

    class NoWeak:
        __slots__ = ("other",)

    weak, no_weak = [Weak() for _ in range(3)], [NoWeak() for _ in range(2)]
    no_weak[0].other = no_weak[0]                  # a cycle of one: alive until a collection
    lives = Lifetimes(weak + no_weak)
    assert lives.count == 5 and lives.alive() == 5
    del weak[:2]
    assert lives.alive() == 3
    first = no_weak[0]
    del no_weak[:], first
    assert lives.alive() == 2                      # one Weak, and the NoWeak in its cycle
    gc.collect()
    assert lives.alive() == 1


# -- stand-ins and what calls leave alive -------------------------------------------------
def test_a_stub_has_its_name_takes_weak_references_and_a_freed_ones_address_goes_to_the_next():
    from gclab.refs import Stub
    stub = Stub("m0")
    assert stub.name == "m0" and weakref.ref(stub)() is stub and repr(stub) == "Stub('m0')"
    reused = 0
    for _ in range(20):
        first = id(Stub("a"))           # freed at once
        reused += id(Stub("b")) == first
    assert reused >= 15, f"a freed Stub's address went to the next one {reused} times in 20"


def test_objects_added_counts_what_the_calls_left_alive():
    from gclab.refs import objects_added
    kept = []
    assert objects_added(lambda i: kept.append([i]), times=50) >= 50
    assert objects_added(lambda i: [i], times=50) < 10          # each list dropped at once


# -- weakref_or_none, reuse_address, assert_is ----------------------------------------------
def test_weakref_or_none_refers_weakly_or_returns_none():
    from gclab.refs import weakref_or_none
    thing = Thing()
    ref = weakref_or_none(thing)
    assert ref() is thing
    del thing
    assert ref() is None
    assert weakref_or_none(3)() is None                      # an int takes no weak reference


def test_reuse_address_makes_objects_until_one_takes_the_address():
    from gclab.refs import reuse_address
    thing = Thing()
    address = id(thing)
    del thing
    made = reuse_address(address, Thing)
    assert id(made[-1]) == address and len(made) <= 2000
    assert len(reuse_address(-1, Thing, limit=5)) == 5


def test_assert_is_says_what_a_proxy_hides():
    from gclab.refs import assert_is
    thing, other = Thing(), Thing()
    assert_is(thing, thing, "it")
    with pytest.raises(AssertionError, match="^its parent is a weakref.proxy of the node, not the node: a proxy is"):
        assert_is(weakref.proxy(thing), thing, "its parent", name="the node")
    with pytest.raises(AssertionError, match="^its parent is a weakref.proxy, not the expected object: a proxy is"):
        assert_is(weakref.proxy(other), thing, "its parent")
    with pytest.raises(AssertionError, match="^its parent is not the expected object: keep its own$"):
        assert_is(other, thing, "its parent", "keep its own")
