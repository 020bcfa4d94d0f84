"""One grading job, run by `gclab grade` in a child process of its own:

    python -m gclab._nbgrader_job COURSE ASSIGNMENT [--generate] [--student ID] [--cell-timeout S]
                                 [--memory-limit BYTES]

It loads the course's autograder/nbgrader_config.py, optionally regenerates the
assignment (which records the hidden tests in the gradebook) and autogrades one
student's submission, all in one interpreter: nbgrader takes seconds to import, and a
grading command pays that once per submission instead of once per step.  The memory
limit caps the address space of this process and of the kernels it starts.

`run_forked` runs the same job in a process forked from a server that has imported
nbgrader already (grading._nbgrader_job uses it where it can).
"""
import argparse
import os
import sys
import warnings
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("course", type=Path)
    parser.add_argument("assignment")
    parser.add_argument("--generate", action="store_true")
    parser.add_argument("--student")
    parser.add_argument("--cell-timeout", type=int)
    parser.add_argument("--memory-limit", type=int)
    args = parser.parse_args(argv)
    if args.memory_limit:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (args.memory_limit, args.memory_limit))

    from traitlets.config.loader import PyFileConfigLoader
    from nbgrader.apps import NbGraderAPI

    autograder = args.course / "autograder"
    os.chdir(autograder)
    config = PyFileConfigLoader("nbgrader_config.py", path=str(autograder)).load_config()
    if args.cell_timeout:
        config.Execute.timeout = args.cell_timeout
    api = NbGraderAPI(config=config)
    steps = []
    if args.generate:
        steps.append(("generate_assignment", lambda: api.generate_assignment(args.assignment, force=True)))
    if args.student:
        steps.append(("autograde", lambda: api.autograde(args.assignment, args.student, force=True)))
    for name, step in steps:
        result = step()
        print(result.get("log", ""))
        if not result.get("success"):
            print(f"nbgrader {name} failed:\n{result.get('error', '')}", file=sys.stderr)
            return 3
    return 0


def supervised(job) -> int:
    """Run `job()` in a child while this process, a subreaper, waits; then end every process
    the job started, also those that left its session (setsid) or whose parent died: they
    are re-parented to this process.  SIGTERM ends the job and all of them at once."""
    import signal
    _become_subreaper()
    child = os.fork()
    if child == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            code = job()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code or 0)
    signal.signal(signal.SIGTERM, lambda *args: (end_descendants(), os._exit(124)))
    _, status = os.waitpid(child, 0)
    end_descendants()
    return os.waitstatus_to_exitcode(status)


def _become_subreaper() -> None:
    try:
        import ctypes
        PR_SET_CHILD_SUBREAPER = 36
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass                     # not Linux: only the job's own session is stopped


def end_descendants() -> None:
    """Kill this process's descendants until none is left (orphans come back to a subreaper)."""
    import signal
    me = os.getpid()
    for _ in range(100):
        children = _children_of(me)
        if not children:
            return
        for pid in _descendants(children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in children:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _children_of(parent: int) -> list:
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                found.append(int(entry))
    return found


def _descendants(roots: list) -> list:
    seen, stack = [], list(roots)
    while stack:
        pid = stack.pop()
        seen.append(pid)
        stack.extend(_children_of(pid))
    return seen


def run_forked(argv, log_path: str, environment: dict) -> None:
    """The same job in a process forked from the grading fork server: a session of its own
    (so a timeout can stop it and the kernel it started), output into `log_path`, and the
    `environment` changes a subprocess job gets (grading._job_environment)."""
    os.setsid()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.update(environment)
    warnings.simplefilter("ignore")
    sys.exit(supervised(lambda: main(argv)))


if __name__ == "__main__":
    sys.exit(supervised(main))
