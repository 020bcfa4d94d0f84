"""What the operating system says about a process and the processes it started, read from outside.

The grader reads these figures about the process that runs a learner's code; nothing that process
does to its own memory changes them (it can rewrite any of its own objects, not the kernel's
accounting of it):

- resident memory, `VmRSS` in `/proc/PID/status`, and its peak `VmHWM`, which writing 5 to
  `/proc/PID/clear_refs` resets to the current figure (so a peak can be read for a window); each
  with what the process has in swap (`VmSwap`) added, so that memory paged out, by the kernel under
  pressure or by the process itself (`madvise(MADV_PAGEOUT)`), still counts as its;
- time on the CPU, the kernel's CPU-time clock of the whole process (`clock_gettime` on the clock
  id `clock_getcpuclockid(PID)` names: nanoseconds all its threads ran, the ones that already ended
  included; time spent waiting for a core does not count, so a busy machine does not inflate it),
  plus what its finished children ran (`cutime`, `cstime` of `/proc/PID/stat`, clock ticks);
- its threads (`/proc/PID/task`) and the processes of its session (a verdict process starts a
  session of its own: whatever it starts, a model server included, stays in it unless it leaves);
- on a machine with an NVIDIA GPU, the driver's figure of each process's device memory (NVML,
  the `nvidia-ml-py` package), where that package is installed.

- the sockets it holds (`/proc/PID/fd`, each a `socket:[INODE]`), and, in the network namespace the
  reader is in, which socket is the server's end of a TCP connection (`/proc/self/net/tcp`): so a load
  can confirm that the process whose CPU time it reads is the one that holds its connections.

What it cannot see: memory a process maps but never touches (not resident), processes that left
the session (`setsid`; the grader's verdict counts such a departure against the learner).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

__all__ = ["Reading", "read", "reset_peaks", "session_members", "member_numbered", "cpu_ns", "socket_inodes",
           "server_ends"]

_TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Reading:
    """One reading of a session's processes, summed over them."""
    at: float           # time.monotonic() of the reading
    rss: int            # resident bytes
    peak: int           # peak resident bytes since the last `reset_peaks` (VmHWM)
    cpu_ns: int         # nanoseconds on a CPU, finished children included
    threads: int
    processes: int
    gpu: int | None     # device bytes the driver reports for them; None without NVML
    charged: int | None = None        # bytes charged to their memory cgroup (gclab.grader.memory_group) ...
    charged_peak: int | None = None   # ... and its peak since the last reading; None without one

    def as_dict(self) -> dict:
        return {"rss": self.rss, "peak": self.peak, "cpu_ns": self.cpu_ns, "threads": self.threads,
                "processes": self.processes, "gpu": self.gpu, "charged": self.charged}


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def session_members(sid: int) -> list[int]:
    """The live processes of session `sid` (zombies left out: they hold no memory)."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat_fields(int(name))
        # fields[0] is the state, [3] the session (stat's 3rd and 6th fields)
        if fields and fields[0] != "Z" and int(fields[3]) == sid:
            members.append(int(name))
    return sorted(members)


def member_numbered(sid: int, number: int) -> int | None:
    """The process of session `sid` that its own PID namespace numbers `number`, or None: a verdict behind
    the grader's walls numbers its processes in a namespace of its own (gclab.grader.sandbox)."""
    found = [(len(numbers), pid) for pid in session_members(sid)
             if (numbers := _pid_numbers(pid)) and numbers[-1] == number]
    return max(found)[1] if found else None


def _pid_numbers(pid: int) -> list[int]:
    """`pid`'s number in each PID namespace it is in, this one's first (NSpid in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((list(map(int, line.split()[1:])) for line in f if line.startswith("NSpid:")), [pid])
    except (OSError, ValueError):
        return []


def _status(pid: int) -> dict:
    found = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM", "VmSwap", "Threads"):
                    number = int(value.split()[0])
                    found[key] = number * 1024 if key.startswith("Vm") else number
    except (OSError, ValueError):
        pass
    return found


def _threads_ns(pid: int) -> int:
    """What the live threads of `pid` ran (the fallback where the process clock cannot be read)."""
    ran = 0
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ran += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass            # a thread that ended since the listing
    return ran


def _process_clock(pid: int) -> int:
    # the clock id glibc's clock_getcpuclockid(pid) returns: CPUCLOCK_SCHED (2) of the whole process
    return ((~pid) << 3) | 2


def _ran_ns(pid: int) -> int:
    """Nanoseconds every thread of `pid` ran, the ended ones included (a thread started and ended
    inside a call cannot take its work out of the count)."""
    try:
        return time.clock_gettime_ns(_process_clock(pid))
    except OSError:
        return _threads_ns(pid)


def _cpu_ns(pid: int) -> int:
    fields = _stat_fields(pid)
    children = (int(fields[13]) + int(fields[14])) * _TICK_NS if fields else 0     # cutime, cstime
    return _ran_ns(pid) + children


def cpu_ns(pids) -> int:
    """Nanoseconds on a CPU of `pids`, now (cheaper than `read`: no listing of the session)."""
    return sum(_ran_ns(pid) for pid in pids)


def socket_inodes(pid: int) -> set[int] | None:
    """The inodes of the sockets process `pid` holds open; None where its descriptors cannot be read."""
    inodes = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue                    # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _ipv4_endpoint(field: str) -> tuple[str, int]:
    address, port = field.split(":")
    return ".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)), int(port, 16)


def server_ends(port: int, host: str = "127.0.0.1") -> dict[int, int] | None:
    """In this process's network namespace: for each TCP connection to `host:port`, the client's port ->
    the inode of the server's end (the socket `accept` gave the server); None where the table cannot be read."""
    ends = {}
    try:
        with open("/proc/self/net/tcp") as table:
            lines = table.read().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 10:
            continue
        local, remote, inode = _ipv4_endpoint(fields[1]), _ipv4_endpoint(fields[2]), int(fields[9])
        if local == (host, port) and remote[0] == host and inode:
            ends[remote[1]] = inode
    return ends


def read(sid: int) -> Reading:
    """The figures of session `sid`'s processes, now."""
    pids = session_members(sid)
    rss = peak = cpu = threads = 0
    for pid in pids:
        status = _status(pid)
        swapped = status.get("VmSwap", 0)       # still the process's: paging out (MADV_PAGEOUT) hides none
        rss += status.get("VmRSS", 0) + swapped
        peak += max(status.get("VmHWM", 0), status.get("VmRSS", 0)) + swapped
        threads += status.get("Threads", 0)
        cpu += _cpu_ns(pid)
    return Reading(time.monotonic(), rss, peak, cpu, threads, len(pids), _gpu_bytes(pids))


def reset_peaks(sid: int) -> None:
    """Reset VmHWM of session `sid`'s processes to their current resident memory."""
    for pid in session_members(sid):
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


_NVML: list = []


def _gpu_bytes(pids) -> int | None:
    """Device memory NVML reports for `pids` on every GPU; None where NVML is not at hand."""
    if not os.path.exists("/dev/nvidiactl"):
        return None
    if not _NVML:
        try:
            import pynvml
            pynvml.nvmlInit()
            _NVML.append(pynvml)
        except Exception:
            _NVML.append(None)
    nvml = _NVML[0]
    if nvml is None:
        return None
    wanted, total = set(pids), 0
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid in wanted and proc.usedGpuMemory:
                    total += proc.usedGpuMemory
    except Exception:
        return None
    return total
