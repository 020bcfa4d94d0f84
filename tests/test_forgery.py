"""Grades the learner's code cannot forge (on lesson 07, the quickest to grade).

The process that runs a learner's code can read and write any address of itself: through numpy, an
array over any address (`__array_interface__`) reads and rewrites memory with no audit event.  So these
submissions lie, each in its own way, about what their process did; the grader decides from what it
measured itself (outputs compared with the reference solution's, what the system reports about the
process) and each loses the points its code did not earn, with a reason a learner can read."""
import os

import nbformat
import pytest

from lesson_support import ROOT, assert_full_marks, cell_result, grade_all, write_variants
from test_lesson_03 import LEAKY as LEAKY_PAIR, RELEASE as RELEASE_03
from test_lesson_07 import POINTS, RELEASE, reference, strong
from test_lesson_04 import RELEASE as RELEASE_04, WRONG as WRONG_04, view as view_04
from test_lesson_06 import REFERENCE as RIGHT_POLICY_06, RELEASE as RELEASE_06

from gclab.grader import grading, memory_group

# An array over any address: what the attacks below read and write memory with.
ANY_ADDRESS = '''
import numpy as _np
class _At:
    def __init__(self, address, size):
        self.__array_interface__ = {"data": (address, False), "shape": (size,), "typestr": "|u1", "version": 3}
def _memory(address, size):
    return _np.asarray(_At(address, size))
def _regions(writable=True):
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if fields[1].startswith("rw" if writable else "r") and end - start < 1 << 30:
                yield start, end
def _readable(address, size):
    return any(start <= address and address + size <= end for start, end in _regions(False))
'''

# The result channel's token read out of memory (the verdict's token object, found by its class's address),
# then a "passed" written for every test with it, and the channel pointed at /dev/null so that no real result
# follows.
FORGES_RESULT_LINES = ANY_ADDRESS + '''
import os, re, json, struct, sys
def _instance_of(kind):
    needle = struct.pack("<Q", id(kind))
    for start, end in _regions():
        data = _memory(start, end - start).tobytes()
        at = data.find(needle)
        while at != -1:
            if at >= 8 and at % 8 == 0:
                value = struct.unpack("<Q", data[at + 8:at + 16])[0]       # its one slot: the token, a str
                text = _memory(value + 48, 32).tobytes() if _readable(value + 48, 32) else b""
                if re.fullmatch(rb"[0-9a-f]{32}", text):
                    return text.decode()
            at = data.find(needle, at + 1)
def _token():
    for module in [m for m in list(sys.modules.values()) if hasattr(m, "_Token")]:
        found = _instance_of(module._Token)
        if found:
            return found
_t = _token()
for _fd in range(3, 256):
    try:
        _link = os.readlink(f"/proc/self/fd/{_fd}")
    except OSError:
        continue
    if _link.startswith(("socket:", "pipe:")):
        for _test in ("test_same_model", "test_frees_memory", "test_no_stale_entries", "test_keeps_recent"):
            for _event in ({"event": "start", "test": _test},
                           {"event": "result", "test": _test, "status": "passed", "message": "", "output": ""}):
                try:
                    os.write(_fd, (json.dumps({"token": _t, **_event}) + "\\n").encode())
                except OSError:
                    pass
        os.dup2(os.open(os.devnull, os.O_RDWR), _fd)
'''

# No token needed: the channel's file descriptor swapped for one end of a socket pair, and a thread that
# passes on every message of the verdict's, each result turned into "passed" (its outputs as they were).
RELAYS_THE_CHANNEL_SAYING_PASSED = '''
import json, os, socket, threading
def _relay(channel):
    real = os.dup(channel)
    mine, theirs = socket.socketpair()
    os.dup2(theirs.fileno(), channel)
    def run():
        pending = b""
        while True:
            data = mine.recv(1 << 20)
            if not data:
                return
            pending += data
            while b"\\n" in pending:
                line, pending = pending.split(b"\\n", 1)
                message = json.loads(line)
                if message.get("event") == "result":
                    message.update(status="passed", message="")
                os.write(real, (json.dumps(message) + "\\n").encode())
                if message.get("event") in ("ready", "start", "result", "done", "mark", "price"):
                    mine.send(os.read(real, 1))
                elif message.get("event") == "load":     # the rows of a load the grader sent: their length first
                    size = os.read(real, 8)
                    left = int.from_bytes(size, "big")
                    mine.send(size)
                    while left:
                        chunk = os.read(real, left)
                        mine.send(chunk)
                        left -= len(chunk)
    threading.Thread(target=run, daemon=True).start()
for _fd in range(3, 256):
    try:
        if os.readlink(f"/proc/self/fd/{_fd}").startswith("socket:"):
            _relay(_fd)
            break
    except OSError:
        pass
'''

# Memory no meter sees: from a cache's 100th call on, a numpy array of 256 KiB, written to (so resident),
# kept for every call; the self-checks and short tests, which make fewer calls, never meet it.
HOARDS_WHAT_NO_METER_SEES = reference(
    first="self._calls = getattr(self, '_calls', 0) + 1\n"
          "        if self._calls > 100:\n"
          "            _HOARD.append(_np.ones(64 * 1024, dtype=_np.float32))   # a 'prefetch buffer', never freed"
) + "\nimport numpy as _np\n_HOARD = []\n"

# Caches right at first that stop: after 1,000 calls, or for names with a "/" (a hub's "org/model")
STOPS_EVICTING_AFTER_1000_CALLS = reference(strong='''self._calls = getattr(self, "_calls", 0) + 1
        self._recent[name] = model
        self._recent.move_to_end(name)
        while len(self._recent) > self.keep and self._calls <= 1000:
            self._recent.popitem(last=False)''')
PINS_NAMES_WITH_A_SLASH = reference(strong='''self._recent[name] = model
        self._recent.move_to_end(name)
        if "/" in name:
            self.__dict__.setdefault("_pinned", []).append(model)     # hub models: kept warm
        while len(self._recent) > self.keep:
            self._recent.popitem(last=False)''')


# The meter's own count rewritten: each pair's tensors taken out of the CPU meter's records as they are made,
# so that it reads 0 B while every pair stays held; and the channel relayed, each failure of a check that sees
# otherwise (the allocator's census, the process's memory) turned into "passed".
REWRITES_THE_METERS_COUNT = """
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
def _unseen(*tensors):
    for mode in _get_current_dispatch_mode_stack():
        size, weak = getattr(mode, "_size", None), getattr(mode, "_weak", None)
        if size is None:
            continue
        for tensor in tensors:
            key = tensor.untyped_storage()._cdata
            if key in size:
                mode._counted -= size.pop(key)
                weak.pop(key, None)
""" + LEAKY_PAIR.format(extra="_unseen(head.tensor, tail.tensor)") + RELAYS_THE_CHANNEL_SAYING_PASSED


def only_when_graded(condition: str) -> str:
    """The right cache where `condition` says it runs under grading, the lesson's leaky one elsewhere."""
    return ("import os, sys\n" + f"_GRADED = {condition}\n" + reference()
            + "\nif not _GRADED:\n" + "\n".join("    " + line for line in strong().splitlines()))


FORGED = {
    "cheat_forges_result_lines": strong() + FORGES_RESULT_LINES,
    "cheat_relays_the_channel_saying_passed": strong() + RELAYS_THE_CHANNEL_SAYING_PASSED,
}
TIME_BOMBS = {
    "stops_evicting_after_1000_calls": STOPS_EVICTING_AFTER_1000_CALLS,
    "pins_names_with_a_slash": PINS_NAMES_WITH_A_SLASH,
}
# Each condition held while graded before this grader's folder, environment, command line and parent
# process looked like a learner's own (JupyterLab's kernel, `make lab`'s server).
ONLY_WHEN_GRADED = {
    "right_only_in_a_grading_folder": only_when_graded(
        "'gclab-grade' in os.getcwd() or os.path.basename(os.getcwd()) != '07_weakref_caches'"),
    "right_only_with_the_graders_environment": only_when_graded(
        "os.environ.get('MPLBACKEND') == 'Agg' or 'PYTHONWARNINGS' in os.environ or "
        "not os.environ.get('JPY_PARENT_PID')"),
    "right_only_with_the_graders_arguments": only_when_graded(
        "'gclab' in ' '.join(sys.argv) or 'ipykernel' not in sys.argv[0]"),
    # what the system says of the process: the command line and environment it started with, its parent's
    "right_only_with_the_graders_command_line": only_when_graded(
        "'gclab' in open('/proc/self/cmdline').read() or 'ipykernel_launcher' not in open('/proc/self/cmdline').read()"),
    "right_only_with_the_graders_starting_environment": only_when_graded(
        "any(v.startswith((b'PYTHONWARNINGS=', b'GCLAB_GRADE', b'NBGRADER')) "
        "for v in open('/proc/self/environ', 'rb').read().split(b'\\0'))"),
    "right_only_under_the_graders_parent": only_when_graded(
        "'gclab' in open(f'/proc/{os.getppid()}/cmdline').read() or "
        "open(f'/proc/{os.getppid()}/comm').read().strip() != 'jupyter-lab'"),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("forged")
    variants = {**FORGED, **TIME_BOMBS, **ONLY_WHEN_GRADED, "right": reference(), "leaky": strong(),
                "hoards_what_no_meter_sees": HOARDS_WHAT_NO_METER_SEES}
    return grade_all(write_variants(RELEASE, variants, folder), folder)


def test_the_right_cache_earns_full_marks_beside_the_forgeries(graded):
    assert_full_marks(graded["right"], POINTS)


@pytest.mark.parametrize("name", sorted(FORGED))
def test_a_process_that_lies_about_its_results_earns_no_point_its_code_did_not(graded, name):
    """The leaky cache, graded as it is, earns the one test it passes (the same object while in use);
    lying about the rest earns nothing more."""
    result, honest = graded[name], graded["leaky"]
    assert result.max_score == POINTS and result.score <= honest.score < POINTS, grading.format_results([result, honest])
    assert all(t.status == "failed" for t in result.tests if t.id != "test_same_model"), grading.format_results([result])
    assert result.disagreements, "a submission whose process said passed where the grader measured otherwise is flagged"


def test_forged_lines_are_refuted_by_outputs_the_test_never_produced(graded):
    result = graded["cheat_forges_result_lines"]
    assert all(t.message.startswith("your process reported that the test passed, but") for t in result.tests), (
        grading.format_results([result]))


def test_memory_no_meter_sees_is_measured_by_the_system(graded):
    """The hoard passes the memory test's every check in the process (no meter counts numpy's memory);
    the system's figure of the process's resident memory over the long run of requests refutes it."""
    result = graded["hoards_what_no_meter_sees"]
    failed = cell_result(result, "test_frees_memory")
    assert "the system measured" in failed.message and "resident memory" in failed.message, failed.message
    assert any(line.startswith("test_frees_memory: ") for line in result.disagreements)


@pytest.mark.parametrize("name", sorted(TIME_BOMBS))
def test_a_cache_that_misbehaves_only_after_many_calls_or_for_some_names_loses_the_memory_points(graded, name):
    failed = cell_result(graded[name], "test_frees_memory")
    assert failed.status == "failed" and "however long it serves, whatever the names" in failed.message, failed.message


@pytest.mark.parametrize("name", sorted(ONLY_WHEN_GRADED))
def test_code_that_behaves_well_only_when_graded_is_graded_as_it_behaves_for_the_learner(graded, name):
    result = graded[name]
    assert result.score < POINTS, grading.format_results([result])
    assert result.review, "the lines that ask where the code runs are listed for the instructor"


@pytest.fixture(scope="module")
def graded_03(tmp_path_factory):
    folder = tmp_path_factory.mktemp("forged_03")
    variants = {"leaky": LEAKY_PAIR.format(extra=""), "cheat_rewrites_the_meters_count": REWRITES_THE_METERS_COUNT}
    return grade_all(write_variants(RELEASE_03, variants, folder), folder)


def test_a_meter_rewritten_in_the_process_does_not_hide_a_leak_from_the_system(graded_03):
    """Lesson 03's Node leak with the meter's records rewritten and every failure relayed as "passed": the
    system's figures of the process over the 400 pairs of the memory test refute it."""
    result, honest = graded_03["cheat_rewrites_the_meters_count"], graded_03["leaky"]
    failed = cell_result(result, "test_memory_flat")
    assert failed.status == "failed", grading.format_results([result])
    assert "your process reported that the test passed" in failed.message, failed.message
    assert result.score <= honest.score, grading.format_results([result, honest])



# A toy lesson whose test calls the answer 30 times, each call marked for the grader (gclab.outside), and
# checks for collections only at its end, so that a relayed "passed" comes with every output of the test.
BAND_AID_TEST = """from gclab.gcwatch import GCWatch
from gclab.outside import marked
with GCWatch() as watch:
    timed = marked(double)
    got = [timed(i) for i in range(30)]
checks.observe("doubles", got)
assert not watch.collections, f"the collector ran {watch.count()} times while double() was called"
"""
COLLECTS_IN_EVERY_CALL = "import gc\ndef double(x):\n    gc.collect()\n    return 2 * x\n"
# the collection run by a thread that has ended by the time the call returns (its own CPU-time count gone)
COLLECTS_IN_A_THREAD_THAT_ENDS = ("import gc, threading\ndef double(x):\n"
                                  "    helper = threading.Thread(target=gc.collect)\n"
                                  "    helper.start()\n    helper.join()\n    return 2 * x\n")


@pytest.fixture(scope="module")
def graded_band_aid(tmp_path_factory):
    from toy_course import lesson, make_course
    folder = tmp_path_factory.mktemp("band_aid")

    def toy(answer):
        return lesson(answer, [("test_double", BAND_AID_TEST, 2)], setup="import gc\nfrom gclab import checks")
    course = make_course(folder / "course", {"toy": toy("### BEGIN SOLUTION\ndef double(x):\n    return 2 * x\n"
                                                         "### END SOLUTION")})
    paths = {}
    for name, answer in {"collects_in_every_call": COLLECTS_IN_EVERY_CALL,
                         "cheat_collects_in_every_call_and_relays_passed":
                             COLLECTS_IN_EVERY_CALL + RELAYS_THE_CHANNEL_SAYING_PASSED,
                         "cheat_collects_in_a_thread_that_ends_and_relays_passed":
                             COLLECTS_IN_A_THREAD_THAT_ENDS + RELAYS_THE_CHANNEL_SAYING_PASSED}.items():
        paths[name] = folder / f"{name}-toy.ipynb"
        nbformat.write(toy(answer), paths[name])
    return dict(zip(paths, grading.grade(list(paths.values()), root=course)))


def test_a_band_aid_collection_in_every_call_is_timed_from_outside_whatever_the_process_says(graded_band_aid):
    """gc.collect() in every call of the answer, the failed check relayed as "passed" with the test's outputs:
    the grader, reading the process's CPU time at every call's mark, finds a collection's worth in each."""
    honest, lying = graded_band_aid["collects_in_every_call"], graded_band_aid["cheat_collects_in_every_call_and_relays_passed"]
    assert honest.score == lying.score == 0, grading.format_results([honest, lying])
    assert "the collector ran 30 times" in honest.tests[0].message, honest.tests[0].message
    message = lying.tests[0].message
    assert "timing each of its 30 calls" in message and "Something collected inside them" in message, message
    assert lying.disagreements, "refuted by the grader's own figures: listed for review"


def test_a_collection_run_by_a_thread_that_ends_inside_the_call_is_still_timed(graded_band_aid):
    """The collection moved to a helper thread, started and joined inside each call: the thread is gone
    when the grader reads the call's end, but the process's CPU-time clock keeps what it ran."""
    lying = graded_band_aid["cheat_collects_in_a_thread_that_ends_and_relays_passed"]
    assert lying.score == 0, grading.format_results([lying])
    assert "Something collected inside them" in lying.tests[0].message, lying.tests[0].message


# What a learner's code can do with no trick at all, through libc (no audit hook sees it) or torch (which
# writes files from C++): read and write any file its user may, and start a process that outlives the grading.
# The kernel's walls (gclab.grader.sandbox) leave it the grading folder alone.
THROUGH_LIBC = """
import ctypes, json, os
_libc = ctypes.CDLL(None, use_errno=True)
def _read(path):
    fd = _libc.open(os.fsencode(path), os.O_RDONLY)
    if fd < 0:
        return None
    chunks, buffer = [], ctypes.create_string_buffer(1 << 16)
    while (n := _libc.read(fd, buffer, len(buffer))) > 0:
        chunks.append(buffer.raw[:n])
    _libc.close(fd)
    return b"".join(chunks)
def _write(path, data):
    fd = _libc.open(os.fsencode(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    if fd >= 0:
        _libc.write(fd, data, len(data))
        _libc.close(fd)
"""
# The reference solution read from the course's sources, and run.
READS_THE_SOLUTION = THROUGH_LIBC + """
_source = _read("{course}/solutions/toy/toy.ipynb")
for _cell in json.loads(_source)["cells"] if _source else []:
    if _cell["metadata"].get("nbgrader", {{}}).get("solution"):
        exec("".join(_cell["source"]))
"""
WRONG_DOUBLE = "def double(x):\n    return x\n"
# A wrong answer whose outputs are written into the reference solution's figures, which the grader keeps in
# the course folder: the next grading compares with them.
PLANTS_ITS_OUTPUTS_AS_THE_REFERENCES = WRONG_DOUBLE + THROUGH_LIBC + """
def _as_mine(value):
    if value == [2 * i for i in range(30)]:
        return list(range(30))
    if isinstance(value, list):
        return [_as_mine(v) for v in value]
    return {{k: _as_mine(v) for k, v in value.items()}} if isinstance(value, dict) else value
_cache = "{course}/autograder/work/cache"
for _name in os.listdir(_cache) if os.path.isdir(_cache) else []:
    if _name.startswith("reference-") and _name.endswith(".json"):
        _write(f"{{_cache}}/{{_name}}", json.dumps(_as_mine(json.loads(_read(f"{{_cache}}/{{_name}}")))).encode())
import torch
try:
    torch.save({{"planted": True}}, "{course}/autograder/planted.pt")
except RuntimeError:
    pass
"""
# A right answer that leaves a process behind, in a session of its own (the grader ends the verdict's session),
# free to write the gradebook once the grader has.
LEAVES_A_PROCESS_BEHIND = """def double(x):
    return 2 * x
import ctypes, time
_libc = ctypes.CDLL(None)
if _libc.fork() == 0:
    _libc.setsid()
    _libc.prctl(15, b"{name}", 0, 0, 0)
    time.sleep(120)
    _libc._exit(0)
"""

# A wrong answer that kills the grader, whose number it was given (another submission graded beside it, or the
# instructor's JupyterLab, are as easily found in the machine's /proc): the grading of the class would stop.
KILLS_THE_GRADER = WRONG_DOUBLE + """
import ctypes
ctypes.CDLL(None).kill({grader}, 9)
"""


@pytest.fixture(scope="module")
def graded_behind_walls(tmp_path_factory):
    from toy_course import lesson, make_course
    folder = tmp_path_factory.mktemp("walls")
    test = "got = [double(i) for i in range(30)]\nchecks.observe('doubles', got)\nassert got == [2 * i for i in range(30)]"

    def toy(answer):
        return lesson(answer, [("test_double", test, 2)], setup="from gclab import checks")
    course = make_course(folder / "course", {"toy": toy("### BEGIN SOLUTION\ndef double(x):\n    return 2 * x\n"
                                                         "### END SOLUTION")})
    left_behind = f"left-{folder.name}"[:15]
    attacks = {"cheat_reads_the_solution_through_libc": READS_THE_SOLUTION.format(course=course),
               "cheat_plants_its_outputs_as_the_references": PLANTS_ITS_OUTPUTS_AS_THE_REFERENCES.format(course=course),
               "cheat_leaves_a_process_behind": LEAVES_A_PROCESS_BEHIND.format(name=left_behind),
               "cheat_kills_the_grader": KILLS_THE_GRADER.format(grader=os.getpid()),
               "wrong": WRONG_DOUBLE}
    paths = {}
    for name, answer in attacks.items():
        paths[name] = folder / f"{name}-toy.ipynb"
        nbformat.write(toy(answer), paths[name])
    graded = dict(zip(paths, grading.grade(list(paths.values()), root=course)))
    graded["wrong, graded again"] = grading.grade([paths["wrong"]], root=course)[0]
    return graded, course, left_behind


def test_the_course_sources_are_out_of_reach_of_the_learners_code(graded_behind_walls):
    graded, _, _ = graded_behind_walls
    result = graded["cheat_reads_the_solution_through_libc"]
    assert result.score == 0, grading.format_results([result])
    assert "double" in result.tests[0].message and "not defined" in result.tests[0].message, result.tests[0].message


def test_the_reference_figures_cannot_be_rewritten_for_the_next_grading(graded_behind_walls):
    graded, course, _ = graded_behind_walls
    assert graded["cheat_plants_its_outputs_as_the_references"].score == 0
    again = graded["wrong, graded again"]
    assert again.score == 0 and not again.tests[0].message.startswith("the grader could not confirm"), (
        grading.format_results([again]))
    assert not (course / "autograder" / "planted.pt").exists()


def test_no_process_of_the_learners_outlives_the_grading(graded_behind_walls):
    graded, _, left_behind = graded_behind_walls
    result = graded["cheat_leaves_a_process_behind"]
    assert result.score == 2, grading.format_results([result])
    assert not _running_as(left_behind), f"processes the submission started are still running: {_running_as(left_behind)}"


def test_the_learners_code_cannot_signal_the_grader(graded_behind_walls):
    """Graded in this process: had the signal reached it, no test would run on; the submission after it in
    the class is graded as well."""
    graded, _, _ = graded_behind_walls
    result = graded["cheat_kills_the_grader"]
    assert result.score == 0 and result.tests[0].status == "failed", grading.format_results([result])
    assert graded["wrong"].tests[0].status == "failed", "the next submission is graded"


def _running_as(name: str) -> list[str]:
    """Processes named `name` not yet ended (a killed one waits a moment to be reaped: state Z)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                head, _, tail = stat.read().rpartition(")")
        except OSError:
            continue
        if head.partition("(")[2] == name and tail.split()[:1] != ["Z"]:
            found.append(pid)
    return found


# Lesson 06: the right policy, with the load the grader sends timed on an idle process the answer forked (the
# verdict names the model server to the grader: a decoy's CPU time shows no pause, whatever the server's)
NAMES_A_DECOY_AS_ITS_SERVER = """
import ctypes
_libc = ctypes.CDLL(None)
_decoy = _libc.fork()
if _decoy == 0:
    while True:
        _libc.pause()
""" + RELAYS_THE_CHANNEL_SAYING_PASSED.replace('''                if message.get("event") == "result":
                    message.update(status="passed", message="")''', '''                if message.get("event") == "load":
                    message["server"] = _decoy''')


def test_a_load_timed_on_a_decoy_is_refuted_by_the_connections_the_decoy_does_not_hold(tmp_path):
    """The grader reads, from /proc, which process holds the server's end of its load's connections: the one
    it timed must (gclab.serving.load); a right policy whose load was timed elsewhere loses its points."""
    assert "_decoy" in NAMES_A_DECOY_AS_ITS_SERVER
    policy = RIGHT_POLICY_06["answer_policy"].removeprefix("%%writefile my_policy.py\n")
    answer = f"open('my_policy.py', 'w').write({policy!r})\n" + NAMES_A_DECOY_AS_ITS_SERVER
    path, = write_variants(RELEASE_06, {"cheat_names_a_decoy_as_its_server": {"answer_policy": answer}},
                           tmp_path).values()
    result, = grading.grade([path], root=ROOT)
    assert result.score == 0, grading.format_results([result])
    assert "came over connections that the process whose CPU time it read did not hold" in result.tests[0].message


def test_views_left_in_cycles_are_seen_in_memory_when_every_assert_is_gone(tmp_path, monkeypatch):
    """Lesson 04's views left in reference cycles, graded with every assert of the process removed
    (GCLAB_GRADE_STRIP_ASSERTS=1, verdicts run with -O: each test runs to its end and says "passed", its outputs
    those of a run that did not stop): with the collector off, the hidden test's 80 views hold 80 MiB of
    batches, which the system's figures of the process show (autograder/grader_figures.py found this
    test's 2 points kept by such a process while its views held 2.5 MiB)."""
    path, = write_variants(RELEASE_04, {"keeps_views_in_cycles": WRONG_04["empty_cache_in_wait"]}, tmp_path).values()
    monkeypatch.setenv("GCLAB_GRADE_STRIP_ASSERTS", "1")
    lying, = grading.grade([path], root=ROOT)
    failed = cell_result(lying, "test_no_cycle")
    assert failed.status == "failed", grading.format_results([lying])
    assert "your process reported that the test passed" in failed.message and "resident memory" in failed.message


def _each_view_first_calls(hook: str) -> str:
    """Code that makes lesson 04's BatchView call `hook(pending)` before it makes each view."""
    return f'''
_init = BatchView.__init__
def _hooked_init(self, pending, rows, keep_columns):
    {hook}(pending)
    _init(self, pending, rows, keep_columns)
BatchView.__init__ = _hooked_init
'''


# Lesson 04's views left in cycles, and each new view pages out (madvise MADV_PAGEOUT) the batch the view made
# before it holds: that batch is not read again, so on a machine with swap it leaves the resident figures
VIEWS_PAGED_OUT = view_04(extra='''
import ctypes as _ctypes
_madvise = _ctypes.CDLL(None).madvise
_madvise.argtypes = [_ctypes.c_void_p, _ctypes.c_size_t, _ctypes.c_int]
_held = []

def _page_out_earlier(pending):
    while _held:
        buffer = _held.pop()
        start = buffer.data_ptr() // 4096 * 4096
        _madvise(start, buffer.data_ptr() + buffer.numel() * 4 - start, 21)     # MADV_PAGEOUT
    _held.append(pending.buffer)
''' + _each_view_first_calls("_page_out_earlier"))


def test_views_left_in_cycles_and_paged_out_to_swap_are_still_counted(tmp_path, monkeypatch):
    """The lying views of the test above, their batches paged out as they go. Measured on a machine with
    256 MiB of swap: while the grader read VmRSS and VmHWM alone, test_no_cycle's 2 points stood (5/8 in 4
    of 4 gradings; the honest wrong fix gets 3/8), its 80 MiB in swap; VmSwap added, they still stood in 3 of
    4 (the test's last collection frees the swap before its end, and no peak of swap is kept). Now the verdict
    refuses itself such advice (seccomp, `gclab.syscalls.PAGING_OUT`): 3/8 in 3 of 3, its peak 55.6 to 66.9
    MiB over the reference's. Where a machine has no swap (CI), MADV_PAGEOUT leaves the pages resident
    anyway."""
    path, = write_variants(RELEASE_04, {"cheat_pages_out_views_in_cycles": VIEWS_PAGED_OUT}, tmp_path).values()
    monkeypatch.setenv("GCLAB_GRADE_STRIP_ASSERTS", "1")
    lying, = grading.grade([path], root=ROOT)
    assert lying.score == 3, grading.format_results([lying])
    failed = cell_result(lying, "test_no_cycle")
    assert failed.status == "failed" and "resident memory (swap included)" in failed.message, failed.message


# Lesson 04's views left in cycles, and each new view moves the batch the view made before it holds into shared
# memory: the batch's pages are mapped over, at the same address, by a memfd holding the same bytes, then dropped
# from the process (MADV_DONTNEED); the data stays in the memfd, which no process's resident figure counts
VIEWS_MOVED_TO_SHARED_MEMORY = view_04(extra='''
import ctypes as _ctypes, mmap as _mmap, os as _os
_libc = _ctypes.CDLL(None)
_libc.mmap.restype = _ctypes.c_void_p
_libc.mmap.argtypes = [_ctypes.c_void_p, _ctypes.c_size_t, _ctypes.c_int, _ctypes.c_int, _ctypes.c_int, _ctypes.c_long]
_libc.madvise.argtypes = [_ctypes.c_void_p, _ctypes.c_size_t, _ctypes.c_int]
_held = []

def _move_to_shared_memory(buffer):
    start = -(-buffer.data_ptr() // 4096) * 4096
    length = (buffer.data_ptr() + buffer.numel() * buffer.element_size()) // 4096 * 4096 - start
    if length <= 0:
        return
    fd = _os.memfd_create("batch")
    _os.pwrite(fd, _ctypes.string_at(start, length), 0)
    _libc.mmap(start, length, _mmap.PROT_READ | _mmap.PROT_WRITE, _mmap.MAP_SHARED | 0x10, fd, 0)   # MAP_FIXED
    _os.close(fd)
    _libc.madvise(start, length, 4)       # MADV_DONTNEED: the pages leave the process, the memfd keeps them

def _move_earlier(pending):
    while _held:
        _move_to_shared_memory(_held.pop())
    _libc.malloc_trim(0)
    _held.append(pending.buffer)
''' + _each_view_first_calls("_move_earlier"))

# ... and, each time, resets the peak the kernel keeps of its cgroup, having tried to leave the cgroup first
# (through libc, around the guard inside the process: what refuses it is the kernel's read-only mount)
_GROUP = '''
_lines = open("/proc/self/cgroup").read().splitlines()
_v1 = [l.split(":", 2)[2] for l in _lines if ":memory:" in l]
_group = ("/sys/fs/cgroup/memory" + _v1[0]) if _v1 else ("/sys/fs/cgroup" + [l[3:] for l in _lines if l.startswith("0::")][0])
_peak = "memory.max_usage_in_bytes" if _v1 else "memory.peak"       # v2's: reset from Linux 6.12
def _try_writing(path, text):
    fd = _libc.open(path.encode(), _os.O_WRONLY)
    if fd >= 0:
        _libc.write(fd, text.encode(), len(text))
        _libc.close(fd)
_try_writing(_os.path.join(_os.path.dirname(_group), "cgroup.procs"), str(_os.getpid()))
_moved = _move_to_shared_memory
def _move_to_shared_memory(buffer):
    _moved(buffer)
    _try_writing(_os.path.join(_group, _peak), "0")
'''
VIEWS_MOVED_TO_SHARED_MEMORY_AND_PEAK_RESET = VIEWS_MOVED_TO_SHARED_MEMORY.replace(
    "\n_init = BatchView.__init__\n", _GROUP + "\n_init = BatchView.__init__\n")


def test_views_left_in_cycles_and_moved_into_shared_memory_are_still_counted(tmp_path, monkeypatch):
    """The lying views above, each batch moved into a memfd and dropped from the process's pages once a newer
    view is made. While the grader read the process's resident figures alone, test_no_cycle's 2 points stood
    (5/8; the honest wrong fix gets 3/8): its batches were in shared memory, which no process's figure counts.
    Each verdict now runs in a memory cgroup of its own (`gclab.grader.memory_group`), whose peak the kernel
    keeps of every page charged to it, shared memory and the page cache included. Behind the kernel's walls the
    cgroup's files are read-only: the process can neither reset that peak nor leave its cgroup. (Under cgroup v2,
    in a virtual machine with Linux 6.1 (`autograder/cgroup2_check.py`), the resident peak refuted it first.)"""
    if memory_group.available() is not None:
        pytest.skip(f"no memory cgroup here: {memory_group.available()}")
    paths = write_variants(RELEASE_04, {
        "cheat_moves_views_into_shared_memory": VIEWS_MOVED_TO_SHARED_MEMORY,
        "cheat_moves_views_into_shared_memory_and_resets_its_cgroups_peak": VIEWS_MOVED_TO_SHARED_MEMORY_AND_PEAK_RESET,
    }, tmp_path)
    monkeypatch.setenv("GCLAB_GRADE_STRIP_ASSERTS", "1")
    for lying in grading.grade(list(paths.values()), root=ROOT):
        assert lying.score == 3, grading.format_results([lying])
        failed = cell_result(lying, "test_no_cycle")
        assert failed.status == "failed" and any(
            refuted in failed.message for refuted in ("memory charged to your process", "resident memory")), failed.message
