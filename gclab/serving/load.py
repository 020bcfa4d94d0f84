"""The load generator: an open-loop schedule of HTTP requests, sent from a process of its own.

It runs with the collector off (`python -m gclab.serving load`, started by `gclab.serving.run_load`),
so that its own pauses cannot be charged to the server.  It is open-loop: request i leaves at its
scheduled time whatever happened to the earlier ones, and its latency is measured from that scheduled
time, so a request that waited behind a pause is charged for the wait.  It may send its schedule in
bursts: each burst leaves a lull after the last answer to the one before, so the server is idle
between bursts however slow the machine, and open-loop within a burst.

What it measures: per request its scheduled send time, when it was sent, when its answer arrived, its
HTTP status and a digest of the answer's body (the same seed gets the same answer from the same server);
with `watch_cpu`, the server's CPU time (every thread's, from /proc) at each request sent and answered,
and, at the end of each burst, whether that process holds the server's end of the connection each of the
burst's answers came over (`procfs.socket_inodes`): the CPU time read is then the serving process's, not
a decoy's that the server forked or a verdict named.  What it cannot see: why a request was late (the
server's own trace says which collections ran meanwhile: `Trace.charges`), nor time spent in the kernel's
network stack apart from the rest.
"""
from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import time
from dataclasses import dataclass, field

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


def digest(body: bytes) -> str:
    """A short digest of an answer's body, compared with the reference server's answer to the same request."""
    return hashlib.blake2b(body, digest_size=8).hexdigest()


async def _send_all(host, port, times, timeout, burst=0, lull=0.0, server_cpu=None, held=None):
    """Send request i at times[i] after the start, open-loop, and wait for the answers until
    `timeout` seconds after the start.  With `burst`, the schedule is cut into bursts of that many
    requests, and each burst starts `lull` seconds after every answer to the one before it has
    arrived (its requests keep their spacing, shifted by the wait); each burst has as long after
    its last scheduled request as the whole load would have after its last.  With `server_cpu` (a
    function), each row also holds what it returned as the request was sent and as its answer came; with
    `held` (a function of the client ports of a burst's answered requests, to True, False or None), what it
    said of each at the end of its burst."""
    idle: list = []
    t0 = time.perf_counter() + 0.05
    slack = timeout - (times[-1] - times[0] if times else 0.0)
    deadline = t0 + timeout
    # scheduled, sent, done, status, server CPU at both, held by the watched server, the answer's digest
    rows = [[None, None, None, 0, None, None, None, None] for _ in times]
    client_ports = [None] * len(times)
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
        body = await reader.readexactly(length)
        row[2], row[3], row[5] = time.perf_counter(), int(head.split(b" ", 2)[1]), cpu()
        row[7], client_ports[i] = digest(body), writer.get_extra_info("sockname")[1]
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
        if held is not None:        # before the lull: its connections are all still open, idle
            answered = [i for i in group if rows[i][2] is not None]
            said = held([client_ports[i] for i in answered])
            for i in answered:
                rows[i][6] = said.get(client_ports[i])
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
    request sent and each answer, and confirm at each burst's end that it holds the server's end of the
    connections the burst's answers came over."""
    gc.disable()                            # the client's own pauses must not be charged to the server
    host, port = url.split("//")[1].split(":")
    server_cpu = held = None
    if watch_cpu:
        from ..procfs import cpu_ns
        server_cpu = lambda: cpu_ns([watch_cpu])        # noqa: E731
        held = held_by(watch_cpu, host, int(port))
    rows = asyncio.run(_send_all(host, int(port), schedule(rate, count, poisson, seed), timeout, burst, lull,
                                 server_cpu, held))
    print(json.dumps(rows))


def held_by(pid: int, host: str, port: int):
    """A function of client ports: for each, whether process `pid` holds the server's end of that
    connection to host:port (None where this process cannot read its descriptors or the connections)."""
    from ..procfs import server_ends, socket_inodes

    def held(client_ports):
        ends, inodes = server_ends(port, host), socket_inodes(pid)
        if ends is None or inodes is None:
            return dict.fromkeys(client_ports)
        return {p: ends.get(p) in inodes for p in client_ports}
    return held


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
    held: list = field(default_factory=list)         # whether the watched server held its connection (or None)
    digests: list = field(default_factory=list)      # a digest of each answer's body (None: no answer)

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
