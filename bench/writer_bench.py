"""The CommitLog's append path: the CPU time per message of Python appends through the
Python writer and through the native engine (`lightgate serve` with LIGHTGATE_NATIVE=1),
in this process (all its threads: the appender, the engine's dispatcher and the
flusher), flush async, appends of one message (a gateway's publish) and of 100 (the
SDK's batches), bounded in count and time. Prints one JSON object.

    python bench/writer_bench.py [--messages N] [--size BYTES]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightqueue.index import ConsumeQueueIndex  # noqa: E402
from store.commitlog import CommitLog  # noqa: E402
from store.record import Message  # noqa: E402

TIME_LIMIT_S = 60.0


def run(writer: str, batch: int, messages: int, size: int) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix="lg-writer-bench-"))
    log = CommitLog(root / "log", ConsumeQueueIndex(root / "index"))
    log.open()
    if writer == "native":
        log.start_engine(1, 1)
    body = b"x" * size
    try:
        n = 0
        cpu, wall = time.process_time(), time.monotonic()
        while n < messages and time.monotonic() - wall < TIME_LIMIT_S:
            msgs = [Message(f"dev/{(n + i) % 100}/t", body, qos=1) for i in range(batch)]
            queues = [[m.topic, "dev/+/t"] for m in msgs]
            log.append(msgs, queues).result(10)
            n += batch
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    finally:
        log.close()
        log.index.close()
        shutil.rmtree(root, ignore_errors=True)
    return {"messages": n, "cpu_us_per_msg": round(cpu / n * 1e6, 2),
            "msgs_per_s": round(n / wall)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--size", type=int, default=64)
    args = parser.parse_args()
    out = {}
    for batch in (1, 100):
        for writer in ("python", "native"):
            out[f"{writer}_batch{batch}"] = run(writer, batch, args.messages, args.size)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
