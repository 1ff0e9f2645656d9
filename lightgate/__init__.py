"""Lightgate: the command line, and the client SDK for server applications."""

from store.sdk import (
    AsyncConsumer,
    AsyncProducer,
    Consumer,
    Producer,
    ReceivedMessage,
    SendResult,
)

__all__ = [
    "AsyncConsumer",
    "AsyncProducer",
    "Consumer",
    "Producer",
    "ReceivedMessage",
    "SendResult",
]
