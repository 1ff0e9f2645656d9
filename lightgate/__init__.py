"""Lightgate: the command line, and the client SDK for server applications."""

from store.sdk import (
    AsyncConsumer,
    AsyncProducer,
    Consumer,
    DeliveryTimeout,
    Producer,
    ReceivedMessage,
    SendResult,
)

__all__ = [
    "AsyncConsumer",
    "AsyncProducer",
    "Consumer",
    "DeliveryTimeout",
    "Producer",
    "ReceivedMessage",
    "SendResult",
]
