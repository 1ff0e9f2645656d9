"""One writer task per connection, shared by the native server and client."""

from __future__ import annotations

from typing import Any

import trio


async def batched_writer(stream: trio.abc.SendStream, recv: Any,
                         scope: trio.CancelScope) -> None:
    """Send everything queued in `recv`, joined into one write per wake-up; a broken
    connection cancels `scope` (the reader then sees it and cleans up)."""
    try:
        async for data in recv:
            chunks = [data]
            while True:
                try:
                    chunks.append(recv.receive_nowait())
                except trio.WouldBlock:
                    break
            await stream.send_all(b"".join(chunks))
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        scope.cancel()
