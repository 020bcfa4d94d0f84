"""The model server and the open-loop load generator: behaviour, not speed (timings live in `make bench`)."""
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gclab.gcwatch import Collection, gc_disabled
from gclab.serving import LoadResult, ModelServer, Trace, assert_served, run_load, schedule, serve_inline

pytestmark = pytest.mark.timed     # run alone by `make test`: it times a server


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


def test_a_load_in_bursts_waits_for_each_bursts_answers_and_then_its_lull():
    with ModelServer(heap_objects=20_000, attribution="objects", cache_size=50) as server:
        load = run_load(server.url, rate=200, duration=0.5, burst=25, lull=0.03)
        trace = server.trace()
    assert len(load.status) == 100 and load.failed == 0
    steady = schedule(200, 100, poisson=True)
    for first in (25, 50, 75):
        last_answer = max(load.done[first - 25:first])
        assert load.scheduled[first] >= last_answer + 0.03, "a burst starts a lull after the last answer before it"
        spacing = [b - a for a, b in zip(load.scheduled[first:first + 25], load.scheduled[first + 1:first + 25])]
        assert spacing == pytest.approx([b - a for a, b in zip(steady[first:first + 25], steady[first + 1:first + 25])])
    assert trace.idle_moments() >= 3, "the server is idle in each lull"


def test_a_slow_server_has_the_whole_slack_after_each_burst(tmp_path):
    """Bursts wait for their answers, so a server that serves slower than the load comes finishes later than
    the load's own timeout: each burst has its share of slack, not the whole load's deadline."""
    policy = _policy(tmp_path, "import time\ndef before_request(in_flight):\n    time.sleep(0.01)\n")
    with ModelServer(heap_objects=20_000, attribution="objects", cache_size=50, policy=policy) as server:
        load = run_load(server.url, rate=200, duration=0.5, timeout=0.9, burst=25, lull=0.03)
    assert load.failed == 0, f"{load.failed} of 100 unanswered"
    assert max(load.done) - min(load.scheduled) > 0.9, "served slower than the load's own timeout: the test is moot"


def test_the_graded_load_is_cut_into_bursts(monkeypatch):
    import gclab.serving
    from gclab import checks
    seen = []
    monkeypatch.setattr(gclab.serving, "measure", lambda name, **options: seen.append(options) or _run())
    checks.run_policy_check("policy.py")
    assert seen[0]["burst"] == checks.LOAD_BURST and seen[0]["lull"] == checks.LOAD_LULL
    assert 875 // checks.LOAD_BURST == 7 and 875 % checks.LOAD_BURST == 0


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


def test_the_folder_a_policy_may_write_to_is_removed_once_its_server_stops(tmp_path):
    policy = _policy(tmp_path, "def on_startup():\n    pass\n")
    with ModelServer(heap_objects=1000, policy=policy) as server:
        folder = Path(server._workdir.name)
        assert folder.is_dir()
    assert not folder.exists(), "a grading of many servers must not fill the temporary folder"
    broken = ModelServer(heap_objects=1000, policy=_policy(tmp_path, "raise ValueError('broken')\n", "b.py"))
    with pytest.raises(RuntimeError):
        broken.start()
    assert not Path(broken._workdir.name).exists()


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


# -- CPU-time accounting --------------------------------------------------------------------
def _served(generation, start, duration, cpu):
    from gclab.serving import ServedCollection
    return ServedCollection(generation, start, duration, 0, 0, cpu)


def test_each_request_is_charged_with_the_collections_it_waited_behind():
    load = LoadResult(scheduled=[0.0, 1.0, 2.0, 3.0], sent=[0.0, 1.0, 2.0, 3.0],
                      done=[0.5, 1.5, 2.5, None], status=[200, 200, 200, 0])
    trace = Trace(requests=[], collections=[
        _served(0, 0.1, 0.01, 0.002),       # inside the first request's wait
        _served(2, 0.2, 0.2, 0.150),        # also inside the first: the longest
        _served(1, 1.45, 0.2, 0.004),       # runs into the second request's wait
        _served(2, 1.8, 0.1, 0.080),        # between requests: charged to no one
        _served(2, 2.9, 0.2, 0.090),        # after the third was answered, before the fourth (unanswered)
    ])
    charges = trace.charges(load)
    assert charges["longest"].tolist() == pytest.approx([0.150, 0.004, 0.0]), "answered requests only"
    assert charges["total"].tolist() == pytest.approx([0.152, 0.004, 0.0])
    assert charges["count"].tolist() == [2, 1, 0]
    assert trace.collector_cpu() == pytest.approx(0.326) and trace.collector_cpu(2) == pytest.approx(0.320)


def test_a_wall_clock_stretched_by_a_busy_machine_does_not_raise_a_charge():
    """The same collection, descheduled for most of its wall-clock time: charged at its CPU time."""
    load = LoadResult(scheduled=[0.0], sent=[0.0], done=[2.0], status=[200])
    trace = Trace(requests=[], collections=[_served(0, 0.5, 1.0, 0.0003)])
    assert trace.charges(load)["longest"].tolist() == pytest.approx([0.0003])


def test_tampered_says_why_and_an_unreadable_trace_is_not_tampered():
    assert Trace([], [], info={"tampered": ["x was replaced"], "recording_intact": False}).tampered == ["x was replaced"]
    assert Trace([], [], info={"recording_intact": False}).tampered        # an older server's flag alone
    assert Trace([], [], info={"recording_intact": True, "tampered": []}).tampered == []
    assert Trace.unavailable("stopped").tampered == []


def test_the_record_takes_messages_only_in_its_own_forms_and_reads_only_with_its_token():
    from gclab.serving import _recorder
    token = object()
    record = _recorder(token)
    next(record)
    record.send(("start", 0, 1.0, 0.5))
    record.send(("stop", 0, 1.25, 0.75, 3, 0))
    record.send(("request", 7, 1.0, 2.0))
    assert record.send(("read", object())) is None, "a read without the token gets nothing"
    record.send(("stop", 2, 3.0, 1.0, 0, 0))                 # a stop with no start
    record.send("anything")
    data = record.send(("read", token))
    assert data["collections"] == [[0, 1.0, 0.25, 0.25, 3, 0]]
    assert data["requests"] == [[7, 1.0, 2.0]]
    assert len(data["forged"]) == 3, data["forged"]
    assert len(data["counted"]) == 3 and data["server_cpu"] >= 0


def test_a_read_that_comes_during_a_collection_is_answered_as_the_collection_stops():
    """A server collecting back to back is, whenever the trace endpoint's thread gets the interpreter,
    inside a collection: its read is answered by the thread that runs it, as the collection stops."""
    from gclab.serving import _recorder
    token, counts = object(), [[0, 0], [0, 0], [0, 0]]
    record = _recorder(token, stats=lambda: [tuple(c) for c in counts])
    next(record)
    record.send(("start", 0, 1.0, 0.5))
    assert record.send(("read", token)) == {"in_progress": True}
    counts[0] = [1, 3]                      # CPython counts a collection before its stop callback runs
    assert record.send(("answer", token)) == {"in_progress": True}
    record.send(("stop", 0, 1.25, 0.75, 3, 0))
    record.send(("start", 0, 2.0, 1.0))     # the next collection is under way when the endpoint asks again
    counts[0] = [2, 3]
    data = record.send(("answer", token))
    assert data["collections"] == [[0, 1.0, 0.25, 0.25, 3, 0]] and data["counted"] == [1, 0, 0], data
    assert not data["forged"]


def test_a_message_that_finds_the_record_busy_waits_in_line_and_keeps_its_order():
    from gclab.serving import _serialized
    seen = []

    def send(message):
        seen.append(message)
        if message == "first":              # a collection starts while the record is busy
            assert record("inside") is None
        return message
    record = _serialized(send)
    assert record("first") == "first" and seen == ["first"]
    assert record("second", wait=True) == "second"
    assert seen == ["first", "inside", "second"]


@pytest.fixture(scope="module")
def cpu_served():
    with ModelServer(heap_objects=20_000, attribution="objects", cache_size=20) as server:
        load = run_load(server.url, rate=200, duration=0.5)
        trace = server.trace()
    return load, trace


def test_the_server_records_the_cpu_time_of_each_collection_and_of_a_full_one(cpu_served):
    load, trace = cpu_served
    assert trace.collections and all(c.cpu >= 0 for c in trace.collections)
    assert trace.info["full_collection_cpu"] > 0, "measured at start-up, before any policy"
    assert trace.info["server_cpu"] > 0
    assert not trace.tampered, trace.tampered
    assert len(trace.charges(load)["longest"]) == len(load.status)


def _tampered_by(tmp_path, source):
    with ModelServer(heap_objects=1000, cache_size=10, policy=_policy(tmp_path, source)) as server:
        run_load(server.url, rate=100, duration=0.3)
        time.sleep(0.1)
        return server.trace()


def test_a_policy_that_rewrites_the_servers_garbage_count_through_main_is_caught(tmp_path):
    trace = _tampered_by(tmp_path, "import gc, sys\n"
                                   "def on_startup():\n"
                                   "    server = sys.modules['__main__']\n"
                                   "    server.ServerState.garbage = lambda self: {'uncollected': 0, 'peak_uncollected': 0}\n"
                                   "    gc.disable()\n")
    assert any("ServerState.garbage was replaced" in t for t in trace.tampered), trace.tampered
    assert trace.garbage["uncollected"] == 30 - 10, "the server's own count, bound before the policy loaded"


def test_importing_gclab_serving_reaches_the_same_guarded_module(tmp_path):
    trace = _tampered_by(tmp_path, "import gclab.serving as server\n"
                                   "def on_startup():\n"
                                   "    try:\n"
                                   "        server.Trace = None\n"
                                   "    except AttributeError:\n"
                                   "        vars(server)['Trace'] = None\n")
    assert any("Trace was replaced" in t for t in trace.tampered), trace.tampered


def test_a_policy_that_feeds_the_record_forged_collections_is_caught(tmp_path):
    trace = _tampered_by(tmp_path, "import gc\n"
                                   "done = []\n"
                                   "def before_request(in_flight):\n"
                                   "    if not done:\n"
                                   "        hook = gc.callbacks[-1]\n"
                                   "        hook('start', {'generation': 2})\n"
                                   "        hook('stop', {'generation': 2, 'collected': 0, 'uncollectable': 0})\n"
                                   "        done.append(1)\n")
    assert any("CPython counted" in t for t in trace.tampered), trace.tampered


def test_the_trace_answers_while_the_server_is_still_busy(tmp_path):
    """Collecting after every request on a large heap: the server falls far behind, yet it reports."""
    policy = _policy(tmp_path, "import gc\ndef after_request(in_flight):\n    gc.collect()\n")
    with ModelServer(heap_objects=300_000, policy=policy) as server:
        load = run_load(server.url, rate=200, duration=1.0, timeout=1.5)
        trace = server.trace()
    assert load.failed > 0 and not trace.info.get("unavailable"), trace.errors
    # what it reports is what it did: requests answered, and the policy's full collections (how many requests
    # it answered, and whether one waited behind a collection, depends on how busy the machine is)
    assert trace.requests and any(c.generation == 2 for c in trace.collections) and not trace.tampered


def test_compare_interleaves_the_loads_and_keeps_the_servers_running():
    from gclab.serving import compare, spread
    lines = []
    runs = compare({"a": dict(heap_objects=1000), "b": dict(heap_objects=1000, attribution="compact")},
                   repeats=2, rate=100, duration=0.3, settle=0.05, progress=lines.append)
    assert [line.split()[2] for line in lines] == ["a", "b", "a", "b"]
    assert all(len(seen) == 2 and all(r.load.failed == 0 for r in seen) for seen in runs.values())
    assert set(spread(runs)) == {"a", "b"} and all(lo <= med <= hi for med, lo, hi in spread(runs).values())


# -- judging a policy on what the server recorded (gclab.checks.PolicyReport) ------------------
IDLE_FULL_COLLECTION = (_served(2, 50.5, 0.01, 0.001),)      # between two requests


def _run(name="your policy", collections=IDLE_FULL_COLLECTION, uncollected=0, peak=0, failed=0, requests=100,
         tampered=(), freed=(), idle=(), p50_ms=8.0, full_cpu=0.1):
    from gclab.serving import ServedRun
    scheduled = [float(i) for i in range(requests)]
    done = [t + p50_ms / 1e3 for t in scheduled]
    load = LoadResult(scheduled=scheduled, sent=scheduled, done=done,
                      status=[200] * (requests - failed) + [0] * failed)
    trace = Trace(requests=[(i, t + 1e-4, d) for i, (t, d) in enumerate(zip(scheduled, done))],
                  collections=list(collections), garbage={"uncollected": uncollected, "peak_uncollected": peak},
                  info={"full_collection_cpu": full_cpu, "tampered": list(tampered), "recording_intact": not tampered,
                        "freed_times": list(freed), "idle_call_times": list(idle)})
    return ServedRun(name, load, trace)


def _report(acts_when_idle=True, **run):
    from gclab.checks import PolicyReport
    return PolicyReport({"your policy": _run(**run)}, acts_when_idle=acts_when_idle)


def test_a_policy_with_short_collections_and_collected_garbage_passes():
    report = _report(collections=[_served(0, 3.001, 1e-4, 1e-4), _served(2, 50.5, 0.01, 0.01)], peak=30, freed=[1.0])
    assert report.ok and report.verdict == "pass", report.explain()
    assert "within budget" in report.explain() and "No full collection ran inside a request." in report.explain()


def test_requests_waiting_behind_a_costly_collection_fail_in_cpu_time():
    # 12 requests (over 1 %) wait behind a collection of 90 ms of CPU; budget 0.75 x 100 ms
    report = _report(collections=[_served(1, float(i) + 0.5, 0.6, 0.09) for i in range(12)])
    assert not report.ok and not report.checks["collector pauses within budget"]
    assert "P99 90.0 ms; budget 0.75 x one full collection" in report.explain()
    assert report.failed_by_facts() == [], "between 0.75x and 1x: measured again before it counts"
    costly = _report(collections=[_served(1, float(i) + 0.5, 0.6, 0.12) for i in range(12)])
    assert costly.failed_by_facts() == ["collector pauses within budget"], "a whole heap's walk is a fact"


def test_requests_waiting_behind_many_slow_young_collections_fail_and_are_told_so():
    """gc.set_debug(gc.DEBUG_STATS) makes each young collection count every generation, frozen ones included:
    no one collection is long, but a request waits behind twenty of them (measured in lesson 06's server:
    24 ms each, 419 ms a request at P99, where the reference policy's requests wait 1.7 ms)."""
    many = [_served(0, i + 1e-4 * k, 5e-5, 0.005) for i in range(12) for k in range(20)]
    report = _report(collections=[*many, *IDLE_FULL_COLLECTION], peak=30, freed=[1.0])
    assert not report.ok and not report.checks["collector pauses within budget"]
    assert "P99 100.0 ms; budget 0.75 x one full collection" in report.explain()
    assert "the longest a request waited behind: P99 5.0 ms" in report.explain()
    assert "many in a row (P99 20)" in report.explain() and "DEBUG_STATS" in report.explain()


def test_a_full_collection_inside_a_request_fails():
    report = _report(collections=[_served(2, 7.002, 0.03, 0.001)])
    assert not report.ok and report.checks["collector pauses within budget"]
    assert "1 full (generation 2) collection(s) ran while requests were in flight" in report.explain()
    assert report.failed_by_facts() == ["no full collection inside a request"]


def test_garbage_never_collected_is_a_fact_and_garbage_collected_late_is_measured_again():
    never = _report(uncollected=90, peak=90)
    assert not never.ok and never.failed_by_facts() == ["garbage bounded"]
    assert "at most 90 at any time, 90 left at the end, over the bound of 65" in never.explain()
    assert "collecting only once the load is over, is not a fact" not in never.explain()
    late = _report(uncollected=0, peak=90, freed=[200.0])
    assert not late.ok and late.failed_by_facts() == []


def test_a_policy_that_runs_no_full_collection_while_serving_has_only_postponed_them():
    raised = _report(collections=[_served(0, 3.001, 1e-4, 1e-4), _served(1, 40.003, 0.004, 0.004)], peak=30,
                     freed=[1.0])
    assert not raised.ok and not raised.checks["full collections while serving"]
    assert "No full (generation 2) collection ran while the load was served" in raised.explain()
    assert raised.failed_by_facts() == [], "a machine too busy to leave idle moments can cause it: measured again"
    no_idle_hook = _report(collections=raised.policy.trace.collections, peak=30, freed=[1.0], acts_when_idle=False)
    assert no_idle_hook.failed_by_facts() == ["full collections while serving"], (
        "with no hook between requests only the thresholds start one, and they count allocations, not time")
    after_the_load = _report(collections=[_served(2, 150.0, 0.01, 0.001)], freed=[150.0])
    assert not after_the_load.checks["full collections while serving"]


def test_a_tampered_record_fails_and_says_so():
    report = _report(tampered=["gclab.serving.ServerState.garbage was replaced"])
    assert not report.ok and report.failed_by_facts() == ["record vouched for"]
    assert report.explain().startswith("tampered: the server cannot vouch for its record")


def test_a_hook_that_fails_every_time_is_told_once_with_its_count():
    report = _report()
    report.policy.trace.errors[:] = ["on_idle: TypeError: on_idle() takes 0 positional arguments but 1 was given"] * 40
    assert "but 1 was given (40 times)" in report.explain()
    assert report.explain().count("takes 0 positional arguments") == 1


def test_failed_requests_fail_the_policy():
    report = _report(failed=1)
    assert not report.ok and "1 request(s) got no answer" in report.explain()


def _fake_measure(runs, busier=None):
    """A stand-in for gclab.serving.measure: each call serves the next run of the list; the busier load
    (never idle), `busier` or a run with no collection."""
    calls = iter(runs)

    def measure(name, **options):
        run = (busier or _run()) if "busier load" in name else next(calls)
        run.name = name
        return run
    return measure


def test_a_failure_a_busy_machine_can_cause_is_measured_again_after_the_collector_off(monkeypatch):
    import gclab.serving
    from gclab.checks import run_policy_check
    late = dict(peak=90, freed=[200.0], idle=[10.5, 20.5, 30.5])
    monkeypatch.setattr(gclab.serving, "measure", _fake_measure([_run(**late), _run(), _run(peak=20, freed=[1.0])]))
    report = run_policy_check("policy.py")
    assert report.ok and report.first_failures == ["garbage bounded"]
    assert "A first run failed on garbage bounded" in report.explain()


def test_a_failure_seen_twice_on_a_quiet_machine_fails(monkeypatch):
    import gclab.serving
    from gclab.checks import run_policy_check
    late = dict(peak=90, freed=[200.0], idle=[10.5, 20.5, 30.5])
    monkeypatch.setattr(gclab.serving, "measure", _fake_measure([_run(**late), _run(), _run(**late)]))
    report = run_policy_check("policy.py")
    assert report.verdict == "fail" and not report.inconclusive


def test_a_server_never_idle_under_load_makes_a_garbage_failure_inconclusive(monkeypatch):
    import gclab.serving
    from gclab.checks import assert_policy, run_policy_check
    late = dict(peak=90, freed=[200.0], idle=[])
    monkeypatch.setattr(gclab.serving, "measure", _fake_measure([_run(**late), _run(), _run(**late)]))
    report = run_policy_check("policy.py")
    assert report.verdict == "inconclusive" and not report.ok
    with pytest.raises(AssertionError, match="^inconclusive: the server found no request in flight only 0 time"):
        assert_policy(report)


def test_a_policy_that_let_the_servers_few_idle_moments_pass_is_not_excused_by_a_busy_machine(monkeypatch):
    """Collecting only once the load is over: a busy machine left the server idle twice while it ran, and the
    policy collected at neither: it failed on its own (seen in CI: told the machine was too busy).  One that
    did collect at them may blame the machine."""
    import gclab.serving
    from gclab.checks import run_policy_check
    late = dict(peak=90, freed=[200.0], idle=[10.5, 20.5], collections=())
    monkeypatch.setattr(gclab.serving, "measure", _fake_measure([_run(**late), _run(), _run(**late)]))
    report = run_policy_check("policy.py")
    assert report.verdict == "fail" and not report.inconclusive
    assert "collecting only once the load is over, is not a fix" in report.explain()
    took_them = dict(peak=90, freed=[20.6], idle=[10.5, 20.5])
    monkeypatch.setattr(gclab.serving, "measure", _fake_measure([_run(**took_them), _run(), _run(**took_them)]))
    assert run_policy_check("policy.py").verdict == "inconclusive"


def test_a_policy_with_no_hook_between_requests_is_not_excused_by_a_server_never_idle(monkeypatch, tmp_path):
    """Idle moments are a policy's chance only if it acts between requests (on_idle, after_request): without
    such a hook its failure is its own, however busy the machine (seen in CI: thresholds raised alone was
    told the machine was too busy)."""
    import gclab.serving
    from gclab.checks import run_policy_check
    policy = tmp_path / "my_policy.py"
    policy.write_text("import gc\n\ndef on_startup():\n    gc.set_threshold(50_000)\n")
    late = dict(peak=90, freed=[200.0], idle=[])
    monkeypatch.setattr(gclab.serving, "measure", _fake_measure([_run(**late), _run(), _run(**late)]))
    report = run_policy_check(str(policy))
    assert report.verdict == "fail" and not report.inconclusive


def test_a_busy_collector_off_run_makes_unanswered_requests_inconclusive(monkeypatch):
    import gclab.serving
    from gclab.checks import run_policy_check
    monkeypatch.setattr(gclab.serving, "measure",
                        _fake_measure([_run(failed=3), _run(p50_ms=120.0), _run(failed=2)]))
    report = run_policy_check("policy.py")
    assert report.inconclusive and "P99 was 120 ms" in report.inconclusive_reason


def test_a_fact_is_not_measured_again(monkeypatch):
    import gclab.serving
    from gclab.checks import run_policy_check
    monkeypatch.setattr(gclab.serving, "measure", _fake_measure([_run(uncollected=90, peak=90)]))
    report = run_policy_check("policy.py")       # a second call would raise StopIteration
    assert report.verdict == "fail" and report.first_failures is None


# -- serving in this process (serve_inline) ---------------------------------------------
class _Node:
    def __init__(self):
        self.other = _Other(self)


class _Other:
    def __init__(self, node):
        self.node = node


def _cycles(request):
    """A request that leaves 50 small reference cycles behind."""
    for _ in range(50):
        _Node()
    return request * 2


def test_inline_serving_answers_in_order_and_keeps_errors_without_frames():
    def handle(request):
        if request == 3:
            raise ValueError("bad request 3")
        return request * 2
    run = serve_inline(handle, range(5))
    assert run.results[:3] == [0, 2, 4] and run.results[4] == 8
    assert isinstance(run.results[3], ValueError) and run.results[3].__traceback__ is None
    assert [rid for rid, _, _ in run.requests] == [0, 1, 2, 3, 4] and len(run.cpu) == 5


def test_a_collection_inside_a_request_is_charged_to_it_in_cpu_time():
    def handle(request):
        if request == 2:
            gc.collect()
        return request
    run = serve_inline(handle, range(4))
    charged = run.charges()
    assert charged[2] > 0 and charged[[0, 1, 3]].sum() == 0
    assert [c.generation for c in run.collections] == [2]
    assert run.collections[0].cpu == pytest.approx(charged[2])


def test_a_request_is_charged_with_all_the_collections_inside_it_added_up():
    def handle(request):
        for _ in range(request):
            gc.collect(0)
        return request
    run = serve_inline(handle, [0, 3])
    assert run.charges()[1] == pytest.approx(sum(c.cpu for c in run.collections)) and len(run.collections) == 3


def test_the_collector_switched_off_leaves_all_the_garbage_and_on_frees_most():
    with gc_disabled():
        off = serve_inline(_cycles, range(100))
    assert off.garbage_left() == 1.0 and off.left == 100 * 50 * 2 and not off.collections
    on = serve_inline(_cycles, range(100))
    assert on.collections and on.garbage_left() < 0.5


def test_a_run_over_its_pause_budget_stops_once_the_p99_cannot_be_met():
    def collects(request):
        gc.collect()
        return request
    run = serve_inline(collects, list(range(300)), pause_budget=1e-9)
    assert run.stopped_early and len(run.requests) == 300 // 100 + 2
    assert run.pause_p99() > 1e-9 and "stopped early" in run.summary()
    assert not serve_inline(_cycles, list(range(50)), pause_budget=10.0).stopped_early


def test_a_program_that_collects_only_when_unwatched_is_told_apart():
    """It looks for a hook in gc.callbacks and skips its collection while one is there."""
    def collects_unless_watched(request):
        if not gc.callbacks:
            gc.collect()
        return request
    run = serve_inline(collects_unless_watched, list(range(200)), pause_budget=1.0)
    assert run.full_inside == 0 and run.pause_p99() == 0
    assert run.full_inside_unwatched == run.unwatched_margin() + 1, "the second pass stops once it is told"
    assert "3 full collections, against 0 while watched" in run.differs_unwatched()
    assert run.differs_unwatched() in run.summary()


def test_the_second_pass_cannot_be_told_by_its_requests():
    """The program also skips its collection for a request object it has served before."""
    seen = set()

    def collects_for_new_requests_unwatched(request):
        if not gc.callbacks and id(request) not in seen:
            gc.collect()
        seen.add(id(request))
        return request["id"]
    requests = [{"id": k} for k in range(100)]
    assert serve_inline(collects_for_new_requests_unwatched, requests, pause_budget=1.0).differs_unwatched()
    fresh = [{"id": k} for k in range(100, 200)]
    run = serve_inline(collects_for_new_requests_unwatched, requests, pause_budget=1.0, unwatched_requests=fresh)
    assert run.differs_unwatched()


@pytest.mark.parametrize("every", [None, 50])
def test_a_program_that_does_the_same_watched_or_not_is_not_told_anything(every):
    def handle(request):
        _cycles(request)
        if every and request % every == every - 1:
            gc.collect()
        return request
    run = serve_inline(handle, list(range(400)), pause_budget=1.0)
    assert run.full_inside_unwatched is not None and not run.differs_unwatched()
    assert run.full_inside >= (400 // every if every else 0)


def test_assert_served_passes_a_program_that_leaves_collecting_to_the_collector():
    run = serve_inline(_cycles, list(range(200)), pause_budget=1.0)
    assert_served(run, pause_budget=1.0, garbage="the requests' cycles")


def test_assert_served_names_the_first_rule_a_run_breaks():
    def raises(request):
        raise ValueError(f"bad {request}")
    with pytest.raises(AssertionError, match=r"^3 of 3 requests raised an error, the first ValueError: bad 0$"):
        assert_served(serve_inline(raises, range(3)), pause_budget=1.0)

    def collects(request):
        _cycles(request)
        if request == 5:
            gc.collect()
        return request
    with pytest.raises(AssertionError, match=r"^collector pauses over budget: P99"):
        assert_served(serve_inline(collects, range(100)), pause_budget=0.0)
    with pytest.raises(AssertionError, match=r"^the program itself started 1 full collection\(s\) inside the requests"):
        assert_served(serve_inline(collects, range(100)), pause_budget=1.0)

    def freezes(request):
        gc.freeze()
        return request
    try:
        with pytest.raises(AssertionError, match=r"objects while it served \(gc.freeze\(\)\): the cycles among them"):
            assert_served(serve_inline(freezes, range(2)), pause_budget=1.0, garbage="the cycles")
    finally:
        gc.unfreeze()
    with gc_disabled():
        off = serve_inline(_cycles, range(50))
        with pytest.raises(AssertionError, match=r"^the collector is off after serving; the collector left 100% of "
                                                 r"the cycles unfreed \(at most 50%\): it must stay on"):
            assert_served(off, pause_budget=1.0, garbage="the cycles")
    with pytest.raises(AssertionError, match=r"^the collector left 100% of the cycles unfreed \(at most 50%\)"):
        assert_served(off, pause_budget=1.0, garbage="the cycles")


def test_a_full_collection_is_priced_with_a_heap_added_while_it_runs():
    from gclab.serving import full_collection_cpu
    bare, heavy = full_collection_cpu(), full_collection_cpu(heap_objects=200_000)
    assert 0 < bare < heavy


def test_without_a_pause_budget_the_requests_are_served_once():
    served = []
    serve_inline(served.append, list(range(10)))
    assert served == list(range(10))


def test_modules_and_variables_the_learner_left_behind_do_not_reach_the_server(tmp_path, monkeypatch):
    """The server and its load generator start isolated (-I) with the environment gclab started
    with: a `uvicorn.py` in the current folder, or PYTHONPATH set afterwards, is not imported."""
    (tmp_path / "uvicorn.py").write_text("raise SystemExit('the learner\\'s uvicorn.py was imported')\n")
    (tmp_path / "sitecustomize.py").write_text("raise SystemExit('the learner\\'s sitecustomize.py was imported')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with ModelServer(heap_objects=1000, cache_size=10) as server:
        load = run_load(server.url, rate=50, duration=0.2)
    assert load.failed == 0 and len(load.status) == 10


def test_servers_and_loads_are_forked_from_one_zygote_that_imported_torch_once():
    from gclab import serving
    with ModelServer(heap_objects=1000, cache_size=10) as first, ModelServer(heap_objects=1000, cache_size=10) as second:
        load = run_load(first.url, rate=50, duration=0.2)
        [zygote] = serving._ZYGOTE
        parents = {int(open(f"/proc/{s.proc.pid}/stat").read().rsplit(")", 1)[1].split()[1]) for s in (first, second)}
        assert parents == {zygote.proc.pid}
    assert load.failed == 0
    assert first.proc.poll() is not None and second.proc.poll() is not None


def test_a_server_is_as_traceable_as_the_process_that_starts_it_now():
    """A grading shields its process (gclab.grader.sandbox.shield); a server started once the process is dumpable
    again comes from a zygote that is dumpable too, so that a user without root may read its /proc."""
    from gclab import serving, zygote
    from gclab.grader import sandbox

    def parent_of(server):
        return int(open(f"/proc/{server.proc.pid}/stat").read().rsplit(")", 1)[1].split()[1])
    sandbox.shield()
    with ModelServer(heap_objects=1000, cache_size=10) as shielded:
        [undumpable] = serving._ZYGOTE
        assert not undumpable.dumpable and parent_of(shielded) == undumpable.proc.pid
        zygote._LIBC.prctl(zygote._PR_SET_DUMPABLE, 1, 0, 0, 0)      # dumpable again, as after a grading's test
        with ModelServer(heap_objects=1000, cache_size=10) as server:
            [dumpable] = serving._ZYGOTE
            assert dumpable.dumpable and parent_of(server) == dumpable.proc.pid
        assert run_load(shielded.url, rate=50, duration=0.2).failed == 0, "the first server serves on"


def test_without_the_zygote_each_server_is_a_fresh_python(monkeypatch):
    monkeypatch.setenv("GCLAB_SERVING_FORK", "0")
    with ModelServer(heap_objects=1000, cache_size=10) as server:
        assert isinstance(server.proc, subprocess.Popen)
        load = run_load(server.url, rate=50, duration=0.2)
    assert load.failed == 0 and server.proc.poll() is not None


def test_graded_code_cannot_start_a_server_through_the_zygote(tmp_path):
    """Forking is starting a process: the guard refuses it to the learner's code as it refuses Popen."""
    code = ("import gclab.memory, gclab.serving\nfrom gclab import guard\n"
            "gclab.serving.prestart()\n"              # as lesson 06's set-up cell does, before the learner's code
            f"keeper = guard.install({str(tmp_path)!r}, processes=False)\n"
            "learner = 'import gclab.serving, os, socket\\ntry:\\n    gclab.serving.ModelServer(heap_objects=1000).start()\\n"
            "    print(\"started\")\\nexcept RuntimeError as error:\\n    print(error)\\n"
            "read, write = os.pipe()\\ntry:\\n"
            "    socket.send_fds(gclab.serving._ZYGOTE[0].sock, [b\"{}\"], [write, write])\\n"
            "    print(\"sent\")\\nexcept RuntimeError as error:\\n    print(error)\\n'\n"
            f"exec(compile(learner, {str(tmp_path / 'answer.py')!r}, 'exec'), {{}})\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TMPDIR=str(tmp_path)))       # as in a verdict process
    assert "refused while grading: subprocess.Popen" in done.stdout, done.stdout + done.stderr
    assert "refused while grading: socket.sendmsg" in done.stdout and "sent" not in done.stdout, done.stdout


def test_a_policy_is_compiled_from_its_source_never_from_bytecode_cached_beside_it(tmp_path):
    """Bytes in the policy's folder could be any code object: the one a policy file's cache names is not run,
    and none is written."""
    import importlib.util
    import py_compile
    from gclab.serving import load_policy
    path = _policy(tmp_path, "def on_idle(idle_seconds):\n    return 'from the source'\n")
    other = _policy(tmp_path, "def on_idle(idle_seconds):\n    return 'from the cached bytecode'\n", "other.py")
    cached = Path(importlib.util.cache_from_source(str(path)))
    py_compile.compile(str(other), cfile=str(cached), doraise=True)
    written = cached.read_bytes()
    py_compile.compile(str(path), cfile=str(cached), doraise=True)     # a valid cache for policy.py ...
    cached.write_bytes(cached.read_bytes()[:16] + written[16:])        # ... holding the other file's code
    assert load_policy(str(path))["on_idle"](0.01) == "from the source"


def test_a_collection_the_program_starts_is_told_from_the_collectors_own():
    """gc.collect() finds the young generation's count at or under its threshold; the collector starts one
    by itself once the count passes it."""
    def collects_every_tenth(request):
        if request % 10 == 9:
            gc.collect()
        return [[] for _ in range(2000)]           # enough allocations for the collector's own collections
    run = serve_inline(collects_every_tenth, list(range(30)))
    assert run.explicit_full_inside() == 3
    assert any(not c.explicit for c in run.collections), "the collector's own collections ran too"
    assert serve_inline(_cycles, list(range(100))).explicit_full_inside() == 0


def test_objects_frozen_while_serving_are_counted():
    def freezes(request):
        _cycles(request)
        gc.freeze()
        return request
    try:
        run = serve_inline(freezes, list(range(10)))
    finally:
        gc.unfreeze()
    assert run.frozen >= 10 * 50 * 2 and "frozen while serving" in run.summary()
    assert serve_inline(_cycles, list(range(10))).frozen == 0


def test_what_a_policy_prints_goes_to_the_servers_log_not_before_its_ready_line(tmp_path):
    policy = _policy(tmp_path, "print('my policy loaded')\ndef on_startup():\n    print('starting')\n"
                               "def after_request(in_flight):\n    print('served', in_flight)\n")
    with ModelServer(heap_objects=1000, cache_size=10, policy=policy) as server:
        load = run_load(server.url, rate=100, duration=0.3)
        assert not server.trace().tampered
    assert load.failed == 0 and len(load.status) == 30


def test_explanations_the_collector_keeps_in_gc_garbage_are_uncollected_not_freed(tmp_path):
    """gc.DEBUG_SAVEALL: what a collection finds goes to gc.garbage, never freed; its weak references were
    cleared first, so the explanations left the server's set as if freed."""
    policy = _policy(tmp_path, "import gc\ndef on_startup():\n    gc.set_debug(gc.DEBUG_SAVEALL)\n"
                               "def on_idle(idle_seconds):\n    gc.collect()\n")
    with ModelServer(heap_objects=1000, cache_size=10, policy=policy, idle_after=0.005) as server:
        run_load(server.url, rate=100, duration=0.5)
        time.sleep(0.2)
        trace = server.trace()
    assert trace.garbage["saved_in_gc_garbage"] == 50 - 10 and trace.garbage["uncollected"] >= 50 - 10, trace.garbage
    report = _report(uncollected=40, peak=40)
    report.policy.trace.garbage.update(left_after_full_collection=40, saved_in_gc_garbage=40)
    assert "kept in gc.garbage: with gc.DEBUG_SAVEALL set" in report.explain(), report.explain()


# reaches the server's state the way a policy can: uvicorn's signal handler, its app's closure
FIND_THE_STATE = ("import signal\n_state = []\n"
                  "def _find():\n"
                  "    app = signal.getsignal(signal.SIGTERM).__self__.config.loaded_app\n"
                  "    while getattr(app, '__closure__', None) is None:\n        app = app.app\n"
                  "    _state.append(dict(zip(app.__code__.co_freevars, (c.cell_contents for c in app.__closure__)))['state'])\n")


def test_a_policy_that_empties_the_servers_explanations_in_place_is_caught(tmp_path):
    trace = _tampered_by(tmp_path, FIND_THE_STATE + "def after_request(in_flight):\n"
                                                    "    if not _state:\n        _find()\n"
                                                    "    _state[0].explanations.clear()\n")
    assert any("state.explanations lists 0 explanations, but" in t for t in trace.tampered), trace.tampered


def test_a_policy_that_rewires_what_the_record_sends_to_is_caught(tmp_path):
    """The gc hook's record is a function too: its closure (what it sends to, its queue) is the record's."""
    trace = _tampered_by(tmp_path, "import gc\n"
                                   "def on_startup():\n"
                                   "    hook = next(h for h in gc.callbacks if 'send' in getattr(getattr(h, '__code__', None), 'co_freevars', ()))\n"
                                   "    record = dict(zip(hook.__code__.co_freevars, hook.__closure__))['send'].cell_contents\n"
                                   "    cells = dict(zip(record.__code__.co_freevars, record.__closure__))\n"
                                   "    real = cells['send'].cell_contents\n"
                                   "    cells['send'].cell_contents = lambda message: real(message)\n")
    assert any("the server's record's send was replaced" in t for t in trace.tampered), trace.tampered


def test_a_policy_that_stops_the_hooks_clocks_is_caught(tmp_path):
    """The gc hook keeps its clocks in its closure: clocks that stand still would record every collection at 0 s."""
    trace = _tampered_by(tmp_path, "import gc\n"
                                   "def on_startup():\n"
                                   "    for hook in list(gc.callbacks):\n"
                                   "        code = getattr(hook, '__code__', None)\n"
                                   "        if code is not None and 'send' in code.co_freevars:\n"
                                   "            for name, cell in zip(code.co_freevars, hook.__closure__):\n"
                                   "                if name in ('perf_counter', 'thread_time'):\n"
                                   "                    cell.cell_contents = float\n")
    assert any("the server's gc hook's thread_time was replaced" in t for t in trace.tampered), trace.tampered



def test_a_full_collection_inside_a_request_at_the_busier_load_fails_as_a_fact():
    from gclab.checks import PolicyReport
    inside = _served(2, 3.002, 0.05, 0.04)             # request 3 is in flight from 3.0001 to 3.008
    report = PolicyReport({"your policy": _run(), "busier load": _run(collections=[inside])})
    assert not report.ok and report.failed_by_facts() == ["none at a busier load either"]
    assert ("1 full collection(s) ran inside requests, the longest 50.0 ms (40.0 ms of CPU)"
            in report.explain()), report.explain()
    assert PolicyReport({"your policy": _run(), "busier load": _run()}).ok


FORKS_A_DECOY = ("import ctypes, os, signal\n"
                 "def on_startup():\n"
                 "    libc = ctypes.CDLL(None)\n"
                 "    if libc.fork() > 0:          # the process the grader times sits idle; its child serves\n"
                 "        signal.signal(signal.SIGTERM, lambda *args: os._exit(0))\n"
                 "        while True:\n"
                 "            libc.pause()\n")


def _timed_load(server, watched_pid):
    from gclab.serving import load_rows
    return load_rows(["load", server.url, "--rate", "200", "--count", "100", "--seed", "0", "--timeout", "20",
                      "--burst", "50", "--lull", "0.05", "--watch-cpu", str(watched_pid)])


def test_a_policy_cannot_hand_the_serving_to_a_process_it_forks(tmp_path):
    """The server refuses its policy new processes (gclab.syscalls): the process the grader times serves."""
    with ModelServer(heap_objects=1000, cache_size=10, policy=_policy(tmp_path, FORKS_A_DECOY)) as server:
        rows = _timed_load(server, server.proc.pid)
    assert all(row[2] is not None for row in rows)
    assert all(row[6] is True for row in rows), "the timed process held every answer's connection"
    assert rows[-1][5] > rows[0][4], "and ran while it served"


def test_a_load_timed_on_a_process_that_is_not_the_server_says_so_and_answers_are_digested(tmp_path):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with ModelServer(heap_objects=1000, cache_size=10) as server:
            rows = _timed_load(server, bystander.pid)
            again = _timed_load(server, server.proc.pid)
    finally:
        bystander.kill()
        bystander.wait()
    assert all(row[2] is not None for row in rows) and not any(row[6] for row in rows)
    assert [row[7] for row in rows] == [row[7] for row in again], "the same requests, the same answers"
