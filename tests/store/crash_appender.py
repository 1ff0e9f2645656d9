"""Child process for the kill -9 test: appends with flush=sync from several threads and
reports each acknowledged append on stdout, so the parent knows what was promised."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from lightqueue.index import ConsumeQueueIndex
from store.commitlog import CommitLog
from store.record import Message


def main() -> None:
    root, run = Path(sys.argv[1]), sys.argv[2]
    log = CommitLog(
        root / "commitlog", ConsumeQueueIndex(root / "index"), segment_size=256 * 1024, flush="sync"
    )
    log.open()
    out_lock = threading.Lock()

    def worker(n: int) -> None:
        for i in range(1_000_000):
            body = f"{run}-{n}-{i}".encode()
            msg = log.append([Message(f"crash/{n}", body, qos=1)], [[f"crash/{n}", "crash/+"]])
            done = msg.result()[0]
            with out_lock:
                sys.stdout.write(f"{body.decode()} {done.offset_in('crash/+')}\n")
                sys.stdout.flush()

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(4)]
    print("started", flush=True)
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
