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
request started and ended and every collection (`gclab.gcwatch`), and hands them back on
`GET /_gclab/trace`.

The load generator runs in a process of its own with the collector off, so its own
pauses cannot be charged to the server.  It is open-loop: request i leaves at its
scheduled time whatever happened to the earlier ones, and its latency is measured from
that scheduled time, so a request that waited behind a pause is charged for the wait.

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
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from .gcwatch import Collection, GCWatch, gc_disabled

__all__ = ["ModelServer", "LoadResult", "Trace", "ServedRun", "measure", "run_load", "schedule"]

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
        loader.exec_module(module)
        hooks.update({name: getattr(module, name) for name in HOOKS if callable(getattr(module, name, None))})
    return hooks


class ServerState:
    def __init__(self, model, heap, cache, hooks, attribution):
        self.model, self.heap, self.cache, self.hooks = model, heap, cache, hooks
        self.attribution = attribution
        self.in_flight = 0
        self.last_end = time.perf_counter()
        self.requests: list[tuple[int, float, float]] = []      # (request id, start, end)
        self.idle_calls: list[tuple[float, float]] = []      # (start, end) of on_idle calls that took time
        self.idle_call_count = 0
        self.peak_garbage = 0
        self.errors: list[str] = []
        self.explanations = weakref.WeakSet()
        self.watch = GCWatch()
        self.stats_at_reset = _collections_so_far()

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
        collected, now and at its highest since the last reset (sampled while the server runs)."""
        alive = len(self.explanations)
        cached = sum(1 for value in self.cache.entries.values() if isinstance(value, Explanation))
        uncollected = max(0, alive - cached)
        self.peak_garbage = max(self.peak_garbage, uncollected)
        return {"explanations_alive": alive, "cached": cached, "uncollected": uncollected,
                "peak_uncollected": self.peak_garbage}

    def trace(self) -> dict:
        return {
            "requests": self.requests, "idle_calls": self.idle_calls, "errors": self.errors[:20],
            "idle_call_count": self.idle_call_count,
            "collections": [[c.generation, c.start, c.duration, c.collected, c.uncollectable]
                            for c in self.watch.collections],
            "garbage": self.garbage(), "gc_enabled": gc.isenabled(), "threshold": list(gc.get_threshold()),
            "frozen": gc.get_freeze_count(), "count": list(gc.get_count()),
            "python": sys.version.split()[0],
            "recording_intact": self.recording_intact(),
        }

    def recording_intact(self) -> bool:
        """Is the watch still hooked in, and did it see every collection CPython counted?"""
        with gc_disabled():             # no collection may slip in between the two counts
            counted = [now - then for now, then in zip(_collections_so_far(), self.stats_at_reset)]
            seen = [self.watch.count(g) for g in range(len(counted))]
        return self.watch._on_gc in gc.callbacks and counted == seen

    def reset(self):
        with gc_disabled():
            self.requests, self.idle_calls, self.errors = [], [], []
            self.idle_call_count = 0
            self.peak_garbage = 0
            self.watch.collections = []
            self.stats_at_reset = _collections_so_far()


def _collections_so_far() -> list[int]:
    """CPython's own count of collections per generation (independent of gc.callbacks)."""
    return [generation["collections"] for generation in gc.get_stats()]


def _request_id(query: bytes) -> int:
    """The load generator numbers its requests `?seed=i`; other requests are -1."""
    for part in query.split(b"&"):
        if part.startswith(b"seed="):
            try:
                return int(part[5:])
            except ValueError:
                break
    return -1


def build_app(state: ServerState, device_seconds: float):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def predict(request):
        inferred = state.infer(int(request.query_params.get("seed", "0")))
        # waiting for the accelerator's answer: the event loop serves other requests meanwhile
        await asyncio.sleep(device_seconds)
        return JSONResponse(state.postprocess(*inferred))

    async def trace(request):
        data = state.trace()
        if request.query_params.get("reset"):
            state.reset()
        return JSONResponse(data)

    app = Starlette(routes=[Route("/predict", predict), Route("/_gclab/trace", trace)])

    async def timed(scope, receive, send):
        if scope["type"] != "http" or scope["path"].startswith("/_gclab"):
            return await app(scope, receive, send)
        start = time.perf_counter()
        request_id = _request_id(scope["query_string"])
        state.in_flight += 1
        try:
            state.hooks["before_request"](state.in_flight)
            await app(scope, receive, send)
        except Exception as exc:
            state.errors.append(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            state.in_flight -= 1
            state.last_end = end = time.perf_counter()
            state.requests.append((request_id, start, end))
            try:
                state.hooks["after_request"](state.in_flight)
            except Exception as exc:
                state.errors.append(f"after_request: {type(exc).__name__}: {exc}")
    return timed


async def _watch_idle_and_parent(state: ServerState, idle_after: float, parent: int):
    """Call the policy's on_idle(idle_seconds) every `idle_after` seconds while no request is in
    flight; stop the server if the process that started it has gone."""
    last_call = 0.0
    while True:
        await asyncio.sleep(idle_after / 2)
        if os.getppid() != parent:          # the notebook went away: do not outlive it
            os._exit(0)
        state.garbage()                     # samples the peak of uncollected garbage
        now = time.perf_counter()
        if state.in_flight or now - state.last_end < idle_after or now - last_call < idle_after:
            continue
        try:
            state.hooks["on_idle"](now - state.last_end)
        except Exception as exc:
            state.errors.append(f"on_idle: {type(exc).__name__}: {exc}")
        last_call = time.perf_counter()
        state.idle_call_count += 1
        if last_call - now > 1e-4:          # keep the calls that did something, for the timeline
            state.idle_calls.append((now, last_call))


def serve(heap_objects: int, attribution: str, policy: str | None, device: str,
          cache_size: int, idle_after: float, device_ms: float) -> None:
    import socket

    import torch
    import uvicorn
    torch.set_num_threads(1)
    hooks = load_policy(policy)
    model = Model(torch.device(device))
    state = ServerState(model, long_lived_heap(heap_objects), ResponseCache(cache_size), hooks, attribution)
    for seed in range(50):                  # warm-up: first calls into torch allocate for good
        state.answer(seed)
    state.cache.entries.clear()
    gc.collect()
    hooks["on_startup"]()
    app = build_app(state, device_ms / 1e3)
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
        watcher = asyncio.ensure_future(_watch_idle_and_parent(state, idle_after, parent))
        print(f"{READY} {sock.getsockname()[1]}", flush=True)
        with state.watch:
            state.reset()
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


async def _send_all(host, port, times, timeout):
    idle: list = []
    t0 = time.perf_counter() + 0.05
    rows = [[t0 + at, None, None, 0] for at in times]      # scheduled, sent, done, status

    async def one(i):
        row = rows[i]
        await asyncio.sleep(max(0.0, row[0] - time.perf_counter()))
        row[1] = time.perf_counter()
        reader, writer = idle.pop() if idle else await asyncio.open_connection(host, port)
        writer.write(b"GET /predict?seed=%d HTTP/1.1\r\nHost: gclab\r\n\r\n" % i)
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        row[2], row[3] = time.perf_counter(), int(head.split(b" ", 2)[1])
        idle.append((reader, writer))

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(times))]
    await asyncio.wait(tasks, timeout=timeout)
    for task in tasks:
        task.cancel()
    for _, writer in idle:
        writer.close()
    return rows


def load_main(url: str, rate: float, count: int, poisson: bool, seed: int, timeout: float) -> None:
    gc.disable()                            # the client's own pauses must not be charged to the server
    host, port = url.split("//")[1].split(":")
    rows = asyncio.run(_send_all(host, int(port), schedule(rate, count, poisson, seed), timeout))
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


@dataclass
class Trace:
    """What the server recorded: each request's (id, start, end), the collections, the
    policy's idle calls (start, end) and the cyclic garbage still alive at the end."""
    requests: list
    collections: list[Collection]
    idle_calls: list = field(default_factory=list)
    garbage: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)

    @classmethod
    def from_json(cls, data: dict) -> "Trace":
        collections = [Collection(int(g), s, d, int(c), int(u)) for g, s, d, c, u in data["collections"]]
        info = {k: data[k] for k in ("gc_enabled", "threshold", "frozen", "count", "python", "recording_intact",
                                     "idle_call_count")}
        return cls([tuple(r) for r in data["requests"]], collections, [tuple(c) for c in data["idle_calls"]],
                   data["garbage"], info, data["errors"])

    @classmethod
    def unavailable(cls, reason: str) -> "Trace":
        return cls([], [], info={"recording_intact": False}, errors=[reason])

    def collections_inside_requests(self, generation: int | None = None) -> list[Collection]:
        """Collections that ran while at least one request was being handled."""
        import numpy as np
        if not self.requests:
            return []
        _, starts, ends = np.array(self.requests).T
        return [c for c in self.collections if (generation is None or c.generation == generation)
                and bool(np.any((starts < c.start + c.duration) & (ends > c.start)))]


def _kill(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class ModelServer:
    """Start the model server in its own process; always stopped on exit, error or interrupt."""

    def __init__(self, heap_objects: int = 300_000, attribution="objects", policy=None,
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
        self.proc = None
        self.port = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ModelServer":
        o = self.options
        cmd = [sys.executable, "-m", "gclab.serving", "serve", "--heap-objects", str(o["heap_objects"]),
               "--device", o["device"], "--cache-size", str(o["cache_size"]), "--idle-after", str(o["idle_after"]),
               "--device-ms", str(o["device_ms"])]
        cmd += ["--attribution", o["attribution"]]
        cmd += ["--policy", o["policy"]] if o["policy"] else []
        self._log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, text=True)
        self._finalizer = weakref.finalize(self, _kill, self.proc)
        line = self._first_line()
        if not line.startswith(READY):
            self.stop()
            raise RuntimeError("the model server did not start: " + (self._error_text() or line or "no output"))
        self.port = int(line.split()[-1])
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

    def __enter__(self) -> "ModelServer":
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

    def trace(self, reset: bool = False, timeout: float = 5) -> Trace:
        """What the server recorded; if it cannot answer within `timeout` seconds (still busy
        with a backlog, or stuck), a Trace that says so and records nothing."""
        try:
            with urllib.request.urlopen(f"{self.url}/_gclab/trace{'?reset=1' if reset else ''}",
                                        timeout=timeout) as answer:
                return Trace.from_json(json.loads(answer.read()))
        except (OSError, ValueError) as exc:      # URLError, timeouts and bad JSON
            return Trace.unavailable(f"the server did not report its trace within {timeout:g} s "
                                     f"({type(exc).__name__}): it was still busy or had stopped")


def run_load(url: str, rate: float = 200.0, duration: float = 4.0, poisson: bool = True, seed: int = 0,
             timeout: float | None = None) -> LoadResult:
    """Send rate × duration requests on an open-loop schedule (in a process of its own) and wait
    for their answers; requests still unanswered `timeout` seconds after the start count as failed."""
    count = max(1, int(rate * duration))
    timeout = timeout or duration + 5
    cmd = [sys.executable, "-m", "gclab.serving", "load", url, "--rate", str(rate), "--count", str(count),
           "--seed", str(seed), "--timeout", str(timeout)] + (["--poisson"] if poisson else [])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30)
    if done.returncode != 0:
        raise RuntimeError("the load generator failed: " + done.stderr.strip()[-800:])
    rows = json.loads(done.stdout)
    return LoadResult(*[list(column) for column in zip(*rows)])


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
            **server_options) -> ServedRun:
    """Start a server with `server_options` (see ModelServer), send it the open-loop load, wait
    `settle` idle seconds (time for the policy's on_idle), read its trace, stop it."""
    with ModelServer(**server_options) as server:
        load = run_load(server.url, rate=rate, duration=duration, seed=seed)
        time.sleep(settle)
        return ServedRun(name, load, server.trace())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gclab.serving")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--heap-objects", type=int, default=300_000)
    s.add_argument("--attribution", choices=ATTRIBUTION, default="off")
    s.add_argument("--policy")
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
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.heap_objects, args.attribution, args.policy, args.device, args.cache_size, args.idle_after,
              args.device_ms)
    else:
        load_main(args.url, args.rate, args.count, args.poisson, args.seed, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
