"""A byte-level MQTT client built on our codec, for protocol edge cases that a library
client hides (unacked messages, duplicate packet ids, malformed bytes)."""

from __future__ import annotations

import socket

from gateway import mqtt


class RawClient:
    def __init__(self, port: int, version: int = 4, timeout: float = 5.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.version = version
        self.decoder = mqtt.Decoder(server=False, version=version)
        self.pending: list = []

    def connect(self, client_id: str, clean: bool = True, keepalive: int = 60, **kw) -> object:
        self.send(mqtt.Connect(client_id=client_id, protocol_level=self.version,
                               clean_start=clean, keepalive=keepalive, **kw))
        ack = self.recv()
        assert isinstance(ack, mqtt.Connack), ack
        return ack

    def send(self, packet: object) -> None:
        self.sock.sendall(mqtt.encode(packet, self.version))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> object:
        while not self.pending:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed by the server")
            self.pending.extend(self.decoder.feed(data))
        return self.pending.pop(0)

    def closed_by_server(self) -> bool:
        """True if the server closes the connection (EOF or reset) within the timeout."""
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def subscribe(self, topic_filter: str, qos: int, packet_id: int = 1) -> object:
        """SUBSCRIBE and wait for its SUBACK; packets that come first (a resumed session
        resending its in-flight messages) are put back to be received after it."""
        self.send(mqtt.Subscribe(packet_id, [(topic_filter, mqtt.SubscriptionOptions(qos))]))
        earlier = []
        while True:
            ack = self.recv()
            if isinstance(ack, mqtt.Suback):
                self.pending[:0] = earlier
                return ack
            earlier.append(ack)

    def close(self) -> None:
        self.sock.close()
