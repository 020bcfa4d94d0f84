"""A memory cgroup of its own for each verdict (gclab.grader.memory_group): the kernel's count of every page
charged to its processes, shared memory included, which a process's resident figures miss."""
import contextlib
import fcntl
import mmap
import os
import time
from pathlib import Path

import pytest

from gclab.grader import memory_group

MiB = 1024 * 1024

needs_a_group = pytest.mark.skipif(memory_group.available() is not None,
                                  reason=f"no memory cgroup here: {memory_group.available()}")


@contextlib.contextmanager
def _child_in(group, work):
    """A child in a session of its own that joins `group`, runs `work()` and waits, holding what it returned,
    until the block ends; its pid."""
    ready, go = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            memory_group.join(group.path)
            kept = work()
            os.write(ready[1], b"x")
            os.read(go[0], 1)
            del kept
        finally:
            os._exit(0)
    try:
        os.read(ready[0], 1)
        yield pid
    finally:
        os.write(go[1], b"x")
        os.waitpid(pid, 0)
        group.remove()


def _kept_in_a_memfd_and_dropped(size=64 * MiB):
    fd = os.memfd_create("kept")
    os.ftruncate(fd, size)
    kept = mmap.mmap(fd, size, mmap.MAP_SHARED)
    for at in range(0, size, MiB):
        kept[at:at + MiB] = b"\1" * MiB
    kept.madvise(mmap.MADV_DONTNEED)        # out of the process's pages; the memfd keeps the bytes
    assert kept[size - 1] == 1
    return kept


def _kept_in_pipes(count=32):
    """`count` MiB written into pipes nobody reads: kernel memory, in no process's pages."""
    pipes = []
    for _ in range(count):
        read, write = os.pipe()
        fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, MiB)
        os.set_blocking(write, False)
        try:
            for _ in range(16):
                os.write(write, b"\1" * (MiB // 16))
        except BlockingIOError:
            pass
        pipes.append((read, write))
    return pipes


def _touched_and_freed(size=32 * MiB):
    bytearray(size)


@needs_a_group
def test_memory_moved_into_a_memfd_and_dropped_from_the_process_is_charged_to_its_group():
    group = memory_group.MemoryGroup.made()
    with _child_in(group, _kept_in_a_memfd_and_dropped) as pid:
        charged, peak = group.read([pid])
    assert charged >= 64 * MiB and peak >= charged


@needs_a_group
def test_a_process_that_ended_is_no_process_outside_the_group_reaped_or_not():
    # /proc showed a zombie in the hierarchy's root here (kernel 6.18): read as outside, a verdict's child that had just ended
    # would refute every test
    group = memory_group.MemoryGroup.made()
    with _child_in(group, lambda: None) as pid:
        ended = os.fork()
        if ended == 0:
            memory_group.join(group.path)
            os._exit(0)
        deadline = time.monotonic() + 10
        while not memory_group._ended(ended) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert group.read([pid, ended]) is not None
        os.waitpid(ended, 0)
        assert group.read([pid, ended]) is not None


@needs_a_group
def test_bytes_kept_in_pipe_buffers_are_charged_to_the_group():
    group = memory_group.MemoryGroup.made()
    with _child_in(group, _kept_in_pipes) as pid:
        charged, _ = group.read([pid])
    assert charged >= 32 * MiB


@needs_a_group
def test_the_peak_is_reset_at_each_reading():
    group = memory_group.MemoryGroup.made()
    with _child_in(group, _touched_and_freed) as pid:
        (_, first), (charged, second) = group.read([pid]), group.read([pid])
    assert first >= 32 * MiB and second < 8 * MiB and charged < 8 * MiB, (first, second, charged)


@needs_a_group
def test_a_process_that_left_its_group_is_read_as_none():
    group = memory_group.MemoryGroup.made()
    own = memory_group.hierarchy().folder(memory_group._memory_path())      # the grader's own group
    with _child_in(group, lambda: memory_group.join(own)) as pid:
        assert group.read([pid]) is None


@needs_a_group
def test_groups_left_by_a_grader_that_ended_are_removed_and_a_running_graders_are_not():
    parent = memory_group._parent_folder()
    ended = os.path.join(parent, f"{memory_group.PREFIX}999999999-0000")
    ours = os.path.join(parent, f"{memory_group.PREFIX}{os.getpid()}-0000")
    os.mkdir(ended)
    os.mkdir(ours)
    try:
        memory_group.MemoryGroup(parent).remove()
        assert not os.path.exists(ended) and os.path.exists(ours)
    finally:
        for path in (ended, ours):
            if os.path.exists(path):
                os.rmdir(path)


def test_a_grader_told_to_make_none_makes_none(monkeypatch):
    monkeypatch.setenv("GCLAB_GRADE_MEMORY_GROUP", "0")
    assert "GCLAB_GRADE_MEMORY_GROUP=0" in memory_group.available()
    assert memory_group.MemoryGroup.made() is None


def _fake_cgroup2(root, own, subtree_controls):
    """A cgroup v2 tree under `root` as the grader would find it: its own group `own`, and each group's
    `cgroup.subtree_control` as given."""
    (root / own.strip("/")).mkdir(parents=True, exist_ok=True)
    for group, controllers in subtree_controls.items():
        (root / group.strip("/") / "cgroup.subtree_control").write_text(controllers)
    return memory_group.Hierarchy(str(root), 2, "memory.current", "memory.peak")


def test_cgroup_v2_groups_are_made_where_the_children_have_the_memory_controller(tmp_path, monkeypatch):
    # a group with processes may not give its children controllers: not the grader's own service, but the slice
    # above it, delegated to its user (a systemd user service with Delegate=yes)
    hierarchy = _fake_cgroup2(tmp_path, "/user@1000.service/app.slice/course.service", {
        "/": "cpu memory pids", "/user@1000.service": "memory pids", "/user@1000.service/app.slice": "memory pids",
        "/user@1000.service/app.slice/course.service": ""})
    monkeypatch.setattr(memory_group, "hierarchy", lambda: hierarchy)
    monkeypatch.setattr(memory_group, "_memory_path", lambda pid="self": "/user@1000.service/app.slice/course.service")
    assert memory_group._parent_folder() == str(tmp_path / "user@1000.service" / "app.slice")
    group = memory_group.MemoryGroup(memory_group._parent_folder())
    assert group.cgroup.startswith(f"/user@1000.service/app.slice/{memory_group.PREFIX}{os.getpid()}-")


def test_cgroup_v2_with_the_memory_controller_nowhere_below_the_root_enables_it_at_the_root(tmp_path, monkeypatch):
    hierarchy = _fake_cgroup2(tmp_path, "/", {"/": ""})
    monkeypatch.setattr(memory_group, "hierarchy", lambda: hierarchy)
    monkeypatch.setattr(memory_group, "_memory_path", lambda pid="self": "/")
    assert memory_group._parent_folder() == str(tmp_path)
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+memory"


def test_cgroup_v2_window_peak_is_the_groups_where_it_rose_and_else_the_larger_charge_at_its_ends(tmp_path, monkeypatch):
    # v2 resets no peak before Linux 6.12 (here memory.peak is not there when the group is made, so it is not
    # written to): a window's peak is never read as more than the window's own
    monkeypatch.setattr(memory_group, "hierarchy", lambda: memory_group.Hierarchy(str(tmp_path), 2, "memory.current",
                                                                                   "memory.peak"))
    group = memory_group.MemoryGroup(str(tmp_path))
    readings = []
    for charged, group_peak in [(10, 50), (30, 50), (20, 50), (40, 90), (5, 90)]:
        Path(group.path, "memory.current").write_text(f"{charged * MiB}\n")
        Path(group.path, "memory.peak").write_text(f"{group_peak * MiB}\n")
        readings.append(tuple(figure // MiB for figure in group.read([])))
    assert readings == [(10, 50), (30, 30), (20, 30), (40, 90), (5, 40)]



def _fake_systemd_run(folder: Path, scope: str) -> None:
    """A `systemd-run` on PATH that notes its arguments and the scope's environment, then: "none", fails as with
    no user manager; "cannot", runs the command in a scope where no group can be made either; "can", answers
    for a command run in a scope where one can."""
    script = folder / "systemd-run"
    script.write_text("#!/bin/sh\n"
                      f'echo "$* | $GCLAB_GRADE_USER_SCOPE" >> "{folder}/calls"\n'
                      + {"none": "exit 1\n", "can": "exit 0\n",
                         "cannot": 'while [ "$1" != "--" ]; do shift; done; shift\n'
                                   'GCLAB_GRADE_MEMORY_GROUP=0 exec "$@"\n'}[scope])
    script.chmod(0o755)


@pytest.fixture
def ungrouped_on_cgroup2(tmp_path, monkeypatch):
    """A grader on cgroup v2 that can make no group where it is (a login session's scope, owned by root)."""
    monkeypatch.setattr(memory_group, "hierarchy", lambda: memory_group.Hierarchy(str(tmp_path), 2, "memory.current",
                                                                                   "memory.peak"))
    monkeypatch.setattr(memory_group, "available", lambda: "a memory cgroup could not be made: Permission denied")
    monkeypatch.delenv(memory_group.USER_SCOPE_ENV, raising=False)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    import pwd
    (tmp_path / "linger").mkdir()
    (tmp_path / "linger" / pwd.getpwuid(os.getuid()).pw_name).touch()
    monkeypatch.setattr(memory_group, "LINGER_FOLDER", str(tmp_path / "linger"))
    return tmp_path


def _calls(folder: Path) -> list[str]:
    return (folder / "calls").read_text().splitlines() if (folder / "calls").exists() else []


def test_a_grader_that_can_make_no_group_runs_again_in_a_systemd_user_scope_that_can(ungrouped_on_cgroup2):
    _fake_systemd_run(ungrouped_on_cgroup2, "can")
    command = memory_group.in_a_user_scope(["gclab", "grade"])
    assert command[1:] == ["--user", "--scope", "--quiet", "--property=MemoryAccounting=yes", "--", "gclab", "grade"]
    [tried] = _calls(ungrouped_on_cgroup2)
    assert tried.startswith("--user --scope --quiet --property=MemoryAccounting=yes -- ") and "available()" in tried
    assert tried.endswith("| 1"), "the Python tried in the scope is told not to try again"


@pytest.mark.parametrize("scope", ["none", "cannot"])
def test_a_grader_stays_where_it_is_where_a_user_scope_cannot_be_had_or_would_not_help(ungrouped_on_cgroup2, scope):
    _fake_systemd_run(ungrouped_on_cgroup2, scope)
    assert memory_group.in_a_user_scope(["gclab", "grade"]) is None
    assert len(_calls(ungrouped_on_cgroup2)) == 1


def test_a_grader_tries_no_user_scope_that_ends_with_the_users_last_session(ungrouped_on_cgroup2, monkeypatch):
    # without lingering, logging out ends the user's manager and every process in its tree: a class graded in a
    # terminal multiplexer would be ended with it
    _fake_systemd_run(ungrouped_on_cgroup2, "can")
    monkeypatch.setattr(memory_group, "LINGER_FOLDER", str(ungrouped_on_cgroup2 / "no-linger"))
    assert not memory_group.lingers()
    assert memory_group.in_a_user_scope(["gclab", "grade"]) is None
    assert _calls(ungrouped_on_cgroup2) == []


def test_a_grader_tries_no_user_scope_where_it_can_make_groups_or_has_tried_once(ungrouped_on_cgroup2, monkeypatch):
    _fake_systemd_run(ungrouped_on_cgroup2, "can")
    monkeypatch.setenv(memory_group.USER_SCOPE_ENV, "1")
    assert memory_group.in_a_user_scope(["gclab", "grade"]) is None
    monkeypatch.delenv(memory_group.USER_SCOPE_ENV)
    monkeypatch.setattr(memory_group, "available", lambda: None)
    assert memory_group.in_a_user_scope(["gclab", "grade"]) is None
    assert _calls(ungrouped_on_cgroup2) == []


@needs_a_group
def test_the_python_tried_in_a_user_scope_says_so_where_it_can_make_a_group():
    import subprocess
    import sys
    assert subprocess.run([sys.executable, "-c", memory_group.CAN_MAKE_ONE]).returncode == 0
    assert subprocess.run([sys.executable, "-c", memory_group.CAN_MAKE_ONE],
                          env={**os.environ, "GCLAB_GRADE_MEMORY_GROUP": "0"}).returncode == 1
