"""The model server and the open-loop load generator: behaviour, not speed (timings live in `make bench`)."""
import os
import subprocess
import sys
import time

import pytest

from gclab.gcwatch import Collection
from gclab.serving import LoadResult, ModelServer, Trace, run_load, schedule


def _policy(tmp_path, source, name="policy.py"):
    path = tmp_path / name
    path.write_text(source)
    return path


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:     # a zombie has exited
        return stat.read().split(") ")[1][0] != "Z"


def test_steady_schedule_is_evenly_spaced():
    assert schedule(100, 4) == pytest.approx([0.0, 0.01, 0.02, 0.03])


def test_poisson_schedule_is_repeatable_and_has_the_asked_rate():
    times = schedule(200, 4000, poisson=True, seed=3)
    assert times == schedule(200, 4000, poisson=True, seed=3)
    assert times != schedule(200, 4000, poisson=True, seed=4)
    assert 4000 / times[-1] == pytest.approx(200, rel=0.05)


def test_load_result_percentiles_and_failures():
    load = LoadResult(scheduled=[0.0, 1.0, 2.0, 3.0], sent=[0.0, 1.0, 2.0, 3.0],
                      done=[0.001, 1.002, 2.003, None], status=[200, 200, 200, 0])
    assert load.failed == 1
    assert load.latencies_ms.tolist() == pytest.approx([1.0, 2.0, 3.0])
    assert load.percentiles((50, 100)) == pytest.approx({50: 2.0, 100: 3.0})


def test_collections_inside_requests_are_found_by_overlap():
    trace = Trace(requests=[(0, 1.0, 2.0), (1, 5.0, 6.0)], collections=[
        Collection(0, 1.5, 0.1, 0, 0),       # inside the first request
        Collection(2, 2.5, 0.5, 0, 0),       # between requests
        Collection(2, 5.9, 0.5, 0, 0),       # starts inside the second
        Collection(1, 0.5, 0.6, 0, 0),       # runs into the first
    ])
    assert [c.start for c in trace.collections_inside_requests()] == [1.5, 5.9, 0.5]
    assert [c.start for c in trace.collections_inside_requests(generation=2)] == [5.9]
    assert Trace(requests=[], collections=trace.collections).collections_inside_requests() == []


@pytest.fixture(scope="module")
def served():
    with ModelServer(heap_objects=20_000, attribution="objects", cache_size=50) as server:
        load = run_load(server.url, rate=200, duration=1.0)
        trace = server.trace()
    return server, load, trace


def test_every_request_is_answered_and_recorded(served):
    server, load, trace = served
    assert len(load.status) == 200 and load.failed == 0
    assert len(trace.requests) == 200
    assert all(start <= end for _, start, end in trace.requests)
    assert sorted(i for i, _, _ in trace.requests) == list(range(200)), "each request is known by its id"
    assert all(d >= s for s, d in zip(load.sent, load.done))


def test_latency_is_measured_from_the_scheduled_send_time(served):
    _, load, _ = served
    assert all(sent >= scheduled - 1e-3 for scheduled, sent in zip(load.scheduled, load.sent))
    assert load.latencies_ms.min() > 0


def test_server_records_collections_and_garbage(served):
    _, _, trace = served
    assert trace.collections, "attribution builds enough objects for the collector to run"
    assert trace.info["gc_enabled"] and trace.info["python"] == sys.version.split()[0]
    assert trace.garbage["cached"] == 50


def test_server_process_is_stopped_after_the_block(served):
    server, _, _ = served
    assert server.proc.poll() is not None


def test_server_is_stopped_when_the_block_fails():
    with pytest.raises(KeyboardInterrupt):
        with ModelServer(heap_objects=1000) as server:
            raise KeyboardInterrupt
    assert server.proc.poll() is not None


def test_server_does_not_outlive_its_parent():
    code = ("from gclab.serving import ModelServer\n"
            "server = ModelServer(heap_objects=1000).start()\n"
            "print(server.proc.pid, flush=True)\n"
            "import os; os._exit(0)\n")
    pid = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout)
    deadline = time.time() + 10
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def test_policy_hooks_run_in_the_server(tmp_path):
    policy = _policy(tmp_path, "import gc\n"
                               "def on_startup():\n    gc.disable()\n"
                               "def on_idle(idle_seconds):\n    gc.collect()\n")
    with ModelServer(heap_objects=1000, cache_size=10, policy=policy, idle_after=0.005) as server:
        run_load(server.url, rate=100, duration=0.5)
        time.sleep(0.2)
        trace = server.trace()
    assert not trace.info["gc_enabled"]
    assert trace.idle_calls, "on_idle runs when no request is in flight"
    assert all(c.generation == 2 for c in trace.collections), "only the policy's own collections ran"
    assert trace.garbage["uncollected"] == 0


def test_collector_off_leaves_the_evicted_cycles_alive(tmp_path):
    policy = _policy(tmp_path, "import gc\ndef on_startup():\n    gc.disable()\n")
    with ModelServer(heap_objects=1000, cache_size=10, policy=policy) as server:
        run_load(server.url, rate=100, duration=0.5)
        trace = server.trace()
    assert trace.collections == []
    assert trace.garbage["uncollected"] == 50 - 10


def test_a_broken_policy_stops_the_start_with_its_error(tmp_path):
    policy = _policy(tmp_path, "raise ValueError('my policy is broken')\n")
    with pytest.raises(RuntimeError, match="my policy is broken"):
        ModelServer(heap_objects=1000, policy=policy).start()


def test_trace_reset_starts_a_fresh_record():
    with ModelServer(heap_objects=1000) as server:
        run_load(server.url, rate=100, duration=0.2)
        assert len(server.trace(reset=True).requests) == 20
        assert server.trace().requests == []


def test_recording_is_intact_on_a_plain_run(served):
    _, _, trace = served
    assert trace.info["recording_intact"]


def test_a_policy_that_unhooks_the_recording_is_caught(tmp_path):
    policy = _policy(tmp_path, "import gc\n"
                               "def before_request(in_flight):\n    gc.callbacks.clear()\n    gc.collect(0)\n")
    with ModelServer(heap_objects=1000, policy=policy) as server:
        run_load(server.url, rate=100, duration=0.2)
        trace = server.trace()
    assert not trace.info["recording_intact"]


def _answer(server, seed):
    import json
    import urllib.request
    with urllib.request.urlopen(f"{server.url}/predict?seed={seed}", timeout=30) as reply:
        return json.loads(reply.read())


def test_compact_attribution_answers_the_same_without_garbage():
    with ModelServer(heap_objects=1000, attribution="objects") as server:
        expected = [_answer(server, seed) for seed in (3, 4)]
    with ModelServer(heap_objects=1000, attribution="compact", cache_size=10) as server:
        got = [_answer(server, seed) for seed in (3, 4)]
        run_load(server.url, rate=100, duration=0.5)
        trace = server.trace()
    assert [g["label"] for g in got] == [e["label"] for e in expected]
    for g, e in zip(got, expected):
        assert [t for t, _ in g["top_tokens"]] == [t for t, _ in e["top_tokens"]]
        assert [s for _, s in g["top_tokens"]] == pytest.approx([s for _, s in e["top_tokens"]], abs=1e-3)
    assert trace.garbage["explanations_alive"] == 0


def test_unknown_attribution_is_refused():
    with pytest.raises(ValueError, match="attribution must be one of off, objects, compact"):
        ModelServer(attribution="yes")
