"""Topic-name events, merged per short window, broadcast to every gateway."""

from notify.local import RESYNC, LocalBus, open_bus

__all__ = ["RESYNC", "LocalBus", "open_bus"]
