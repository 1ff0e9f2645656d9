"""What a connection lets go of while the native plane carries it (gateway.handover):
idle devices are most of a gateway's connections, and the native plane carries most of
those, so what only reading, writing and delivering here use is dropped at promotion
and made again at demotion."""

from __future__ import annotations

from typing import Any

import trio

from gateway.delivery import Delivery
from gateway.mqtt.protocol import MqttProtocol
from gateway.output import Output


class Parking:
    """The parking of gateway.connection.Connection (a mixin: what it uses of the
    connection is declared here)."""

    __slots__ = ()  # the connection's own slots hold the state

    fd: int
    out: Output
    delivery: Delivery | None
    core: MqttProtocol
    stream: trio.abc.Stream | None
    broker: Any

    def park(self) -> None:
        """The engine has the socket and delivers: the output, the delivery, the decoder
        and the outbox are let go until `unpark`."""
        self.fd = -1  # the engine's now: nothing here writes or closes it
        self.out = None  # type: ignore[assignment]
        self.delivery = None
        self.core.park()

    def unpark(self, fd: int) -> None:
        """The socket is Python's again (before the core's `handed_back`). Its output
        starts empty (the engine hands back what the socket had not taken), and so does
        its delivery (the positions come back with the socket)."""
        self.fd = fd
        self.out = Output(self, fd, self.stream, self.broker.write_rules,  # type: ignore[arg-type]
                          self.broker.stats)
        self.delivery = Delivery(self)  # type: ignore[arg-type]
