"""Tests for gclab.memory: the exact CPU meter, its simulated budget, and the CUDA wiring."""
from __future__ import annotations

import gc
import inspect

import pytest
import torch

from gclab.memory import Meter, MeterPoint, default_device, describe_device, format_bytes

KiB = 1024
MiB = 1024**2
GiB = 1024**3


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Node:
    """One half of a reference cycle, holding a tensor."""

    def __init__(self, tensor):
        self.tensor = tensor
        self.other = None


def make_cycle(make_tensor=lambda: torch.zeros(1024)):
    a, b = Node(make_tensor()), Node(make_tensor())
    a.other, b.other = b, a


@pytest.fixture
def gc_off():
    gc.disable()
    yield
    gc.collect()        # whatever a test leaked in cycles goes now, not in a later test


# -- factories and copies ------------------------------------------------------------
FACTORIES = {
    "zeros": lambda: torch.zeros(3, 5),
    "empty": lambda: torch.empty(7, dtype=torch.float64),
    "randn": lambda: torch.randn(4, 4),
    "full": lambda: torch.full((2, 3), 7, dtype=torch.int16),
    "tensor_literal": lambda: torch.tensor([1.0, 2.0, 3.0]),
    "tensor_literal_int": lambda: torch.tensor([[1, 2], [3, 4], [5, 6]]),
    "arange": lambda: torch.arange(10),
    "ones_uint8": lambda: torch.ones(13, dtype=torch.uint8),
}


@pytest.mark.parametrize("factory", FACTORIES.values(), ids=FACTORIES.keys())
def test_factory_result_is_counted_to_the_byte(factory):
    with Meter("cpu") as m:
        assert m.allocated() == 0
        t = factory()
        assert m.allocated() == nbytes(t)
        assert m.peak() == nbytes(t)


def test_clone_is_counted_as_a_new_storage():
    with Meter("cpu") as m:
        a = torch.zeros(100)
        b = a.clone()
        assert m.allocated() == nbytes(a) + nbytes(b) == 800


def test_dtype_conversion_is_counted_at_the_new_element_size():
    with Meter("cpu") as m:
        a = torch.zeros(100)
        b = a.to(torch.float64)
        assert nbytes(b) == 800
        assert m.allocated() == 400 + 800
        c = a.to(torch.float32)        # same dtype: returns `a` itself, nothing new
        assert c is a
        assert m.allocated() == 1200


def test_op_with_several_new_results_counts_each():
    with Meter("cpu") as m:
        a = torch.randn(10)
        before = m.allocated()
        values, indices = torch.sort(a)
        assert m.allocated() - before == nbytes(values) + nbytes(indices) == 40 + 80


def test_cat_and_stack_are_counted_as_new_storages():
    with Meter("cpu") as m:
        a, b = torch.zeros(10), torch.ones(10)
        base = m.allocated()
        c = torch.cat([a, b])
        assert m.allocated() - base == nbytes(c) == 80
        s = torch.stack([a, b])
        assert m.allocated() - base == nbytes(c) + nbytes(s) == 160



def _storage_bytes(*tensors):
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_tensor_is_counted_by_the_dense_parts_that_hold_its_bytes():
    with Meter("cpu") as m:
        coo = torch.eye(3).to_sparse()            # 2x3 int64 indices, 3 float32 values
        assert m.allocated() == 2 * 3 * 8 + 3 * 4 == _storage_bytes(coo._indices(), coo._values())
        csr = torch.eye(3).to_sparse_csr()
        parts = (csr.crow_indices(), csr.col_indices(), csr.values())
        assert m.allocated() == 60 + _storage_bytes(*parts)
        del coo, csr, parts
        assert m.allocated() == 0


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no mkldnn in this build")
def test_tensor_without_storage_does_not_break_the_meter():
    with Meter("cpu") as m:
        t = torch.zeros(4).to_mkldnn()            # opaque: no storage the meter can see
        assert t.to_dense().sum().item() == 0
        assert m.allocated() == 0

# -- views, in-place, out= -----------------------------------------------------------
VIEWS = {
    "view": lambda a: a.view(6, 4),
    "reshape_contiguous": lambda a: a.reshape(2, 12),
    "slice": lambda a: a[1:3, ::2],
    "transpose": lambda a: a.t(),
    "transpose_dims": lambda a: a.transpose(0, 1),
    "detach": lambda a: a.detach(),
    "expand": lambda a: a[:1].expand(100, 6),
    "unsqueeze": lambda a: a.unsqueeze(0),
    "select": lambda a: a[2],
}


@pytest.mark.parametrize("make_view", VIEWS.values(), ids=VIEWS.keys())
def test_view_is_not_counted_twice(make_view):
    with Meter("cpu") as m:
        a = torch.zeros(4, 6)
        v = make_view(a)
        assert v.untyped_storage()._cdata == a.untyped_storage()._cdata
        assert m.allocated() == nbytes(a) == 96
        assert m.peak() == 96


def test_in_place_ops_are_not_counted_again():
    with Meter("cpu") as m:
        a = torch.randn(50)
        a.add_(1)
        a.mul_(2)
        a.relu_()
        a.clamp_(max=3)
        a.zero_()
        assert m.allocated() == m.peak() == 200
        a[:10] = 1.0                          # the 1.0 becomes a 4-byte scalar tensor, briefly
        assert m.allocated() == 200


def test_out_variant_writes_into_the_existing_storage_without_counting_again():
    with Meter("cpu") as m:
        a, b, c = torch.ones(25), torch.ones(25), torch.empty(25)
        assert m.allocated() == 300
        r = torch.add(a, b, out=c)
        assert r is c
        torch.mul(a, b, out=c)
        assert m.allocated() == m.peak() == 300



def test_out_variant_that_grows_its_output_is_counted():
    with Meter("cpu") as m:
        a, b = torch.ones(25), torch.ones(25)
        c = torch.empty(0)
        torch.add(a, b, out=c)                    # c's storage grows from 0 to 100 bytes
        assert m.allocated() == 300
        del c
        assert m.allocated() == 200


def test_resize_in_place_is_counted_and_checked_against_the_budget():
    with Meter("cpu", budget=1000) as m:
        x = torch.zeros(10)
        x.resize_(100)
        assert m.allocated() == m.peak() == 400
        with pytest.raises(torch.OutOfMemoryError, match="simulated|Simulated"):
            x.resize_(1000)
        assert m.allocated() == 4000              # the bytes were taken: the count stays exact
        del x
        assert m.allocated() == 0

def test_view_keeps_its_base_counted_until_the_view_goes_too():
    with Meter("cpu") as m:
        a = torch.zeros(1000)
        v = a[10:20]
        del a
        assert m.allocated() == 4000          # the whole storage, not the 40 bytes the view shows
        del v
        assert m.allocated() == 0


def test_non_contiguous_reshape_copies_and_is_counted():
    with Meter("cpu") as m:
        a = torch.zeros(4, 6)
        r = a.t().reshape(24)                 # a transpose cannot be viewed flat: reshape copies
        assert r.untyped_storage()._cdata != a.untyped_storage()._cdata
        assert m.allocated() == 96 + 96


# -- freeing ---------------------------------------------------------------------------
def test_freed_storage_is_removed_at_once():
    with Meter("cpu") as m:
        a = torch.zeros(1000)
        b = torch.zeros(10)
        del a
        assert m.allocated() == 40
        del b
        assert m.allocated() == 0
        assert m.peak() == 4040


def test_count_stays_exact_when_storages_are_freed_and_reallocated_many_times():
    with Meter("cpu") as m:
        keep = torch.zeros(3)
        for i in range(200):
            t = torch.zeros(100 + i % 7)
            u = t * 2
            assert m.allocated() == 12 + 2 * nbytes(t)
            del t, u
            assert m.allocated() == 12


def test_tensors_created_before_the_meter_are_not_counted():
    a = torch.zeros(100)
    c = torch.empty(100)
    with Meter("cpu") as m:
        assert m.allocated() == 0
        a.view(10, 10)
        a[5:50]
        a.reshape(4, 25)
        a.detach()
        a.unsqueeze(1).expand(100, 3)
        a.add_(1)
        a.mul_(3)
        a.relu_()
        torch.add(a, a, out=c)
        del a
        assert m.allocated() == 0
        assert m.peak() == 0
        b = c * 2                             # a new result of an old tensor is new, though
        assert m.allocated() == nbytes(b)


# -- peak, timeline, growth ------------------------------------------------------------
def test_peak_is_the_true_maximum():
    with Meter("cpu") as m:
        a, b, c = torch.zeros(1000), torch.zeros(1000), torch.zeros(1000)
        del a, b
        d = torch.zeros(1000)
        assert m.allocated() == 8000
        assert m.peak() == 12000


def test_peak_counts_a_temporary_freed_inside_an_expression():
    with Meter("cpu") as m:
        x = torch.zeros(1000)
        y = (x + 1).sum()                     # x + 1 lives only until .sum() has run
        assert m.allocated() == 4000 + 4
        assert m.peak() == 4000 + 4000 + 4


def test_readings_after_exit_are_the_final_ones():
    with Meter("cpu") as m:
        keep = torch.zeros(100)
        tmp = torch.zeros(200)
        del tmp
    assert m.allocated() == 400
    assert m.peak() == 1200
    del keep
    assert m.allocated() == 400               # stopped: it no longer follows the tensors


def test_a_meter_never_started_reads_zero():
    m = Meter("cpu")
    assert m.allocated() == 0 and m.peak() == 0 and m.growth() == 0
    assert m.started is None


def test_a_running_meter_cannot_be_entered_again():
    with Meter("cpu") as m:
        with pytest.raises(RuntimeError):
            m.__enter__()


def test_record_appends_labelled_points_with_increasing_seconds():
    with Meter("cpu") as m:
        m.record("start")
        a = torch.zeros(10)
        m.record("after a")
        b = torch.zeros(20)
        m.record("after b")
        del a
        m.record()
    assert len(m.timeline) == 4
    assert all(isinstance(p, MeterPoint) for p in m.timeline)
    assert [p.label for p in m.timeline] == ["start", "after a", "after b", ""]
    assert [p.allocated for p in m.timeline] == [0, 40, 120, 80]
    seconds = [p.seconds for p in m.timeline]
    assert seconds[0] >= 0
    assert all(s < t for s, t in zip(seconds, seconds[1:]))


def test_growth_is_allocated_minus_baseline():
    with Meter("cpu") as m:
        assert m.baseline == 0
        assert m.growth() == m.allocated() - m.baseline == 0
        a = torch.zeros(64)
        assert m.growth() == m.allocated() - m.baseline == 256
        del a
        assert m.growth() == 0


def test_nested_meters_each_count_what_was_created_inside_them():
    with Meter("cpu") as outer:
        a = torch.zeros(10)
        with Meter("cpu") as inner:
            b = torch.zeros(20)
            assert inner.allocated() == 80
        assert outer.allocated() == 120


# -- autograd ---------------------------------------------------------------------------
def _tiny_model():
    g = torch.Generator().manual_seed(0)          # not torch.manual_seed: that seeds CUDA too
    x = torch.randn(8, 16, generator=g)                        # input, no grad
    w = torch.randn(16, 4, generator=g, requires_grad=True)    # the one parameter
    return x, w


def _loss(x, w):
    return (x @ w).relu().sum()


def test_kept_losses_keep_their_graphs_saved_tensors_counted():
    with Meter("cpu") as m:
        x, w = _tiny_model()
        before = m.allocated()
        # What one step keeps while its loss is alive: mm saves x and w (both already
        # counted), relu saves its own 8x4 float32 result, sum saves only a shape; plus
        # the scalar loss itself.  The mm result is dropped once relu has used it.
        relu_result = 8 * 4 * 4
        loss_bytes = 4
        per_step = relu_result + loss_bytes
        losses = []
        for step in range(1, 6):
            loss = _loss(x, w)
            losses.append(loss)
            assert m.allocated() - before == step * per_step
        # at the peak, the last step's mm result and relu result were both alive, its loss not yet
        assert m.peak() - before == 4 * per_step + 2 * relu_result
        del losses, loss
        assert m.allocated() == before


def test_kept_float_losses_keep_nothing_counted():
    with Meter("cpu") as m:
        x, w = _tiny_model()
        before = m.allocated()
        losses = [_loss(x, w).item() for _ in range(5)]
        assert m.allocated() == before
        assert len(losses) == 5


def test_loss_without_a_graph_keeps_only_itself():
    with Meter("cpu") as m:
        x, w = _tiny_model()
        before = m.allocated()
        with torch.no_grad():
            losses = [_loss(x, w) for _ in range(5)]
        assert m.allocated() - before == 5 * 4


def test_backward_makes_grad_counted_and_clearing_it_removes_it():
    with Meter("cpu") as m:
        x, w = _tiny_model()
        before = m.allocated()
        loss = _loss(x, w)
        loss.backward()
        assert w.grad is not None
        # the graph (relu's saved result) is gone; the loss and w.grad remain
        assert m.allocated() - before == nbytes(loss) + nbytes(w.grad) == 4 + 16 * 4 * 4
        w.grad = None
        assert m.allocated() - before == 4
        del loss
        assert m.allocated() == before


def test_grad_accumulates_in_place_on_a_second_backward():
    with Meter("cpu") as m:
        x, w = _tiny_model()
        _loss(x, w).backward()
        after_first = m.allocated()
        _loss(x, w).backward()
        assert m.allocated() == after_first == nbytes(x) + nbytes(w) + nbytes(w.grad)


# -- reference cycles ---------------------------------------------------------------------
def test_reference_cycle_keeps_its_bytes_until_the_collector_runs(gc_off):
    with Meter("cpu") as m:
        make_cycle()
        make_cycle()
        assert m.allocated() == 4 * 4096          # unreachable, but only the collector can tell
        gc.collect()
        assert m.allocated() == 0
        assert m.peak() == 4 * 4096


def test_broken_cycle_is_freed_by_reference_counting_alone(gc_off):
    with Meter("cpu") as m:
        a, b = Node(torch.zeros(1024)), Node(torch.zeros(1024))
        a.other, b.other = b, a
        b.other = None
        del a, b
        assert m.allocated() == 0


# -- budget ---------------------------------------------------------------------------------
def test_allocation_past_the_budget_raises_a_simulated_out_of_memory_error():
    with Meter("cpu", budget=10_000) as m:
        a = torch.zeros(2000)                     # 8000 bytes
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.zeros(1000)                     # 4000 more: 12000 > 10000
        message = str(info.value).lower()
        assert "simulated" in message and "budget" in message
        assert m.allocated() == 8000              # the rejected allocation is not counted
        assert m.peak() == 8000


def test_allocations_up_to_exactly_the_budget_succeed():
    with Meter("cpu", budget=10_000) as m:
        a = torch.zeros(2000)
        b = torch.zeros(500)                      # 8000 + 2000 == 10000: allowed
        assert m.allocated() == m.peak() == 10_000
        with pytest.raises(torch.OutOfMemoryError):
            torch.zeros(1, dtype=torch.uint8)     # one byte more is not
        assert m.allocated() == m.peak() == 10_000


def test_budget_counts_only_live_tensors():
    with Meter("cpu", budget=10_000) as m:
        for _ in range(100):                      # 100 x 8000 bytes, one at a time
            t = torch.zeros(2000)
            del t
        assert m.peak() == 8000


def test_out_of_memory_error_leaving_the_block_is_recorded():
    with pytest.raises(torch.OutOfMemoryError):
        with Meter("cpu", budget=1000) as m:
            keep = torch.zeros(200)
            torch.zeros(200)
    assert m.oom is not None
    assert m.oom.label == "OOM"
    assert m.oom.allocated == 800
    assert m.allocated() == 800


@pytest.mark.parametrize("budget", [0, -1, -4096])
def test_budget_must_be_positive(budget):
    with pytest.raises(ValueError):
        Meter("cpu", budget=budget)
    with pytest.raises(ValueError):
        Meter(budget=budget)


def test_only_cpu_and_cuda_devices_are_metered():
    with pytest.raises(ValueError):
        Meter("meta")


def test_leaking_loop_hits_a_small_budget_long_before_real_memory_matters(gc_off):
    budget = 256 * KiB                            # 32 iterations of two 4 KiB tensors
    iterations = 0
    with pytest.raises(torch.OutOfMemoryError):
        with Meter("cpu", budget=budget) as m:
            for i in range(10_000):
                make_cycle()
                iterations += 1
    assert iterations == budget // (2 * 4096)
    assert m.allocated() == m.peak() == budget
    assert m.oom is not None and m.oom.allocated == budget


# -- no CUDA on a CPU build -----------------------------------------------------------------
def _forbid_cuda(monkeypatch):
    touched = []

    def forbidden(name):
        def call(*args, **kwargs):
            touched.append(name)
            raise AssertionError(f"{name} was called on a CPU build")
        return call

    for module, prefix in ((torch.cuda, "torch.cuda"), (torch.cuda.memory, "torch.cuda.memory")):
        for name in dir(module):
            if name.startswith("_") or name == "is_available":
                continue
            obj = getattr(module, name)
            if inspect.ismodule(obj) or not callable(obj):
                continue
            if inspect.isclass(obj) and issubclass(obj, BaseException):
                continue                          # only raised by CUDA code, never called by it
            monkeypatch.setattr(module, name, forbidden(f"{prefix}.{name}"))
    return touched


def _cpu_workload(m: Meter):
    x, w = _tiny_model()
    losses = []
    for _ in range(3):
        loss = _loss(x, w)
        losses.append(loss)
        m.record("step")
    loss.backward()
    views = [x.t(), x[1:], x.view(-1), x.detach()]
    x.add_(1)
    make_cycle()
    gc.collect()
    total = torch.cat([x, x]).sum() + torch.stack([x, x]).mean()
    repr(m), m.describe(), m.reserved(), m.growth()
    return m.allocated(), m.peak()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU build's behaviour")
def test_cpu_meter_never_touches_torch_cuda(monkeypatch):
    touched = _forbid_cuda(monkeypatch)
    with pytest.raises(AssertionError):
        torch.cuda.memory_allocated()             # the trap is set...
    with pytest.raises(AssertionError):
        torch.cuda.memory.memory_allocated()
    touched.clear()

    assert default_device() == torch.device("cpu")
    with Meter("cpu") as m:
        allocated, peak = _cpu_workload(m)
    assert allocated > 0 and peak >= allocated
    with Meter() as m:                            # default device
        assert m.device == torch.device("cpu")
        assert m.simulated
        _cpu_workload(m)
    with pytest.raises(torch.OutOfMemoryError):
        with Meter(budget=4096) as m:
            keep = torch.zeros(1024)
            torch.zeros(1)
    assert m.oom is not None
    describe_device("cpu")
    assert touched == []


# -- the CUDA path, with a fake torch.cuda ------------------------------------------------------
class FakeCuda:
    def __init__(self, allocated=1000, peak=1200, reserved=2048, total=10_000, fraction=0.75):
        self.values = {"allocated": allocated, "peak": peak, "reserved": reserved}
        self.total = total
        self.fraction = fraction
        self.calls = []

    def install(self, monkeypatch):
        def rec(name, result=None):
            def fn(*args, **kwargs):
                self.calls.append((name, args))
                return result() if callable(result) else result
            return fn

        def set_fraction(fraction, device=None):
            self.calls.append(("set_per_process_memory_fraction", (fraction, device)))
            self.fraction = fraction

        class Props:
            total_memory = self.total

        def stats():
            return {"allocated_bytes": {"all": {"current": self.values["allocated"], "peak": self.values["peak"]}},
                    "reserved_bytes": {"all": {"current": self.values["reserved"]}}}

        fakes = {
            # the meter must read the nested statistics: the flat readers leave a cycle per call
            "memory_stats_as_nested_dict": rec("memory_stats_as_nested_dict", stats),
            "memory_allocated": rec("memory_allocated", lambda: self.values["allocated"]),
            "max_memory_allocated": rec("max_memory_allocated", lambda: self.values["peak"]),
            "memory_reserved": rec("memory_reserved", lambda: self.values["reserved"]),
            "reset_peak_memory_stats": rec("reset_peak_memory_stats"),
            "synchronize": rec("synchronize"),
            "empty_cache": rec("empty_cache"),
            "get_device_properties": rec("get_device_properties", lambda: Props()),
            "get_per_process_memory_fraction": rec("get_per_process_memory_fraction", lambda: self.fraction),
            "set_per_process_memory_fraction": set_fraction,
            "get_device_name": rec("get_device_name", "Fake GPU"),
            "is_available": rec("is_available", True),
            "current_device": rec("current_device", 0),
        }
        for name, fake in fakes.items():
            monkeypatch.setattr(torch.cuda, name, fake, raising=False)
        return self

    def names(self):
        return [name for name, _ in self.calls]


def test_cuda_meter_reads_the_allocator_and_sets_the_budget_as_a_memory_fraction(monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    m = Meter("cuda", budget=3000)
    assert m.is_cuda and not m.simulated
    with m:
        names = fake.names()
        assert (names.index("synchronize") < names.index("reset_peak_memory_stats")
                < names.index("memory_stats_as_nested_dict"))
        assert m.baseline == 1000
        assert fake.fraction == pytest.approx((2048 + 3000) / 10_000)
        assert ("set_per_process_memory_fraction", (pytest.approx(0.5048), m.device)) in fake.calls
        assert "empty_cache" in names
        fake.values.update(allocated=1500, peak=1800, reserved=4096)
        assert m.allocated() == 1500
        assert m.peak() == 1800
        assert m.growth() == 500
        assert m.reserved() == 4096
        m.record("x")
        assert m.timeline[-1].allocated == 1500
        assert "Fake GPU" in m.describe()
        fake.values.update(allocated=1600, peak=1900)
    assert fake.fraction == 0.75                  # restored on exit
    assert fake.calls[-1] == ("set_per_process_memory_fraction", (0.75, m.device))
    assert m.allocated() == 1600 and m.peak() == 1900   # read once, on exit
    fake.values.update(allocated=0, peak=0)
    assert m.allocated() == 1600 and m.growth() == 600
    assert not {"memory_allocated", "max_memory_allocated", "memory_reserved"} & set(fake.names())


def test_reading_the_cuda_allocator_leaves_no_cycle_for_the_collector():
    # torch.cuda.memory_allocated() flattens the statistics through a nested function that refers to
    # itself: a cycle per call (about 250 objects on a GPU, 7 here), so a meter read each step would
    # set off collections of its own; gclab reads the nested statistics, which make none
    from gclab.gcwatch import gc_disabled
    from gclab.memory import cuda_bytes
    with gc_disabled():
        gc.collect()
        for _ in range(10):
            torch.cuda.memory_allocated()
        assert gc.collect() >= 10
        for _ in range(10):
            cuda_bytes(), cuda_bytes(what="reserved_bytes", which="peak")
        assert gc.collect() == 0


def test_cuda_budget_larger_than_the_device_caps_the_fraction_at_one(monkeypatch):
    fake = FakeCuda(total=10_000).install(monkeypatch)
    with Meter("cuda", budget=10**12):
        assert fake.fraction == 1.0
    assert fake.fraction == 0.75


def test_cuda_meter_without_budget_leaves_the_fraction_alone(monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    with Meter("cuda") as m:
        assert m.baseline == 1000
    assert "set_per_process_memory_fraction" not in fake.names()
    assert "get_per_process_memory_fraction" not in fake.names()
    assert fake.fraction == 0.75


def test_cuda_budget_works_on_a_torch_without_get_per_process_memory_fraction(monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction")   # added in torch 2.6
    with Meter("cuda", budget=3000):
        assert fake.fraction == pytest.approx((2048 + 3000) / 10_000)
    assert fake.fraction == 1.0                    # the allocator's default, restored


def test_cuda_fraction_is_restored_when_the_block_raises(monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    with pytest.raises(torch.OutOfMemoryError):
        with Meter("cuda", budget=3000) as m:
            raise torch.OutOfMemoryError("CUDA out of memory")
    assert fake.fraction == 0.75
    assert m.oom is not None and m.oom.allocated == 1000


def test_default_device_is_the_current_cuda_device_when_there_is_one(monkeypatch):
    FakeCuda().install(monkeypatch)
    assert default_device() == torch.device("cuda", 0)
    assert Meter().is_cuda


# -- the collector sees the same program, metered or not -------------------------------------
def _collection_starts(n: int, metered: bool) -> list[tuple[int, int]]:
    """(iteration, generation) of each collection that starts while `n` cycle steps run."""
    starts = []
    i = -1

    def on_gc(phase, info):
        if phase == "start":
            starts.append((i, info["generation"]))

    def loop():
        nonlocal i
        gc.callbacks.append(on_gc)
        try:
            for i in range(n):
                make_cycle()
        finally:
            gc.callbacks.remove(on_gc)

    gc.collect()
    if metered:
        with Meter("cpu"):                        # outermost: its exit is not recorded
            loop()
    else:
        loop()
    return starts


def test_metering_does_not_change_when_the_collector_runs():
    gc.enable()
    n = 1000
    _collection_starts(50, metered=True)          # warm up the meter and the dispatcher
    plain = _collection_starts(n, metered=False)
    metered = _collection_starts(n, metered=True)

    assert abs(len(plain) - len(metered)) <= 1, (plain, metered)

    def spacing(starts):
        gen0 = [i for i, generation in starts if generation == 0]
        assert len(gen0) >= 3, starts
        gaps = [b - a for a, b in zip(gen0, gen0[1:])]
        return sum(gaps) / len(gaps)

    plain_gap, metered_gap = spacing(plain), spacing(metered)
    assert abs(metered_gap - plain_gap) <= 0.05 * plain_gap, (plain, metered)


# -- format_bytes and describe_device -------------------------------------------------------------
@pytest.mark.parametrize("n, text", [
    (0, "0 B"),
    (512, "512 B"),
    (1023, "1023 B"),
    (3 * KiB, "3.00 KiB"),
    (2 * MiB, "2.00 MiB"),
    (int(1.5 * GiB), "1.50 GiB"),
    (-2 * MiB, "-2.00 MiB"),
])
def test_format_bytes_gives_short_human_strings(n, text):
    assert format_bytes(n) == text


def test_the_cpu_meter_has_no_cache_reserved_is_allocated_at_every_moment():
    readings = []
    with Meter("cpu") as m:
        t = torch.ones(256 * 1024)
        readings.append((m.allocated(), m.reserved()))
        torch.cuda.empty_cache()                 # no CUDA here: nothing to hand back
        readings.append((m.allocated(), m.reserved()))
        del t
        readings.append((m.allocated(), m.reserved()))
        torch.cuda.empty_cache()
        readings.append((m.allocated(), m.reserved()))
    assert readings == [(MiB, MiB), (MiB, MiB), (0, 0), (0, 0)]


def test_describe_device_says_the_cpu_budget_is_simulated():
    text = describe_device("cpu")
    assert "simulated" in text and "CPU" in text
    assert Meter("cpu").describe() == text


def test_metering_does_not_import_torch_compile():
    """torch._dynamo takes over a second to import; every lesson's kernel meters, none compiles."""
    import subprocess
    import sys
    code = ("import sys, torch\nfrom gclab.memory import Meter\nwith Meter('cpu') as m:\n"
            "    (torch.ones(4) * 2).sum()\nprint(any(name.startswith('torch._dynamo') for name in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


def test_a_meter_paused_sees_nothing_made_inside_and_counts_what_was_freed_inside():
    with Meter("cpu") as meter:
        kept = torch.ones(1024)
        with meter.paused():
            assert torch._C._len_torch_dispatch_stack() == 0 and meter._tracker._on_gc not in gc.callbacks
            unseen = torch.ones(1024)
            del kept
        assert meter.allocated() == 0
        seen = torch.ones(16)
        assert meter.allocated() == 64
    del unseen, seen


def test_process_memory_sees_a_tensor_made_in_another_thread():
    import threading
    from gclab.memory import process_memory
    before = process_memory()
    if before is None:
        pytest.skip("the C library cannot report its heap (not glibc 2.33 or later)")
    kept, MiB = [], 1024 * 1024
    worker = threading.Thread(target=lambda: kept.append(torch.ones(MiB // 4)))
    worker.start()
    worker.join()
    holding = process_memory().heap
    assert holding - before.heap >= MiB - 64 * 1024              # whatever else the process freed meanwhile
    del kept[:]
    assert holding - process_memory().heap >= MiB - 64 * 1024    # given back the moment it is freed


def test_process_memory_sees_a_tensor_over_memory_mapped_by_hand():
    import mmap
    from gclab.memory import process_memory
    if process_memory() is None:
        pytest.skip("the C library cannot report its heap (not glibc 2.33 or later)")
    MiB = 1024 * 1024
    # once unmeasured: a first fill may start torch's thread pool, whose threads take heap (221 KiB on
    # the 16 cores of a GPU machine)
    torch.frombuffer(mmap.mmap(-1, MiB), dtype=torch.uint8).fill_(1)
    for flags in (mmap.MAP_SHARED, mmap.MAP_PRIVATE):
        before = process_memory()
        unseen = torch.frombuffer(mmap.mmap(-1, MiB, flags=flags), dtype=torch.uint8)
        unseen.fill_(1)                                           # a shared mapping counts once touched
        holding = process_memory()
        assert holding.total - before.total >= MiB - 64 * 1024 and holding.heap - before.heap < 64 * 1024
        del unseen
        assert holding.total - process_memory().total >= MiB - 64 * 1024   # unmapped when freed


def test_pythons_own_arenas_are_not_taken_for_mapped_memory():
    """pymalloc maps its small-object arenas a MiB at a time: objects, not mappings, so `mapped`
    leaves them out (they are in `blocks`)."""
    from gclab.memory import process_memory
    before = process_memory()
    if before is None:
        pytest.skip("the C library cannot report its heap (not glibc 2.33 or later)")
    many = [{"n": float(n)} for n in range(100_000)]             # tens of MiB of small objects
    after = process_memory()
    assert after.blocks - before.blocks >= 200_000
    assert abs(after.mapped - before.mapped) < 256 * 1024, (before, after)
    del many


def test_a_thread_starting_is_not_taken_for_mapped_memory():
    """A new thread maps its stack (8 MiB): a thread pool's first use, not memory a step keeps."""
    import threading
    from gclab.memory import process_memory
    before = process_memory()
    if before is None:
        pytest.skip("the C library cannot report its heap (not glibc 2.33 or later)")
    release = threading.Event()
    waiting = threading.Thread(target=release.wait)
    waiting.start()
    try:
        assert process_memory().total - before.total < 512 * 1024
    finally:
        release.set()
        waiting.join()


def test_a_threads_heap_that_shrank_is_not_taken_for_mapped_memory():
    """A thread's own malloc arena gives memory back without unmapping it: still the C heap's."""
    import threading
    from gclab.memory import process_memory
    before = process_memory()
    if before is None:
        pytest.skip("the C library cannot report its heap (not glibc 2.33 or later)")

    def allocate_then_free():
        kept = [torch.ones(16 * 1024) for _ in range(300)]    # 64 KiB each, 19 MiB in the thread's arena
        del kept

    worker = threading.Thread(target=allocate_then_free)
    worker.start()
    worker.join()
    assert process_memory().total - before.total < 512 * 1024


def test_process_memory_without_mappings_reads_the_heap_alone():
    from gclab.memory import process_memory
    full = process_memory()
    if full is None:
        pytest.skip("the C library cannot report its heap (not glibc 2.33 or later)")
    quick = process_memory(mappings=False)
    assert quick.mapped == 0 and quick.total == quick.heap and abs(quick.heap - full.heap) < 1024 * 1024


# -- the census of allocations --------------------------------------------------------
def test_census_counts_tensors_made_with_dispatch_off_which_the_meter_cannot_see():
    from gclab.memory import AllocationCensus
    kept = []
    with Meter("cpu") as meter, AllocationCensus() as census:
        census.mark()
        with torch._C._DisableTorchDispatch():
            kept.append(torch.zeros(1024))
        census.mark()
    assert meter.allocated() == 0 and census.held() == [0, 4 * KiB]


def test_census_ignores_memory_freed_that_was_allocated_before_it():
    from gclab.memory import AllocationCensus
    reserve = [torch.zeros(1024) for _ in range(4)]
    with AllocationCensus() as census:
        census.mark()
        kept = torch.zeros(1024)
        reserve.clear()
        census.mark()
    assert census.held() == [0, 4 * KiB]
    del kept


def test_census_counts_the_release_of_what_an_earlier_census_carried():
    from gclab.memory import AllocationCensus
    with AllocationCensus() as first:
        state = torch.zeros(1024)
    with AllocationCensus(first.alive) as second:
        second.mark()
        state = torch.zeros(1024)          # replaces the carried one: nothing more held
        second.mark()
    assert second.held() == [4 * KiB, 4 * KiB]
    del state


def test_census_says_when_the_code_it_watched_stopped_the_profiler():
    from gclab.memory import AllocationCensus
    with AllocationCensus() as census:
        census.mark()
        torch.autograd._disable_profiler()
        census.mark()
    assert census.held() is None and "stopped the profiler" in census.error


def test_census_keeps_the_profilers_notes_off_stderr(capfd):
    from gclab.memory import AllocationCensus
    before = torch.zeros(1024)
    with AllocationCensus() as census:
        del before                         # the profiler warns about memory it did not see allocated
        census.mark()
    assert census.held() == [0]
    assert capfd.readouterr().err == ""


# -- the CUDA side of the census: the caching allocator's history, as `_snapshot()` lists it --------
MARKS_STREAM = 0x7F00


def _mark():
    return [{"action": "alloc", "addr": 0xB000, "size": 512, "stream": MARKS_STREAM},
            {"action": "free_requested", "addr": 0xB000, "size": 512, "stream": MARKS_STREAM},
            {"action": "free_completed", "addr": 0xB000, "size": 512, "stream": MARKS_STREAM}]


def _history(*actions):
    """Snapshot trace entries: the census's start, then `actions` ("mark", or (action, addr, size))."""
    entries = _mark()
    for action in actions:
        if action == "mark":
            entries += _mark()
        else:
            kind, addr, size = action
            entries.append({"action": kind, "addr": addr, "size": size, "stream": 0})
    return entries


def test_cuda_history_counts_what_is_kept_between_marks_and_not_the_marks_own_blocks():
    from gclab.census import _history_events, _replay
    entries = _history("mark", ("alloc", 0x1000, 2 << 20), ("alloc", 0x2000, 512), ("free_requested", 0x2000, 512),
                       ("free_completed", 0x2000, 512), "mark", ("segment_alloc", 0x9000, 20 << 20), "mark")
    alive = {}
    assert _replay(_history_events(entries, "cuda:0"), alive) == [0, 2 << 20, 2 << 20]
    assert alive == {("cuda:0", 0x1000): 2 << 20}


def test_cuda_history_counts_the_release_of_what_an_earlier_census_carried_only():
    from gclab.census import _history_events, _replay
    entries = _history("mark", ("free_requested", 0x1000, 4096), ("free_requested", 0x5000, 4096), "mark")
    alive = {("cuda:0", 0x1000): 4096}
    assert _replay(_history_events(entries, "cuda:0"), alive) == [0, -4096]
    assert alive == {}


def test_cuda_history_may_begin_with_the_segment_mapped_for_the_census_start():
    """The first block on a stream the allocator has no memory for yet comes from a new segment: the
    history lists the segment first (seen on an H100, torch 2.11)."""
    from gclab.census import _history_events, _replay
    segment = {"action": "segment_alloc", "addr": 0xB000, "size": 2 << 20, "stream": MARKS_STREAM}
    entries = [segment] + _history("mark", ("alloc", 0x1000, 4096), "mark")
    assert _replay(_history_events(entries, "cuda:0", MARKS_STREAM), {}) == [0, 4096]


def test_cuda_history_that_does_not_begin_with_the_census_start_has_no_count():
    """Restarted by the code it watched (turning it off clears it), or wrapped round: no count."""
    from gclab.census import _history_events
    assert _history_events([], "cuda:0") is None
    assert _history_events(_history("mark")[1:], "cuda:0") is None
    restarted = [{"action": "alloc", "addr": 0x1000, "size": 4096, "stream": 0}] + _history("mark")
    assert _history_events(restarted, "cuda:0", MARKS_STREAM) is None


def test_census_on_a_cpu_only_machine_reads_no_cuda_history():
    from gclab.memory import AllocationCensus
    with AllocationCensus() as census:
        census.mark()
    assert (census._cuda is None) == (not torch.cuda.is_initialized())


class FakeAllocatorHistory:
    """A stand-in for the CUDA caching allocator's history, as torch 2.11 keeps it on an H100: turning
    it off clears it; the first block on a stream comes from a new segment, listed first."""

    def __init__(self):
        self.enabled, self.entries, self.segments = False, [], set()
        self.next_addr, self.next_stream, self.live = 0x10000, 0x7000, {}

    def install(self, monkeypatch):
        import gclab.census as census
        fake = self
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: fake.enabled, raising=False)
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", self.record, raising=False)
        monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda device=None: {"device_traces": [list(fake.entries)]})
        monkeypatch.setattr(torch.cuda, "Stream", self.stream)
        monkeypatch.setattr(torch.cuda, "caching_allocator_alloc",
                            lambda size, device=None, stream=None: fake.alloc(size, stream.cuda_stream))
        monkeypatch.setattr(torch.cuda, "caching_allocator_delete", self.free)
        monkeypatch.setattr(census, "_MARK_STREAMS", {})
        monkeypatch.setattr(census, "_HISTORY_WITH_ROOM", set())
        return self

    def record(self, enabled="all", **_):
        self.enabled = enabled is not None
        if not self.enabled:
            self.entries.clear()

    def stream(self, device=None):
        import types
        self.next_stream += 0x100
        return types.SimpleNamespace(cuda_stream=self.next_stream)

    def _trace(self, action, addr, size, stream):
        if self.enabled:
            self.entries.append({"action": action, "addr": addr, "size": size, "stream": stream})

    def alloc(self, size, stream=0):
        if stream not in self.segments:
            self.segments.add(stream)
            self._trace("segment_alloc", self.next_addr, 2 << 20, stream)
        self.next_addr += 0x1000
        self.live[self.next_addr] = (max(512, size), stream)
        self._trace("alloc", self.next_addr, max(512, size), stream)
        return self.next_addr

    def free(self, addr):
        size, stream = self.live.pop(addr)
        self._trace("free_requested", addr, size, stream)
        self._trace("free_completed", addr, size, stream)

    def empty_cache(self):
        self.segments.clear()


def test_census_counts_cuda_blocks_kept_between_marks_through_the_allocators_history(monkeypatch):
    from gclab.memory import AllocationCensus
    gpu = FakeAllocatorHistory().install(monkeypatch)
    for _ in range(3):                     # the first census gives the history room; later ones reuse its stream
        with AllocationCensus() as census:
            census.mark()
            kept = gpu.alloc(4096)
            gpu.free(gpu.alloc(8192))
            census.mark()
        assert census.error is None and census.held() == [0, 4096], census.error
        assert ("cuda:0", kept) in census.alive and not gpu.enabled
    gpu.empty_cache()                      # the marks' segment given back: the next start maps a new one first
    with AllocationCensus(census.alive) as again:
        again.mark()
        gpu.free(kept)                     # what the earlier census counted, released: it counts
        again.mark()
    assert again.held() == [4096, 0], again.error


def test_census_has_no_count_when_the_code_restarts_cudas_history(monkeypatch):
    from gclab.memory import AllocationCensus
    gpu = FakeAllocatorHistory().install(monkeypatch)
    with AllocationCensus() as census:
        census.mark()
        gpu.record(None), gpu.record("all")          # the history cleared, with what it had counted
        gpu.alloc(4096)
        census.mark()
    assert census.held() is None and "restarted" in census.error


def test_census_does_not_take_over_a_cuda_history_already_recording(monkeypatch):
    from gclab.memory import AllocationCensus
    gpu = FakeAllocatorHistory().install(monkeypatch)
    gpu.record("all")
    with AllocationCensus() as census:
        census.mark()
    assert census.held() is None and "already being recorded" in census.error and gpu.enabled


def test_flat_check_runs_with_the_cuda_history_beside_the_profiler(monkeypatch):
    """With CUDA's history on too (a stand-in here), a check of CPU steps judges as without it."""
    from gclab import checks
    FakeAllocatorHistory().install(monkeypatch)
    kept = []
    assert checks.run_flat_check(lambda i: torch.ones(256).sum().item(), iterations=6, device="cpu").ok
    leaking = checks.run_flat_check(lambda i: kept.append(torch.ones(256)), iterations=6, device="cpu")
    assert not leaking.ok and leaking.growth[-1] == 6 * 1024


def test_census_adds_the_cuda_history_to_what_the_profiler_counted(monkeypatch):
    from gclab.memory import AllocationCensus
    gpu = FakeAllocatorHistory().install(monkeypatch)
    with AllocationCensus() as census:
        census.mark()
        kept, block = torch.zeros(1024), gpu.alloc(1)          # 4 KiB on the CPU, a 512-byte block on the GPU
        census.mark()
    assert census.held() == [0, 4096 + 512] and ("cuda:0", block) in census.alive
    del kept


def test_census_has_no_count_when_the_cuda_history_was_stopped(monkeypatch):
    from gclab.memory import AllocationCensus
    gpu = FakeAllocatorHistory().install(monkeypatch)
    with AllocationCensus() as census:
        census.mark()
        gpu.record(None)                                       # the code turns CUDA's history off
        census.mark()
    assert census.held() is None and "stopped CUDA's memory history" in census.error


# -- held_while_and_after -------------------------------------------------------------
class _Keeper:
    def __init__(self, cycle=False):
        self.tensors = []
        if cycle:
            self.me = self


def test_held_while_alive_and_after_the_last_reference_is_dropped():
    from gclab.memory import held_while_and_after
    use = lambda keeper: keeper.tensors.append(torch.zeros(256))     # noqa: E731  (1 KiB)
    assert held_while_and_after(_Keeper, use, "cpu") == (1024, 0)
    assert held_while_and_after(lambda: _Keeper(cycle=True), use, "cpu", collector=False) == (1024, 1024)
    assert gc.isenabled()
    gc.collect()                                                      # the cycle left behind
    from gclab.gcwatch import gc_disabled
    with gc_disabled():
        held_while_and_after(_Keeper, use, "cpu", collector=False)
        assert not gc.isenabled(), "a collector that was off is left off"


# -- peak_growth, CachingDevice -----------------------------------------------------------------
def test_peak_growth_is_the_most_a_call_held_at_once():
    from gclab.memory import peak_growth

    def call():
        a = torch.ones(256)
        b = torch.ones(512)
        del a, b
        return torch.ones(128)
    assert peak_growth(call, "cpu") == 3 * KiB


def _readings(make):
    """[allocated growth, reserved minus its start] at the four moments around a tensor's `del`."""
    with Meter("cpu") as m:
        start, out = m.reserved(), []
        t = make()
        out.append([m.growth(), m.reserved() - start])
        torch.cuda.empty_cache()
        out.append([m.growth(), m.reserved() - start])
        del t
        out.append([m.growth(), m.reserved() - start])
        torch.cuda.empty_cache()
        out.append([m.growth(), m.reserved() - start])
    return out, m


def test_caching_device_simulated_on_cpu_caches_freed_blocks_until_empty_cache():
    from gclab.memory import CachingDevice
    given = (Meter.__enter__, Meter.allocated, Meter.peak, Meter.reserved, torch.cuda.empty_cache)

    def with_scratch():
        scratch = torch.ones(256 * KiB)                  # 1 MiB, freed: its block stays cached
        return scratch[:64 * KiB] * 2                    # 256 KiB kept
    with CachingDevice(cached=MiB, device="cpu") as device:
        assert device.simulated
        seen, meter = _readings(lambda: torch.ones(MiB // 4))
        assert meter.baseline == 3 * MiB and meter.allocated() == 3 * MiB     # the others' 3 MiB, counted
        assert seen == [[MiB, MiB], [MiB, 0], [0, 0], [0, -MiB]]
    with CachingDevice(device="cpu"):
        assert _readings(with_scratch)[0] == [[256 * KiB, 1280 * KiB], [256 * KiB, 256 * KiB], [0, 256 * KiB], [0, 0]]
    assert (Meter.__enter__, Meter.allocated, Meter.peak, Meter.reserved, torch.cuda.empty_cache) == given
    assert _readings(lambda: torch.ones(MiB // 4))[0] == [[MiB, MiB], [MiB, MiB], [0, 0], [0, 0]]   # no cache


def test_caching_device_seals_what_it_installs():
    from gclab.memory import CachingDevice
    sealed = []

    def seal(function, name):
        sealed.append(name)
        return function
    with CachingDevice(device="cpu", seal=seal):
        pass
    assert sorted(sealed) == ["__enter__", "allocated", "empty_cache", "peak", "reserved"]
