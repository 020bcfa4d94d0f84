"""The grader's own measurements, which decide whether a test's "passed" stands.

The process that runs a learner's code can read and rewrite any address of itself, so what it
reports (a test passed, a meter read 0 B, a check saw no collection) explains a result but never
decides it.  A test's point stands only when the grader, in its own process, confirms it:

1. **Outputs.**  What the test observed (`gclab.checks.observe`: the values it compared, what a
   flat check's steps returned) equals what the same test observed running the reference
   solution, under the same conditions on the same machine.  A "passed" with nothing to compare
   is not one.
2. **Work done.**  The process spent on the CPU during the test at least a fifth of the time the
   reference's spent (the kernel's CPU-time clock of the process, every thread's time, those that
   ended included; waiting for a core does not inflate it): a test
   whose result arrives without its work having run did not run.
3. **Memory.**  The process's resident memory and its peak over the test (`VmRSS`, `VmHWM` after
   resetting it at the test's start; each with what it has in swap, `VmSwap`), and over the whole run,
   stayed within a margin of the reference's; so did what the kernel charged to the verdict's memory cgroup,
   and its peak, where it has one (`memory_group`: shared memory and the page cache included, which memory
   moved out of the process's pages stays in); on a GPU, the driver's figure for the process as well.

`Watch` takes the readings as the verdict process's messages arrive; `reference` runs the
reference solution once per lesson, source and machine and keeps its figures; `confirm` turns a
test that passed in the learner's process but not by these figures into a failure that says, in
words, what the process reported and what the system measured.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import math
import os
import platform
import statistics
import sys
from pathlib import Path

from .. import procfs

MiB = 1024 * 1024
WORK_FRACTION = 0.2          # of the reference's CPU time a test must at least spend ...
WORK_FLOOR_S = 0.05          # ... where the reference spends at least this much
# memory a test (or the whole run) may take beyond the reference's: a fixed slack for the allocator's
# and the interpreter's own noise, plus a share of what the reference itself grew.  A test's slack is what
# glibc may keep of one freed block: after an mmapped block is freed it serves blocks that size from its
# heap, which it need not give back, up to 32 MiB (DEFAULT_MMAP_THRESHOLD_MAX); measured, lesson 00's
# 24 MiB seed tensor, freed, stayed resident 0 to 5 MiB in the reference's run and 23.1 to 24.1 MiB in a
# right answer's, which a 24 MiB slack failed 4 times in 6
TEST_SLACK, RUN_SLACK, SHARE = 32 * MiB, 48 * MiB, 0.25
CALL_FACTOR = 2              # a call may take this many times the reference's same call, plus half a collection
CHARGED = "memory charged to your process's cgroup (shared memory and the files it wrote included)"
STRETCH_FLOOR_S = 0.010      # the least "longest stretch" of a reference's server that a load is judged against


class Watch:
    """The grader's readings of one verdict process (its session `sid`), taken as its messages arrive:
    at "ready" (before any learner code runs), at each test's start and result, and at the end.

    The whole run is read from the first test's start: memory the answer cells take once (a library they
    import) is theirs; whatever the tests drive, inside their windows or between them, is counted."""

    def __init__(self, sid: int, group=None):
        self.sid, self.before_answers, self.first, self.final, self.peak = sid, None, None, None, 0
        self.group, self.charged_peak, self.left_group = group, 0, False    # its memory cgroup, if any
        self.window = None
        self.answers: dict = {}
        self.pids: list[int] = []
        self.marks: list[int] = []
        self.prices: list[int] = []
        self.loads: list[dict] = []

    def _read(self) -> procfs.Reading:
        reading = procfs.read(self.sid)
        if self.group is not None:
            charged = self.group.read(procfs.session_members(self.sid))
            if charged is not None:
                reading = dataclasses.replace(reading, charged=charged[0], charged_peak=charged[1])
        if self.first is not None:
            self.peak = max(self.peak, reading.peak)
            if reading.charged is None:
                self.left_group = True
            else:
                self.charged_peak = max(self.charged_peak, reading.charged_peak)
        procfs.reset_peaks(self.sid)
        return reading

    def _between(self, start: procfs.Reading, end: procfs.Reading, peak: int, charged_peak: int | None) -> dict:
        figures = _between(start, end, peak)
        if self.group is not None:
            grew = None not in (start.charged, end.charged, charged_peak)
            figures["charged_growth"] = end.charged - start.charged if grew else None
            figures["charged_peak_growth"] = max(charged_peak, end.charged) - start.charged if grew else None
        return figures

    def ready(self) -> None:
        self.before_answers = self._read()

    def start(self) -> None:
        self.window = self._read()
        self.pids, self.marks, self.loads = procfs.session_members(self.sid), [], []
        if self.first is None:
            self.first = self.window
            if self.before_answers is not None:
                self.answers = self._between(self.before_answers, self.first, self.first.peak, self.first.charged_peak)

    def mark(self) -> None:
        """A boundary of a call the test's code makes (gclab.outside): the CPU time now."""
        if self.window is not None:
            self.marks.append(procfs.cpu_ns(self.pids))

    def load(self, key: str, rows: list) -> None:
        """A load the grader sent during the test (`key`: its schedule's arguments; rows of
        `serving.load_rows`, with the server's CPU time read, whether the server held each answer's
        connection, and each answer's digest)."""
        if self.window is not None:
            answered = [r for r in rows if r[2] is not None]
            self.loads.append({"key": key, "requests": len(rows), "answered": len(answered),
                               "held": sum(1 for r in answered if r[6] is True),
                               "digests": [r[7] if r[2] is not None else None for r in rows],
                               "stretches": [round(x, 6) for x in busy_stretches(rows)]})

    def price(self) -> None:
        """Between the full collections the verdict process runs before its tests (their price)."""
        self.prices.append(procfs.cpu_ns(procfs.session_members(self.sid)))

    def result(self, test_id: str) -> dict:
        if self.window is None:
            return {}
        start, end = self.window, self._read()
        self.window = None
        figures = self._between(start, end, end.peak, end.charged_peak)
        if len(self.marks) > 1:
            figures["calls"] = [round((b - a) / 1e9, 6) for a, b in zip(self.marks, self.marks[1:])]
        if self.loads:
            figures["loads"] = self.loads
        return figures

    def end(self) -> dict:
        """The whole run of the tests, from the first one's start to now; the answer cells' own
        figures under "answers"; what a full collection cost the process, where it said."""
        if self.first is None:
            return {}
        if self.final is None:
            self.final = self._read()
        charged_peak = None if self.left_group else self.charged_peak
        figures = {**self._between(self.first, self.final, self.peak, charged_peak), "answers": self.answers}
        if len(self.prices) >= 2:
            figures["full_collection_cpu_s"] = statistics.median(
                (b - a) / 1e9 for a, b in zip(self.prices, self.prices[1:]))
        return figures


def _between(start: procfs.Reading, end: procfs.Reading, peak: int) -> dict:
    figures = {"cpu_s": (end.cpu_ns - start.cpu_ns) / 1e9, "rss_growth": end.rss - start.rss,
               "peak_growth": max(peak, end.rss) - start.rss, "threads": end.threads, "processes": end.processes}
    if start.gpu is not None and end.gpu is not None:
        figures["gpu_growth"] = end.gpu - start.gpu
    return figures


# -- the reference solution's figures, once per lesson, source and machine -----------------------
def machine_key(conditions: dict) -> str:
    """What the reference's figures depend on beside the lesson's source: this Python, the grader's
    own code, the machine's kind, and the grading conditions."""
    digest = hashlib.sha256(json.dumps(conditions, sort_keys=True).encode())
    digest.update(f"{sys.version}|{platform.machine()}|{os.cpu_count()}|{os.path.exists('/dev/nvidiactl')}".encode())
    package = Path(__file__).parent.parent          # gclab/: the grader and the instruments it runs
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def reference(cache: Path | None, compute) -> dict:
    """The reference's figures, {"tests": {id: {"status", "observed", "measured"}}, "run": {...}}: read
    from `cache` where it holds them, else `compute()`d (under a lock, so that graders running side by
    side compute it once) and kept there when every test passed."""
    if cache is None:
        return compute()
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return json.loads(cache.read_text())
        except (OSError, ValueError):
            pass
        figures = compute()
        if not all(t["status"] == "passed" for t in figures["tests"].values()):
            figures = compute()       # once more: a reference that fails here is the machine's doing
        if all(t["status"] == "passed" for t in figures["tests"].values()):
            partial = cache.with_suffix(f".{os.getpid()}.part")
            partial.write_text(json.dumps(figures))
            partial.rename(cache)
        return figures


# -- a test's "passed", confirmed ------------------------------------------------------------------
def confirm(status: str, observed, measured: dict, reference_test: dict | None,
            price: float | None = None) -> str | None:
    """None where the grader's own figures confirm a test the learner's process says `status`
    "passed"; else why not, in words a learner can read.  `price`: the CPU seconds a full collection
    is taken to cost (see `collection_price`)."""
    if status != "passed":
        return None
    if not reference_test or reference_test.get("status") != "passed":
        return ("the grader could not confirm this test: the reference solution did not pass it on this "
                "machine (an instructor should look at the grading machine)")
    expected = reference_test.get("observed") or []
    if not expected:
        return ("the grader could not confirm this test: it records no output to compare with the reference "
                "solution's (a course's test observes what it checks: gclab.checks.observe)")
    different = differing_output(observed or [], expected)
    if different:
        return f"your process reported that the test passed, but {different}"
    ref = reference_test.get("measured") or {}
    if not measured and ref:
        return ("your process reported that the test passed, but the grader saw no test run: the result came "
                "without the test's start")
    return (_figures_disagree(measured, ref, TEST_SLACK, "over the test")
            or calls_disagree(measured.get("calls") or [], ref.get("calls") or [], price)
            or loads_disagree(measured.get("loads") or [], ref.get("loads") or []))


PRICE_FLOOR = 1 / 3


def collection_price(reference_run: dict, own_run: dict) -> float | None:
    """The CPU seconds a full collection is taken to cost by `calls_disagree`: the reference solution's
    price, or the graded process's own where lower, but not below a third of the reference's.  The own
    price is taken in the same process moments before its calls, so a machine that ran slower for the
    reference's run than for this one does not hide a collection inside a call; a process can only lower
    it, against itself (one that does not say it is priced at the floor); the floor leaves a process
    whose objects are frozen (which collects for almost nothing) the room its calls' noise needs."""
    reference = reference_run.get("full_collection_cpu_s")
    if not reference:
        return None
    return max(min(reference, own_run.get("full_collection_cpu_s") or 0.0), reference * PRICE_FLOOR)


def calls_disagree(calls: list, ref_calls: list, price: float | None) -> str | None:
    """Why the CPU time of a test's calls, read from outside at each mark (gclab.outside), refutes its
    "passed", or None.  A call that took more than twice the reference's same call (or its median call,
    if more) plus half a full collection's price ran (most of) a collection the reference's did not.  A
    right answer's automatic collections fall where they fall (where its own allocations and the
    machine's timing put them), so such calls are counted, not matched call by call: the test may have as
    many as the reference solution's same test had calls that ran one, plus one, or one in a hundred."""
    if not ref_calls:
        return None
    if len(calls) != len(ref_calls):
        return (f"your process reported that the test passed, but the grader timed {len(calls)} calls (requests "
                f"served, steps of a check), where the reference solution's test makes {len(ref_calls)}: the "
                "test's calls did not run as written")
    if not price:
        return None
    typical = statistics.median(ref_calls)
    over = [got for got, ref in zip(calls, ref_calls) if got > CALL_FACTOR * max(ref, typical) + price / 2]
    ref_over = sum(1 for ref in ref_calls if ref > CALL_FACTOR * typical + price / 2)
    if len(over) <= ref_over + max(1, len(calls) // 100):
        return None
    return (f"your process reported that the test passed, but the grader, timing each of its {len(calls)} calls "
            f"(requests served, steps of a check) from outside, found {len(over)} that took far more CPU time than "
            f"the reference solution's same calls, where the reference's test had {ref_over} that ran one: the longest "
            f"{max(over) * 1e3:.0f} ms, where the reference's took {typical * 1e3:.1f} ms (median) and a full "
            f"collection {price * 1e3:.0f} ms. Something collected inside them")


def busy_stretches(rows: list) -> list[float]:
    """From a load's rows (scheduled, sent, done, status, server CPU ns at sent, at done): the CPU seconds
    the server ran from each answer (or from the request that ended an idle moment) to the next answer,
    while requests were in flight all along.  A collection inside requests holds every answer back, so
    it shows whole in one stretch; what the server runs while none is in flight is in none."""
    events = sorted([(r[1], 1, r[4]) for r in rows if r[1] is not None and r[4] is not None]
                    + [(r[2], -1, r[5]) for r in rows if r[2] is not None and r[5] is not None])
    stretches, in_flight, since = [], 0, None
    for _, change, cpu in events:
        if change > 0 and in_flight == 0:
            since = cpu
        elif change < 0 and since is not None:
            stretches.append((cpu - since) / 1e9)
            since = cpu
        in_flight = max(0, in_flight + change)
        if in_flight == 0:
            since = None
    return stretches


def loads_disagree(loads: list, ref_loads: list) -> str | None:
    """Why the server's CPU time while requests were in flight, read from outside during the loads the
    grader sent (`busy_stretches`), refutes a test's "passed", or None.  Loads are matched to the
    reference's by their schedule (a check may serve the same load again, or with the collector off).
    A stretch longer than twice the reference's longest (taken as at least 10 ms) plus 10 ms held requests
    behind a pause the reference's never had: no more than one in a hundred may, as the P99 budget
    allows (a busy machine, or a collection just as a request arrives, makes a few such).  So a full
    collection in a request now and then, which the test's own rule forbids, is not refuted from
    outside, nor is a pause shorter than the limit (a full collection over a frozen heap)."""
    for key in dict.fromkeys(ref["key"] for ref in ref_loads):
        ref = next(r for r in ref_loads if r["key"] == key)
        mine = [load for load in loads if load.get("key") == key]
        if not mine:
            return (f"your process reported that the test passed, but the grader was never asked to send the load "
                    f"the test serves ({ref['requests']} requests): the test did not run as written")
        answered = max(load["answered"] for load in mine)
        if answered < ref["answered"] - ref["requests"] // 100:
            return (f"your process reported that the test passed, but of the {ref['requests']} requests the grader "
                    f"sent to your server, at most {answered} were answered (the reference's: {ref['answered']})")
        for load in mine:
            why = _served_elsewhere(load, ref) or _answered_otherwise(load, ref)
            if why:
                return why
        limit = 2 * max(max(ref["stretches"], default=0.0), STRETCH_FLOOR_S) + 0.010
        for load in mine:
            over = [x for x in load["stretches"] if x > limit]
            if len(over) > len(load["stretches"]) // 100:
                return (f"your process reported that the test passed, but the grader, sending the load itself and "
                        f"reading your server's CPU time at every request sent and answered, found "
                        f"{'a moment' if len(over) == 1 else f'{len(over)} moments'} in which it ran up to "
                        f"{max(over) * 1e3:.0f} ms of CPU with requests waiting, where "
                        f"the reference solution's server ran at most {max(ref['stretches'], default=0.0) * 1e3:.1f} "
                        "ms between two answers: collector pauses inside requests, in more than one in a hundred")
    return None


def _served_elsewhere(load: dict, ref: dict) -> str | None:
    """Where the reference's server was seen holding every connection it answered over, and this one was
    not: the CPU time the grader read was another process's (a decoy the server forked, or one the
    verdict named as its server)."""
    if ref.get("held") != ref["answered"] or load.get("held") == load["answered"]:
        return None
    elsewhere = load["answered"] - (load.get("held") or 0)
    return (f"your process reported that the test passed, but {elsewhere} of the {load['answered']} answers the "
            "grader's load received came over connections that the process whose CPU time it read did not hold: "
            "another process served them, so the grader could not time your server's pauses")


def _answered_otherwise(load: dict, ref: dict) -> str | None:
    """Where the server's answers differ from the reference server's answers to the same requests."""
    pairs = [(mine, theirs) for mine, theirs in zip(load.get("digests") or [], ref.get("digests") or [])
             if mine is not None and theirs is not None]
    differ = sum(1 for mine, theirs in pairs if mine != theirs)
    if not differ:
        return None
    return (f"your process reported that the test passed, but {differ} of your server's {len(pairs)} answers "
            "differed from the reference server's answers to the same requests: the server did not run its own "
            "code to answer them")


def _figures_disagree(measured: dict, ref: dict, slack: int, span: str) -> str | None:
    cpu, ref_cpu = measured.get("cpu_s", 0.0), ref.get("cpu_s", 0.0)
    if ref_cpu >= WORK_FLOOR_S and cpu < WORK_FRACTION * ref_cpu:
        return (f"your process reported that the test passed, but the system measured {cpu:.3f} s on the CPU "
                f"{span}, where the reference solution spends {ref_cpu:.2f} s: the test's work did not run")
    for key, what in MEMORY_FIGURES:
        if key not in measured or ref.get(key) is None:
            continue
        if measured[key] is None:
            return _LEFT_THE_GROUP
        allowed = _allowed(ref[key], slack)
        if measured[key] > allowed:
            return (f"your process reported that the test passed; the system measured {_mib(measured[key])} more "
                    f"{what} {span}, where the reference solution's grew {_mib(ref[key])} "
                    f"(allowed: {_mib(allowed)})")
    return None


MEMORY_FIGURES = (("rss_growth", "resident memory (swap included)"),
                  ("peak_growth", "peak resident memory (swap included)"),
                  ("charged_growth", CHARGED),
                  ("charged_peak_growth", "peak " + CHARGED),
                  ("gpu_growth", "GPU memory (the driver's figure)"))
_LEFT_THE_GROUP = ("your process reported that the test passed, but the grader could not read the memory charged to "
                   "it: a process of the verdict left the memory cgroup the grader made for it")


def without_charges(figures: dict) -> dict:
    """`figures` less those of the verdict's memory cgroup."""
    return {key: value for key, value in figures.items() if not key.startswith("charged_")}


def without_timings(figures: dict) -> dict:
    """`figures` less the CPU time of the test's calls and of its loads' busy stretches (`calls_disagree`,
    `loads_disagree`); how many calls there were, and all else of the loads, kept."""
    steady = dict(figures)
    if "calls" in figures:
        steady["calls"] = [0.0] * len(figures["calls"])
    if "loads" in figures:
        steady["loads"] = [{**load, "stretches": []} for load in figures["loads"]]
    return steady


def _allowed(reference_growth: int, slack: int) -> float:
    """Growth allowed where the reference's grew `reference_growth` (what a reference frees, of memory
    earlier tests left, is no growth the learner's must match)."""
    base = max(reference_growth, 0)
    return base + slack + SHARE * base


def outside_the_tests(whole: dict, tests) -> dict:
    """The whole run's growth less what the tests' own windows grew: what grew while no test ran (code
    of the learner's in a thread, a finalizer, between tests)."""
    if not whole:
        return {}
    between = {}
    for key in ("rss_growth", "charged_growth"):
        if key in whole:
            within = [m.get(key, 0) for m in tests]
            between[key] = None if whole[key] is None or None in within else whole[key] - sum(within)
    return between


def whole_run_disagrees(measured: dict, ref: dict) -> str | None:
    """Why the memory that grew between the tests (from the first test's start to the end, less the
    tests' own windows) refutes the tests' "passed", or None."""
    for key, what in (("rss_growth", "memory held by your process"), ("charged_growth", CHARGED)):
        if key not in measured or ref.get(key) is None:
            continue
        if measured[key] is None:
            return _LEFT_THE_GROUP.replace("the test passed", "its tests passed")
        allowed = _allowed(ref[key], RUN_SLACK)
        if measured[key] > allowed:
            return (f"your process reported that its tests passed; the system measured {_mib(measured[key])} "
                    f"more {what} between its tests (while no test ran), where the reference "
                    f"solution's grew {_mib(ref[key])} (allowed: {_mib(allowed)})")
    return None


def _mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"


def differing_output(observed: list, expected: list) -> str | None:
    """How the outputs a test observed differ from the reference's, or None where they agree."""
    if len(observed) != len(expected):
        return (f"it recorded {len(observed)} outputs where the same test, running the reference solution, "
                f"recorded {len(expected)}")
    # compared by position: a name is for the message (it may hold readings, in an order of the code's own)
    for (_, got), (name, want) in zip(observed, expected):
        if len(got) != len(want):
            return f"{name}: {len(got)} values where the reference solution gave {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            if not _same(g, w):
                return f"{name}: value {i} is {g!r} where the reference solution gave {w!r}"
    return None


def _same(got, want) -> bool:
    if type(got) in (int, float) and type(want) in (int, float) and type(got) is not bool and type(want) is not bool:
        return math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)
    return type(got) is type(want) and got == want


# -- nothing of a hidden test handed back ----------------------------------------------------------
PIECE = 40        # characters in a row shared with a hidden test that count as a piece of it


class Redactor:
    """Removes every line of the hidden tests, and every piece of their code of PIECE characters or more,
    from a text: whatever route it took into a message (a learner's code can read the tests' source
    from its own memory and raise it as its own error).  The tests' own messages (their string
    literals) are written for the learner and are not pieces of code."""

    def __init__(self, hidden_sources, visible_text: str = ""):
        text = "\n".join(hidden_sources)
        self.lines = sorted({line.strip() for line in text.splitlines()
                             if len(line.strip()) > 8 and line.strip() not in visible_text}, key=len, reverse=True)
        code = "\n".join(_without_strings(source) for source in hidden_sources)
        self.pieces = {code[i:i + PIECE] for i in range(max(len(code) - PIECE + 1, 0))
                       if "\0" not in code[i:i + PIECE] and code[i:i + PIECE] not in visible_text}

    def __call__(self, text: str) -> str:
        if not text or not (self.lines or self.pieces):
            return text
        for line in self.lines:
            if line in text:
                text = text.replace(line, "[a line of a hidden test]")
        covered = [False] * len(text)
        for i in range(len(text) - PIECE + 1):
            if text[i:i + PIECE] in self.pieces:
                covered[i:i + PIECE] = [True] * PIECE
        if not any(covered):
            return text
        out, i = [], 0
        while i < len(text):
            if covered[i]:
                while i < len(text) and covered[i]:
                    i += 1
                out.append("[part of a hidden test]")
            else:
                out.append(text[i])
                i += 1
        return "".join(out)


def _without_strings(source: str) -> str:
    """`source` with each string literal (f-strings included) replaced by a NUL, where it tokenizes."""
    import io
    import tokenize
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return source
    lines = source.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    out, at = [], 0
    for token in tokens:
        if token.type != tokenize.STRING:
            continue
        begin = starts[token.start[0] - 1] + token.start[1]
        end = starts[token.end[0] - 1] + token.end[1]
        out += [source[at:begin], "\0"]
        at = end
    out.append(source[at:])
    return "".join(out)
