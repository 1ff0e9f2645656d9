"""What the kernel says about the brokers under test (/proc): CPU and RSS per process with
all its descendants, CPU and context switches per thread, the accept-queue overflows, and the
file-descriptor limit the brokers inherit. Linux only."""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path


def raise_nofile(want: int) -> int:
    """Raise RLIMIT_NOFILE as far as allowed; brokers started afterwards inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < want:
        try:  # root may raise the hard limit up to fs.nr_open
            nr_open = int(Path("/proc/sys/fs/nr_open").read_text())
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, nr_open),) * 2)
            return min(want, nr_open)
        except (OSError, ValueError):
            pass
    new = min(max(soft, want), hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    return new


def rss_kb(pid: int) -> int:
    """Resident memory of a process and its descendants (kB)."""
    total = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/status") as fh:
                total += next(int(ln.split()[1]) for ln in fh if ln.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes and their descendants so far. Unlike a
    rate, CPU per message hardly moves when other work shares the machine."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        for p in _tree(pid):
            try:
                with open(f"/proc/{p}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
            except (OSError, IndexError, ValueError):
                pass
    return total


@dataclass(frozen=True)
class Usage:
    """One reading of a broker's CPU: in all (seconds), per thread name (thread_times),
    when it was taken (monotonic), and of its Lightgate processes' threads, those that
    run Python and all of them (python_split)."""

    cpu: float
    threads: dict[str, list[float]]
    at: float
    python: tuple[float, float] = (0.0, 0.0)


def usage(pids: list[int], python_pids: list[int] | None = None) -> Usage:
    return Usage(cpu_seconds(pids), thread_times(pids), time.monotonic(),
                 python_split(python_pids or []))


# The threads of a Lightgate process that never run Python: the native plane's reactors
# (native/src/reactor.rs names them), the thread that reads the rounds of subscribers
# that fell behind ("lightgate-backlog", native/src/backlog.rs; a comm holds 15
# characters), a gateway node's client of the store ("lightgate-store-client" and its
# master search, native/src/client.rs), a store's native server ("store-native",
# native/src/server.rs) and RocksDB's background threads. Every other thread does: the
# trio loop, trio's worker threads, the CommitLog's writer and dispatcher, the Raft
# controller's, the Redis client's.
NATIVE_THREADS = ("lightgate-io-", "lightgate-backl", "lightgate-store", "store-native",
                  "rocksdb:")


def python_split(pids: list[int]) -> tuple[float, float]:
    """CPU seconds so far of these processes' threads that run Python, and of all their
    threads (a thread that ended is not counted: take both readings while they run).
    From each thread's schedstat (nanoseconds on a CPU), not its stat's clock ticks: a
    short row's window may hold no tick at all."""
    python = total = 0.0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                    name = fh.read()
                with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                    used = int(fh.read().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                continue
            total += used
            if not name.startswith(NATIVE_THREADS):
                python += used
    return python, total


def thread_times(pids: list[int]) -> dict[str, list[float]]:
    """Per thread name (comm) of these processes: [CPU seconds, voluntary and involuntary
    context switches, user and system CPU seconds]. Shows which thread burns the CPU,
    whether threads hand the GIL back and forth (involuntary switches), and how much of
    it is the kernel's (socket and file calls) rather than the interpreter's."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, list[float]] = {}
    for pid in pids:
        for p in _tree(pid):
            try:
                tids = os.listdir(f"/proc/{p}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{p}/task/{tid}/stat") as fh:
                        head, _, rest = fh.read().rpartition(")")
                    status = Path(f"/proc/{p}/task/{tid}/status").read_text()
                except OSError:
                    continue
                fields = rest.split()
                name = head.split("(", 1)[1]
                sw = {k: int(v) for k, v in (ln.split(":\t") for ln in status.splitlines()
                                             if ln.endswith(tuple("0123456789"))
                                             and "ctxt_switches" in ln)}
                row = out.setdefault(name, [0.0, 0, 0, 0.0, 0.0])
                row[0] += (int(fields[11]) + int(fields[12])) / tick
                row[1] += sw.get("voluntary_ctxt_switches", 0)
                row[2] += sw.get("nonvoluntary_ctxt_switches", 0)
                row[3] += int(fields[11]) / tick
                row[4] += int(fields[12]) / tick
    return out


def thread_report(before: dict[str, list[float]], after: dict[str, list[float]],
                  messages: int, seconds: float) -> dict[str, dict[str, float]]:
    """CPU µs per message and context switches per second, per thread name (a name
    shared by several threads, e.g. a pool, is their sum)."""
    rep = {}
    for name, (cpu, vol, invol, user, system) in after.items():
        b = before.get(name, [0.0, 0, 0, 0.0, 0.0])
        used = cpu - b[0]
        if used <= 0 and vol - b[1] <= 0:
            continue
        per_msg = 1e6 / messages if messages else None
        rep[name] = {"cpu_us_per_msg": round(used * per_msg, 2) if per_msg else None,
                     "user_us_per_msg": round((user - b[3]) * per_msg, 2) if per_msg else None,
                     "sys_us_per_msg": round((system - b[4]) * per_msg, 2) if per_msg else None,
                     "voluntary_switches_per_s": round((vol - b[1]) / seconds),
                     "involuntary_switches_per_s": round((invol - b[2]) / seconds)}
    return rep


def listen_overflows() -> int:
    """Kernel count of SYNs dropped on a full accept queue (each costs the client a 1 s
    SYN retransmit); system-wide, so only meaningful on an otherwise idle machine."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
        names, values = (ln.split() for ln in lines if ln.startswith("TcpExt:"))
        return int(dict(zip(names, values, strict=True))["ListenOverflows"])
    except (OSError, ValueError, KeyError):
        return 0


def _tree(pid: int) -> list[int]:
    """The process and all its descendants: a broker may run its work a few levels down
    (RabbitMQ: a script, beam.smp under it, beam's helpers under that)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(_children(p))
    return out


def _children(pid: int) -> list[int]:
    """Children of every thread of the process (a thread that forks is their parent)."""
    kids: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                kids += [int(x) for x in fh.read().split()]
        except OSError:
            pass
    return kids
