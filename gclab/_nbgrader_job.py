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
    try:
        code = main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


if __name__ == "__main__":
    sys.exit(main())
