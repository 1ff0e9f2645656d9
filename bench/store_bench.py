"""Store benchmark: CommitLog append, dispatch, 1M light queues, recovery.

Prints one JSON object on stdout (progress on stderr) and writes it to
bench/results/store_latest.json. Figures are ratios wherever a peer exists on the same
disk (dd), because this machine is shared and noisy.

    python bench/store_bench.py            # full: 1M queues, ~1 GB recovery log
    python bench/store_bench.py --quick    # smaller sizes, same keys (~1 minute)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results_dir import RESULTS  # noqa: E402
from lightqueue.index import ConsumeQueueIndex  # noqa: E402
from store.commitlog import CommitLog  # noqa: E402
from store.record import Message  # noqa: E402


def progress(text: str) -> None:
    print(f"[store_bench] {text}", file=sys.stderr, flush=True)


def open_log(root: Path, flush: str, **kw) -> CommitLog:
    log = CommitLog(root / "commitlog", ConsumeQueueIndex(root / "index"), flush=flush, **kw)
    log.open()
    return log


def close_log(log: CommitLog) -> None:
    log.close()
    log.index.close()


def dd_mb_per_s(root: Path, mib: int) -> float:
    """Sequential write bandwidth of the disk under `root`, durable at the end."""
    target = root / "dd.bin"
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}", "conv=fdatasync"],
        check=True, capture_output=True,
    )
    seconds = time.perf_counter() - t0
    target.unlink()
    return mib * 1024 * 1024 / seconds / 1e6


def pipelined(log: CommitLog, total: int, per_request: int, make: Callable[[int], tuple]) -> float:
    """Append `total` messages in requests of `per_request`, keeping up to 1,000 requests
    in flight (as many gateway connections would); returns messages per second."""
    window: list = []
    t0 = time.perf_counter()
    for i in range(0, total, per_request):
        msgs, queues = make(i)
        window.append(log.append(msgs, queues))
        if len(window) >= 1000:
            window.pop(0).result()
    for fut in window:
        fut.result()
    return total / (time.perf_counter() - t0)


def bench_append(root: Path, flush: str, size: int, total: int, per_request: int) -> dict:
    shutil.rmtree(root / "a", ignore_errors=True)
    log = open_log(root / "a", flush)
    body = os.urandom(size)
    queues = [["dev/1/temp", "dev/+/temp", "dev#1"]] * per_request

    def make(i: int) -> tuple:
        return [Message("dev/1/temp", body, qos=1, client_id="dev-1") for _ in queues], queues

    rate = pipelined(log, total, per_request, make)
    close_log(log)
    return {"msgs_per_s": round(rate), "mb_per_s": round(rate * size / 1e6, 1)}


def bench_dispatch(root: Path, entries: int) -> float:
    shutil.rmtree(root / "d", ignore_errors=True)
    index = ConsumeQueueIndex(root / "d")
    # One entry per stored message, 10,000 queues, as the CommitLog's dispatch writes them.
    rows = [Message("dev/t", b"", store_ts=1, phys_offset=i * 100, size=100,
                    queues=[(f"dev/{i % 10_000}/t", i // 10_000)]) for i in range(entries)]
    t0 = time.perf_counter()
    for j in range(0, entries, 4000):
        index.write_messages(rows[j : j + 4000], j)
    rate = entries / (time.perf_counter() - t0)
    index.close()
    return rate


def bench_queues(root: Path, nqueues: int, measure: int) -> tuple[float, float]:
    """Append rates with messages spread over `nqueues` light queues (all pre-created):
    warm (every queue already touched by this process) and cold (just reopened, so each
    queue's next offset is first looked up in RocksDB)."""
    shutil.rmtree(root / "q", ignore_errors=True)
    log = open_log(root / "q", "async")
    body = b"q" * 16

    def make_for(offset: int) -> Callable[[int], tuple]:
        def make(i: int) -> tuple:
            names = [f"fleet/{(offset + i + k) % nqueues}/s" for k in range(100)]
            return [Message(n, body) for n in names], [[n] for n in names]

        return make

    created = 0
    while created < nqueues:  # every queue gets its first message
        step = min(200_000, nqueues - created)
        pipelined(log, step, 100, make_for(created))
        created += step
        progress(f"  {created:,}/{nqueues:,} queues created")
    warm = pipelined(log, measure, 100, make_for(7))
    close_log(log)
    log = open_log(root / "q", "async")
    cold = pipelined(log, measure, 100, make_for(7 + measure))
    close_log(log)
    return warm, cold


def bench_recovery(root: Path, mib: int) -> float:
    """Seconds per GB to verify every record and rebuild the index after a crash."""
    shutil.rmtree(root / "r", ignore_errors=True)
    log = open_log(root / "r", "async", segment_size=128 << 20)
    body = os.urandom(1000)
    total = mib * 1024 * 1024 // 1100 // 100 * 100
    queues = [["car/1/gps", "car/+/gps", "car#0"]] * 100
    pipelined(log, total, 100, lambda i: ([Message("car/1/gps", body) for _ in queues], queues))
    size = log.max_offset
    close_log(log)
    shutil.rmtree(root / "r" / "index")  # the index is lost ...
    (root / "r" / "commitlog" / "checkpoint").unlink()  # ... and so is the checkpoint
    t0 = time.perf_counter()
    log = CommitLog(root / "r" / "commitlog", ConsumeQueueIndex(root / "r" / "index"))
    report = log.open()
    seconds = time.perf_counter() - t0
    assert report.records_verified == report.redispatched == total, report
    close_log(log)
    return seconds / (size / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dir", help="where to write (default: a temp dir under ./bench)")
    args = parser.parse_args()
    quick = args.quick
    base = Path(args.dir) if args.dir else Path(__file__).resolve().parent
    root = Path(tempfile.mkdtemp(prefix="store-bench-", dir=base))
    try:
        out: dict = {"quick": quick}
        n = 200_000 if quick else 1_000_000
        progress("dd sequential write")
        dd = dd_mb_per_s(root, 256 if quick else 1024)
        out["dd_mb_per_s"] = round(dd, 1)
        for flush in ("async", "sync"):
            for size in (64, 1024):
                progress(f"append {size} B flush={flush} (requests of 64)")
                out[f"append_{size}b_{flush}"] = bench_append(root, flush, size, n, 64)
        progress("append 64 B flush=sync, one message per request")
        single = bench_append(root, "sync", 64, n // 4, 1)
        out["append_64b_sync_single"] = single
        out["append_64b_sync_msgs_per_s"] = single["msgs_per_s"]
        out["append_1k_async_vs_dd"] = round(out["append_1024b_async"]["mb_per_s"] / dd, 3)
        progress("dispatch")
        out["dispatch_entries_per_s"] = round(bench_dispatch(root, n))
        nq = 100_000 if quick else 1_000_000
        progress("rate at 1k queues")
        r1k, r1k_cold = bench_queues(root, 1_000, 200_000)
        progress(f"rate at {nq:,} queues")
        rbig, rbig_cold = bench_queues(root, nq, 200_000)
        out["queues_big"] = nq
        out["queues_1k_msgs_per_s"] = round(r1k)
        out["queues_big_msgs_per_s"] = round(rbig)
        out["queues_1m_vs_1k_rate_ratio"] = round(rbig / r1k, 3)
        # Right after a restart every queue's first append costs one RocksDB seek.
        out["queues_1m_vs_1k_cold_rate_ratio"] = round(rbig_cold / r1k_cold, 3)
        progress("recovery")
        out["recovery_s_per_gb"] = round(bench_recovery(root, 256 if quick else 1024), 2)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "store_latest.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
