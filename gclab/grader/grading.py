"""Release the course's notebooks, and grade submitted ones: the `gclab release` and `gclab grade` commands.

`release` regenerates the student notebooks from the nbgrader source (`solutions/`) with nbgrader's
generate_assignment, run in a process of its own on a scratch copy of the course (`prepare` keeps one
per lesson in autograder/work/cache/ until its sources change).

`grade_one` grades a notebook, and every grading command (`grade`, a class in `gclab.grader.classroom`
or on a Dask cluster, nbgrader's Autograde button through `gclab.grader.preprocessors`) goes through it:

1. It reads the submission: an unreadable file, or an answer that rebinds the grader's tools
   (`gclab.grader.tampering`), scores 0 with the reason said; the lines an instructor may want to read
   by hand are listed (`gclab.grader.review`).
2. A verdict process runs the lesson's set-up, given and test cells with the learner's answer cells in
   their places (`gclab.grader.launch`): forked from the grader's zygote server, which imported the
   instruments once, in a session of its own, within a memory limit, behind the kernel's walls
   (`gclab.grader.sandbox`: nothing writable but its folder, the course hidden, no network, no process
   outside its own to name, no capability), its own state guarded (`gclab.guard`).  The learner's code runs there and nowhere else.  The grader reads its
   results on a channel, interrupts a runaway cell, and takes its own readings of the process at every
   step.
3. That process reports; it never decides.  A "passed" keeps its point only where the grader's own
   measurements (`gclab.grader.measured`: outputs compared with the reference solution's, run under the
   same conditions, and what the operating system reports about the process) agree; where they do not,
   the test fails saying so and the submission is flagged for review.
4. Nothing of a hidden test is handed back: messages and outputs are redacted.

It always returns a score and a reason per test (`gclab.grader.results`), also when a submission loops
forever, kills its process, edits locked cells or tampers with the grader.
"""
from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from . import _jsonschema  # noqa: F401  (before nbformat: see there)
import nbformat

from . import measured, review
from .cells import answer_cells, hidden_tests, without_hidden_tests  # noqa: F401  (gclab.grader.grading's names)
from .launch import _ZYGOTE, _job_environment, _run, run_verdict, verdict_conditions, verdict_job  # noqa: F401
from .results import NotebookResult, TestResult, _all_tests, _grade_cells, _score  # noqa: F401
from .tampering import _student_sources, imported_tools, tampering  # noqa: F401

CONFIG = Path("autograder") / "nbgrader_config.py"


# -- the course and its lessons -----------------------------------------------------
def find_course_root(*starts) -> Path:
    """The nearest folder, from each start upwards, that holds autograder/nbgrader_config.py and solutions/."""
    for start in [*starts, Path.cwd()]:
        path = Path(start).resolve()
        for folder in [path, *path.parents]:
            if (folder / CONFIG).is_file() and (folder / "solutions").is_dir():
                return folder
    raise SystemExit("cannot find the course: no folder with autograder/nbgrader_config.py and "
                     "solutions/ above the given notebooks or the current folder (use --course DIR)")


def lessons(root: Path) -> list[str]:
    """Assignment names: the folders of solutions/ that hold a notebook, in order."""
    return sorted(p.name for p in (root / "solutions").iterdir()
                  if p.is_dir() and any(p.glob("*.ipynb")))


def _generate_assignment(course: Path, assignment: str, timeout=None) -> subprocess.CompletedProcess:
    """nbgrader generate_assignment in a process of its own (it runs no learner code)."""
    return _run([sys.executable, "-m", "gclab.grader._nbgrader_job", str(course), assignment], course, timeout)


def _course_config(root: Path):
    """The course's nbgrader configuration (autograder/nbgrader_config.py), as traitlets loads it."""
    from traitlets.config.loader import PyFileConfigLoader
    return PyFileConfigLoader(CONFIG.name, path=str(root / CONFIG.parent)).load_config()


def ignored_patterns(root: Path) -> list[str]:
    """The file patterns the course's nbgrader config never releases (CourseDirectory.ignore)."""
    return list(_course_config(root).CourseDirectory.get("ignore", [".ipynb_checkpoints", "__pycache__"]))


def _scratch_course(root: Path, assignments, workdir: Path) -> Path:
    """A throw-away nbgrader course in `workdir` with the given lessons' sources, the course's
    address (autograder/course.toml) written into their set-up cells before nbgrader locks them."""
    from . import course
    (workdir / "autograder").mkdir(parents=True, exist_ok=True)
    shutil.copy(root / CONFIG, workdir / CONFIG)
    source = course.read_source(root)
    for name in assignments:
        shutil.copytree(root / "solutions" / name, workdir / "solutions" / name,
                        ignore=shutil.ignore_patterns(*ignored_patterns(root)))
        for path in (workdir / "solutions" / name).glob("*.ipynb"):
            _strip_hidden_tests(path)
            course.write_source_into(path, source)
    return workdir


def _strip_hidden_tests(path: Path) -> None:
    """The kernel that runs a submission for the notebook handed back never sees a hidden test
    (the verdict process runs them): neither the gradebook nor the graded notebook holds one."""
    nb = nbformat.read(path, 4)
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("grade"):
            cell.source = without_hidden_tests(cell.source)
    nbformat.write(nb, path)


def build_release(root: Path, out: Path, assignments=None) -> Path:
    """Copy the student release of `assignments` (default: every lesson) into `out`."""
    root = Path(root).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name in assignments or lessons(root):
        shutil.rmtree(out / name, ignore_errors=True)
        shutil.copytree(prepare(root, name) / "notebooks" / name, out / name)
    return out


def release(root: Path, source: str | None = None) -> list[Path]:
    """Regenerate notebooks/ from solutions/ (stale lesson folders are removed), and README's
    Colab links.  With `source`, first keep it as the course's address (autograder/course.toml)."""
    from . import course
    if source is not None:
        course.write_source(root, source)
    target = root / "notebooks"
    for stale in target.glob("*/"):
        if stale.name not in lessons(root):
            shutil.rmtree(stale)
    build_release(root, target)
    course.update_readme(root)
    return sorted(target.glob("*/*.ipynb"))


# -- grading -------------------------------------------------------------------------
def assignment_of(path: Path, root: Path) -> tuple[str, str]:
    """(assignment, notebook name) of a submission: by file name, else by its grade cells."""
    sources = {nb.stem: nb.parent.name for nb in (root / "solutions").glob("*/*.ipynb")}
    for stem, assignment in sources.items():
        if path.stem == stem or path.stem.endswith("_" + stem) or path.stem.endswith("-" + stem):
            return assignment, stem
    try:
        ids = {c.metadata.get("nbgrader", {}).get("grade_id") for c in nbformat.read(path, 4).cells} - {None}
    except Exception:
        ids = set()
    for nb_path in (root / "solutions").glob("*/*.ipynb"):
        source_ids = {c.metadata.get("nbgrader", {}).get("grade_id")
                      for c in nbformat.read(nb_path, 4).cells} - {None}
        if ids and ids <= source_ids:
            return nb_path.parent.name, nb_path.stem
    raise SystemExit(f"{path}: not a notebook of this course (no lesson named {path.stem!r} "
                     "and its cells match no lesson)")


def default_memory_limit() -> int | None:
    """Address-space limit for a grading kernel: none on a machine with an NVIDIA GPU (CUDA
    reserves far more address space than memory), else 8 GiB or 3/4 of the RAM, the lower."""
    if os.path.exists("/dev/nvidiactl"):
        return None
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(8 * 1024**3, ram * 3 // 4)


def grade(paths, root: Path | None = None, timeout: int = 900, memory_limit: int | None | str = "auto",
          cell_timeout: int | None = None, jobs: int = 1, students=None) -> list[NotebookResult]:
    """Grade each submitted notebook (see `grade_one`), `jobs` at a time; a lesson whose
    hidden tests time things (`timed_lesson`) is graded alone, before the others; the
    results in the order of `paths`.
    `students` names the student of each notebook (default: none)."""
    paths = [Path(p) for p in paths]
    root = root or find_course_root(*[p.parent for p in paths])
    students = list(students) if students is not None else [""] * len(paths)
    assignments = [assignment_of(p, root)[0] for p in paths]
    timed = {a for a in set(assignments) if timed_lesson(root, a)}
    return schedule(list(zip(paths, students, assignments)),
                    lambda unit: grade_one(unit[0], root, student=unit[1], timeout=timeout,
                                           memory_limit=memory_limit, cell_timeout=cell_timeout),
                    jobs, alone=lambda unit: unit[2] in timed)


def schedule(units, work, jobs: int, alone=lambda unit: False) -> list:
    """[work(unit) for unit in units], in that order: the units `alone` picks first, one at
    a time, then the others `jobs` at a time (each grading job is a process of its own;
    these threads only wait for them)."""
    results = [None] * len(units)

    def run(index):
        results[index] = work(units[index])
    first = [i for i, unit in enumerate(units) if alone(unit)]
    rest = [i for i in range(len(units)) if i not in first]
    for index in first:
        run(index)
    if jobs > 1 and len(rest) > 1:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(run, rest))
    else:
        for index in rest:
            run(index)
    return results


def timed_lesson(root: Path, assignment: str) -> bool:
    """Does the lesson's notebook say its hidden tests time things (metadata gclab.timed)?
    Such a lesson is graded with no other grading job beside it."""
    return any(nbformat.read(path, 4).metadata.get("gclab", {}).get("timed", False)
               for path in (root / "solutions" / assignment).glob("*.ipynb"))


def grade_one(path, root: Path, student: str = "", timeout: int = 900, memory_limit: int | None | str = "auto",
              cell_timeout: int | None = None, lesson: tuple[str, str] | None = None) -> NotebookResult:
    """Grade one submitted notebook: the unit of work of every grading command.

    The score comes from a verdict process started for it (`gclab.grader.verdict`): the lesson's
    own set-up, given and test cells with the learner's answer cells, the grader's tools
    loaded and guarded before the learner's code runs.  The learner's code runs nowhere
    else.  `memory_limit` caps that process's address space, so that a submission that
    allocates without end gets a MemoryError (and a score) instead of taking the machine
    down; "auto" is `default_memory_limit()`, None no limit.  `timeout` bounds it all.
    `lesson`: the (assignment, notebook name) it is graded as where the caller knows it (a
    class's folders); by default `assignment_of` the file.
    """
    path = Path(path)
    if memory_limit == "auto":
        memory_limit = default_memory_limit()
    assignment, stem = lesson or assignment_of(path, root)
    result = NotebookResult(notebook=str(path), assignment=assignment, student=student, lesson_notebook=stem)
    source_nb = nbformat.read(root / "solutions" / assignment / f"{stem}.ipynb", 4)
    # a folder named as the lesson's own, as a learner's is: nothing in the path tells a grading run apart
    with tempfile.TemporaryDirectory() as folder:
        workdir = Path(folder) / assignment
        workdir.mkdir()
        _grade_submission(root, workdir, source_nb, path, result, timeout, memory_limit,
                          cell_timeout or _cell_timeout(root))
    return _score(result)


def _source_key(root: Path, assignment: str) -> str:
    """A hash of everything generation depends on: the config, the lesson's files, nbgrader."""
    import hashlib
    from importlib.metadata import version
    digest = hashlib.sha256(version("nbgrader").encode() + b"hidden tests stripped line by line")
    digest.update((root / CONFIG).read_bytes())
    from . import course
    if course.read_source(root):        # the address goes into the set-up cells
        digest.update(b"\0source\0" + course.read_source(root).encode())
    ignored = ignored_patterns(root)
    for path in sorted((root / "solutions" / assignment).rglob("*")):
        parts = path.relative_to(root / "solutions" / assignment).parts
        if path.is_file() and not any(fnmatch.fnmatch(part, p) for part in parts for p in ignored):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def prepare(root: Path, assignment: str) -> Path:
    """A generated nbgrader course for `assignment` (its gradebook holds the hidden tests).

    Generation costs seconds (nbgrader runs a database migration in a subprocess), so the
    result is kept in autograder/work/cache/, keyed by a hash of the sources and config,
    and reused until they change.  Where that folder cannot be written, a temporary one
    is used and nothing is kept.
    """
    cache_root = root / "autograder" / "work" / "cache"
    target = cache_root / f"{assignment}-{_source_key(root, assignment)}"
    if (target / "autograder" / "gradebook.db").is_file():
        return target
    try:
        cache_root.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=f".{assignment}-", dir=cache_root))
    except OSError:
        building = Path(tempfile.mkdtemp(prefix="gclab-course-"))
        target = building
    course = _scratch_course(root, [assignment], building / "course" if building != target else building)
    done = _generate_assignment(course, assignment, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"nbgrader generate_assignment {assignment} failed:\n{done.stdout}")
    if building != target:
        try:
            course.rename(target)       # atomic: a concurrent grader sees all of it or none
        except OSError:
            pass                        # another grader got there first; theirs is the same
        shutil.rmtree(building, ignore_errors=True)
    return target


def _grade_submission(root, workdir, source_nb, path, result, timeout, memory_limit, cell_timeout):
    try:
        submitted = nbformat.read(path, 4)
    except Exception as exc:
        result.tests = _all_tests(source_nb, "error", f"not graded: the file is not a readable notebook ({exc})")
        result.reason = "unreadable notebook"
        return
    every_cell = tuple(c.source for c in submitted.cells if c.cell_type == "code")
    tools = imported_tools(c.source for c in source_nb.cells if c.cell_type == "code"
                           and c.metadata.get("nbgrader", {}).get("locked"))
    patched = [line for src in _student_sources(submitted) for line in tampering(src, every_cell, tools)]
    result.review = list(dict.fromkeys(line for cell in submitted.cells if cell.cell_type == "code"
                                       and cell.metadata.get("nbgrader", {}).get("solution")
                                       for line in review.environment_reads(cell.source)))
    if patched:
        result.reason = "the submission modifies the grader's tools: " + "; ".join(list(dict.fromkeys(patched))[:3])
        result.tests = _all_tests(source_nb, "error", "not graded: " + result.reason)
        return
    _judge(root, workdir, source_nb, submitted, result, cell_timeout, memory_limit, timeout)


def _cell_timeout(root: Path) -> int:
    return int(_course_config(root).Execute.get("timeout", 180))


def _judge(root, workdir, source_nb, submitted, result, cell_timeout, memory_limit, timeout) -> None:
    """Score every test cell: the verdict process's results, each "passed" confirmed by the grader's
    own figures against the reference solution's (gclab.grader.measured)."""
    conditions = {"cell_timeout": cell_timeout, "memory_limit": memory_limit, "timeout": timeout}
    reference = reference_figures(root, result.assignment, result.lesson_notebook, source_nb, conditions)
    job = _run_tests(root, workdir, source_nb, submitted, result, conditions)
    if _refuted_only_by_what_the_machine_moves(result, reference):
        # files the verdict read that the page cache had let go of since the reference's run are charged to the
        # verdict's memory cgroup (measured: lesson 06's reference, its cache dropped, 371.2 MiB where its own
        # run grew 216.5); and a shared machine's cores run slower at times, in CPU time too (measured: lesson
        # 08's reference calls, median 2.1 ms, 4.2 ms within one suite's run): graded once more, beside a
        # reference run just before it, and the second run's figures decide
        reference = _reference_now(root, result, source_nb, conditions, reference)
        _empty(workdir)
        job = _run_tests(root, workdir, source_nb, submitted, result, conditions)
    _confirm(result, reference)
    _decide_reason(result, job)
    _redact(result, source_nb)


def _reference_now(root, result: NotebookResult, source_nb, conditions: dict, kept: dict) -> dict:
    """The reference solution run again now, on the machine as it is (not kept): where it passes every test, the
    figures a second run is compared with; else the `kept` ones."""
    now = reference_figures(root, result.assignment, result.lesson_notebook, source_nb, conditions, kept=False)
    return now if all(t["status"] == "passed" for t in now["tests"].values()) else kept


def _empty(folder: Path) -> None:
    for left in list(folder.iterdir()):
        if left.is_dir() and not left.is_symlink():
            shutil.rmtree(left)
        else:
            left.unlink()


def _run_tests(root, workdir, source_nb, submitted, result: NotebookResult, conditions: dict) -> dict:
    """Run the verdict process on the submission; its tests' results and the whole run's figures into
    `result`; the job it ran."""
    job = verdict_job(source_nb, submitted, workdir, hidden=[root], notebook=result.lesson_notebook)
    whole = []
    verdicts = run_verdict(job, whole=whole, **conditions)
    result.tests = [verdicts.get(t.id, TestResult(t.id, 0.0, t.max_score, "error",
                                                 "not graded: the grading process ended before this test"))
                    for t in _all_tests(source_nb, "", "")]
    result.unguarded = list(dict.fromkeys(note for run in whole for note in run.get("unguarded", ())))
    result.measured = _figures_of(whole)
    return job


def _figures_of(whole: list) -> dict:
    """The grader's figures of the whole run, where one verdict process ran it all."""
    return {key: value for key, value in whole[0].items() if key != "unguarded"} if len(whole) == 1 else {}


def _refuted_only_by_what_the_machine_moves(result: NotebookResult, reference: dict) -> bool:
    """Would a "passed" be refuted only by figures the machine's state moves as well as the learner's code: the
    memory charged to the verdict's cgroup (the page cache), the CPU time of its calls and of its server's
    busy stretches (how fast the shared cores run)?"""
    price = measured.collection_price(reference.get("run") or {}, result.measured)
    for test in result.tests:
        ref = reference["tests"].get(test.id)
        steady = measured.without_timings(measured.without_charges(test.measured))
        if (measured.confirm(test.status, test.observed, test.measured, ref, price)
                and not measured.confirm(test.status, test.observed, steady, ref, price)):
            return True
    ref_tests = [t.get("measured") or {} for t in reference["tests"].values()]
    ref_between = measured.outside_the_tests(reference.get("run") or {}, ref_tests)
    between = measured.outside_the_tests(result.measured, [t.measured for t in result.tests])
    return bool(measured.whole_run_disagrees(between, ref_between)
                and not measured.whole_run_disagrees(measured.without_charges(between), ref_between))


def reference_of(root: Path, assignment: str, timeout: int = 900, memory_limit: int | None | str = "auto",
                 cell_timeout: int | None = None) -> dict:
    """The reference solution's figures for `assignment`, under the conditions `grade_one` grades with."""
    source = next((root / "solutions" / assignment).glob("*.ipynb"))
    conditions = {"cell_timeout": cell_timeout or _cell_timeout(root), "timeout": timeout,
                  "memory_limit": default_memory_limit() if memory_limit == "auto" else memory_limit}
    return reference_figures(root, assignment, source.stem, nbformat.read(source, 4), conditions)


def reference_figures(root: Path, assignment: str, notebook: str, source_nb, conditions: dict,
                      kept: bool = True) -> dict:
    """The reference solution's run of the lesson's tests on this machine (see gclab.grader.measured): kept in
    autograder/work/cache/ per lesson, source and machine (`kept=False`: run now, and not kept); run in a folder
    named as the lesson."""
    def compute():
        with tempfile.TemporaryDirectory() as folder:
            workdir = Path(folder) / assignment
            workdir.mkdir()
            job = verdict_job(source_nb, source_nb, workdir, hidden=[root], notebook=notebook)
            whole = []
            verdicts = run_verdict(job, whole=whole, **conditions)
        return {"tests": {test_id: {"status": t.status, "message": t.message, "observed": t.observed,
                                    "measured": t.measured} for test_id, t in verdicts.items()},
                "run": _figures_of(whole)}
    cache = root / "autograder" / "work" / "cache" / (
        f"reference-{assignment}-{_source_key(root, assignment)}-"
        f"{measured.machine_key({**conditions, **verdict_conditions()})}.json")
    if not kept:
        return measured.reference(None, compute)
    try:
        return measured.reference(cache, compute)
    except OSError:                   # a course folder that cannot be written: computed, not kept
        return measured.reference(None, compute)


def _confirm(result: NotebookResult, reference: dict) -> None:
    """A test the learner's process says passed keeps its point only where the grader's figures agree;
    where they do not, the test fails saying so, and the submission is flagged for review."""
    price = measured.collection_price(reference.get("run") or {}, result.measured)
    for test in result.tests:
        why = measured.confirm(test.status, test.observed, test.measured, reference["tests"].get(test.id), price)
        if why:
            test.status, test.score, test.message = "failed", 0.0, why
            result.disagreements.append(f"{test.id}: {why}")
    ref_tests = [t.get("measured") or {} for t in reference["tests"].values()]
    between = measured.outside_the_tests(result.measured, [t.measured for t in result.tests])
    why = measured.whole_run_disagrees(between, measured.outside_the_tests(reference.get("run") or {}, ref_tests))
    if why:
        for test in result.tests:
            if test.status == "passed":
                test.status, test.score, test.message = "failed", 0.0, why
        result.disagreements.append(f"the whole run: {why}")


def _redact(result: NotebookResult, source_nb) -> None:
    """Nothing of a hidden test in anything handed back: messages, outputs, the notebook's reason."""
    hidden = [hidden_tests(c.source) for c in _grade_cells(source_nb)]
    visible = "\n".join(without_hidden_tests(c.source) if c.cell_type == "code" else c.source for c in source_nb.cells)
    redact = measured.Redactor(hidden, visible)
    for test in result.tests:
        test.message, test.output = redact(test.message), redact(test.output)
    result.reason = redact(result.reason)
    result.disagreements = [redact(line) for line in result.disagreements]


def _decide_reason(result: NotebookResult, job: dict) -> None:
    """Why the whole notebook scored what it did, where that is not the tests' own doing."""
    tampered = [t.message for t in result.tests if t.status == "tampered"]
    if tampered:
        result.reason = "the submission tampers with grading: " + tampered[0]
        for t in result.tests:
            t.status, t.score, t.message = "error", 0.0, "not graded: " + result.reason
    elif job["missing_answers"]:
        result.reason = ("the submission has no answer cell " + ", ".join(job["missing_answers"])
                         + " (deleted, or its cell metadata removed): a fresh copy of the lesson keeps them")
    elif result.tests and len({t.message for t in result.tests}) == 1 and result.tests[0].message.startswith("not graded: "):
        result.reason = result.tests[0].message.removeprefix("not graded: ")
    elif job["copied_answers"]:
        result.reason = "; ".join(f"answer cell {grade_id} is in the notebook {count} times" for grade_id, count
                                  in job["copied_answers"].items()) + (
            " (a copied cell keeps the answer's metadata): every copy was run, in order, as Run All runs them; "
            "keep one")


def format_results(results) -> str:
    out = []
    for r in results:
        out.append(f"{r.notebook} [{r.assignment}]: {r.score:g} / {r.max_score:g}")
        if r.reason:
            out.append(f"  reason: {r.reason}")
        for t in r.tests:
            line = f"  {t.status:<8} {t.id:<32} {t.score:g}/{t.max_score:g}"
            out.append(line + (f"  {t.message}" if t.message and t.status != "passed" else ""))
    total = sum(r.score for r in results), sum(r.max_score for r in results)
    out.append(f"total: {total[0]:g} / {total[1]:g}")
    return "\n".join(out)


def results_json(results) -> str:
    return json.dumps([r.as_dict() for r in results], indent=2)
