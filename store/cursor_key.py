"""The key history cursors are signed with (store.history): a cursor is handed to
clients and comes back, and only one this store (or its group) gave out may be read on.

A lone node keeps a random key in its data directory, so its cursors survive a
restart. The nodes of a store group derive one key from the group secret, so a cursor
given out by one master is good on the next after a failover.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

KEY_FILE = "history-cursor.key"
KEY_BYTES = 32


def node_key(data_dir: Path) -> bytes:
    """The node's own key: read from the data directory, made there on first use (and
    again if the file was damaged: cursors given out before are then refused)."""
    path = Path(data_dir) / KEY_FILE
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        key = b""
    if len(key) == KEY_BYTES:
        return key
    key = os.urandom(KEY_BYTES)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return key


def group_key(secret: bytes) -> bytes:
    """The key every node of a group derives from the group secret."""
    return hmac.new(secret, b"lightgate history cursor key", hashlib.sha256).digest()
