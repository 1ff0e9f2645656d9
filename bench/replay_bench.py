"""Replay benchmark: the store's history reader and its seek by time, alone (in-process,
no network), on a store holding 1M MQTT messages over 10,000 topics.

Prints one JSON object on stdout (progress on stderr) and writes it to
bench/results/replay_latest.json.

    python bench/replay_bench.py              # 1M messages over 10k topics, + 1M on one topic
    python bench/replay_bench.py --quick      # 100k over 1k topics (seconds)
    python bench/replay_bench.py --data DIR   # keep the store in DIR; a second run reuses it
    python bench/replay_bench.py --mqtt       # the same through MQTT: bench/replay_mqtt.py

Figures (goals in brackets):
- reader_msgs_per_s: every message of `fleet/+/temp` (all 1M, 10k topics) from
  earliest, in batches of 4,096 [>= 200,000];
- log_reader_msgs_per_s: `+/+/temp`, whose first level is a wildcard (the reader walks
  the log, half of whose records match);
- seek_ms: median and p99 of a seek by time in a queue of 1M entries [median <= 1 ms];
- startup_ms: from the call to the first batch of `fleet/+/temp` from a time in the
  middle, spanning 10,000 topic queues [<= 50 ms]; also for `+/+/temp` (a seek by time
  over the log) and for `last` (which reads each of the 10,000 topics' newest entry).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results_dir import RESULTS  # noqa: E402
from lightqueue.since import TIME, Since  # noqa: E402
from store.record import Message  # noqa: E402
from store.service import EmbeddedStore, StoreConfig  # noqa: E402

BATCH = 100  # messages per append (a gateway's read of many publishes)
SEEK_QUEUE = "seek/one"


def progress(text: str) -> None:
    print(f"[replay_bench] {text}", file=sys.stderr, flush=True)


def config(root: Path) -> StoreConfig:
    return StoreConfig(data_dir=root, segment_size=256 << 20, retention_hours=None,
                       wildcard_idle_s=0)


async def build(store: EmbeddedStore, messages: int, topics: int) -> None:
    """`messages` over `topics` topics (round robin, 100-message appends) and as many on
    one topic (its queue is the seek's), interleaved."""
    t0 = time.perf_counter()
    for i in range(0, messages, BATCH):
        fleet = [Message(f"fleet/d{(i + k) % topics}/temp", b'{"t":%d.5,"n":%d}' % (
            (i + k) % 40, i + k), qos=1, client_id=f"d{(i + k) % topics}")
            for k in range(BATCH)]
        one = [Message(SEEK_QUEUE, b"%d" % (i + k), qos=1) for k in range(BATCH)]
        await store.publish(fleet)
        await store.publish(one)
        if i % 100_000 == 0:
            progress(f"stored {2 * i:,} messages")
    await trio.to_thread.run_sync(store.index.flush)
    progress(f"stored {2 * messages:,} messages in {time.perf_counter() - t0:.1f} s")


async def read_all(store: EmbeddedStore, topic_filter: str) -> tuple[int, float]:
    """Every message of the filter from earliest: (count, seconds)."""
    t0 = time.perf_counter()
    batch = await store.history(topic_filter, "earliest", max_count=4096)
    n = len(batch.messages)
    while not batch.done:
        batch = await store.history(topic_filter, cursor=batch.cursor, max_count=4096)
        n += len(batch.messages)
    return n, time.perf_counter() - t0


def seek_ms(store: EmbeddedStore, probes: int) -> dict[str, float]:
    """Seeks by time in the 1M-entry queue, in this thread (what a request's worker
    thread spends), at random store times within the queue's span."""
    reader, index = store.history_reader, store.index
    first = index.read_tuples(SEEK_QUEUE, 0, 1)[0][2]
    last = index.entry_before(SEEK_QUEUE, index.max_offset(SEEK_QUEUE))[2]
    rng = random.Random(1)
    took = []
    for _ in range(probes):
        ms = rng.randrange(first, last + 1)
        t0 = time.perf_counter()
        reader.seek(SEEK_QUEUE, ms)
        took.append((time.perf_counter() - t0) * 1000)
    took.sort()
    return {"entries": index.max_offset(SEEK_QUEUE), "median": statistics.median(took),
            "p99": took[int(len(took) * 0.99)], "max": took[-1]}


async def startup_ms(store: EmbeddedStore, topic_filter: str, since: str | Since,
                     rounds: int = 20) -> float:
    """Median ms from the call to the first batch (of one message)."""
    took = []
    for _ in range(rounds):
        store.history_reader._last.clear()  # `last` keeps its listing for the next batch
        t0 = time.perf_counter()
        await store.history(topic_filter, since, max_count=1)
        took.append((time.perf_counter() - t0) * 1000)
    return statistics.median(took)


async def main(args: argparse.Namespace) -> dict:
    root = Path(args.data) if args.data else Path(tempfile.mkdtemp(prefix="replay-bench-"))
    try:
        async with EmbeddedStore.open(config(root)) as store:
            if store.index.max_offset(SEEK_QUEUE) < args.messages:
                await build(store, args.messages, args.topics)
            out: dict = {"messages": args.messages, "topics": args.topics}
            n, secs = await read_all(store, "fleet/+/temp")
            assert n == args.messages, n
            out["reader_msgs_per_s"] = round(n / secs)
            progress(f"fleet/+/temp: {n:,} messages in {secs:.2f} s")
            n, secs = await read_all(store, "+/+/temp")
            assert n == args.messages, n
            out["log_reader_msgs_per_s"] = round(n / secs)
            progress(f"+/+/temp: {n:,} messages in {secs:.2f} s")
            out["seek_ms"] = seek_ms(store, args.probes)
            index = store.index
            first = index.read_tuples("fleet#0", 0, 1)[0][2]
            last = index.entry_before("fleet#0", index.max_offset("fleet#0"))[2]
            middle = Since(TIME, (first + last) // 2)
            out["startup_ms"] = {
                "fleet/+/temp": round(await startup_ms(store, "fleet/+/temp", middle), 2),
                "+/+/temp": round(await startup_ms(store, "+/+/temp", middle), 2),
                "fleet/+/temp last": round(await startup_ms(store, "fleet/+/temp", "last", 3),
                                           2),
            }
            out["seek_ms"] = {k: round(v, 4) if isinstance(v, float) else v
                              for k, v in out["seek_ms"].items()}
            return out
    finally:
        if not args.data:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="100k messages over 1k topics")
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--topics", type=int, default=10_000)
    parser.add_argument("--probes", type=int, default=2000, help="seeks to time")
    parser.add_argument("--data", help="keep the store here (reused by the next run)")
    parser.add_argument("--mqtt", action="store_true",
                        help="replay through a gateway to MQTT clients (bench/replay_mqtt.py)")
    args = parser.parse_args()
    if args.quick:
        args.messages, args.topics = 100_000, 1_000
    if args.mqtt:
        from bench import replay_mqtt
        result, name = replay_mqtt.run(args.messages, args.topics), "replay_mqtt_latest.json"
    else:
        result, name = trio.run(main, args), "replay_latest.json"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
