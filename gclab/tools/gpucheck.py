"""`gclab gpu-check`: every lesson run and graded on a CUDA GPU, beside the CPU, in one table per lesson.

On a machine with CUDA it runs, for each lesson: the solution notebook (executed with
nbclient, seconds), the grading of the solution and of the untouched release (nbgrader's
hidden tests, through the course's grader), and it reads the key figures the lesson prints
(the text output of code cells tagged `key-figures`).  The same is done at the same time
with CUDA hidden (`CUDA_VISIBLE_DEVICES=""`): the CPU column, same commit, same machine.
Verdicts must be identical on both; figures may differ where the lesson says why.  Last it
runs the test modules that exercise the meter, the detectors and the server on the device.

Exit status 0 when every verdict matches and every solution ran, else 1.  `--json FILE`
keeps everything (outputs of every cell included) for the record.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from ..grader import _jsonschema  # noqa: F401  (before nbformat: see there)
import nbformat

from . import bench
from ..grader import grading

KEY_FIGURES_TAG = "key-figures"
DEVICE_TESTS = ["tests/test_memory.py", "tests/test_held.py", "tests/test_cycles.py", "tests/test_cycle_detector.py",
                "tests/test_gcwatch.py", "tests/test_checks.py", "tests/test_serving.py", "tests/test_traces.py"]


def _cell_text(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            parts.append(output.get("text", ""))
        elif output.get("output_type") in ("execute_result", "display_data"):
            parts.append(output.get("data", {}).get("text/plain", "") if "image/png" not in output.get("data", {}) else "")
        elif output.get("output_type") == "error":
            parts.append(f"{output.get('ename')}: {output.get('evalue')}")
    return "".join(parts)


def notebook_outputs(nb) -> list[dict]:
    """Each code cell's text output, with its tags: what the table and the record keep."""
    return [{"index": i, "tags": list(cell.metadata.get("tags", [])), "text": _cell_text(cell)}
            for i, cell in enumerate(nb.cells) if cell.cell_type == "code"]


def key_figures(outputs) -> str:
    return "".join(o["text"] for o in outputs if KEY_FIGURES_TAG in o["tags"])


def _execute(path: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="gclab-gpu-check-") as folder:
        out = Path(folder) / path.name
        try:
            seconds = bench.execute_seconds(path, out=out)
            return {"seconds": round(seconds, 1), "error": "", "outputs": notebook_outputs(nbformat.read(out, 4))}
        except Exception as error:                  # a cell's error: nbclient's message says which
            return {"seconds": None, "error": f"{type(error).__name__}: {str(error)[-2000:]}", "outputs": []}


def _grade(path: Path, root: Path) -> dict:
    try:
        [result] = grading.grade([path], root=root)
        failed = [f"{t.id}: {t.message.strip().splitlines()[-1] if t.message.strip() else ''}"
                  for t in result.tests if t.score < t.max_score]
        return {"score": f"{result.score:g}/{result.max_score:g}", "reason": result.reason, "failed": failed}
    except Exception:
        return {"score": "error", "reason": traceback.format_exc()[-2000:], "failed": []}


def check_lesson(root: Path, name: str) -> dict:
    """Execute the lesson's solution, grade it and its release, on whatever device this process has."""
    [solution] = sorted((root / "solutions" / name).glob("*.ipynb"))
    release = root / "notebooks" / name / solution.name
    result = {"lesson": name, "execute": _execute(solution), "solution": _grade(solution, root)}
    result["release"] = _grade(release, root) if release.is_file() else {"score": "missing", "reason": "", "failed": []}
    print(f"[{device_line().rsplit(', ', 1)[-1]}] {name}: executed in {result['execute']['seconds']} s "
          f"{result['execute']['error'][:200]}, solution {result['solution']['score']}, "
          f"release {result['release']['score']}", flush=True)
    return result


def check_lessons(root: Path, names, jobs: int) -> list[dict]:
    """check_lesson for each lesson: those whose hidden tests time things alone, then the rest `jobs` at a time."""
    for name in names:
        grading.prepare(root, name)                 # once, before any job needs it
    return grading.schedule(list(names), lambda name: check_lesson(root, name), jobs,
                            alone=lambda name: grading.timed_lesson(root, name))


def device_line() -> str:
    import torch
    where = f"CUDA {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "CPU only"
    return f"Python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), {where}"


def _start_cpu_side(root: Path, names, jobs: int, into: Path) -> subprocess.Popen:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.Popen([sys.executable, "-m", "gclab", "--course", str(root), "gpu-check", "--side", "cpu",
                             "--jobs", str(jobs), "--json", str(into), *names], env=env)


def run_device_tests(root: Path) -> dict:
    tests = [t for t in DEVICE_TESTS if (root / t).is_file()]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "3",
                           "--dist", "loadfile", *tests],
                          cwd=root, capture_output=True, text=True)
    lines = (done.stdout + done.stderr).strip().splitlines()
    counts = [line for line in lines if re.search(r"\d+ (passed|failed|error)", line)]
    return {"modules": tests, "returncode": done.returncode, "summary": counts[-1] if counts else "no result",
            "seconds": round(time.perf_counter() - start, 1), "tail": "\n".join(lines[-400:])}


def _same_verdict(gpu: dict, cpu: dict) -> bool:
    return all(gpu[k]["score"] == cpu[k]["score"] for k in ("solution", "release"))


def format_lesson(gpu: dict, cpu: dict | None) -> str:
    """One lesson's table: executed, solution score, release score, key figures; CUDA beside CPU."""
    def seconds(side):
        ex = side["execute"]
        return f"{ex['seconds']:.1f} s" if ex["seconds"] is not None else "FAILED"
    cpu = cpu or {"execute": {"seconds": None, "error": "not run", "outputs": []},
                  "solution": {"score": "-"}, "release": {"score": "-"}}
    rows = [("executed", seconds(gpu), seconds(cpu) if cpu["execute"]["error"] != "not run" else "-"),
            ("solution score", gpu["solution"]["score"], cpu["solution"]["score"]),
            ("release score", gpu["release"]["score"], cpu["release"]["score"])]
    lines = [f"== {gpu['lesson']}" + ("" if _same_verdict(gpu, cpu) or cpu["solution"]["score"] == "-"
                                       else "   VERDICTS DIFFER"),
             f"{'':<16}{'CUDA':>14}{'CPU':>14}"]
    lines += [f"{name:<16}{a:>14}{b:>14}" for name, a, b in rows]
    for side, label in ((gpu, "CUDA"), (cpu, "CPU")):
        if side["execute"]["error"] and side["execute"]["error"] != "not run":
            lines.append(f"  {label} execution failed: {side['execute']['error'].splitlines()[-1][:300]}")
        for what in ("solution", "release"):
            if side[what].get("reason"):
                lines.append(f"  {label} {what}: {side[what]['reason'].strip().splitlines()[-1][:300]}")
    gpu_fig, cpu_fig = key_figures(gpu["execute"]["outputs"]), key_figures(cpu["execute"]["outputs"])
    if gpu_fig or cpu_fig:
        lines.append("  key figures, CUDA:")
        lines += ["    " + line for line in gpu_fig.strip().splitlines()]
        lines.append("  key figures, CPU:")
        lines += ["    " + line for line in cpu_fig.strip().splitlines()]
    return "\n".join(lines)


def main(root: Path, names=(), side: str = "both", jobs: int = 3, json_path: Path | None = None,
         tests: bool = True) -> int:
    names = list(names) or grading.lessons(root)
    import torch
    if side == "cpu":
        results = check_lessons(root, names, jobs)
        if json_path:
            json_path.write_text(json.dumps({"device": device_line(), "lessons": results}))
        return 0
    if not torch.cuda.is_available():
        print("gpu-check needs a CUDA GPU, and torch sees none here "
              f"({device_line()}). On a CPU-only machine `make test` checks the course.", file=sys.stderr)
        return 2
    print(device_line(), flush=True)
    for name in names:
        grading.prepare(root, name)                 # generated once, before either side grades
    cpu_json = Path(tempfile.mkdtemp(prefix="gclab-gpu-check-")) / "cpu.json"
    cpu_side = _start_cpu_side(root, names, jobs, cpu_json) if side == "both" else None
    start = time.perf_counter()
    gpu_results = check_lessons(root, names, jobs)
    gpu_seconds = time.perf_counter() - start
    cpu_results, cpu_device = {}, "not run"
    if cpu_side is not None:
        cpu_side.wait()
        if cpu_json.is_file():
            data = json.loads(cpu_json.read_text())
            cpu_device, cpu_results = data["device"], {r["lesson"]: r for r in data["lessons"]}
    device_tests = run_device_tests(root) if tests else None
    record = {"device": device_line(), "cpu_device": cpu_device, "lessons": gpu_results,
              "cpu_lessons": list(cpu_results.values()), "device_tests": device_tests,
              "seconds": round(gpu_seconds, 1)}
    if json_path:
        json_path.write_text(json.dumps(record, indent=1))
    ok = True
    for result in gpu_results:
        cpu = cpu_results.get(result["lesson"])
        print(format_lesson(result, cpu), flush=True)
        ok &= not result["execute"]["error"] and (cpu is None or _same_verdict(result, cpu))
    if device_tests:
        print(f"== tests on the device ({device_tests['seconds']} s): {device_tests['summary']}")
        ok &= device_tests["returncode"] == 0
    print("gpu-check: " + ("every verdict the same on CUDA and CPU" if ok else "FAILED (see above)"))
    return 0 if ok else 1
