"""The kernel's walls around a verdict process (gclab.grader.sandbox): what code inside them can no longer do.

Each test forks a stand-in for the grader and, under it, a process that enters the walls and then tries,
as a learner's code could without any trick (ctypes, torch), to reach past them."""
import ctypes
import json
import os
import signal
import socket
import threading
import time

import pytest
import torch

from gclab.grader import sandbox

pytestmark = pytest.mark.skipif(sandbox.available() is not None, reason=f"walls refused here: {sandbox.available()}")

LIBC = ctypes.CDLL(None, use_errno=True)
O_WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


def _in_child(body, *args) -> dict:
    """Run body(*args) in a forked child; what it returns (a dict) comes back through a pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            try:
                out = body(*args)
            except BaseException as error:      # noqa: BLE001 (reported to the test)
                out = {"error": repr(error)}
            os.write(write, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(data or b"{}")


def _course(tmp_path):
    course = tmp_path / "course"
    for folder in ("solutions/toy", "autograder/work/cache", "gclab"):
        (course / folder).mkdir(parents=True)
    (course / "solutions/toy/toy.ipynb").write_text("the hidden tests")
    (course / "autograder/work/cache/reference-toy.json").write_text("{}")
    (course / "gclab/memory.py").write_text("# a tool")
    folder = tmp_path / "grading" / "toy"
    folder.mkdir(parents=True)
    return course, folder


def _walled(course, folder, then):
    def body():
        why = sandbox.enter(str(folder), hidden=[str(course)], keep=[str(course / "gclab")])
        return {"why": why, **then()}
    return _in_child(body)


def _create(path) -> int:
    """0 where a file could be opened for writing at `path` (through libc, as no audit hook sees), else errno."""
    fd = LIBC.open(os.fsencode(path), O_WRITE, 0o644)
    if fd < 0:
        return ctypes.get_errno()
    LIBC.close(fd)
    return 0


def test_code_inside_writes_only_in_its_grading_folder(tmp_path):
    course, folder = _course(tmp_path)
    beside = tmp_path / "beside"

    def attempts():
        out = {"libc": {str(p): _create(p) for p in (folder / "mine", beside,
                                                      course / "autograder/work/cache/reference-toy.json")}}
        try:
            torch.save({"forged": True}, str(tmp_path / "saved.pt"))
            out["torch.save"] = "written"
        except RuntimeError:
            out["torch.save"] = "refused"
        return out
    out = _walled(course, folder, attempts)
    assert out["why"] is None, out
    assert out["libc"] == {str(folder / "mine"): 0, str(beside): 30,      # EROFS
                           str(course / "autograder/work/cache/reference-toy.json"): 2}, out   # hidden: ENOENT
    assert out["torch.save"] == "refused"
    assert (folder / "mine").exists() and not beside.exists() and not (tmp_path / "saved.pt").exists()
    assert (course / "autograder/work/cache/reference-toy.json").read_text() == "{}"


def test_the_course_is_hidden_but_for_the_tools_it_keeps(tmp_path):
    course, folder = _course(tmp_path)

    def look():
        return {"listed": sorted(os.listdir(course)), "tool": (course / "gclab/memory.py").read_text(),
                "solutions": os.path.exists(course / "solutions/toy/toy.ipynb")}
    out = _walled(course, folder, look)
    assert out == {"why": None, "listed": ["gclab"], "tool": "# a tool", "solutions": False}, out


def test_code_inside_has_a_network_of_its_own_loopback_alone(tmp_path):
    course, folder = _course(tmp_path)
    with socket.create_server(("127.0.0.1", 0)) as outside:       # a gradebook server, a Dask scheduler
        port = outside.getsockname()[1]

        def connect():
            out = {}
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                out["outside"] = "reached"
            except OSError as error:
                out["outside"] = error.errno
            with socket.create_server(("127.0.0.1", 0)) as inside:   # a lesson's model server
                socket.create_connection(inside.getsockname(), timeout=2).close()
            out["inside"] = "reached"
            return out
        out = _walled(course, folder, connect)
    assert out == {"why": None, "outside": 111, "inside": "reached"}, out       # ECONNREFUSED


def test_the_graders_load_joins_the_network_of_a_server_behind_the_walls(tmp_path):
    from gclab.serving.processes import join_network_of
    course, folder = _course(tmp_path)

    def serve(write):
        with socket.create_server(("127.0.0.1", 0)) as listening:
            os.write(write, str(listening.getsockname()[1]).encode())
            listening.settimeout(10)
            listening.accept()[0].close()
    server, port = _walled_child(course, folder, serve)

    def send(join: bool):
        if join:
            join_network_of(server)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            return {"reached": True}
        except OSError:
            return {"reached": False}
    try:
        assert _in_child(send, False) == {"reached": False}
        assert _in_child(send, True) == {"reached": True}
    finally:
        os.waitpid(server, 0)


def _walled_child(course, folder, body) -> tuple[int, int]:
    """Fork a child that enters the walls and runs body(write), which writes a number on `write` (then may
    wait): the child's pid and that number."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        sandbox.enter(str(folder), hidden=[str(course)])
        body(write)
        os._exit(0)
    number = int(os.read(read, 32))
    os.close(read), os.close(write)
    return pid, number


def test_code_inside_can_name_no_process_outside_so_signal_none(tmp_path):
    """The grader, a verdict graded beside it, the instructor's JupyterLab: a process of the same user, which
    a signal from a learner's code (through libc: no audit hook sees it) would end."""
    course, folder = _course(tmp_path)
    grader = os.getpid()

    def signal_out():
        return {"kill": ctypes.get_errno() if LIBC.kill(grader, 0) else 0, "pidfd": _pidfd_errno(grader),
                "listed": sorted(int(name) for name in os.listdir("/proc") if name.isdigit()), "me": os.getpid()}
    out = _walled(course, folder, signal_out)
    assert out == {"why": None, "kill": 3, "pidfd": 3, "listed": [1], "me": 1}, out     # ESRCH


def _pidfd_errno(pid: int) -> int:
    try:
        os.close(os.pidfd_open(pid))
        return 0
    except OSError as error:
        return error.errno


def test_sockets_the_machine_keeps_are_out_of_reach_and_shared_memory_is_its_own(tmp_path):
    """A socket is reached through a read-only mount, and some run commands (a terminal multiplexer's, the
    user's systemd): the folders that keep them (/tmp here) are hidden, but for the grading folder."""
    course, folder = _course(tmp_path)
    (tmp_path / "sockets").mkdir()
    with socket.socket(socket.AF_UNIX) as multiplexer:
        multiplexer.bind(str(tmp_path / "sockets" / "default"))
        multiplexer.listen()

        def reach():
            out = {}
            with socket.socket(socket.AF_UNIX) as client:
                try:
                    client.connect(str(tmp_path / "sockets" / "default"))
                    out["socket"] = "reached"
                except OSError as error:
                    out["socket"] = error.errno
            out["shm"] = sorted(os.listdir("/dev/shm"))
            out["shm write"] = _create("/dev/shm/mine")
            return out
        out = _walled(course, folder, reach)
    assert out == {"why": None, "socket": 2, "shm": [], "shm write": 0}, out        # ENOENT
    assert not os.path.exists("/dev/shm/mine")


def test_the_users_home_is_hidden_but_for_what_the_verdict_loads_from_it(tmp_path, monkeypatch):
    """Keys and tokens (~/.ssh, ~/.jupyter) that an answer could raise in an error's message, which its
    feedback shows; a Python environment or user site-packages there stays."""
    course, folder = _course(tmp_path)
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("a key")
    (home / ".local" / "site-packages").mkdir(parents=True)
    monkeypatch.setattr(sandbox, "_home", lambda: str(home))

    def look():
        why = sandbox.enter(str(folder), hidden=[str(course)], keep=[str(home / ".local" / "site-packages")])
        return {"why": why, "home": sorted(os.listdir(home)), "key": os.path.exists(home / ".ssh" / "id_ed25519"),
                "site": os.path.isdir(home / ".local" / "site-packages")}
    assert _in_child(look) == {"why": None, "home": [".local"], "key": False, "site": True}


def test_the_grader_finds_the_process_the_verdict_names_by_its_number_inside(tmp_path):
    """Lesson 06's model server, which the verdict names to the grader for its load: numbered inside."""
    from gclab import procfs
    course, folder = _course(tmp_path)

    def start_a_server(write):
        if os.fork() == 0:
            os.write(write, str(os.getpid()).encode())
            time.sleep(60)
        time.sleep(60)
    read, write = os.pipe()
    verdict = os.fork()
    if verdict == 0:
        os.setsid()                          # a verdict leads a session of its own
        sandbox.enter(str(folder), hidden=[str(course)])
        start_a_server(write)
        os._exit(0)
    try:
        inside = int(os.read(read, 32))
        server = procfs.member_numbered(verdict, inside)
        assert inside == 2 and server not in (None, verdict, inside), server
        with open(f"/proc/{server}/status") as status:
            assert next(line for line in status if line.startswith("NSpid:")).split()[1:] == [str(server), "2"]
        assert procfs.member_numbered(verdict, 99) is None
    finally:
        os.kill(verdict, signal.SIGTERM)
        os.waitpid(verdict, 0)
        os.close(read), os.close(write)


def test_the_walls_cannot_be_taken_down_from_inside(tmp_path):
    course, folder = _course(tmp_path)
    ms_remount, ms_bind, ms_rec = 32, 4096, 16384

    def take_down():
        out = {"remount": LIBC.mount(None, b"/", None, ms_remount | ms_bind | ms_rec, None)}
        out["new namespaces"] = LIBC.unshare(0x10000000 | 0x00020000)    # a user and a mount namespace anew
        out["remount there"] = LIBC.mount(None, b"/", None, ms_remount | ms_bind | ms_rec, None)
        out["unmount there"] = LIBC.umount2(os.fsencode(course), 2)      # MNT_DETACH: what lies under?
        out["write"] = _create(tmp_path / "beside")
        return out
    out = _walled(course, folder, take_down)
    assert out["why"] is None and out["new namespaces"] == 0, out
    assert out["remount"] == out["remount there"] == out["unmount there"] == -1, out
    assert out["write"] != 0 and not (tmp_path / "beside").exists()


def test_no_process_outside_can_be_read_or_traced_from_inside_shielded_or_not(tmp_path):
    """Inside, the grader has no number (ENOENT in /proc, ESRCH for the system call); a process of the same
    user that is not shielded (the instructor's JupyterLab, a verdict graded beside it) neither."""
    course, folder = _course(tmp_path)

    def grader(shielded: bool, walled: bool):
        if shielded:
            sandbox.shield()
        me = os.getpid()

        def reach():
            out = {"why": sandbox.enter(str(folder), hidden=[str(course)]) if walled else None}
            try:
                with open(f"/proc/{me}/mem", "rb"):
                    out["mem"] = "opened"
            except OSError as error:
                out["mem"] = error.errno
            out["process_vm_readv"] = _read_memory_of(me, id(None), 8)
            return out
        return _in_child(reach)
    assert _in_child(grader, True, True) == {"why": None, "mem": 2, "process_vm_readv": 3}       # ENOENT, ESRCH
    assert _in_child(grader, False, True) == {"why": None, "mem": 2, "process_vm_readv": 3}
    if _ptrace_scope() == 0:
        # the same reach, without the walls and the shield, succeeds on this machine: the check can fail
        assert _in_child(grader, False, False) == {"why": None, "mem": "opened", "process_vm_readv": 0}


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def _read_memory_of(pid: int, address: int, size: int) -> int:
    """0 where `size` bytes at `address` of process `pid` could be read into this one, else errno."""
    buffer = ctypes.create_string_buffer(size)
    local, remote = _IoVec(ctypes.addressof(buffer), size), _IoVec(address, size)
    got = LIBC.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return 0 if got == size else ctypes.get_errno()


def _ptrace_scope() -> int:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read())
    except OSError:
        return 0


def test_every_process_left_inside_is_ended_with_the_verdict(tmp_path):
    course, folder = _course(tmp_path)

    def leave_one_behind(write):
        if os.fork() == 0:                  # left behind, in a session of its own, nested a namespace deeper
            os.setsid()
            LIBC.unshare(0x10000000)
            os.write(write, b"1")
            time.sleep(60)
        time.sleep(60)                      # the verdict, until the grader ends it
    verdict, _ = _walled_child(course, folder, leave_one_behind)
    namespace = sandbox.hold(verdict)
    left = [pid for pid in sandbox._pids() if pid != verdict and sandbox._descends_from(pid, namespace.inode)]
    assert len(left) == 2 and all(sandbox._runs(pid) for pid in left), "the verdict, and the one it left"
    os.kill(verdict, signal.SIGTERM)         # as the grader ends a verdict
    os.waitpid(verdict, 0)
    for _ in range(100):
        if not any(sandbox._runs(pid) for pid in left):
            break
        time.sleep(0.02)
    assert not any(sandbox._runs(pid) for pid in left), "the kernel ended them with the verdict"
    assert sandbox.end_within(namespace) == []
    assert namespace.fd == -1, "the namespace is let go once swept"


def test_the_sweep_ends_what_is_left_in_the_verdicts_user_namespace_when_it_has_ended():
    """What the kernel's PID namespace would not end (a process of the verdict's user namespace outside it)."""
    read, write = os.pipe()
    verdict = os.fork()
    if verdict == 0:
        LIBC.unshare(0x10000000)
        if os.fork() == 0:                  # left behind, in a session of its own, nested a namespace deeper
            os.setsid()
            LIBC.unshare(0x10000000)
            os.write(write, str(os.getpid()).encode())
            time.sleep(60)
            os._exit(0)
        time.sleep(60)
        os._exit(0)
    left = int(os.read(read, 32))
    os.close(read), os.close(write)
    namespace = sandbox.hold(verdict)
    os.kill(verdict, signal.SIGKILL)
    os.waitpid(verdict, 0)
    assert sandbox._runs(left)
    assert sandbox.end_within(namespace) == [left]
    assert sandbox.end_within(sandbox.hold(os.getpid())) == [], "the grader's own namespace is never swept"
    for _ in range(100):
        if not sandbox._runs(left):
            break
        time.sleep(0.02)
    assert not sandbox._runs(left)


def test_a_held_namespace_keeps_its_number_from_the_verdicts_after_it():
    """The kernel gives a freed namespace's number to the next one made: a sweep by number after the verdict
    ended would kill another verdict's processes (one started beside it, with --jobs 2)."""
    def new_namespaces_with_the_number_of_one_that_ended(held: bool) -> int:
        ended = _in_new_user_namespace()
        number, holding = sandbox.namespace_of(ended), sandbox.hold(ended) if held else None
        os.kill(ended, signal.SIGKILL)
        os.waitpid(ended, 0)
        same = 0
        for _ in range(50):
            other = _in_new_user_namespace()
            same += sandbox.namespace_of(other) == number
            os.kill(other, signal.SIGKILL)
            os.waitpid(other, 0)
        if holding:
            holding.close()
        return same
    # the kernel's habit, seen (another process making namespaces meanwhile may take the number first)
    assert any(new_namespaces_with_the_number_of_one_that_ended(held=False) > 0 for _ in range(3))
    assert new_namespaces_with_the_number_of_one_that_ended(held=True) == 0


def _in_new_user_namespace() -> int:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        LIBC.unshare(0x10000000)
        os.write(write, b"in")
        time.sleep(30)
        os._exit(0)
    os.read(read, 2)
    os.close(read), os.close(write)
    return pid


def test_the_grader_sees_for_itself_whether_a_process_is_walled_in(tmp_path):
    course, folder = _course(tmp_path)
    seen = {}
    for walls in (True, False):
        read, write = os.pipe()
        child = os.fork()
        if child == 0:
            if walls:
                sandbox.enter(str(folder), hidden=[str(course)])
            os.write(write, b"in")
            time.sleep(30)
            os._exit(0)
        os.read(read, 2)
        seen[walls] = sandbox.walled(child)
        os.kill(child, 9)
        os.waitpid(child, 0)
        os.close(read), os.close(write)
    assert seen == {True: True, False: False}


def test_a_process_with_threads_is_told_why_it_cannot_be_walled_in(tmp_path):
    course, folder = _course(tmp_path)

    def with_a_thread():
        stop = threading.Event()
        threading.Thread(target=stop.wait).start()
        try:
            why = sandbox.enter(str(folder), hidden=[str(course)])
            return {"why": why, "write": _create(tmp_path / "beside")}
        finally:
            stop.set()
    out = _in_child(with_a_thread)
    assert out["why"].startswith("the kernel refused the grader's walls (a user, mount, network, IPC and PID "
                                 "namespace: "), out
    assert out["write"] == 0, "nothing half built: the process runs as before, behind the guard alone"


def test_a_grader_that_cannot_wall_in_says_why(monkeypatch):
    monkeypatch.setattr(sandbox, "_LIBC", None)
    assert sandbox.available() == sandbox.enter("/tmp") == "the grader's walls need Linux"
