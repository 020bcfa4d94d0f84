"""Run the lessons as a workshop attendee on Google Colab would, and time it.

    .venv/bin/python autograder/colab_check.py [--env DIR] [--python python3.13] [--source SRC] [LESSON ...]

A Colab runtime has Python 3.13 with torch 2.11, ipywidgets 7.7.1, notebook 6.5.7 and
matplotlib 3.10 preinstalled, and no gclab.  This script builds such an environment once
(`--env`, default autograder/work/colab-env: PyPI's torch 2.11.0, the CUDA build Colab has
too, about 5 GB; on a machine without a GPU it runs on the CPU), then for each lesson:

1. removes gclab from it, so that the lesson's first cell has to install it;
2. writes SRC into the lesson's set-up cell, as `gclab release --source SRC` does (default
   SRC: this checkout's folder, which pip installs as it would the course's repository;
   `--source git+file:///path/to/clone` installs its committed HEAD, as from a git host);
3. runs the lesson's solution top to bottom in a kernel of that environment (GCLAB_SOURCE
   unset), and reports the seconds the first cell took (the install) and the whole lesson,
   errors, and whether Colab's own packages were kept.

It first runs the first cell with no source, in the same environment, and checks that it
stops with the message that says how to set one.  Exit status 0 when everything passed.
Too slow for the test suite (minutes, and gigabytes the first time): run it before a
workshop, and after a change to the set-up cell or to gclab's dependencies.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from gclab.grader import course  # noqa: E402

# What Colab has preinstalled (issue 13; Colab's runtime of 2026), and what runs notebooks here.
COLAB_PACKAGES = ["torch==2.11.0", "ipywidgets==7.7.1", "notebook==6.5.7", "matplotlib==3.10.*"]
RUNNER_PACKAGES = ["ipykernel", "nbclient", "nbformat"]
KEPT = ["torch", "ipywidgets", "notebook", "matplotlib"]

RUNNER = r'''
import json, sys, nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
nb_path, out_path, folder, timeout = sys.argv[1:5]
nb = nbformat.read(nb_path, 4)
client = NotebookClient(nb, timeout=int(timeout), kernel_name="python3", resources={"metadata": {"path": folder}})
error = None
try:
    client.execute()
except CellExecutionError as exc:
    error = str(exc)
nbformat.write(nb, out_path)
print(json.dumps({"error": error}))
'''


def env_python(env: Path) -> Path:
    return env / "bin" / "python"


def versions(env: Path) -> dict:
    code = ("import importlib.metadata as m, json, sys; "
            f"print(json.dumps({{n: m.version(n) for n in {KEPT!r}}} | {{'python': sys.version.split()[0]}}))")
    return json.loads(subprocess.run([env_python(env), "-c", code], check=True, capture_output=True,
                                     text=True).stdout)


def build_env(env: Path, python: str) -> float | None:
    """Create the Colab-like environment unless it exists; the seconds it took, or None."""
    if env_python(env).exists():
        return None
    start = time.perf_counter()
    subprocess.run([python, "-m", "venv", str(env)], check=True)
    subprocess.run([env_python(env), "-m", "pip", "install", "-q", *COLAB_PACKAGES, *RUNNER_PACKAGES], check=True)
    return time.perf_counter() - start


def clean_environment() -> dict:
    """This process's environment without what would point the kernel elsewhere."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("JUPYTER", "VIRTUAL_ENV", "PYTHON", "GCLAB_", "MPLBACKEND"))}


def uninstall_gclab(env: Path) -> None:
    subprocess.run([env_python(env), "-m", "pip", "uninstall", "-q", "-y", "gclab"], capture_output=True)


def execute(env: Path, nb, timeout: int) -> tuple[object, str | None, float]:
    """Run `nb` in a kernel of `env`, in a scratch folder: (the notebook as run, error, seconds)."""
    import nbformat
    with tempfile.TemporaryDirectory(prefix="gclab-colab-") as folder:
        src, out, runner = Path(folder, "in.ipynb"), Path(folder, "out.ipynb"), Path(folder, "run.py")
        nbformat.write(nb, src)
        runner.write_text(RUNNER)
        work = Path(folder, "work")
        work.mkdir()
        start = time.perf_counter()
        done = subprocess.run([env_python(env), str(runner), str(src), str(out), str(work), str(timeout)],
                              capture_output=True, text=True, env=clean_environment(), cwd=work)
        seconds = time.perf_counter() - start
        if done.returncode != 0 or not out.exists():
            return nb, f"the runner failed ({done.returncode}): {done.stderr[-2000:]}", seconds
        error = json.loads(done.stdout.strip().splitlines()[-1])["error"]
        return nbformat.read(out, 4), error, seconds


def cell_seconds(cell) -> float | None:
    from datetime import datetime
    timing = cell.metadata.get("execution", {})
    try:
        start = datetime.fromisoformat(timing["iopub.execute_input"].replace("Z", "+00:00"))
        end = datetime.fromisoformat(timing["shell.execute_reply"].replace("Z", "+00:00"))
    except (KeyError, ValueError):
        return None
    return (end - start).total_seconds()


def setup_index(nb) -> int:
    return next(i for i, c in enumerate(nb.cells) if c.cell_type == "code"
                and c.metadata.get("nbgrader", {}).get("grade_id") == "setup")


def check_unset(env: Path, timeout: int) -> bool:
    """The first cell with no source and no gclab stops with the message that says what to do."""
    import nbformat
    uninstall_gclab(env)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(course.with_source(course.SETUP_BLOCK, ""))]
    _, error, _ = execute(env, nb, timeout)
    ok = bool(error) and "does not say where the course lives" in error and "GCLAB_SOURCE" in error
    print(f"first cell, no source: {'stops with the message' if ok else 'WRONG: ' + str(error)[-500:]}")
    return ok


def check_lesson(env: Path, lesson: str, source: str, timeout: int, before: dict) -> bool:
    import nbformat
    [path] = sorted((ROOT / "solutions" / lesson).glob("*.ipynb"))
    nb = nbformat.read(path, 4)
    setup = nb.cells[setup_index(nb)]
    setup.source = course.with_source(setup.source, source)
    uninstall_gclab(env)
    ran, error, seconds = execute(env, nb, timeout)
    install = cell_seconds(ran.cells[setup_index(ran)])
    stderr = [(i, o["text"]) for i, c in enumerate(ran.cells) if c.cell_type == "code"
              for o in c.get("outputs", []) if o.get("name") == "stderr"]
    after = versions(env)
    kept = after == before
    print(f"{lesson}: first cell (installs gclab) {install if install is None else round(install, 1)} s, "
          f"lesson {seconds:.1f} s, {'no error' if not error else 'ERROR'}, {len(stderr)} stderr outputs, "
          f"Colab's packages {'kept' if kept else f'CHANGED: {before} -> {after}'}")
    for index, text in stderr:
        print(f"   stderr of cell {index}: {text.strip()[:300]}")
    if error:
        print("   " + error[-1500:].replace("\n", "\n   "))
    return not error and kept


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lessons", nargs="*", help="lesson folders of solutions/ (default: all)")
    parser.add_argument("--env", type=Path, default=ROOT / "autograder" / "work" / "colab-env")
    parser.add_argument("--python", default=shutil.which("python3.13") or "python3.13",
                        help="the Python 3.13 that creates --env when it is missing")
    parser.add_argument("--source", default=str(ROOT), help="what the first cell installs gclab from")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)

    built = build_env(args.env, args.python)
    if built is not None:
        print(f"Colab-like environment {args.env}: {' '.join(COLAB_PACKAGES)} installed in {built:.0f} s")
    before = versions(args.env)
    print("environment:", ", ".join(f"{k} {v}" for k, v in before.items()))
    ok = check_unset(args.env, args.timeout)
    start = time.perf_counter()
    for lesson in args.lessons or [p.parent.name for p in sorted(ROOT.glob("solutions/*/*.ipynb"))]:
        ok &= check_lesson(args.env, lesson, args.source, args.timeout, before)
    print(f"lessons: {time.perf_counter() - start:.0f} s in all; {'all passed' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
