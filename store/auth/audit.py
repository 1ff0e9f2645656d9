"""Audit lines for every authentication and authorisation decision, on their own logger
(`lightgate.audit`) so operators can route them to a separate file (--audit-log)."""

from __future__ import annotations

import logging

audit = logging.getLogger("lightgate.audit")


def authentication(user: str, ip: str, via: str, ok: bool, reason: str = "") -> None:
    if audit.isEnabledFor(logging.INFO):
        audit.info("[AUTHENTICATION] user=%s ip=%s via=%s result=%s%s", user or "-", ip, via,
                   "success" if ok else "failure", f" reason={reason}" if reason else "")


def authorization(user: str, ip: str, action: str, resource: str, ok: bool,
                  reason: str) -> None:
    if audit.isEnabledFor(logging.INFO):
        audit.info("[AUTHORIZATION] user=%s ip=%s action=%s resource=%s result=%s reason=%s",
                   user or "-", ip, action, resource, "allow" if ok else "deny", reason)


def to_file(path: str) -> None:
    """Send audit lines to `path` only (not to the main log)."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    audit.addHandler(handler)
    audit.setLevel(logging.INFO)
    audit.propagate = False
