"""A server that forks verdict processes with the grader's instruments already imported.

    python -m gclab.zygote SOCKET_FD        (started by gclab.grading, once per grader)

Importing torch, matplotlib, IPython and gclab costs a fresh Python about 2 s; a class is
hundreds of verdict processes.  This server imports them once (`verdict.preload`), then
for each request forks a child that becomes the verdict process: a session of its own,
its resource limits, its job read from the pipe it was handed, its results written to
the channel it was handed (both passed over the Unix socket, SCM_RIGHTS).  The child
installs the guard and runs the learner's code exactly as a freshly started verdict
process does; nothing of one child reaches the next, since each is a fork of the same
untouched server.  The server exits when the grader closes the socket.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys


def serve(sock: socket.socket) -> None:
    from gclab import verdict
    verdict.preload()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)       # children are reaped by the kernel
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, 65536, 2)
        except OSError:
            return
        if not data:
            return
        request = json.loads(data)
        pid = os.fork()
        if pid == 0:
            _become_verdict(sock, request, *fds)
        for fd in fds:
            os.close(fd)
        sock.sendall(json.dumps({"pid": pid}).encode())


def _become_verdict(sock: socket.socket, request: dict, job_fd: int, channel: int) -> None:
    """In the forked child: never returns into the server's loop."""
    try:
        sock.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        from gclab import grading, verdict
        grading.apply_limits(request.get("memory_limit"))
        with os.fdopen(job_fd, "rb") as job_file:
            job = json.loads(job_file.read())
        verdict.run(job, channel)
    finally:
        os._exit(0)


def main() -> int:
    serve(socket.socket(fileno=int(sys.argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
