"""The model server: a small torch model behind HTTP, in a process of its own, that records every
request and every collection.

It is an ASGI app (Starlette) under uvicorn on 127.0.0.1 (`python -m gclab.serving serve`, started by
`gclab.serving.ModelServer`).  It serves a small torch model, optionally with "attribution"
post-processing that builds many small Python objects with back-references per request ("objects"),
or the same scores as one tensor ("compact"), and it keeps a long-lived heap (vocabulary, metadata, a
response cache) the collector has to walk.  Each request also awaits `device_ms` of simulated
accelerator time (the CPU and the event loop are free meanwhile, as when a GPU runs the model), so
several requests are in flight at once.

What it measures: on the shared `time.perf_counter()` clock (CLOCK_MONOTONIC on Linux), when each
request started and ended, and every collection with the CPU time of the server's thread it took
(`gc.callbacks`); the cyclic garbage its responses left alive; what one full collection of its heap
costs, measured before any policy runs.  It checks that record against CPython's own counters
(`gc.get_stats`) and hands it back on a trace port answered by a thread of its own.

What it cannot see: pauses of other processes on the machine (a busy machine shows as wall time, not
as the server's CPU time); what happens inside torch's C++ code; and, since the policy runs in its own
process, anything a policy does by routes the record and the guard do not cover (the record says
`tampered` where it can tell).

A GC policy is a Python file the server loads; it may define any of

    on_startup()               after the heap and model are built and warmed up
    before_request(in_flight)  as a request starts (in_flight counts it)
    after_request(in_flight)   as a request ends (in_flight no longer counts it)
    on_idle(idle_seconds)      every `idle_after` seconds while no request is in flight;
                               idle_seconds: how long since the last request ended
"""
from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import tempfile
import time
import types
import weakref

from .. import syscalls

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
    """The server's record, kept in this generator's frame: only `send` reaches it by name (a policy
    that digs it out of the process changes the server's report, never the grader's own figures of
    the server's CPU time, gclab.grader.measured).

    Messages: ("start", generation, wall, cpu) and ("stop", generation, wall, cpu, collected,
    uncollectable) from the gc.callbacks hook; ("request", id, start, end) from the server;
    ("read", token) and ("reset", token) from the trace endpoint, and ("answer", token) from it
    while it waits for a read that came during a collection. Anything else is counted as a forgery."""
    collections, requests, forged = [], [], []
    pending = None
    at_reset, cpu_at_reset = stats(), process_time()
    deferred, answered = [], []     # reads that came during a collection; their replies, made when it stopped

    def read(kind):
        nonlocal collections, requests, at_reset, cpu_at_reset
        now, cpu_now = stats(), process_time()
        counted = [now[g][0] - at_reset[g][0] for g in range(len(now))]
        found = [now[g][1] - at_reset[g][1] for g in range(len(now))]
        data = {"collections": [list(c) for c in collections], "requests": [list(r) for r in requests],
                "forged": list(forged), "counted": counted, "found": found, "server_cpu": cpu_now - cpu_at_reset}
        if kind == "reset":             # what was forged stays on the record
            collections, requests = [], []
            at_reset, cpu_at_reset = now, cpu_now
        return data

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
            # a read that waited for this collection is answered now, in the thread that ran it: a server
            # collecting back to back may never be between two collections when the reading thread gets
            # the interpreter; only where the record agrees with CPython's count, or a later read decides
            while deferred and not _record_disagrees(read("read")):
                answered.append(read(deferred.pop(0)))
        elif kind == "request" and len(message) == 4:
            requests.append(message[1:])
        elif kind in ("read", "reset") and len(message) == 2 and message[1] is token and pending is not None:
            deferred.append(kind)
            reply = {"in_progress": True}       # a collection is under way: answered when it stops
        elif kind in ("read", "reset") and len(message) == 2 and message[1] is token:
            deferred.clear()
            answered.clear()                    # a read given up on before this one
            reply = read(kind)
        elif kind == "answer" and len(message) == 2 and message[1] is token:
            if answered:
                reply = answered.pop(0)
            elif deferred and pending is None:  # the record drained, no collection under way: read it now
                reply = read(deferred.pop(0))
            else:
                reply = {"in_progress": True}
        else:
            forged.append(f"an unknown message reached the record ({str(kind)[:40]})")
        if was_enabled:
            enable()


def _record_disagrees(data) -> list[str]:
    """Where a read of the record disagrees with what CPython counted itself (collections per
    generation, and the unreachable objects they found)."""
    problems = []
    seen = [sum(1 for c in data["collections"] if c[0] == g) for g in range(len(data["counted"]))]
    if seen != data["counted"]:
        problems.append(f"the record has {seen} collections per generation, CPython counted {data['counted']}")
    found = [sum(c[4] for c in data["collections"] if c[0] == g) for g in range(len(data["found"]))]
    if found != data["found"]:
        problems.append(f"the record's collections found {found} unreachable objects, CPython counted "
                        f"{data['found']}")
    return problems


def _serialized(send, sleep=time.sleep):
    """`send` to the record from either thread (the server's, or the one that answers trace
    requests).  A caller that finds the record busy (the other thread is in it, or this thread
    is, when a collection starts inside it) leaves its message in a queue drained before the next
    message, and never waits; a read (`wait=True`) waits for the record and, when a collection is
    under way, for its reply, made as the collection stops, so that what it reads matches CPython's
    counters."""
    import collections
    import threading
    lock, backlog = threading.Lock(), collections.deque()
    append, popleft = backlog.append, backlog.popleft

    def record(message, wait=False):
        asked = message
        for _ in range(5000):
            if not lock.acquire(wait):
                append(message)
                return None
            try:
                while backlog:
                    send(popleft())
                reply = send(message)
                in_progress = type(reply) is dict and reply.get("in_progress")
                # asked during a collection: its reply is awaited; messages that came meanwhile: asked again
                message = ("answer", asked[1]) if in_progress else asked
                if not (wait and (backlog or in_progress)):
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


def full_collection_cpu(repeats: int = 3, thread_time=time.thread_time, heap_objects: int = 0) -> float:
    """CPU seconds of one full collection of this process's heap, the least of `repeats`
    (CPU time of this thread: a busy machine that deschedules the process does not add to it).
    `heap_objects`: measured with a `long_lived_heap` of about so many objects added while it runs
    (a heap like a server's), dropped after."""
    heap = long_lived_heap(heap_objects) if heap_objects else None  # noqa: F841  (alive while measured)
    best = float("inf")
    for _ in range(repeats):
        t = thread_time()
        gc.collect()
        best = min(best, thread_time() - t)
    return best


def _serving_modules() -> list:
    """gclab.serving and its modules, as loaded in this process: what a policy may import and rebind."""
    return [module for name, module in list(sys.modules.items())
            if name == __package__ or name.startswith(__package__ + ".")]


def _snapshot(modules=None) -> dict:
    """The names of gclab.serving and of its modules, and the attributes of the classes they define,
    as they are now."""
    taken = {}
    for module in modules if modules is not None else _serving_modules():
        where = module.__name__
        taken.update({(where, "module", name): value for name, value in vars(module).items()})
        for name, value in vars(module).items():
            if isinstance(value, type) and value.__module__ == where:
                taken.update({(where, name, attr): member for attr, member in vars(value).items()})
    return taken


def _replaced(before: dict, modules=None, snapshot=_snapshot) -> list[str]:
    now = snapshot(modules)
    return list(dict.fromkeys(
        f"{where if owner == 'module' else __package__ + '.' + owner}.{attr} was replaced"
        for (where, owner, attr), value in before.items() if now.get((where, owner, attr), _snapshot) is not value))


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
    garbage, callbacks, module, replaced = state.garbage, gc.callbacks, _serving_modules(), _replaced
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
        problems += _record_disagrees(data)
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
    """The guard (gclab.guard), installed before the policy runs: it locks the grader's
    modules, lists what was replaced and refuses the policy new processes and files outside its
    folder: reasons for the policy's author, not what its grade rests on.  The policy may write only in
    `workdir` (ModelServer makes it and removes it once the server has stopped)."""
    if not policy:
        return None
    try:
        from .. import guard
    except ImportError:             # pragma: no cover - a gclab without it still checks its record
        return None
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
    if policy:
        # the grader reads this process's CPU time, sockets and memory: the policy may not hand the serving
        # to another process, reach into one, or page out the garbage it keeps (gclab.syscalls; not on every
        # system: the reason is dropped)
        syscalls.refuse(syscalls.NEW_PROCESSES, syscalls.PASSING_DESCRIPTORS, syscalls.REACH, syscalls.PAGING_OUT)
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
