"""The reader of a connection that comes as a trio stream (TLS, WebSocket): a task of
its own reads it and hands the bytes to the connection, as the reactor does for plain
TCP sockets, within the node's read budget and the connection's deadlines."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from gateway.broker import Broker
from gateway.mqtt import reason as rc
from gateway.mqtt.protocol import Closing, MqttProtocol
from gateway.reading import ReadAgain

log = logging.getLogger("lightgate.gateway.conn")


class StreamReading:
    """The stream reader of gateway.connection.Connection (a mixin: what it uses of the
    connection is declared here)."""

    __slots__ = ()  # the connection's own slots hold the state

    broker: Broker
    core: MqttProtocol
    stream: trio.abc.Stream
    peer: str
    _closed: bool
    _unpaused: trio.Event | None
    _held: int
    native: int | None

    if TYPE_CHECKING:  # the connection's own, used here
        def close(self, closing: Closing, nursery: trio.Nursery | None = None) -> None: ...
        def _closing_for(self, exc: BaseException) -> Closing: ...
        async def detached(self) -> None: ...
        def timeout(self, now: float) -> None: ...
        def eof(self) -> None: ...
        def data_received(self, data: bytes) -> None: ...
        @property
        def reading(self) -> bool: ...

    async def run_stream(self) -> None:
        """Read the stream until the connection ends (the reactor reads plain TCP)."""
        try:
            await self._read_stream()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.close(Closing(f"connection lost: {exc!r}"))
        except Exception as exc:  # noqa: BLE001 - each becomes a Closing
            self.close(self._closing_for(exc))
        finally:
            # Cancelled: the gateway shuts down (one the native plane carries is closed
            # once it is back: gateway.handover's release_all).
            if not self._closed and self.native is None:
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    async with trio.open_nursery() as ending:
                        self.close(Closing("server shutting down", True,
                                           rc.SERVER_SHUTTING_DOWN), ending)
        await self.detached()

    async def _read_stream(self) -> None:
        budget = self.broker.read_budget
        while not self._closed:
            if not self.reading:  # the lane works, or answers wait: read when done
                if self._unpaused is None:
                    self._unpaused = trio.Event()
                await self._unpaused.wait()
                continue
            held = self._held
            if held and budget.must_wait(held) and not await budget.wait(held):
                self._over_budget(held)
                return
            with trio.move_on_at(self.core.deadline) as scope:
                try:
                    data = await self.stream.receive_some(budget.read_size(held, 65536))
                except ReadAgain:
                    continue
            if scope.cancelled_caught:
                self.timeout(trio.current_time())
                continue
            if not data:
                self.eof()
                return
            self.data_received(data)

    def _over_budget(self, held: int) -> None:
        self.broker.stats.limit_refusals += 1
        log.warning("%s closed: held %d bytes of a partial packet while the node's read "
                    "budget was exhausted (--max-partial-bytes)", self.peer, held)
        self.close(Closing("read budget exhausted", True, rc.QUOTA_EXCEEDED))



