"""nbgrader's generate_assignment for one lesson, run by gclab in a child process of its own:

    python -m gclab.grader._nbgrader_job COURSE ASSIGNMENT

It loads the course's autograder/nbgrader_config.py and regenerates the assignment (the
student release and its gradebook entries) under a supervisor that ends every process
it started.  COURSE is a scratch course (`gclab.grader.grading.prepare`): its gradebook is its own
SQLite file, whatever gradebook the configuration names (a PostgreSQL URL names the live one).
"""
import argparse
import os
import sys
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("course", type=Path)
    parser.add_argument("assignment")
    args = parser.parse_args(argv)

    from traitlets.config.loader import PyFileConfigLoader
    from gclab.grader import _jsonschema  # noqa: F401  (before nbgrader: see there)
    from nbgrader.apps import NbGraderAPI

    autograder = args.course / "autograder"
    os.chdir(autograder)
    config = PyFileConfigLoader("nbgrader_config.py", path=str(autograder)).load_config()
    config.CourseDirectory.db_url = f"sqlite:///{(autograder / 'gradebook.db').resolve()}"
    result = NbGraderAPI(config=config).generate_assignment(args.assignment, force=True)
    print(result.get("log", ""))
    if not result.get("success"):
        print(f"nbgrader generate_assignment failed:\n{result.get('error', '')}", file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(supervised(main))
