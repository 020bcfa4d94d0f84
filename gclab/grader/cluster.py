"""Grading a class on a Dask cluster: `gclab grade --scheduler ADDRESS|local`.

Each submission is one Dask task running `classroom.grade_submission` (a grading process,
the student's feedback, the scores into the gradebook).  A lesson whose hidden tests time
things (`grading.timed_lesson`) must not share cores with any other unit: every worker
offers as many "grading-slots" (a Dask worker resource) as it has threads, an ordinary unit
takes one slot, a timed unit all the slots of its worker, so it runs alone there.

`--scheduler local` starts a local cluster of one worker with `--jobs` threads (the grading
itself runs in subprocesses).  For a real cluster, start a scheduler and one worker per
machine, its slots equal to its threads (two workers on one machine would share its cores):

    dask scheduler                                           # on the scheduler's machine
    dask worker tcp://scheduler:8786 --nworkers 1 --nthreads 2 --resources "grading-slots=2"
    gclab grade --submissions /course/submitted --scheduler tcp://scheduler:8786 \\
        --db-url postgresql://grader@dbhost/gradebook

Every worker needs gclab installed as on the grading machine (`pip install -c constraints.txt
-e ".[course,cluster]"`), and the course folder and the submissions at the same path as there
(a shared filesystem): workers read the lessons and submissions there and write autograded/
and feedback/ under --out.  The gradebook must be PostgreSQL (`--db-url postgresql://...`,
or `c.CourseDirectory.db_url` in autograder/nbgrader_config.py), since several workers
write to it at once; SQLite on a shared filesystem is not safe for that.
"""
from __future__ import annotations

import uuid
import warnings
from contextlib import contextmanager

from . import classroom, grading

SLOTS = "grading-slots"


def local_cluster(threads: int = 1, workers: int = 1):
    """A local Dask cluster of `workers` processes of `threads` threads and as many slots."""
    from distributed import LocalCluster
    return LocalCluster(n_workers=workers, threads_per_worker=threads, processes=True,
                        resources={SLOTS: threads}, dashboard_address=None, memory_limit=0)


@contextmanager
def _client(scheduler: str, jobs: int):
    from distributed import Client
    if scheduler == "local":
        with local_cluster(threads=jobs) as cluster, Client(cluster) as client:
            yield client
    else:
        with Client(scheduler) as client:
            client.wait_for_workers(1, timeout=120)
            yield client


def _largest(client) -> tuple[int, list[str]]:
    """The slots of the largest workers and their addresses: a timed unit runs on one of
    them holding all its slots (a worker with fewer would have some left for others)."""
    slots = {address: int(w.get("resources", {}).get(SLOTS, 0))
             for address, w in client.scheduler_info(n_workers=-1)["workers"].items()}
    most = max(slots.values(), default=0)
    if most < 1:
        raise RuntimeError(f'no worker offers the {SLOTS!r} resource: start workers with '
                           f'--resources "{SLOTS}=N", N their --nthreads (see gclab.grader.cluster)')
    return most, [address for address, n in slots.items() if n == most]


def grade_on_cluster(submissions, settings: classroom.Settings, scheduler: str,
                     jobs: int = 1, progress=None) -> list[grading.NotebookResult]:
    """Grade every submission on the cluster at `scheduler` ("local": one started here with
    `jobs` threads), timed lessons alone on their worker; the results in submission order,
    the class report written into out/reports/. `progress` is told each result as it comes.

    Each result is taken from its worker as soon as it is done, and the cluster forgets it: a
    worker lost later (killed, its machine gone) loses only the gradings it was running, which
    the cluster runs again elsewhere; `progress` is told which.  A submission the cluster gave up
    on (its worker lost again and again) is said, and left out of the results and the report."""
    submissions = list(submissions)
    if scheduler != "local" and settings.db_url.startswith("sqlite"):
        warnings.warn(f"several workers write to the gradebook at once: use PostgreSQL, not {settings.db_url}",
                      stacklevel=2)
    say = progress.say if progress is not None else classroom.Progress(0).say
    with classroom.class_run(settings):
        classroom.prepare_gradebook(settings, [s.assignment for s in submissions])
        with _client(scheduler, max(1, jobs)) as client:
            done = _grade_each(client, submissions, settings, progress, say)
        results = [done[i] for i in range(len(submissions)) if i in done]
        classroom.write_report(results, settings.out / "reports")
    return results


def _grade_each(client, submissions, settings, progress, say) -> dict:
    """{index of a submission: its result}, each taken as it comes; those not graded are said."""
    from distributed import as_completed
    timed = set(classroom.exclusive_first(submissions, settings.root)[0])
    slots, largest = _largest(client)
    keys = {}
    for index, s in enumerate(submissions):
        keys[f"grade-{s.student}-{s.assignment}-{uuid.uuid4().hex[:8]}"] = index
    client.subscribe_topic("all", _tell_lost_workers(keys, submissions, say))
    futures = [client.submit(classroom.grade_submission, submissions[index], settings, key=key,
                             resources={SLOTS: slots if submissions[index] in timed else 1},
                             workers=largest if submissions[index] in timed else None,
                             priority=1 if submissions[index] in timed else 0)
               for key, index in keys.items()]
    done, failed = {}, []
    for future in as_completed(futures):
        index = keys[future.key]
        if future.status == "finished":
            done[index] = future.result()
            if progress is not None:
                progress(done[index])
        else:
            failed.append(f"{_name(submissions[index])}: {future.exception()!r}")
        future.release()           # the cluster forgets it: a worker lost from now on cannot lose it
    futures.clear()
    if failed:
        say(f"not graded ({len(failed)}; run the same command again to grade them): " + "; ".join(failed))
    return done


def _name(submission) -> str:
    return f"{submission.student} {submission.assignment}"


def _tell_lost_workers(keys: dict, submissions, say):
    """A handler of the scheduler's events that says, when a worker leaves unexpectedly, which gradings
    it was running (lost, run again elsewhere) and which finished ones it still held (graded again)."""
    def named(found) -> str:
        return ", ".join(sorted(_name(submissions[keys[k]]) for k in found if k in keys))

    def handle(event):
        _, message = event
        if not isinstance(message, dict) or message.get("action") != "remove-worker" or message.get("expected"):
            return
        running, held = named(message.get("processing-tasks", ())), named(message.get("lost-computed-tasks", ()))
        lines = [f"worker {message.get('worker', '?')} left the cluster unexpectedly (killed, or its machine lost)"]
        if running:
            lines.append(f"  lost the gradings it was running, which run again on another worker: {running}")
        if held:
            lines.append(f"  lost the finished grades it held, graded again: {held}")
        say("\n".join(lines))
    return handle
