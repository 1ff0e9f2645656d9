"""Whether a connection is read: not while its lane works (the packets read meanwhile
wait behind it), nor while more than the high-water mark waits for its socket
(gateway.backpressure). The reactor (plain TCP) or the stream task (TLS, WebSocket,
gateway.stream_reader) follows the switch."""

from __future__ import annotations

import trio

from gateway.output import Poller


class ReadAgain(Exception):  # noqa: N818 - not an error: a signal to the reader
    """A stream gave up a read so that its reader looks again whether to read, and
    until when (gateway.native_link: a connection the native plane took over, or held
    still to be taken)."""


class ReadSwitch:
    """The read switch of gateway.connection.Connection (a mixin: what it uses of the
    connection is declared here)."""

    __slots__ = ()  # the connection's own slots hold the state

    reactor: Poller | None
    _closed: bool
    _paused: bool  # the lane works
    _full: bool  # too much waits for the socket
    _quiescing: bool  # held still to be handed to the native plane (gateway.handover)
    _unpaused: trio.Event | None  # a stream reader waits on it
    native: int | None  # promoted: its id in the engine (gateway.handover)

    def _pause(self) -> None:
        """Read no more while the lane works (the socket's buffer holds the rest)."""
        self._paused = True
        self._reading_changed()

    def _resume(self) -> None:
        self._paused = False
        self._reading_changed()

    def hold_reading(self, full: bool) -> None:
        """Too much waits for the client's socket, or no longer (gateway.output): a
        client that does not read its answers is not read either."""
        self._full = full
        if not self._closed:
            self._reading_changed()

    def quiesce(self, on: bool) -> None:
        """Read no more for a moment, so that what is under way settles and the
        connection can be handed over (the socket's buffer holds the rest, which the
        native side reads); or read again."""
        if self._quiescing != on:
            self._quiescing = on
            if not self._closed:
                self._reading_changed()

    def _reading_changed(self) -> None:
        reading = self.reading
        if self.reactor is not None:
            if reading:
                self.reactor.resume(self)
            else:
                self.reactor.pause(self)
        if reading and self._unpaused is not None:
            self._unpaused.set()
            self._unpaused = None

    @property
    def reading(self) -> bool:
        # (Not while the native plane carries it: its engine reads the socket.)
        return not self._paused and not self._full and not self._quiescing \
            and self.native is None
