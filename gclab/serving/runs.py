"""The notebook's side of serving: start a model server, send it a load, read what both saw.

    with ModelServer(heap_objects=300_000, attribution="objects", policy="my_policy.py") as server:
        load = run_load(server.url, rate=200, duration=4.0)
        trace = server.trace()
    load.percentiles()               # latency in ms at P50, P95, P99 and the maximum
    trace.collections_inside_requests(generation=2)

`measure` serves one configuration one load; `compare` serves several configurations the same load,
interleaved, so that a busy spell of the machine lands on every configuration alike.  What it cannot
see is what the two processes it starts cannot see (`gclab.serving.server`, `gclab.serving.load`);
timings on a shared machine are noisy, so compare configurations measured in the same run.
"""
from __future__ import annotations

import json
import subprocess
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from .. import outside
from .load import LoadResult
from .processes import _kill, _spawn, main_parser
from .server import ATTRIBUTION, HEAP_OBJECTS, READY
from .trace import Trace

class ModelServer:
    """Start the model server in its own process; always stopped on exit, error or interrupt."""

    def __init__(self, heap_objects: int = HEAP_OBJECTS, attribution="objects", policy=None,
                 device=None, cache_size: int = 100, idle_after: float = 0.01, device_ms: float = 5.0,
                 startup_timeout: float = 120):
        from ..memory import default_device
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
