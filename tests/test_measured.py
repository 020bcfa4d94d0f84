"""The grader's own measurements (gclab.grader.measured, gclab.procfs): what decides whether a "passed" stands."""
import os
import subprocess
import sys
import time

import pytest

from gclab import procfs
from gclab.grader import measured

MiB = 1024 * 1024


def _child(code: str) -> subprocess.Popen:
    """A Python in a session of its own, running `code`, then waiting on stdin."""
    return subprocess.Popen([sys.executable, "-c", code + "\nimport sys\nsys.stdin.read()"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, start_new_session=True, text=True)


def test_a_process_that_touches_memory_shows_it_in_its_resident_figures():
    proc = _child("import sys\nblock = bytearray(64 * 1024 * 1024)\nprint('ready', flush=True)")
    try:
        assert proc.stdout.readline().strip() == "ready"
        reading = procfs.read(proc.pid)
        assert reading.processes == 1 and reading.threads >= 1
        assert reading.rss > 60 * MiB and reading.peak >= reading.rss, reading
        assert reading.gpu is None or reading.gpu >= 0
    finally:
        proc.kill()
        proc.wait()


def test_the_peak_is_reset_to_the_current_figure_and_cpu_time_only_grows():
    proc = _child("import sys\nblock = bytearray(96 * 1024 * 1024)\ndel block\n"
                  "x = sum(range(3_000_000))\nprint('ready', flush=True)")
    try:
        proc.stdout.readline()
        before = procfs.read(proc.pid)
        assert before.peak > before.rss + 80 * MiB, before      # the freed 96 MiB is in the peak only
        procfs.reset_peaks(proc.pid)
        after = procfs.read(proc.pid)
        assert after.peak < before.peak - 80 * MiB, after
        assert after.cpu_ns >= before.cpu_ns > 0
    finally:
        proc.kill()
        proc.wait()


def test_memory_a_process_has_in_swap_still_counts_as_its(monkeypatch):
    # MADV_PAGEOUT moves a process's pages to swap, where a machine has any (not this one's CI):
    # they leave VmRSS and VmHWM, and land in VmSwap
    figures = {101: {"VmRSS": 10 * MiB, "VmHWM": 12 * MiB, "VmSwap": 200 * MiB, "Threads": 1},
               102: {"VmRSS": 5 * MiB, "VmHWM": 5 * MiB, "Threads": 2}}
    monkeypatch.setattr(procfs, "session_members", lambda sid: list(figures))
    monkeypatch.setattr(procfs, "_status", figures.__getitem__)
    monkeypatch.setattr(procfs, "_cpu_ns", lambda pid: 0)
    reading = procfs.read(101)
    assert (reading.rss, reading.peak, reading.threads) == (215 * MiB, 217 * MiB, 3)


def test_the_whole_session_is_read_a_child_included():
    proc = _child("import subprocess, sys\n"
                  "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                  "print('ready', flush=True)")
    try:
        proc.stdout.readline()
        deadline = time.monotonic() + 10
        while len(procfs.session_members(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert procfs.read(proc.pid).processes == 2
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def _ref(observed=(("scores", [1.0, 2.0]),), cpu=1.0, rss=0, peak=4 * MiB):
    return {"status": "passed", "observed": [list(o) for o in observed],
            "measured": {"cpu_s": cpu, "rss_growth": rss, "peak_growth": peak}}


def test_a_pass_stands_when_outputs_work_and_memory_agree():
    mine = {"cpu_s": 0.8, "rss_growth": 3 * MiB, "peak_growth": 9 * MiB}
    assert measured.confirm("passed", [["my name", [1.0, 2.0000001]]], mine, _ref()) is None


def test_a_failure_is_never_turned_into_a_pass():
    assert measured.confirm("failed", [], {}, _ref()) is None


def test_outputs_the_test_never_produced_refute_a_pass():
    why = measured.confirm("passed", [], {"cpu_s": 1.0, "rss_growth": 0, "peak_growth": 0}, _ref())
    assert why.startswith("your process reported that the test passed, but it recorded 0 outputs")
    why = measured.confirm("passed", [["scores", [1.0, 3.0]]], {"cpu_s": 1.0, "rss_growth": 0, "peak_growth": 0}, _ref())
    assert "scores: value 1 is 3.0 where the reference solution gave 2.0" in why


def test_a_test_whose_work_did_not_run_is_refuted_by_its_cpu_time():
    why = measured.confirm("passed", [["s", [1.0, 2.0]]], {"cpu_s": 0.01, "rss_growth": 0, "peak_growth": 0}, _ref())
    assert "0.010 s on the CPU" in why and "the test's work did not run" in why


def test_memory_over_the_references_and_its_margin_is_refuted_in_words():
    why = measured.confirm("passed", [["s", [1.0, 2.0]]],
                           {"cpu_s": 1.0, "rss_growth": 200 * MiB, "peak_growth": 200 * MiB}, _ref())
    assert why == ("your process reported that the test passed; the system measured 200.0 MiB more resident memory "
                   "(swap included) over the test, where the reference solution's grew 0.0 MiB (allowed: 32.0 MiB)")


def test_memory_a_reference_freed_is_not_asked_of_the_learner():
    ref = _ref(rss=-80 * MiB)
    assert measured.confirm("passed", [["s", [1.0, 2.0]]], {"cpu_s": 1.0, "rss_growth": 5 * MiB,
                                                             "peak_growth": 5 * MiB}, ref) is None


def test_memory_charged_to_the_verdicts_cgroup_over_the_references_is_refuted():
    # memory moved into a memfd and dropped from the process's pages: resident figures flat, the cgroup's not
    ref = _ref()
    ref["measured"].update(charged_growth=0, charged_peak_growth=3 * MiB)
    flat = {"cpu_s": 1.0, "rss_growth": 0, "peak_growth": 0, "charged_growth": 0}
    why = measured.confirm("passed", [["s", [1.0, 2.0]]], {**flat, "charged_peak_growth": 68 * MiB}, ref)
    assert why == ("your process reported that the test passed; the system measured 68.0 MiB more peak memory "
                   "charged to your process's cgroup (shared memory and the files it wrote included) over the test, "
                   "where the reference solution's grew 3.0 MiB (allowed: 35.8 MiB)")
    assert measured.confirm("passed", [["s", [1.0, 2.0]]], {**flat, "charged_peak_growth": 4 * MiB}, ref) is None


def test_a_process_that_left_its_cgroup_is_refuted_and_a_reference_without_one_asks_nothing():
    ref = _ref()
    ref["measured"].update(charged_growth=0, charged_peak_growth=0)
    left = {"cpu_s": 1.0, "rss_growth": 0, "peak_growth": 0, "charged_growth": None, "charged_peak_growth": None}
    assert "left the memory cgroup" in measured.confirm("passed", [["s", [1.0, 2.0]]], left, ref)
    assert measured.confirm("passed", [["s", [1.0, 2.0]]], left, _ref()) is None
    between = measured.outside_the_tests({"rss_growth": 0, "charged_growth": None}, [left])
    assert "left the memory cgroup" in measured.whole_run_disagrees(between, {"rss_growth": 0, "charged_growth": 0})


def test_a_result_without_its_start_is_refuted():
    assert "saw no test run" in measured.confirm("passed", [["s", [1.0, 2.0]]], {}, _ref())



def test_cpu_time_counts_every_thread_of_a_process_the_ended_ones_included():
    proc = _child("import threading, time\n"
                  "def spin():\n    x = 0\n    for _ in range(8_000_000): x += 1\n"
                  "t = threading.Thread(target=spin)\nt.start()\nt.join()\n"
                  "print(time.process_time_ns(), flush=True)\nimport sys\nsys.stdin.read()")
    try:
        claimed = int(proc.stdout.readline())
        pid = proc.pid
        for _ in range(500):                # join() returns before the system has let the thread go
            if len(os.listdir(f"/proc/{pid}/task")) == 1:
                break
            time.sleep(0.01)
        now = procfs.cpu_ns([pid])
        live = procfs._threads_ns(pid)
        assert now >= claimed > live + 50_000_000       # the ended thread's work is in the count
        assert procfs.read(pid).cpu_ns >= now
    finally:
        proc.kill()
        proc.wait()


def _calls_ref(calls, price=0.016):
    ref = _ref()
    ref["measured"]["calls"] = calls
    return ref, price


def _mine_with(calls):
    return {"cpu_s": 1.0, "rss_growth": 0, "peak_growth": 0, "calls": calls}


def test_calls_like_the_references_stand_a_slower_right_answer_included():
    ref, price = _calls_ref([0.001] * 50 + [0.030])
    slower = [0.003] * 50 + [0.055]                       # three times the step, a slower gap: no collection
    assert measured.confirm("passed", [["s", [1.0, 2.0]]], _mine_with(slower), ref, price) is None
    one_automatic = [0.001] * 49 + [0.017, 0.030]         # one collection may fall inside a call
    assert measured.confirm("passed", [["s", [1.0, 2.0]]], _mine_with(one_automatic), ref, price) is None


def test_a_collection_every_few_calls_is_seen_from_outside_whatever_the_process_says():
    ref, price = _calls_ref([0.001] * 50 + [0.030])
    every_tenth = [0.017 if k % 10 == 9 else 0.001 for k in range(50)] + [0.030]
    why = measured.confirm("passed", [["s", [1.0, 2.0]]], _mine_with(every_tenth), ref, price)
    assert why == ("your process reported that the test passed, but the grader, timing each of its 51 calls (requests "
                   "served, steps of a check) from outside, found 5 that took far more CPU time than the reference "
                   "solution's same calls, where the reference's test had 1 that ran one: the longest 17 ms, where the "
                   "reference's took 1.0 ms (median) and a full collection 16 ms. Something collected inside them")


def test_automatic_collections_that_fall_on_other_calls_than_the_references_stand():
    """A right answer allocates otherwise than the reference: its automatic collections fall on other calls
    (measured: lesson 01's scaler written with .item(), two of its 56 flat-check steps, under load)."""
    ref, price = _calls_ref([0.0017] * 20 + [0.010] + [0.0017] * 20 + [0.010] + [0.0017] * 14, price=0.008)
    shifted = [0.0017] * 21 + [0.010] + [0.0017] * 20 + [0.010] + [0.0017] * 13
    assert measured.confirm("passed", [["s", [1.0, 2.0]]], _mine_with(shifted), ref, price) is None


def test_calls_missing_or_added_refute_a_pass():
    ref, price = _calls_ref([0.001] * 20)
    why = measured.confirm("passed", [["s", [1.0, 2.0]]], _mine_with([0.001] * 19), ref, price)
    assert "the grader timed 19 calls" in why and "makes 20" in why
    assert "timed 0 calls" in measured.confirm("passed", [["s", [1.0, 2.0]]], _mine_with([]), ref, price)


def test_a_collection_is_priced_at_the_processs_own_figure_where_the_references_ran_slower():
    """Measured on the toy band-aid lesson: the same full collection cost 3.6 to 12.4 ms of CPU time from one
    run to the next; a reference priced at 10 ms let calls that collected in 3.1 to 3.7 ms pass as clean."""
    slow_reference = {"full_collection_cpu_s": 0.010}
    assert measured.collection_price(slow_reference, {"full_collection_cpu_s": 0.004}) == 0.004
    assert measured.collection_price(slow_reference, {"full_collection_cpu_s": 0.030}) == 0.010


def test_a_process_that_prices_its_collections_near_nothing_or_not_at_all_is_priced_at_the_floor():
    """Frozen objects collect for almost nothing, and a process may skip saying its price: a third of the
    reference's keeps the rule, and the room a right answer's noisy calls need."""
    reference = {"full_collection_cpu_s": 0.009}
    assert measured.collection_price(reference, {"full_collection_cpu_s": 0.0001}) == pytest.approx(0.003)
    assert measured.collection_price(reference, {}) == pytest.approx(0.003)
    assert measured.collection_price({}, {"full_collection_cpu_s": 0.004}) is None


def test_memory_that_grew_between_tests_is_measured_apart_from_the_tests():
    whole = {"rss_growth": 300 * MiB}
    between = measured.outside_the_tests(whole, [{"rss_growth": 100 * MiB}, {"rss_growth": 10 * MiB}])
    assert between == {"rss_growth": 190 * MiB}
    assert "between its tests" in measured.whole_run_disagrees(between, {"rss_growth": 2 * MiB})
    assert measured.whole_run_disagrees({"rss_growth": 20 * MiB}, {"rss_growth": 2 * MiB}) is None
    charged = measured.outside_the_tests({"rss_growth": 0, "charged_growth": 300 * MiB}, [{"charged_growth": 10 * MiB}])
    assert "more memory charged to your process's cgroup" in measured.whole_run_disagrees(
        charged, {"rss_growth": 0, "charged_growth": 0})


def test_hidden_code_is_redacted_however_it_came_back_and_its_messages_are_not():
    hidden = ('_helper_that_builds_the_secret_inputs = [make_pair(_i) for _i in range(_SECRET_COUNT)]\n'
              'assert _left == 0, (f"{_left} bytes left: a pair must free itself when dropped")\n')
    redact = measured.Redactor([hidden])
    assert "_SECRET_COUNT" not in redact("MyError: _helper_that_builds_the_secret_inputs = [make_pair(_i) "
                                         "for _i in range(_SECRET_COUNT)] was in memory")
    assert "make_pair(_i) for _i in range(_SECRET" not in redact("...= [make_pair(_i) for _i in range(_SECRET_COUNT)]")
    assert redact("512 bytes left: a pair must free itself when dropped") == (
        "512 bytes left: a pair must free itself when dropped")


class _FakeNVML:
    """NVML as nvidia-ml-py presents it: per device, the processes using it and their memory (None
    where the driver cannot say)."""

    def __init__(self, devices):
        self.devices = devices

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        from types import SimpleNamespace
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.devices[handle]]


def test_gpu_memory_is_the_drivers_figure_for_the_session_on_every_device(monkeypatch):
    nvml = _FakeNVML([[(10, 300 * MiB), (99, 5000 * MiB)], [(11, 200 * MiB), (10, None)]])
    monkeypatch.setattr(procfs, "_NVML", [nvml])
    monkeypatch.setattr(procfs.os.path, "exists", lambda path: path == "/dev/nvidiactl")
    assert procfs._gpu_bytes([10, 11]) == 500 * MiB          # another user's process (99) is not counted
    monkeypatch.setattr(procfs, "_NVML", [None])              # no nvidia-ml-py, or the driver refused
    assert procfs._gpu_bytes([10, 11]) is None


def test_a_test_whose_gpu_memory_grew_past_the_references_is_refuted_by_the_drivers_figure():
    ref = _ref()
    ref["measured"]["gpu_growth"] = 8 * MiB
    mine = {"cpu_s": 1.0, "rss_growth": 0, "peak_growth": 0, "gpu_growth": 300 * MiB}
    why = measured.confirm("passed", [["s", [1.0, 2.0]]], mine, ref)
    assert "300.0 MiB more GPU memory (the driver's figure) over the test" in why
    assert measured.confirm("passed", [["s", [1.0, 2.0]]], {**mine, "gpu_growth": 10 * MiB}, ref) is None


def _row(sent, done, cpu_sent_ms, cpu_done_ms):
    return [sent, sent, done, 200, int(cpu_sent_ms * 1e6), int(cpu_done_ms * 1e6)]


def test_busy_stretches_are_the_servers_cpu_between_answers_while_requests_wait():
    rows = [_row(0.0, 0.010, 0, 2),          # alone: 2 ms of CPU from its sending to its answer
            _row(0.020, 0.140, 5, 108),       # idle from 0.010 to 0.020 (3 ms of CPU there: in no stretch)
            _row(0.030, 0.150, 10, 110)]      # sent during the other's pause: it waits behind it too
    assert [round(x * 1e3) for x in measured.busy_stretches(rows)] == [2, 103, 2]
    assert measured.busy_stretches([[0.0, None, None, 0, None, None]]) == []       # never sent


def _load(stretches, answered=None, key="--rate 250 --count 301"):
    return {"key": key, "requests": len(stretches), "answered": len(stretches) if answered is None else answered,
            "stretches": stretches}


def test_a_servers_pauses_inside_requests_are_read_from_outside_against_the_budget():
    ref = _ref()
    ref["measured"]["loads"] = [_load([0.001] * 300 + [0.012])]
    mine = {"cpu_s": 1.0, "rss_growth": 0, "peak_growth": 0}
    quiet = {**mine, "loads": [_load([0.002] * 299 + [0.020, 0.030])]}
    assert measured.confirm("passed", [["s", [1.0, 2.0]]], quiet, ref) is None
    three_pauses = {**mine, "loads": [_load([0.001] * 300 + [0.100] * 3)]}     # 1 in 100 may
    assert measured.confirm("passed", [["s", [1.0, 2.0]]], three_pauses, ref) is None
    four_pauses = {**mine, "loads": [_load([0.001] * 300 + [0.100] * 4)]}
    why = measured.confirm("passed", [["s", [1.0, 2.0]]], four_pauses, ref)
    assert "found 4 moments in which it ran up to 100 ms of CPU with requests waiting" in why
    assert "the reference solution's server ran at most 12.0 ms between two answers" in why
    unanswered = {**mine, "loads": [_load([0.001] * 301, answered=250)]}
    assert "at most 250 were answered (the reference's: 301)" in measured.confirm("passed", [["s", [1.0, 2.0]]],
                                                                                  unanswered, ref)
    assert "never asked to send the load" in measured.confirm("passed", [["s", [1.0, 2.0]]], mine, ref)
    served_again = {**mine, "loads": [_load([0.001] * 301, answered=250), _load([0.002] * 301)]}   # a busy first run
    assert measured.confirm("passed", [["s", [1.0, 2.0]]], served_again, ref) is None
    other_load = {**mine, "loads": [_load([0.5] * 301, key="--rate 10 --count 301")]}
    assert "never asked to send the load" in measured.confirm("passed", [["s", [1.0, 2.0]]], other_load, ref)


def _load_seen(held, digests, key="--rate 250 --count 4"):
    return {"key": key, "requests": len(digests), "answered": sum(d is not None for d in digests), "held": held,
            "digests": digests, "stretches": [0.001] * len(digests)}


def test_a_load_served_by_another_process_than_the_one_timed_is_refuted():
    ref = _ref()
    ref["measured"]["loads"] = [_load_seen(4, ["a", "b", "c", "d"])]
    mine = {"cpu_s": 1.0, "rss_growth": 0, "peak_growth": 0}
    same = {**mine, "loads": [_load_seen(4, ["a", "b", "c", "d"])]}
    assert measured.confirm("passed", [["s", [1.0, 2.0]]], same, ref) is None
    decoy = {**mine, "loads": [_load_seen(0, ["a", "b", "c", "d"])]}        # a decoy's CPU time was read
    why = measured.confirm("passed", [["s", [1.0, 2.0]]], decoy, ref)
    assert "4 of the 4 answers the grader's load received came over connections that the process whose CPU " \
           "time it read did not hold" in why
    unreadable = {**mine, "loads": [_load_seen(None, ["a", "b", "c", "d"])]}
    assert "did not hold" in measured.confirm("passed", [["s", [1.0, 2.0]]], unreadable, ref)
    ref["measured"]["loads"] = [_load_seen(None, ["a", "b", "c", "d"])]     # a machine where nobody's can be read
    assert measured.confirm("passed", [["s", [1.0, 2.0]]], decoy, ref) is None


def test_answers_other_than_the_reference_servers_refute_a_pass():
    ref = _ref()
    ref["measured"]["loads"] = [_load_seen(3, ["a", "b", None, "d"])]
    mine = {"cpu_s": 1.0, "rss_growth": 0, "peak_growth": 0}
    one_unanswered = {**mine, "loads": [_load_seen(3, ["a", None, "c", "d"])]}       # compared where both answered
    assert measured.confirm("passed", [["s", [1.0, 2.0]]], one_unanswered, ref) is None
    made_up = {**mine, "loads": [_load_seen(4, ["a", "x", "c", "y"])]}
    why = measured.confirm("passed", [["s", [1.0, 2.0]]], made_up, ref)
    assert "2 of your server's 3 answers differed from the reference server's answers to the same requests" in why
