"""A small model server and an open-loop load generator, to watch collector pauses hit requests.

    with ModelServer(heap_objects=300_000, attribution="objects", policy="my_policy.py") as server:
        load = run_load(server.url, rate=200, duration=4.0)
        trace = server.trace()
    load.percentiles()               # latency in ms at P50, P95, P99 and the maximum
    trace.collections_inside_requests(generation=2)

The server is an ASGI app (Starlette) under uvicorn, in a process of its own on
127.0.0.1.  It serves a small torch model, optionally with "attribution" post-processing
that builds many small Python objects with back-references per request ("objects"), or
the same scores as one tensor ("compact"), and it keeps a long-lived heap (vocabulary,
metadata, a response cache) the collector has to walk.  Each request also awaits
`device_ms` of simulated accelerator time (the CPU and the event loop are free meanwhile,
as when a GPU runs the model), so several requests are in flight at once.  It
records, on the shared `time.perf_counter()` clock (CLOCK_MONOTONIC on Linux), when each
request started and ended and every collection with the CPU time it took, checks that record
against CPython's own counters, and hands it back on a trace port answered by a thread of its
own (`ModelServer.trace()`).

The load generator runs in a process of its own with the collector off, so its own
pauses cannot be charged to the server.  It is open-loop: request i leaves at its
scheduled time whatever happened to the earlier ones, and its latency is measured from
that scheduled time, so a request that waited behind a pause is charged for the wait.  It may
send its schedule in bursts (`run_load(burst=..., lull=...)`): each burst leaves a lull after
the last answer to the one before, so the server is idle between bursts however slow the
machine, and open-loop within a burst.

A GC policy is a Python file the server loads; it may define any of

    on_startup()               after the heap and model are built and warmed up
    before_request(in_flight)  as a request starts (in_flight counts it)
    after_request(in_flight)   as a request ends (in_flight no longer counts it)
    on_idle(idle_seconds)      every `idle_after` seconds while no request is in flight;
                               idle_seconds: how long since the last request ended
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import urllib.request
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from . import outside
from .gcwatch import Collection, GCWatch, gc_disabled
from .grader.guard import starting_environment  # TODO(lead): instrument imports grader

__all__ = ["ModelServer", "LoadResult", "Trace", "ServedRun", "ServedCollection", "measure", "compare", "spread",
           "run_load", "schedule", "InlineRun", "serve_inline", "full_collection_cpu",
           "long_lived_heap", "prestart"]

READY = "gclab-serving ready on port"
HOOKS = ("on_startup", "before_request", "after_request", "on_idle")
# per-token attribution scores: none, as linked Python objects, or as one tensor per response
ATTRIBUTION = ("off", "objects", "compact")


# -- what the server serves ------------------------------------------------------------
class Explanation:
    """Per-token attribution for one response; every token score points back at it."""
    __slots__ = ("label", "tokens", "__weakref__")

    def __init__(self, label):
        self.label = label
        self.tokens = []


class TokenScore:
    __slots__ = ("explanation", "token", "score", "by_class", "detail")

    def __init__(self, explanation, token, score, by_class):
        self.explanation = explanation          # the back-reference: a cycle per token
        self.token = token
        self.score = score
        self.by_class = by_class                # a list of floats
        self.detail = [None, None]              # rank, share of the total


def long_lived_heap(objects: int) -> dict:
    """Model metadata of about `objects` tracked containers that live as long as the server."""
    entries = max(1, objects // 2)
    return {"vocabulary": {f"tok{i}": [i, [i % 97, i % 89]] for i in range(entries)}}


HEAP_OBJECTS = 300_000          # a server's long-lived heap, unless told otherwise
_PREBUILT_HEAPS: dict = {}      # in a zygote: built once, each forked server gets its own copy (see preload)


class Model:
    """An embedding bag and two linear layers: a few hundred microseconds per request on a CPU."""

    def __init__(self, device, vocabulary=4096, width=64, classes=8):
        import torch
        torch.manual_seed(0)
        self.torch, self.device, self.vocabulary = torch, device, vocabulary
        self.embedding = torch.randn(vocabulary, width, device=device)
        self.hidden = torch.nn.Linear(width, width).to(device)
        self.head = torch.nn.Linear(width, classes).to(device)

    def tokens(self, seed: int, length: int = 64) -> list[int]:
        return [(seed * 7919 + k * 104729) % self.vocabulary for k in range(length)]

    def predict(self, tokens):
        torch = self.torch
        with torch.inference_mode():
            embedded = self.embedding[torch.tensor(tokens, device=self.device)]
            logits = self.head(torch.relu(self.hidden(embedded.mean(0))))
            contributions = embedded @ self.head.weight.T       # per token, per class
            return int(logits.argmax()), contributions

    def explain(self, label, tokens, contributions) -> Explanation:
        """Attribution as Python objects: a few container objects per token, each linked back."""
        explanation = Explanation(label)
        for token, by_class in zip(tokens, contributions.tolist()):
            explanation.tokens.append(TokenScore(explanation, token, by_class[label], by_class))
        total = sum(abs(t.score) for t in explanation.tokens) or 1.0
        for rank, scored in enumerate(sorted(explanation.tokens, key=lambda t: t.score, reverse=True)):
            scored.detail[:] = [rank, abs(scored.score) / total]
        return explanation

    def explain_compact(self, label, contributions):
        """The same scores as one tensor: no per-token Python objects, no back-references."""
        return label, contributions[:, label].clone()


class ResponseCache:
    """The last `size` responses, oldest evicted first (a dict keeps insertion order)."""

    def __init__(self, size: int):
        self.size, self.entries = size, {}

    def put(self, key, value):
        self.entries.pop(key, None)
        self.entries[key] = value
        if len(self.entries) > self.size:
            del self.entries[next(iter(self.entries))]


# -- the server process ----------------------------------------------------------------
def load_policy(path):
    """The hooks a policy file defines (missing ones do nothing)."""
    hooks = {name: (lambda *args: None) for name in HOOKS}
    if path:
        import importlib.machinery
        import importlib.util
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no policy file at {path}")
        loader = importlib.machinery.SourceFileLoader("gclab_policy", path)     # any file name will do
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader("gclab_policy", loader))
        # compiled from its source every time, never from bytecode cached beside it: bytes in the policy's
        # folder could be any code object at all (the grading guard refuses to load them)
        with open(path, "rb") as source:
            exec(compile(source.read(), path, "exec"), vars(module))
        hooks.update({name: getattr(module, name) for name in HOOKS if callable(getattr(module, name, None))})
    return hooks


class ServerState:
    def __init__(self, model, heap, cache, hooks, attribution):
        self.model, self.heap, self.cache, self.hooks = model, heap, cache, hooks
        self.attribution = attribution
        self.in_flight = 0
        self.last_end = time.perf_counter()
        self.idle_calls: list[tuple[float, float]] = []      # (start, end) of on_idle calls that took time
        self.idle_call_count = 0
        self.idle_call_times: list[float] = []               # when each on_idle call started
        self.peak_garbage = 0
        self.errors: list[str] = []
        self.explanations = weakref.WeakSet()
        self.freed_times: list[float] = []      # when each explanation was freed (by the collector: they are cycles)
        self._refs = set()

        def on_free(ref, refs=self._refs, times=self.freed_times, clock=time.perf_counter):
            refs.discard(ref)
            times.append(clock())
        self._on_free = on_free

    def answer(self, seed: int) -> dict:
        return self.postprocess(*self.infer(seed))

    def infer(self, seed: int):
        tokens = self.model.tokens(seed)
        return (seed, tokens, *self.model.predict(tokens))

    def postprocess(self, seed, tokens, label, contributions) -> dict:
        body = {"label": label}
        if self.attribution == "objects":
            explanation = self.model.explain(label, tokens, contributions)
            self.explanations.add(explanation)
            self._refs.add(weakref.ref(explanation, self._on_free))
            self.cache.put(seed, explanation)
            top = sorted(explanation.tokens, key=lambda t: t.score, reverse=True)[:5]
            body["top_tokens"] = [[t.token, round(t.score, 4)] for t in top]
        elif self.attribution == "compact":
            label, scores = self.model.explain_compact(label, contributions)
            self.cache.put(seed, (label, scores))
            top = scores.topk(5)
            body["top_tokens"] = [[tokens[i], round(v, 4)] for i, v in zip(top.indices.tolist(), top.values.tolist())]
        return body

    def garbage(self) -> dict:
        """Explanations still alive though neither cached nor in flight: cyclic garbage not yet
        collected, now and at its highest since the last reset (sampled while the server runs).
        A cache holds at most `cache.size` of them, whatever its dict says."""
        alive = len(self.explanations)
        cached = min(self.cache.size, sum(1 for value in list(self.cache.entries.values())
                                          if isinstance(value, Explanation)))
        # with gc.DEBUG_SAVEALL the collector keeps what it finds in gc.garbage, never freed; their weak
        # references were cleared first, so they have left the set (and were counted as freed)
        saved = sum(1 for value in list(gc.garbage) if type(value) is Explanation) if gc.garbage else 0
        uncollected = max(0, alive - cached) + saved
        self.peak_garbage = max(self.peak_garbage, uncollected)
        return {"explanations_alive": alive, "cached": cached, "uncollected": uncollected,
                "peak_uncollected": self.peak_garbage, "saved_in_gc_garbage": saved}


def _collections_so_far(get_stats=gc.get_stats) -> list[tuple[int, int]]:
    """CPython's own count, per generation, of collections and of the objects they found
    unreachable (kept in C, independent of gc.callbacks and of anything Python code can rebind)."""
    return [(generation["collections"], generation["collected"]) for generation in get_stats()]


def _recorder(token, process_time=time.process_time, stats=_collections_so_far,
              isenabled=gc.isenabled, disable=gc.disable, enable=gc.enable):
    """The server's record, kept in this generator's frame: only `send` reaches it, and a frame
    of the grader's code is out of a policy's reach (reading a generator's frame is refused).

    Messages: ("start", generation, wall, cpu) and ("stop", generation, wall, cpu, collected,
    uncollectable) from the gc.callbacks hook; ("request", id, start, end) from the server;
    ("read", token) and ("reset", token) from the trace endpoint. Anything else is counted
    as a forgery."""
    collections, requests, forged = [], [], []
    pending = None
    at_reset, cpu_at_reset = stats(), process_time()
    reply = None
    while True:
        message = yield reply
        was_enabled = isenabled()
        disable()                   # no collection (and no re-entrant callback) while the record changes
        reply = None
        kind = message[0] if type(message) is tuple and message else None
        if kind == "start" and len(message) == 4:
            if pending is not None:
                forged.append("a collection started twice")
            pending = message[1:]
        elif kind == "stop" and len(message) == 6:
            if pending is None or pending[0] != message[1]:
                forged.append("a collection stopped that never started")
            else:
                generation, wall, cpu = pending
                collections.append((generation, wall, message[2] - wall, message[3] - cpu, message[4], message[5]))
            pending = None
        elif kind == "request" and len(message) == 4:
            requests.append(message[1:])
        elif kind in ("read", "reset") and len(message) == 2 and message[1] is token and pending is not None:
            reply = {"in_progress": True}       # a collection is under way in the other thread: ask again
        elif kind in ("read", "reset") and len(message) == 2 and message[1] is token:
            now, cpu_now = stats(), process_time()
            counted = [now[g][0] - at_reset[g][0] for g in range(len(now))]
            found = [now[g][1] - at_reset[g][1] for g in range(len(now))]
            reply = {"collections": [list(c) for c in collections], "requests": [list(r) for r in requests],
                     "forged": list(forged), "counted": counted, "found": found,
                     "server_cpu": cpu_now - cpu_at_reset}
            if kind == "reset":             # what was forged stays on the record
                collections, requests = [], []
                at_reset, cpu_at_reset = now, cpu_now
        else:
            forged.append(f"an unknown message reached the record ({str(kind)[:40]})")
        if was_enabled:
            enable()


def _serialized(send, sleep=time.sleep):
    """`send` to the record from either thread (the server's, or the one that answers trace
    requests).  A caller that finds the record busy (the other thread is in it, or this thread
    is, when a collection starts inside it) leaves its message in a queue drained before the next
    message, and never waits; a read (`wait=True`) waits for the record and for any collection
    under way, so that what it reads matches CPython's counters."""
    import collections
    import threading
    lock, backlog = threading.Lock(), collections.deque()
    append, popleft = backlog.append, backlog.popleft

    def record(message, wait=False):
        for _ in range(5000):
            if not lock.acquire(wait):
                append(message)
                return None
            try:
                while backlog:
                    send(popleft())
                reply = send(message)
                if not (wait and (backlog or (type(reply) is dict and reply.get("in_progress")))):
                    return reply
            finally:
                lock.release()
            sleep(0.001)
        return reply
    return record


def _answer_traces(sock, report, encode):
    """The trace endpoint, on a socket and a thread of its own, so that it answers even while the
    server's event loop is still busy with a backlog of requests: one line in ("read" or
    "reset"), the record as JSON out.  Started with `_thread`, so that no Thread object holds
    what it needs where `threading.enumerate()` would find it."""
    while True:
        conn, _ = sock.accept()
        try:
            conn.settimeout(10)
            command = conn.recv(64).strip()
            conn.sendall(encode(report(reset=command == b"reset", final=command == b"final")).encode())
        except Exception as exc:        # a broken connection must not end the endpoint
            try:
                conn.sendall(encode({"error": f"{type(exc).__name__}: {exc}"}).encode())
            except OSError:
                pass
        finally:
            conn.close()


def _gc_hook(send, thread_time=time.thread_time, perf_counter=time.perf_counter):
    """The gc.callbacks hook: the clocks first, then the record."""
    def on_gc(phase, info):
        if phase == "start":
            send(("start", info["generation"], perf_counter(), thread_time()))
        else:
            wall, cpu = perf_counter(), thread_time()
            send(("stop", info["generation"], wall, cpu, info.get("collected", 0), info.get("uncollectable", 0)))
    return on_gc


def full_collection_cpu(repeats: int = 3, thread_time=time.thread_time) -> float:
    """CPU seconds of one full collection of this process's heap, the least of `repeats`
    (CPU time of this thread: a busy machine that deschedules the process does not add to it)."""
    best = float("inf")
    for _ in range(repeats):
        t = thread_time()
        gc.collect()
        best = min(best, thread_time() - t)
    return best


def _snapshot(module=None) -> dict:
    """This module's names and the attributes of the classes it defines, as they are now."""
    module = module or sys.modules[__name__]
    taken = {("module", name): value for name, value in vars(module).items()}
    for name, value in vars(module).items():
        if isinstance(value, type) and value.__module__ == module.__name__:
            taken.update({(name, attr): member for attr, member in vars(value).items()})
    return taken


def _replaced(before: dict, module=None, snapshot=_snapshot) -> list[str]:
    now = snapshot(module)
    return [f"{'gclab.serving' if owner == 'module' else 'gclab.serving.' + owner}.{attr} was replaced"
            for (owner, attr), value in before.items() if now.get((owner, attr), _snapshot) is not value]


# What the server's record and its count of garbage are made of: the state's parts (not the
# figures it updates as it serves), the cache's, and what the gc hook holds.
_STATE_PARTS = ("model", "heap", "cache", "hooks", "attribution", "explanations", "freed_times", "_refs", "_on_free")


def _parts(state, on_gc) -> dict:
    parts = {f"the server's state.{name}": getattr(state, name, None) for name in _STATE_PARTS}
    parts.update({f"the server's cache.{name}": value for name, value in vars(state.cache).items()})
    parts["the server's gc hook's code"] = on_gc.__code__
    for name, cell in zip(on_gc.__code__.co_freevars, on_gc.__closure__ or ()):
        value = parts[f"the server's gc hook's {name}"] = cell.cell_contents
        if isinstance(value, types.FunctionType):          # the record: what it sends to, its queue, its lock
            parts["the server's record's code"] = value.__code__
            parts.update({f"the server's record's {inner}": inner_cell.cell_contents
                          for inner, inner_cell in zip(value.__code__.co_freevars, value.__closure__ or ())})
    return parts


def _audit(record, state, on_gc, guard, full_cpu, token, before, parts):
    """What the trace endpoint reports, checked against what CPython counted itself."""
    garbage, callbacks, module, replaced = state.garbage, gc.callbacks, sys.modules[__name__], _replaced
    parts_now, collect = _parts, gc.collect

    def report(reset: bool = False, final: bool = False) -> dict:
        data = record(("reset" if reset else "read", token), wait=True)
        problems = list(data.pop("forged")) + replaced(before, module)
        now = parts_now(state, on_gc)
        problems += [f"{what} was replaced" for what, value in parts.items() if now.get(what) is not value]
        if on_gc not in callbacks:
            problems.append("the server's gc.callbacks hook was removed")
        elif callbacks.count(on_gc) != 1:
            problems.append("the server's gc.callbacks hook was added again")
        seen = [sum(1 for c in data["collections"] if c[0] == g) for g in range(len(data["counted"]))]
        if seen != data["counted"]:
            problems.append(f"the record has {seen} collections per generation, CPython counted {data['counted']}")
        found = [sum(c[4] for c in data["collections"] if c[0] == g) for g in range(len(data["found"]))]
        if found != data["found"]:
            problems.append(f"the record's collections found {found} unreachable objects, CPython counted "
                            f"{data['found']}")
        if guard is not None:
            problems += guard.problems()
        problems += _explanations_lost(state, data)
        data.update({
            "idle_calls": list(state.idle_calls), "errors": list(state.errors[:20]),
            "idle_call_count": state.idle_call_count, "idle_call_times": list(state.idle_call_times),
            "freed_times": list(state.freed_times), "page_faults": _page_faults(), "rss_mib": _rss_mib(),
            "garbage": garbage(), "gc_enabled": gc.isenabled(), "threshold": list(gc.get_threshold()),
            "frozen": gc.get_freeze_count(), "count": list(gc.get_count()), "python": sys.version.split()[0],
            "full_collection_cpu": full_cpu, "tampered": list(dict.fromkeys(problems))[:20],
            "guarded": guard is not None,
        })
        data["recording_intact"] = not data["tampered"]
        if final:
            # after the record is read, one full collection of the server's own: garbage still
            # alive after it can never be freed (frozen while in use: gc.freeze())
            collect()
            data["garbage"]["left_after_full_collection"] = garbage()["uncollected"]
        if reset:
            state.idle_calls, state.errors, state.idle_call_times = [], [], []
            del state.freed_times[:]
            state.idle_call_count = 0
            state.peak_garbage = 0
            state.alive_at_reset = len(state._refs)
        return data
    return report


def _explanations_lost(state, data) -> list[str]:
    """Each request makes one explanation, which is then alive or freed: what the server's count of them lost
    (a set emptied in place), said as a problem.  Its weak references and its set must agree, and alive plus
    freed must account for the requests the record has (within a margin: a request that failed made none)."""
    if state.attribution != "objects":
        return []
    problems, alive = [], len(state._refs)
    if alive != len(state.explanations):
        problems.append(f"the server's state.explanations lists {len(state.explanations)} explanations, but "
                        f"{alive} are alive")
    made = len(data["requests"])
    accounted = alive + len(state.freed_times) - getattr(state, "alive_at_reset", 0)
    if accounted < made - max(10, made // 20):
        problems.append(f"the server's count of explanations lost {made - accounted} of the {made} its requests made")
    return problems


def _page_faults() -> int:
    """Minor page faults of this process so far: each is a page of memory touched for the first time."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _rss_mib() -> float:
    """Resident memory of this process now, in MiB (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def _request_id(query: bytes) -> int:
    """The load generator numbers its requests `?seed=i`; other requests are -1."""
    for part in query.split(b"&"):
        if part.startswith(b"seed="):
            try:
                return int(part[5:])
            except ValueError:
                break
    return -1


def build_app(state: ServerState, device_seconds: float, record):
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    encode = json.JSONEncoder(separators=(",", ":")).encode
    infer, postprocess = state.infer, state.postprocess       # bound now: a class patched later changes nothing
    hooks = dict(state.hooks)
    perf_counter = time.perf_counter

    async def predict(request):
        inferred = infer(int(request.query_params.get("seed", "0")))
        # waiting for the accelerator's answer: the event loop serves other requests meanwhile
        await asyncio.sleep(device_seconds)
        return Response(encode(postprocess(*inferred)), media_type="application/json")

    app = Starlette(routes=[Route("/predict", predict)])

    async def timed(scope, receive, send):
        if scope["type"] != "http" or scope["path"].startswith("/_gclab"):
            return await app(scope, receive, send)
        start = perf_counter()
        request_id = _request_id(scope["query_string"])
        state.in_flight += 1
        try:
            hooks["before_request"](state.in_flight)
            await app(scope, receive, send)
        except Exception as exc:
            state.errors.append(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            state.in_flight -= 1
            state.last_end = end = perf_counter()
            record(("request", request_id, start, end))
            try:
                hooks["after_request"](state.in_flight)
            except Exception as exc:
                state.errors.append(f"after_request: {type(exc).__name__}: {exc}")
    return timed


async def _watch_idle_and_parent(state: ServerState, idle_after: float, parent: int, garbage):
    """Call the policy's on_idle(idle_seconds) every `idle_after` seconds while no request is in
    flight, and sample the garbage (`garbage`: the server's own count, bound before the policy
    loaded); stop the server if the process that started it has gone."""
    last_call = 0.0
    on_idle = state.hooks["on_idle"]
    while True:
        await asyncio.sleep(idle_after / 2)
        if os.getppid() != parent:          # the notebook went away: do not outlive it
            os._exit(0)
        garbage()                           # samples the peak of uncollected garbage
        now = time.perf_counter()
        if state.in_flight or now - state.last_end < idle_after or now - last_call < idle_after:
            continue
        try:
            on_idle(now - state.last_end)
        except Exception as exc:
            state.errors.append(f"on_idle: {type(exc).__name__}: {exc}")
        last_call = time.perf_counter()
        state.idle_call_count += 1
        state.idle_call_times.append(now)
        if last_call - now > 1e-4:          # keep the calls that did something, for the timeline
            state.idle_calls.append((now, last_call))


def _install_guard(policy, workdir=None):
    """The lead's guard (gclab.grader.guard), installed before the policy runs: it locks the grader's
    modules, lists what was replaced and refuses the policy what reaches past the server's tools
    (frames, the collector's object graph, ctypes, new processes).  The policy may write only in
    `workdir` (ModelServer makes it and removes it once the server has stopped)."""
    if not policy:
        return None
    try:
        from .grader import guard  # TODO(lead): instrument imports grader
    except ImportError:             # pragma: no cover - a gclab without it still checks its record
        return None
    main = sys.modules.get("__main__")
    if getattr(main, "__file__", None) and os.path.samefile(main.__file__, __file__):
        sys.modules.setdefault("gclab.serving", main)       # one module, whichever name the policy imports
        package = sys.modules.get("gclab")
        if package is not None and not hasattr(package, "serving"):
            package.serving = main
    workdir = workdir or tempfile.mkdtemp(prefix="gclab-policy-work-")     # started by hand
    return guard.install(workdir=workdir, processes=False, files=True)


def serve(heap_objects: int, attribution: str, policy: str | None, device: str,
          cache_size: int, idle_after: float, device_ms: float, workdir: str | None = None) -> None:
    import socket

    import torch
    import uvicorn
    torch.set_num_threads(1)
    model = Model(torch.device(device))
    hooks = {name: (lambda *args: None) for name in HOOKS}
    heap = _PREBUILT_HEAPS.pop(heap_objects, None) or long_lived_heap(heap_objects)
    state = ServerState(model, heap, ResponseCache(cache_size), hooks, attribution)
    for seed in range(50):                  # warm-up: first calls into torch allocate for good
        state.answer(seed)
    state.cache.entries.clear()
    full_cpu = full_collection_cpu()        # what one full collection of this heap costs, before any policy
    token = object()
    recorder = _recorder(token)
    next(recorder)
    record = _serialized(recorder.send)
    on_gc = _gc_hook(record)
    # what runs after the policy loads, bound before it does
    build, watch_idle, garbage = build_app, _watch_idle_and_parent, state.garbage
    import starlette.responses  # noqa: F401  (loaded before the guard takes its manifest)
    import starlette.routing  # noqa: F401
    before, parts = _snapshot(), _parts(state, on_gc)
    # what the policy prints goes to the log (stderr), shown when the server fails: the requester's pipe
    # carries the ready line alone, which a print of the policy's would otherwise come before
    ready_fd = os.dup(1)
    sys.stdout.flush()
    os.dup2(2, 1)
    guard = _install_guard(policy, workdir)
    report = _audit(record, state, on_gc, guard, full_cpu, token, before, parts)
    gc.callbacks.append(on_gc)
    record(("reset", token), wait=True)
    trace_sock = socket.socket()
    trace_sock.bind(("127.0.0.1", 0))
    trace_sock.listen(16)
    import _thread
    _thread.start_new_thread(_answer_traces, (trace_sock, report, json.JSONEncoder(separators=(",", ":")).encode))
    hooks.update(load_policy(policy))      # the policy's own code runs from here on
    app = build(state, device_ms / 1e3, record)
    hooks["on_startup"]()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # accepted connections inherit this: without it Nagle's algorithm holds the body back
    # until the client's delayed ACK, about 40 ms per response
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)                       # connections wait in the backlog until uvicorn accepts them
    config = uvicorn.Config(app, log_level="warning", lifespan="off", loop="asyncio", http="h11")
    server = uvicorn.Server(config)
    parent = os.getppid()

    async def main():
        watcher = asyncio.ensure_future(watch_idle(state, idle_after, parent, garbage))
        report(reset=True)
        os.write(ready_fd, f"{READY} {sock.getsockname()[1]} {trace_sock.getsockname()[1]}\n".encode())
        await server.serve(sockets=[sock])
        watcher.cancel()
    asyncio.run(main())


# -- the load generator process --------------------------------------------------------
def schedule(rate: float, count: int, poisson: bool = False, seed: int = 0) -> list[float]:
    """Send times in seconds from the start: every 1/rate, or a Poisson process of that rate."""
    if not poisson:
        return [i / rate for i in range(count)]
    import random
    rng, at, times = random.Random(seed), 0.0, []
    for _ in range(count):
        times.append(at)
        at += rng.expovariate(rate)
    return times


async def _send_all(host, port, times, timeout, burst=0, lull=0.0, server_cpu=None):
    """Send request i at times[i] after the start, open-loop, and wait for the answers until
    `timeout` seconds after the start.  With `burst`, the schedule is cut into bursts of that many
    requests, and each burst starts `lull` seconds after every answer to the one before it has
    arrived (its requests keep their spacing, shifted by the wait); each burst has as long after
    its last scheduled request as the whole load would have after its last.  With `server_cpu` (a
    function), each row also holds what it returned as the request was sent and as its answer came."""
    idle: list = []
    t0 = time.perf_counter() + 0.05
    slack = timeout - (times[-1] - times[0] if times else 0.0)
    deadline = t0 + timeout
    rows = [[None, None, None, 0, None, None] for _ in times]      # scheduled, sent, done, status, server CPU at both
    cpu = server_cpu or (lambda: None)

    async def one(i):
        row = rows[i]
        await asyncio.sleep(max(0.0, row[0] - time.perf_counter()))
        row[1], row[4] = time.perf_counter(), cpu()
        reader, writer = idle.pop() if idle else await asyncio.open_connection(host, port)
        writer.write(b"GET /predict?seed=%d HTTP/1.1\r\nHost: gclab\r\n\r\n" % i)
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        row[2], row[3], row[5] = time.perf_counter(), int(head.split(b" ", 2)[1]), cpu()
        idle.append((reader, writer))

    size = burst or len(times)
    start, tasks = t0, []
    for first in range(0, len(times), size):
        group = range(first, min(first + size, len(times)))
        for i in group:
            rows[i][0] = start + times[i] - times[first]
        sent = [asyncio.ensure_future(one(i)) for i in group]
        tasks += sent
        deadline = rows[group[-1]][0] + slack
        done, pending = await asyncio.wait(sent, timeout=max(0.0, deadline - time.perf_counter()))
        if pending:
            break
        start = time.perf_counter() + lull
    for task in tasks:
        task.cancel()
    for _, writer in idle:
        writer.close()
    for row in rows:
        if row[0] is None:                  # never sent: its burst did not start before the deadline
            row[0] = deadline
    return rows


def load_main(url: str, rate: float, count: int, poisson: bool, seed: int, timeout: float,
              burst: int = 0, lull: float = 0.0, watch_cpu: int | None = None) -> None:
    """Send the load; with `watch_cpu`, read that process's CPU time (every thread's, `/proc`) at each
    request sent and each answer."""
    gc.disable()                            # the client's own pauses must not be charged to the server
    host, port = url.split("//")[1].split(":")
    server_cpu = None
    if watch_cpu:
        from .procfs import cpu_ns
        server_cpu = lambda: cpu_ns([watch_cpu])        # noqa: E731
    rows = asyncio.run(_send_all(host, int(port), schedule(rate, count, poisson, seed), timeout, burst, lull,
                                 server_cpu))
    print(json.dumps(rows))


# -- the notebook's side -----------------------------------------------------------------
@dataclass
class LoadResult:
    """One open-loop run: per request its scheduled send time, when it was sent, when its
    answer arrived (None if it never did) and its HTTP status (0: no answer)."""
    scheduled: list[float]
    sent: list
    done: list
    status: list[int]
    cpu_sent: list = field(default_factory=list)     # the server's CPU time (ns) as each was sent, where read
    cpu_done: list = field(default_factory=list)     # ... and as its answer came

    @property
    def latencies_ms(self):
        import numpy as np
        return np.array([(d - s) * 1e3 for s, d in zip(self.scheduled, self.done) if d is not None])

    @property
    def failed(self) -> int:
        return sum(1 for code in self.status if code != 200)

    def percentiles(self, points=(50, 95, 99, 100)) -> dict:
        import numpy as np
        latencies = self.latencies_ms
        if len(latencies) == 0:
            return {p: float("inf") for p in points}
        return {p: float(np.percentile(latencies, p)) for p in points}


class ServedCollection(Collection):
    """A collection the server recorded, with the CPU time it took (`cpu`, seconds of the
    server thread's CPU time: unlike `duration`, not inflated when the machine is busy and
    the server waits for a core)."""
    cpu: float = 0.0
    explicit: bool = False      # started by the program's gc.collect(), not by the collector's thresholds


ServedCollection = dataclass(frozen=True)(ServedCollection)


@dataclass
class Trace:
    """What the server recorded: each request's (id, start, end), the collections, the
    policy's idle calls (start, end) and the cyclic garbage still alive at the end; `info`
    adds the collector's settings, what one full collection of the server's heap costs in CPU
    time (`full_collection_cpu`), the server's CPU time over the record (`server_cpu`) and
    `tampered`: why the server cannot vouch for its record (empty when it can)."""
    requests: list
    collections: list[Collection]
    idle_calls: list = field(default_factory=list)
    garbage: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)

    @classmethod
    def from_json(cls, data: dict) -> "Trace":
        collections = [ServedCollection(int(g), s, d, int(c), int(u), cpu) for g, s, d, cpu, c, u in data["collections"]]
        info = {k: data[k] for k in ("gc_enabled", "threshold", "frozen", "count", "python", "recording_intact",
                                     "idle_call_count", "tampered", "full_collection_cpu", "server_cpu", "counted",
                                     "guarded", "idle_call_times", "freed_times", "page_faults", "rss_mib") if k in data}
        return cls([tuple(r) for r in data["requests"]], collections, [tuple(c) for c in data["idle_calls"]],
                   data["garbage"], info, data["errors"])

    @classmethod
    def unavailable(cls, reason: str) -> "Trace":
        return cls([], [], info={"recording_intact": False, "unavailable": True}, errors=[reason])

    @property
    def tampered(self) -> list[str]:
        """Why the server cannot vouch for this record (empty: it can)."""
        if self.info.get("unavailable"):
            return []
        found = list(self.info.get("tampered", []))
        if not found and not self.info.get("recording_intact", True):
            found.append("the server's record of collections does not match CPython's own count")
        return found

    def serving_window(self) -> tuple[float, float] | None:
        """When the load ran: from the first request's start to the last one's end (None: no request)."""
        if not self.requests:
            return None
        return min(start for _, start, _ in self.requests), max(end for _, _, end in self.requests)

    def idle_moments(self) -> int:
        """How many times, while the load ran, the server found no request in flight and called
        the policy's on_idle."""
        window = self.serving_window()
        if window is None:
            return 0
        return sum(1 for t in self.info.get("idle_call_times", []) if window[0] < t < window[1])

    def collections_while_serving(self, generation: int) -> list[Collection]:
        """Collections of `generation` that started while the load ran, inside requests or between them."""
        window = self.serving_window()
        if window is None:
            return []
        return [c for c in self.collections if c.generation == generation and window[0] <= c.start <= window[1]]

    def freed_while_serving(self, until: float | None = None) -> int:
        """How many responses' cyclic garbage the collector freed before `until` (default: the end
        of the last request)."""
        if until is None:
            until = (self.serving_window() or (0.0, float("inf")))[1]
        return sum(1 for t in self.info.get("freed_times", []) if t < until)

    def collector_cpu(self, generation: int | None = None) -> float:
        """CPU seconds the collector took over the record (of one generation, if given)."""
        return sum(getattr(c, "cpu", c.duration) for c in self.collections
                   if generation is None or c.generation == generation)

    def charges(self, load: "LoadResult") -> "dict[str, np.ndarray]":
        """For each answered request of `load`, the collections it waited behind: those that ran
        at any moment between the request's scheduled send time and its answer (the server's
        clock and the load generator's are the same monotonic clock).  Returns per request, in
        CPU seconds of the collector, "longest": the longest such collection, and "total": all
        of them added up; and "count": how many."""
        import numpy as np
        answered = [(s, d) for s, d in zip(load.scheduled, load.done) if d is not None]
        if not answered or not self.collections:
            zeros = np.zeros(len(answered))
            return {"longest": zeros, "total": zeros.copy(), "count": zeros.copy()}
        due, done = np.array(answered).T
        starts = np.array([c.start for c in self.collections])
        ends = starts + np.array([c.duration for c in self.collections])
        cpu = np.array([getattr(c, "cpu", c.duration) for c in self.collections])
        overlap = (starts[None, :] < done[:, None]) & (ends[None, :] > due[:, None])
        charged = np.where(overlap, cpu[None, :], 0.0)
        return {"longest": charged.max(axis=1), "total": charged.sum(axis=1), "count": overlap.sum(axis=1)}

    def collections_inside_requests(self, generation: int | None = None) -> list[Collection]:
        """Collections that ran while at least one request was being handled."""
        import numpy as np
        if not self.requests:
            return []
        _, starts, ends = np.array(self.requests).T
        return [c for c in self.collections if (generation is None or c.generation == generation)
                and bool(np.any((starts < c.start + c.duration) & (ends > c.start)))]


def _python_module(module: str, *args: str) -> list[str]:
    """The command that runs `module` in a fresh, isolated Python (-I): neither the current folder
    nor PYTHON* variables reach its sys.path, so a `uvicorn.py` or `gclab/` that the learner's code
    wrote beside its notebook is never imported in place of the real one."""
    return [sys.executable, "-I", "-m", module, *args]


# -- starting servers and loads: forked from a zygote that imported torch and uvicorn once --
def preload() -> None:
    """What a server and a load generator import, and the usual long-lived heap, built once
    (gclab.zygote forks them after this: half a second of CPU saved per server)."""
    import starlette.applications  # noqa: F401
    import starlette.responses  # noqa: F401
    import starlette.routing  # noqa: F401
    import torch  # noqa: F401
    import uvicorn  # noqa: F401
    import uvicorn.lifespan.off  # noqa: F401
    import uvicorn.loops.asyncio  # noqa: F401
    import uvicorn.protocols.http.h11_impl  # noqa: F401
    _PREBUILT_HEAPS[HEAP_OBJECTS] = long_lived_heap(HEAP_OBJECTS)


def forked(request: dict, fds: list) -> None:
    """In a child of the zygote: run `python -m gclab.serving ARGV...` as if started so (this
    module is __main__), its stdout and stderr the requester's."""
    import traceback
    stdout, stderr = fds
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.modules["__main__"] = sys.modules[__name__]
    try:
        main(request["argv"])
    except BaseException:              # SystemExit included: the same message a fresh Python prints
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


_ZYGOTE: list = []
_ZYGOTE_LOCK = threading.Lock()


def _zygote():
    """This process's serving zygote, started on first use; None where there cannot be one
    (no pidfds: not Linux), or with GCLAB_SERVING_FORK=0 (each server a fresh Python)."""
    from . import zygote
    if (os.environ.get("GCLAB_SERVING_FORK") == "0" or not zygote.available()
            or not hasattr(os, "pidfd_open") or not hasattr(signal, "pidfd_send_signal")):
        return None
    with _ZYGOTE_LOCK:
        if not _ZYGOTE or not _ZYGOTE[0].alive():
            _ZYGOTE[:] = [zygote.Zygote("gclab.serving", env=starting_environment(), new_session=False)]
        return _ZYGOTE[0]


def prestart() -> None:
    """Start this process's zygote now, in the background (it imports torch and uvicorn, a couple
    of seconds of CPU), so that the first servers started later do not wait for it."""
    _zygote()


class _ForkedProcess:
    """A server or load generator forked by the zygote: what ModelServer needs of a Popen,
    through a pidfd (its exit status went to the zygote, which reaped it)."""

    def __init__(self, pid: int, pidfd: int, stdout):
        self.pid, self.stdout, self.returncode = pid, stdout, None
        self._pidfd = pidfd
        self._closer = weakref.finalize(self, os.close, pidfd)

    def wait(self, timeout: float | None = None):
        if self.returncode is None:
            if not select.select([self._pidfd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"gclab.serving (pid {self.pid})", timeout)
            self.returncode = 0
        return self.returncode

    def poll(self):
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, number: int) -> None:
        if self.poll() is None:
            try:
                signal.pidfd_send_signal(self._pidfd, number)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _spawn(argv: list[str], stderr):
    """`python -m gclab.serving ARGV...`, stdout a pipe read as text, stderr the file `stderr`:
    forked from this process's zygote where there is one, else a fresh isolated Python."""
    zygote = _zygote()
    if zygote is not None:
        # a fork is a new process: the guard's rule on them holds for the learner's code here too
        sys.audit("subprocess.Popen", sys.executable, argv, None, None)
        read, write = os.pipe()
        try:
            pid, pidfd = zygote.fork({"argv": argv}, [write, stderr.fileno()])
        except OSError:
            os.close(read)
        else:
            if pidfd is not None:
                return _ForkedProcess(pid, pidfd, os.fdopen(read, "r"))
            os.close(read)
        finally:
            os.close(write)
    return subprocess.Popen(_python_module("gclab.serving", *argv), stdout=subprocess.PIPE, stderr=stderr,
                            text=True, env=starting_environment())


def _kill(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class ModelServer:
    """Start the model server in its own process; always stopped on exit, error or interrupt."""

    def __init__(self, heap_objects: int = HEAP_OBJECTS, attribution="objects", policy=None,
                 device=None, cache_size: int = 100, idle_after: float = 0.01, device_ms: float = 5.0,
                 startup_timeout: float = 120):
        from .memory import default_device
        if attribution not in ATTRIBUTION:
            raise ValueError(f"attribution must be one of {', '.join(ATTRIBUTION)}, not {attribution!r}")
        self.options = dict(heap_objects=heap_objects, attribution=attribution,
                            policy=str(Path(policy).resolve()) if policy else None,
                            device=str(device or default_device()), cache_size=cache_size, idle_after=idle_after,
                            device_ms=device_ms)
        self.startup_timeout = startup_timeout
        self.proc = self._workdir = None
        self.port = self.trace_port = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ModelServer":
        self.launch()
        return self.wait_ready()

    def launch(self) -> "ModelServer":
        """Start the server process without waiting for it (see wait_ready)."""
        o = self.options
        argv = ["serve", "--heap-objects", str(o["heap_objects"]), "--device", o["device"],
                "--cache-size", str(o["cache_size"]), "--idle-after", str(o["idle_after"]),
                "--device-ms", str(o["device_ms"]), "--attribution", o["attribution"]]
        if o["policy"]:
            # the policy's writable folder, made here: a server is stopped by a signal, so it
            # cannot remove the folder itself (stop() does, and the folder's finalizer)
            self._workdir = tempfile.TemporaryDirectory(prefix="gclab-policy-work-", ignore_cleanup_errors=True)
            argv += ["--policy", o["policy"], "--workdir", self._workdir.name]
        self._log = tempfile.TemporaryFile(mode="w+")
        self.proc = _spawn(argv, self._log)
        self._finalizer = weakref.finalize(self, _kill, self.proc)
        return self

    def wait_ready(self) -> "ModelServer":
        line = self._first_line()
        if not line.startswith(READY):
            self.stop()
            raise RuntimeError("the model server did not start: " + (self._error_text() or line or "no output"))
        self.port, self.trace_port = (int(word) for word in line.split()[-2:])
        return self

    def _first_line(self) -> str:
        found: list[str] = []
        reader = threading.Thread(target=lambda: found.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(self.startup_timeout)
        return found[0].strip() if found else ""

    def _error_text(self) -> str:
        self._log.seek(0)
        lines = [line for line in self._log.read().strip().splitlines() if line.strip()]
        return "\n".join(lines[-8:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                _kill(self.proc)
        if self.proc is not None:
            self.proc.stdout.close()
        if self._workdir is not None:
            self._workdir.cleanup()

    def __enter__(self) -> "ModelServer":
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

    def trace(self, reset: bool = False, timeout: float = 10, final: bool = False) -> Trace:
        """What the server recorded (its trace endpoint answers on a thread of its own, so even a
        server still busy with a backlog answers); if it cannot answer within `timeout` seconds
        (stopped, or stuck), a Trace that says so and records nothing.  `final`: the last reading,
        after which the server runs a full collection and adds the garbage still alive after it
        (`garbage["left_after_full_collection"]`)."""
        import socket
        try:
            with socket.create_connection(("127.0.0.1", self.trace_port), timeout=timeout) as conn:
                conn.sendall(b"reset\n" if reset else b"final\n" if final else b"read\n")
                chunks = []
                while chunk := conn.recv(1 << 16):
                    chunks.append(chunk)
            data = json.loads(b"".join(chunks))
            if "error" in data:
                raise ValueError(data["error"])
            return Trace.from_json(data)
        except (OSError, ValueError, TypeError) as exc:      # refused, timeouts, bad JSON
            return Trace.unavailable(f"the server did not report its trace within {timeout:g} s "
                                     f"({type(exc).__name__}): it had stopped or was stuck")


def run_load(url: str, rate: float = 200.0, duration: float = 4.0, poisson: bool = True, seed: int = 0,
             timeout: float | None = None, burst: int = 0, lull: float = 0.0,
             server_pid: int | None = None) -> LoadResult:
    """Send rate × duration requests on an open-loop schedule (in a process of its own) and wait
    for their answers; requests still unanswered `timeout` seconds after the start count as failed.
    `burst`: send them in bursts of that many, each `lull` seconds after the last answer to the one
    before: however slow the machine, the server is then idle that long between bursts.  Each
    burst then has as long after its last request is due (`timeout` - `duration`) as a load
    without bursts has after its own last, so a slow server is not failed for the lulls' waits.
    `server_pid`: the server's process, for a reader outside that sends the load itself (`gclab.outside.load`)."""
    count = max(1, int(rate * duration))
    timeout = timeout or duration + 5
    argv = ["load", url, "--rate", str(rate), "--count", str(count), "--seed", str(seed),
            "--timeout", str(timeout), "--burst", str(burst), "--lull", str(lull)] + (["--poisson"] if poisson else [])
    rows = outside.load(argv, server_pid) if server_pid else None
    if rows is None:
        rows = load_rows(argv)
    return LoadResult(*[list(column) for column in zip(*rows)])


def load_rows(argv: list[str]) -> list:
    """Run the load generator with `argv` (`python -m gclab.serving` arguments) and return its rows."""
    args = main_parser().parse_args(argv)
    count, burst = args.count, args.burst
    bursts = -(-count // burst) if burst else 1
    duration = count / args.rate
    longest = args.timeout + (bursts - 1) * (args.timeout - duration + args.lull)   # each burst late by its whole slack
    with tempfile.TemporaryFile(mode="w+") as errors:
        proc = _spawn(argv, errors)
        out: list[str] = []                 # its rows, printed as it exits
        reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
        reader.start()
        reader.join(longest + 30)
        _kill(proc)
        reader.join(5)
        proc.stdout.close()
        errors.seek(0)
        try:
            return json.loads(out[0] if out else "")
        except ValueError:
            raise RuntimeError("the load generator failed: " + (errors.read().strip()[-800:] or "no output")) from None


@dataclass
class ServedRun:
    """One configuration of the server under one load: what the client saw and what the server recorded."""
    name: str
    load: LoadResult
    trace: Trace

    @property
    def p99(self) -> float:
        return self.load.percentiles((99,))[99]

    def summary(self) -> str:
        p = self.load.percentiles()
        by_gen = {g: [c.duration for c in self.trace.collections if c.generation == g] for g in range(3)}
        gens = ", ".join(f"gen {g}: {len(d)}" + (f" (longest {max(d) * 1e3:.1f} ms)" if d else "")
                         for g, d in by_gen.items())
        return (f"{self.name:<28} P50 {p[50]:6.1f}  P95 {p[95]:6.1f}  P99 {p[99]:6.1f}  max {p[100]:6.1f} ms | "
                f"{gens} | cyclic garbage: peak {self.trace.garbage.get('peak_uncollected', 0)}, "
                f"left {self.trace.garbage.get('uncollected', 0)}")


def measure(name: str, rate: float = 250.0, duration: float = 3.5, settle: float = 0.5, seed: int = 0,
            burst: int = 0, lull: float = 0.0, poisson: bool = True, **server_options) -> ServedRun:
    """Start a server with `server_options` (see ModelServer), send it the open-loop load (Poisson
    arrivals, or evenly spaced), wait `settle` idle seconds (time for the policy's on_idle), read its
    trace, stop it."""
    with ModelServer(**server_options) as server:
        load = run_load(server.url, rate=rate, duration=duration, poisson=poisson, seed=seed, burst=burst, lull=lull,
                        server_pid=server.proc.pid)
        time.sleep(settle)
        return ServedRun(name, load, server.trace(final=True))


def compare(configs: dict, repeats: int = 3, rate: float = 250.0, duration: float = 3.0, settle: float = 0.2,
            seed: int = 0, progress=print) -> dict:
    """Serve the same load to several server configurations, interleaved: one server per
    configuration (`configs` maps a name to ModelServer options), all started together, then
    `repeats` rounds in which each server gets the load in turn (A B C, A B C, ...), so that a
    busy spell of the machine lands on every configuration alike rather than on one.  Each server
    keeps running between its loads, as a real one does (its garbage and its heap carry over).
    Returns name -> [ServedRun, one per round]; `progress` gets a line per load (None: quiet)."""
    servers = {name: ModelServer(**options) for name, options in configs.items()}
    runs = {name: [] for name in configs}
    try:
        for server in servers.values():
            server.launch()
        for server in servers.values():
            server.wait_ready()
        for k in range(repeats):
            for name, server in servers.items():
                before = server.trace(reset=True)
                started = time.perf_counter()
                load = run_load(server.url, rate=rate, duration=duration, seed=seed)
                time.sleep(settle)
                trace = server.trace()
                trace.info["page_faults_during_load"] = (trace.info.get("page_faults", 0)
                                                         - before.info.get("page_faults", 0))
                run = ServedRun(name, load, trace)
                runs[name].append(run)
                if progress:
                    progress(f"round {k + 1}/{repeats}  {name:<28} P99 {run.p99:7.1f} ms "
                             f"({time.perf_counter() - started:.1f} s)")
    finally:
        for server in servers.values():
            server.stop()
    return runs


def spread(runs: dict, value=lambda run: run.p99) -> dict:
    """name -> (median, lowest, highest) of `value` over each configuration's runs."""
    import numpy as np
    out = {}
    for name, seen in runs.items():
        values = [value(run) for run in seen]
        out[name] = (float(np.median(values)), float(min(values)), float(max(values)))
    return out


# -- serving in this process, one request after another ---------------------------------
@dataclass
class InlineRun:
    """Requests a program served one after another in this process (`serve_inline`): for each,
    (id, start, end) on the perf_counter clock and the CPU seconds it took; every collection
    with its CPU time; what each request returned (or the error it raised); `left`: the
    unreachable objects a full collection found right after the last request (cyclic garbage
    the program's collector settings had not freed yet).

    `full_inside`: full collections that ran inside the requests, by the collector's own count
    (`gc.get_stats`, which needs no hook); `full_inside_unwatched`: the same count for as many
    requests served after them with no hook of `serve_inline`'s in `gc.callbacks` (None when
    that second pass did not run), so that a program which looks for the hook and behaves only
    while it is there is told apart (`differs_unwatched`).

    `frozen`: objects the requests moved out of the collector's sight (`gc.freeze()`, by its own count):
    whatever garbage was among them is never collected, and no count of what is left sees it."""
    requests: list
    cpu: list
    collections: list
    results: list
    left: int = 0
    stopped_early: bool = False
    full_inside: int = 0
    full_inside_unwatched: int | None = None
    frozen: int = 0

    @property
    def trace(self) -> Trace:
        """The same record as a `Trace`, for `gclab.plots.plot_requests`."""
        return Trace(self.requests, self.collections)

    def charges(self) -> "np.ndarray":
        """Per request, the CPU seconds of the collections that ran inside it, added up."""
        import numpy as np
        charged = np.zeros(len(self.requests))
        for c in self.collections:
            for k, (_, start, end) in enumerate(self.requests):
                if start <= c.start < end:
                    charged[k] += c.cpu
                    break
        return charged

    def pause_p99(self) -> float:
        """P99 over the requests of the collector CPU time each one ran (its collections, added up), in CPU seconds."""
        import numpy as np
        return float(np.percentile(self.charges(), 99)) if self.requests else 0.0

    def explicit_full_inside(self) -> int:
        """Full collections the program itself started (gc.collect()) inside the requests, however rarely;
        the collector's own are not counted."""
        return sum(1 for c in self.collections if c.generation == 2 and c.explicit
                   and any(start <= c.start < end for _, start, end in self.requests))

    def collected(self) -> int:
        """Unreachable objects the collections during the run freed."""
        return sum(c.collected for c in self.collections)

    def garbage_left(self) -> float:
        """Of the cyclic garbage the run made, the fraction still waiting after the last request."""
        made = self.collected() + self.left
        return self.left / made if made else 0.0

    def summary(self) -> str:
        gens = ", ".join(f"gen {g}: {sum(c.generation == g for c in self.collections)}" for g in range(3))
        return (f"{len(self.requests)} requests; collections {gens}; collector CPU inside a request: at most "
                f"{self.charges().max(initial=0) * 1e3:.2f} ms, P99 {self.pause_p99() * 1e3:.2f} ms; "
                f"cyclic garbage left after the last request: {self.left} objects "
                f"({self.garbage_left():.0%} of what the run made)"
                + (" (stopped early: over the pause budget whatever the rest would do)" if self.stopped_early else "")
                + (f"; {self.frozen:,} objects frozen while serving (gc.freeze()): never collected, garbage or not"
                   if self.frozen > 0 else "")
                + (f"; {self.differs_unwatched()}" if self.differs_unwatched() else ""))

    def unwatched_margin(self) -> int:
        """Full collections the unwatched pass may run beyond the watched one: the hook's own
        records are allocations, which move the automatic collections a little."""
        return 2 + self.full_inside // 10

    def differs_unwatched(self) -> str:
        """"" when the requests ran about as many full collections unwatched as watched; else a
        sentence saying how many more they ran once nothing was watching."""
        if self.full_inside_unwatched is None or \
                self.full_inside_unwatched <= self.full_inside + self.unwatched_margin():
            return ""
        # the unwatched pass stops as soon as it passes the margin: its count is a lower bound
        return (f"served as many requests again with no hook of the measurement's in gc.callbacks, the requests "
                f"ran at least {self.full_inside_unwatched} full collections, against {self.full_inside} while "
                "watched: a program must do the same whether or not it is measured")


def serve_inline(handle, requests, pause_budget: float | None = None, unwatched_requests=None,
                 thread_time=time.thread_time, clock=time.perf_counter) -> InlineRun:
    """Call `handle(request)` for each of `requests` in turn, recording when each ran, the CPU it
    took and every collection (`gc.callbacks`, with the CPU time of this thread: not inflated when
    the machine is busy).  An exception a request raises is kept as its result, without frames.
    Garbage made before the run is collected first; after it, one full collection counts what the
    run left behind.  The collector is left as the program set it.

    With `pause_budget` (CPU seconds), the run stops as soon as so many requests ran a
    collection longer than that that the P99 is over budget whatever the rest would do
    (`stopped_early`): a program that collects in every request is judged in a few requests.
    A run that did not stop early then serves requests once more, unwatched (no hook in
    `gc.callbacks`, the collector's own counts only; their results are dropped), and records
    the full collections inside them (`full_inside_unwatched`, see `InlineRun.differs_unwatched`):
    `unwatched_requests` when given (requests the program has not seen: it cannot tell the
    second pass by them), else copies of the requests served (not the same objects).

    Each request served, in either pass, is marked for a reader outside the process (`gclab.outside`)."""
    record = InlineRun([], [], [], [])
    planned = len(requests)
    over = 0
    pending = {}

    def on_gc(phase, info):
        if phase == "start":
            # the collector starts one by itself once the young generation's count passes its threshold
            # (that count, not yet reset, is over it); a gc.collect() call finds it at or under
            young = gc.get_threshold()[0]
            pending["start"] = (clock(), thread_time(), not (young and gc.get_count()[0] > young))
        elif "start" in pending:
            (start, cpu, explicit), end, cpu_end = pending.pop("start"), clock(), thread_time()
            record.collections.append(ServedCollection(info["generation"], start, end - start,
                                                       info.get("collected", 0), info.get("uncollectable", 0),
                                                       cpu_end - cpu, explicit))

    gc.collect()
    frozen = gc.get_freeze_count()
    gc.callbacks.append(on_gc)
    try:
        outside.mark()
        for k, request in enumerate(requests):
            first, start, cpu, full = len(record.collections), clock(), thread_time(), _full_collections()
            try:
                result = handle(request)
            except Exception as exc:
                result = exc.with_traceback(None)
            record.requests.append((k, start, clock()))
            record.cpu.append(thread_time() - cpu)
            record.full_inside += _full_collections() - full
            record.results.append(result)
            outside.mark()
            if pause_budget is not None:
                over += sum(c.cpu for c in record.collections[first:]) > pause_budget
                if over > planned // 100 + 1:
                    record.stopped_early = True
                    break
    finally:
        gc.callbacks.remove(on_gc)
    record.frozen = gc.get_freeze_count() - frozen
    record.left = gc.collect()
    if pause_budget is not None and not record.stopped_early:
        again = copy.deepcopy(requests[:len(record.requests)]) if unwatched_requests is None else unwatched_requests
        record.full_inside_unwatched = _full_collections_unwatched(
            handle, again, record.full_inside + record.unwatched_margin())
    return record


def _full_collections() -> int:
    """Full collections this process has run, by the collector's own count (no hook needed)."""
    return gc.get_stats()[-1]["collections"]


def _full_collections_unwatched(handle, requests, enough: int) -> int:
    """Full collections inside `handle(request)` for each request, read from the collector's own
    counts with nothing added to gc.callbacks; stops once the count passes `enough`."""
    count = 0
    outside.mark()
    for request in requests:
        before = _full_collections()
        try:
            handle(request)
        except Exception:
            pass
        count += _full_collections() - before
        outside.mark()
        if count > enough:
            break
    return count


def main(argv=None) -> int:
    args = main_parser().parse_args(argv)
    if args.command == "serve":
        serve(args.heap_objects, args.attribution, args.policy, args.device, args.cache_size, args.idle_after,
              args.device_ms, args.workdir)
    else:
        load_main(args.url, args.rate, args.count, args.poisson, args.seed, args.timeout, args.burst, args.lull,
                  args.watch_cpu)
    return 0


def main_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gclab.serving")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--heap-objects", type=int, default=HEAP_OBJECTS)
    s.add_argument("--attribution", choices=ATTRIBUTION, default="off")
    s.add_argument("--policy")
    s.add_argument("--workdir", help="the folder the policy may write to (default: a new temporary one)")
    s.add_argument("--device", default="cpu")
    s.add_argument("--cache-size", type=int, default=100)
    s.add_argument("--idle-after", type=float, default=0.01)
    s.add_argument("--device-ms", type=float, default=5.0)
    c = sub.add_parser("load")
    c.add_argument("url")
    c.add_argument("--rate", type=float, required=True)
    c.add_argument("--count", type=int, required=True)
    c.add_argument("--poisson", action="store_true")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--timeout", type=float, default=60)
    c.add_argument("--burst", type=int, default=0)
    c.add_argument("--lull", type=float, default=0.0)
    c.add_argument("--watch-cpu", type=int, help="a process whose CPU time to read at each request sent and answered")
    return parser


if __name__ == "__main__":
    sys.exit(main())
