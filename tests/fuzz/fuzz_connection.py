"""Coverage-guided fuzzing (atheris/libFuzzer) of the MQTT connection state machine.

    python tests/fuzz/fuzz_connection.py -runs=1000000 [-max_len=2048] [corpus_dir]

Each input is what one client sends on one connection: it is fed, in chunks split where
the input says, to a real `gateway.connection.Connection` over an in-memory stream, in
front of a real Broker on a real EmbeddedStore (CommitLog, RocksDB) in a temporary
directory. Then the client's side closes. Any of these is a bug:
- the connection ends with an exception (it must turn anything a client sends into a
  reason code or a close);
- it is still running 10 s after the client closed (a hang);
- a byte it sent back is not a valid server-to-client MQTT packet of its version;
- the broker still counts the connection, or keeps a clean session after it.

The broker, with its delayed wills and expiry timers, is replaced every GENERATION
inputs and their sessions removed, so that a million inputs run in bounded memory.
Inputs start from the seeds below (a CONNECT of each version, then a subscribe and
publishes of every QoS) so the fuzzer reaches the states past CONNECT at once."""

from __future__ import annotations

import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Any

import atheris
import trio
import trio.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

with atheris.instrument_imports():
    from gateway import mqtt
    from gateway.broker import Broker, GatewayConfig
    from gateway.connection import Connection
    from gateway.mqtt import ProtocolError

from store.service import EmbeddedStore, StoreConfig  # noqa: E402 - not instrumented

GENERATION = 2000  # inputs per broker
HANG_S = 10.0


class Host:
    """A trio loop in a thread holding the store and the current broker; the fuzzer's
    thread hands it one input at a time."""

    def __init__(self) -> None:
        self.token: trio.lowlevel.TrioToken | None = None
        self.broker: Broker | None = None
        self.ready = threading.Event()
        self.failure: BaseException | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="lg-fuzz-conn-")
        self._next_generation: trio.Event | None = None
        self._done = 0

    def start(self) -> None:
        threading.Thread(target=self._run, name="fuzz-host", daemon=True).start()
        self.ready.wait(60)
        if self.failure is not None:
            raise self.failure
        assert self.token is not None, "the fuzz host did not start"

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported by start() or the next input
            self.failure = exc
            self.ready.set()

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        cfg = StoreConfig(data_dir=Path(self._dir.name), segment_size=8 << 20,
                          retention_bytes=32 << 20, retention_check_s=5.0)

        def notify(names: set[str]) -> None:
            broker = self.broker
            if broker is not None:
                self.token.run_sync_soon(broker.on_queues_changed, names)

        async with EmbeddedStore.open(cfg, notify=notify) as store:
            while True:  # one broker per generation
                self._next_generation = trio.Event()
                broker = Broker(store, GatewayConfig())
                async with trio.open_nursery() as nursery:
                    await nursery.start(broker.run_housekeeping)
                    self.broker = broker
                    self.ready.set()
                    await self._next_generation.wait()
                    # No input may pick this broker up while the next one is made: its
                    # nursery is closing (a session detached then could not spawn).
                    self.broker = None
                    nursery.cancel_scope.cancel()  # delayed wills, expiry timers
                for client_id in list(broker.sessions):
                    await broker.discard_session(client_id)
                for client_id, _ in await store.meta_items("sessions", ""):
                    await broker.discard_session(client_id)

    def feed(self, data: bytes, step: int) -> None:
        if self.failure is not None:
            raise self.failure
        trio.from_thread.run(self._one, data, step, trio_token=self.token)
        self._done += 1
        if self._done % GENERATION == 0:
            trio.from_thread.run_sync(self._next_generation.set, trio_token=self.token)

    async def _one(self, data: bytes, step: int) -> None:
        while self.broker is None or self._next_generation.is_set():
            await trio.sleep(0)  # the next broker is being made
        broker = self.broker
        before = broker.stats.connections
        client, server = trio.testing.memory_stream_pair()
        conn = Connection(broker, server, "fuzz:1")
        crashed: list[BaseException] = []
        finished = trio.Event()
        received = bytearray()

        async def run() -> None:
            try:
                await conn.run()
            except Exception as exc:  # the bug this fuzzer looks for
                crashed.append(exc)
            finally:
                finished.set()

        async def read() -> None:
            while chunk := await client.receive_some():
                received.extend(chunk)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            nursery.start_soon(read)
            try:
                for i in range(0, len(data), step):
                    await client.send_all(data[i : i + step])
                    await trio.sleep(0)  # let the connection act between chunks
            except trio.BrokenResourceError:
                pass  # the server closed first: fine
            await client.send_stream.aclose()  # EOF for the server
            with trio.move_on_after(HANG_S) as waited:
                await finished.wait()
            if waited.cancelled_caught:
                print(task_stacks(), file=sys.stderr)
            await trio.sleep(0)  # let the reader take the last bytes
            nursery.cancel_scope.cancel()
        if crashed:  # the whole group: libFuzzer's report shows only its top
            traceback.print_exception(crashed[0], file=sys.stderr)
            raise crashed[0]
        if waited.cancelled_caught:
            raise AssertionError(f"the connection hung after EOF on {data!r}")
        check_output(bytes(received), conn, data)
        assert broker.stats.connections == before, "a closed connection is still counted"
        s = conn.session
        if s is not None and not s.persistent:
            assert broker.sessions.get(s.client_id) is not s, "a clean session outlived it"


def task_stacks() -> str:
    """Where every task of this trio run is waiting (for a hang's report)."""
    lines: list[str] = []

    def walk(task: trio.lowlevel.Task, depth: int) -> None:
        lines.append("  " * depth + f"task {task.name}")
        coro: Any = task.coro
        while coro is not None and getattr(coro, "cr_frame", None) is not None:
            frame = coro.cr_frame
            lines.append("  " * depth + f"  {frame.f_code.co_filename}:{frame.f_lineno} "
                         f"{frame.f_code.co_name}")
            coro = coro.cr_await
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                walk(child, depth + 1)

    walk(trio.lowlevel.current_root_task(), 0)
    return "\n".join(lines)


def check_output(out: bytes, conn: Connection, sent: bytes) -> None:
    """Everything the server sent decodes as server-to-client packets of the connection's
    version; a client whose CONNECT was not accepted gets at most one CONNACK, a refusal
    (in the version its CONNECT asked for, which the server may not have parsed)."""
    if not out:
        return
    if conn.session is not None:
        packets = decode(out, conn.version, sent)
    else:
        for version in (5, 4, 3):
            try:
                packets = decode(out, version, sent)
                break
            except AssertionError:
                continue
        else:
            raise AssertionError(f"a refused client got bytes that do not decode: {out!r}")
        assert len(packets) == 1 and isinstance(packets[0], mqtt.Connack), packets
        assert packets[0].reason_code != 0, "CONNACK success without a session"


def decode(out: bytes, version: int, sent: bytes) -> list[Any]:
    dec = mqtt.Decoder(server=False, version=version, max_packet_size=1 << 28)
    try:
        packets = dec.feed(out)
    except ProtocolError as exc:
        raise AssertionError(f"the server sent bytes that do not decode as {version} "
                             f"({exc}): {out[:200]!r} after {sent[:200]!r}") from exc
    assert not dec._buf, f"the server sent a truncated packet: {out[-100:]!r}"
    return packets


HOST = Host()


def one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    HOST.feed(data[1:], max(1, data[0]))


def seeds() -> list[bytes]:
    """A CONNECT of each version, then subscribe, publishes of each QoS, acks, ping."""
    out = []
    for v in (3, 4, 5):
        pkts: list[Any] = [
            mqtt.Connect(client_id=f"seed{v}", protocol_level=v, clean_start=v != 4),
            mqtt.Subscribe(1, [("fz/#", mqtt.SubscriptionOptions(2))]),
            mqtt.Publish("fz/a", b"0", qos=0),
            mqtt.Publish("fz/b", b"1", qos=1, packet_id=2),
            mqtt.Publish("fz/c", b"2", qos=2, packet_id=3, retain=True),
            mqtt.Pubrel(3), mqtt.Puback(1), mqtt.Pubrec(2), mqtt.Pubcomp(2),
            mqtt.Unsubscribe(4, ["fz/#"]), mqtt.Pingreq(), mqtt.Disconnect(),
        ]
        out.append(b"\xff" + b"".join(mqtt.encode(p, v) for p in pkts))
    # The shapes of issue 23's gateway defects: mosquitto_pub -r (PUBLISH then DISCONNECT
    # in one write), QoS 2 exchanges around a burst (Receive Maximum), a v5 subscriber with
    # topic aliases and a small maximum packet size receiving expiring QoS 1 messages, a
    # client publishing to $SYS.
    v5 = [
        mqtt.Connect(client_id="seed-alias", protocol_level=5, clean_start=False,
                     properties={"topic_alias_maximum": 4, "maximum_packet_size": 128,
                                 "receive_maximum": 2, "session_expiry_interval": 60}),
        mqtt.Subscribe(1, [("fz/#", mqtt.SubscriptionOptions(1))]),
        *(mqtt.Publish("fz/e", b"e" * (i * 40), qos=1, packet_id=10 + i,
                       properties={"message_expiry_interval": 30}) for i in range(4)),
        mqtt.Publish("fz/q2", b"q", qos=2, packet_id=20), mqtt.Pubrel(20),
        mqtt.Publish("fz/q2", b"q", qos=2, packet_id=20, dup=True),
        mqtt.Publish("$SYS/broker/uptime", b"x", qos=1, packet_id=21, retain=True),
        mqtt.Disconnect(),
    ]
    out.append(b"\xff" + b"".join(mqtt.encode(p, 5) for p in v5))
    retained = [mqtt.Connect(client_id="seed-r", protocol_level=4),
                mqtt.Publish("fz/r", b"r", qos=0, retain=True), mqtt.Disconnect()]
    out.append(b"\xff" + b"".join(mqtt.encode(p, 4) for p in retained))
    return out


def main() -> None:
    corpus = [a for a in sys.argv[1:] if not a.startswith("-")]
    if corpus and not Path(corpus[0]).is_file():  # a corpus directory: seeds go in first
        Path(corpus[0]).mkdir(parents=True, exist_ok=True)
        for i, seed in enumerate(seeds()):
            (Path(corpus[0]) / f"seed-{i}").write_bytes(seed)
    atheris.Setup(sys.argv, one_input)
    HOST.start()
    atheris.Fuzz()


if __name__ == "__main__":
    main()
