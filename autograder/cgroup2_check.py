"""Run the grader's memory-cgroup tests on a machine with cgroup v2, in a virtual machine booted here.

    .venv/bin/python autograder/cgroup2_check.py [--kernel VMLINUZ] [--kvm] [--delegated | --user-scope] [--log FILE]
                                                 [PYTEST ARGS ...]

Most course servers today have cgroup v2 alone (Debian 11 and later, Ubuntu 21.10 and later, Fedora), and
the machines this course is developed and tested on have cgroup v1's memory hierarchy, so the suite there
reads v1's files only.  This script boots this machine's own system (its root file system shared read-only,
this checkout read-write) under a Debian kernel in QEMU with virtme-ng, where the kernel mounts cgroup v2
alone, and runs pytest there (default: `tests/test_memory_group.py`, then lesson 04's gradings and the
shared-memory forgery: the reference gets full marks and the forgery does not, with the verdicts' groups
made in cgroup v2).  It prints which hierarchy the grader found, then pytest's report.

`--delegated` runs the tests as a user without root (`nobody`) in a subtree delegated to it, as a systemd user
service with `Delegate=yes` has one: `course/` with the memory controller for its children, the grader's
process in `course/grader/`, both owned by that user; `autograder/work/`, where the grader keeps the
reference's figures, is an empty folder of that user's in the virtual machine.  `--user-scope` runs them as
`nobody` in the tree systemd gives a user (`user.slice/user-65534.slice/user@65534.service`, owned by the user,
with the memory controller), in a scope of it beside this shell (`app.slice/run-gclab.scope`), where
`systemd-run --user --scope` starts a command; the virtual machine has no systemd, so the tree is made by
hand.  `--login-session` puts this shell in a login session's scope of that user (root's, from which no group
can be made), the user lingering, and a `systemd-run` on its PATH that does what systemd's does (a process with
root, as systemd's PID 1, attaches the caller to a new scope in the user's tree), then runs `gclab grade` on
lesson 04's reference (or the notebooks given), which is to run itself again in such a scope
(`memory_group.in_a_user_scope`), say so, and grade with a memory cgroup.

Needs, once (as root): `apt-get install qemu-system-x86 linux-image-amd64`; virtme-ng is installed by the
script into autograder/work/vng-env.  Without `--kvm` the machine is emulated (QEMU's TCG: about ten times
slower, but nested virtualisation hung here at boot): the default tests take about 15 minutes.  Too slow
for the suite: run it after a change to `gclab.grader.memory_group` or the walls.
"""
from __future__ import annotations

import argparse
import glob
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VNG_ENV = ROOT / "autograder" / "work" / "vng-env"
DEFAULT_TESTS = ["tests/test_memory_group.py",
                 "tests/test_lesson_04.py::test_solution_earns_full_marks",
                 "tests/test_lesson_04.py::test_untouched_student_notebook_earns_nothing",
                 "tests/test_forgery.py::test_views_left_in_cycles_and_moved_into_shared_memory_are_still_counted"]
# a subtree delegated to `nobody`, as systemd delegates one to a user service, and this shell moved into it
DELEGATE = ("cd /sys/fs/cgroup && echo +memory > cgroup.subtree_control && mkdir course course/grader && "
            "echo +memory > course/cgroup.subtree_control && chown -R nobody course && "
            "echo $$ > course/grader/cgroup.procs && cd - >/dev/null && "
            "mount -t tmpfs -o mode=755,uid=65534 none autograder/work && ")
# the tree systemd gives a user (user@.service: `Delegate=pids memory cpu`, the user's own manager in it), owned by
# the user, with the memory controller down to app.slice, and this shell moved into `group`
USER_TREE = "user.slice/user-65534.slice/user@65534.service"


def _users_tree_with_this_shell_in(group: str) -> str:
    return ("cd /sys/fs/cgroup && mkdir -p " + USER_TREE + "/app.slice " + group + " && "
            "for level in . user.slice user.slice/user-65534.slice " + USER_TREE + " " + USER_TREE + "/app.slice; "
            "do echo +memory > $level/cgroup.subtree_control; done && chown -R nobody " + USER_TREE + " && "
            "echo $$ > " + group + "/cgroup.procs && cd - >/dev/null && "
            "mount -t tmpfs -o mode=755,uid=65534 none autograder/work && ")


# this shell in a scope the user's manager made for it (`systemd-run --user --scope`)
USER_SCOPE = _users_tree_with_this_shell_in(USER_TREE + "/app.slice/run-gclab.scope")
# this shell in a login session's scope (root's, as logind makes it), from which no group can be made, the user
# lingering, and a `systemd-run` that does what systemd's does for `--user --scope`: asks a manager with root
# (systemd's PID 1, asked by the user's manager) to attach its process to a new scope in the user's tree, then
# runs the command
LOGIN_SESSION = (_users_tree_with_this_shell_in("user.slice/user-65534.slice/session-1.scope") +
                 "mount -t tmpfs none /var/lib/systemd && mkdir /var/lib/systemd/linger && "
                 "touch /var/lib/systemd/linger/nobody && "     # the user lingers (`loginctl enable-linger`)
                 "mkdir -p /run/systemd-here && cd /run/systemd-here && mkfifo attach attached && chmod 666 attach attached && "
                 "printf '%s\\n' '#!/bin/sh' 'while [ \"$1\" != -- ]; do shift; done; shift' "
                 "'echo $$ > /run/systemd-here/attach; read done < /run/systemd-here/attached; exec \"$@\"' > systemd-run && "
                 "chmod 755 systemd-run && cd - >/dev/null && "
                 "(while read pid < /run/systemd-here/attach; do scope=/sys/fs/cgroup/" + USER_TREE + "/app.slice/run-$pid.scope; "
                 "mkdir $scope && chown -R nobody $scope && echo $pid > $scope/cgroup.procs; "
                 "echo attached > /run/systemd-here/attached; done) & ")
# a Python under root's home (pyenv's), which nobody may not enter, shown to it: the home covered by an empty one
# that holds only the interpreters, in the virtual machine alone
SHOW_PYENV = ("mkdir -p /run/home-of-root && mount --bind /root /run/home-of-root && mount -t tmpfs -o mode=755 none "
              "/root && mkdir /root/.pyenv && mount --bind /run/home-of-root/.pyenv /root/.pyenv && ")
SAY_HIERARCHY = ("import os, pwd; from gclab.grader import memory_group as m; "
                 "print('user:', pwd.getpwuid(os.getuid()).pw_name); "
                 "print('hierarchy:', m.hierarchy()); print('groups made in:', m._parent_folder()); "
                 "print('why none:', m.available()); g = m.MemoryGroup.made(); "
                 "print('a peak reset through its own descriptor (Linux 6.12+):', g and g._peak_fd is not None); "
                 "g and g.remove()")


def _vng() -> Path:
    vng = VNG_ENV / "bin" / "vng"
    if not vng.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VNG_ENV)], check=True)
        subprocess.run([str(VNG_ENV / "bin" / "pip"), "install", "-q", "virtme-ng"], check=True)
    return vng


def _reachable_by_nobody(python: Path) -> str:
    return SHOW_PYENV if str(python.resolve()).startswith("/root/.pyenv/") else ""


def _newest_kernel() -> str | None:
    kernels = sorted(glob.glob("/boot/vmlinuz-*"))
    return kernels[-1] if kernels else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", default=_newest_kernel(), help="the kernel to boot (default: the newest in /boot)")
    parser.add_argument("--kvm", action="store_true", help="use KVM rather than emulate the machine")
    parser.add_argument("--memory", default="6G")
    parser.add_argument("--log", type=Path, help="also write the virtual machine's output here")
    parser.add_argument("--delegated", action="store_true", help="as a user without root, in a delegated subtree")
    parser.add_argument("--user-scope", action="store_true",
                        help="as a user without root, in a scope of its systemd user manager (systemd-run --user --scope)")
    parser.add_argument("--login-session", action="store_true",
                        help="as a user without root, in a login session's scope, `gclab grade` of lesson 04's "
                             "reference (or the notebooks given): it runs itself again in a user scope")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args(argv)
    tests = args.pytest_args or DEFAULT_TESTS
    if not args.kernel:
        print("no kernel in /boot: apt-get install linux-image-amd64", file=sys.stderr)
        return 2
    python = shlex.quote(str(ROOT / ".venv" / "bin" / "python"))
    inside = (f"{python} -c {shlex.quote(SAY_HIERARCHY)} && "
              f"{python} -m pytest -q -p no:cacheprovider {' '.join(map(shlex.quote, tests))}")
    if args.login_session:
        notebooks = args.pytest_args or sorted(glob.glob(str(ROOT / "solutions" / "04_*" / "*.ipynb")))
        inside = (f"{python} -c {shlex.quote(SAY_HIERARCHY)}; PATH=/run/systemd-here:$PATH {python} -m gclab grade "
                  + " ".join(map(shlex.quote, notebooks)))
    if args.delegated or args.user_scope or args.login_session:
        prefix = LOGIN_SESSION if args.login_session else USER_SCOPE if args.user_scope else DELEGATE
        inside = (prefix + _reachable_by_nobody(ROOT / ".venv" / "bin" / "python") + "exec setpriv --reuid nobody "
                  f"--regid nogroup --clear-groups env PYTHONDONTWRITEBYTECODE=1 HOME=/tmp sh -c {shlex.quote(inside)}")
    script = ROOT / "autograder" / "work" / "cgroup2-inside.sh"    # the kernel's command line, which carries a
    script.parent.mkdir(exist_ok=True)                              # command, is cut at 2,048 characters
    script.write_text(inside + "\n")
    command = [str(_vng()), "-r", args.kernel, "--force-9p", "--memory", args.memory, "--cpus", "2",
               f"--rwdir={ROOT}", "--cwd", str(ROOT), *([] if args.kvm else ["--disable-kvm"]), "--", f"sh {script}"]
    env = {"PATH": f"{VNG_ENV / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin"}     # vng runs its own tools by name
    lines = []
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as run:
        for line in run.stdout:         # as it comes: the tests take minutes
            print(line, end="", flush=True)
            lines.append(line)
    output = "".join(lines)
    if args.log:
        args.log.write_text(output)
    if args.login_session:
        return 0 if "grading in a scope of your systemd user manager" in output and "total:" in output \
            and "makes no memory cgroup" not in output else 1
    return 0 if "hierarchy: Hierarchy(" in output and " passed" in output and " failed" not in output else 1


if __name__ == "__main__":
    sys.exit(main())
