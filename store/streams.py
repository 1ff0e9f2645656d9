"""One writer task per connection, shared by the native server and client."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import trio

JOIN_MAX = 1 << 20  # small frames are joined into one write up to this; larger go alone


async def batched_writer(stream: trio.abc.SendStream, recv: Any, scope: trio.CancelScope,
                         written: Callable[[int], None] | None = None) -> None:
    """Send everything queued in `recv`, small frames joined into one write per wake-up;
    `written(n)` after each write. A broken connection cancels `scope` (the reader then
    sees it and cleans up)."""
    try:
        async for data in recv:
            frames = deque([data])
            del data  # each frame is let go once written (see below)
            while True:
                try:
                    frames.append(recv.receive_nowait())
                except trio.WouldBlock:
                    break
            while frames:
                chunk = _next_write(frames)
                await stream.send_all(chunk)
                if written is not None:
                    written(len(chunk))
                del chunk  # written: not held while the next one waits for the socket
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        scope.cancel()


def _next_write(frames: deque[bytes]) -> bytes:
    """Take the next write off `frames`: a run of small frames joined, or a large one
    alone (joining it would copy it, and an answer may be many MiB)."""
    first = frames.popleft()
    if len(first) >= JOIN_MAX or not frames:
        return first
    run, size = [first], len(first)
    while frames and size + len(frames[0]) <= JOIN_MAX:
        frame = frames.popleft()
        run.append(frame)
        size += len(frame)
    return run[0] if len(run) == 1 else b"".join(run)
