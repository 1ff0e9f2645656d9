"""Whether a gateway (`lightgate gateway`) can serve: its store group's master within
reach.

A gateway cut off from the master while the group has one (the link between this
gateway and that node down; the other nodes answer and name the master, other gateways
still reach it) can store nothing: every publish and every CONNECT would be refused for
as long as the cut lasts. Once it has lasted --master-unreachable-s (longer than a
failover, when the nodes name a master that is gone until they elect another), the
gateway says so once in its log, answers 503 on /readyz so a load balancer sends new
clients elsewhere, and sends its MQTT clients away: an MQTT 5 client gets DISCONNECT
0x9C Use another server (and a CONNECT, CONNACK 0x9C) with the gateways of --peers as
Server Reference, a 3.1.1 client a closed connection, so that both connect again,
elsewhere. Once it reaches a master again it says so once and serves.

A group that has no master at all (the nodes this gateway reaches name none) is not this
gateway's fault: every gateway is in the same place, so it keeps its clients (a CONNECT
gets 0x88, as while a group elects); /readyz answers 503 all the same, for it cannot
serve."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.mqtt import reason as rc
from gateway.mqtt.events import Closing

log = logging.getLogger("lightgate.gateway.store")

CHECK_S = 0.25  # how often the link is looked at
SERVING, SEARCHING, NO_MASTER, CUT_OFF = "serving", "searching", "no master", "cut off"


@dataclass(frozen=True)
class Elsewhere:
    """Clients are sent away: why, and the Server Reference they are given (MQTT 5:
    "host:port" entries separated by spaces; "" when no peer is known)."""

    why: str
    server_reference: str = ""

    @property
    def properties(self) -> dict[str, Any]:
        return {"server_reference": self.server_reference} if self.server_reference else {}


class LinkJudge:
    """The link's state from what the store client saw (sans-IO): SERVING with a
    master; SEARCHING within `after_s` of losing it (a failover); then CUT_OFF when the
    nodes that answer name a master this gateway cannot reach, NO_MASTER when they name
    none (or none answers)."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self.lost_at: float | None = None
        self.state = SERVING

    def judge(self, now: float, connected: bool, master_elsewhere: str | None) -> str:
        if connected:
            self.lost_at, self.state = None, SERVING
        else:
            if self.lost_at is None:
                self.lost_at = now
            if now - self.lost_at < self.after_s:
                self.state = SEARCHING
            else:
                self.state = CUT_OFF if master_elsewhere else NO_MASTER
        return self.state

    @property
    def ready(self) -> bool:
        return self.state in (SERVING, SEARCHING)


class StoreClient(Protocol):
    """What the watch reads of store.client.NativeClient."""

    addr: str
    connected: bool
    master_elsewhere: str | None
    last_failure: str


class Clients(Protocol):
    """What the watch uses of the broker: its live sessions, and where it tells
    CONNECTs to go (gateway.connect reads it)."""

    elsewhere: Elsewhere | None

    @property
    def sessions(self) -> dict[str, Any]: ...


class StoreLink:
    """The judge, the task that applies it, and /readyz."""

    def __init__(self, client: StoreClient, peers: Iterable[str], after_s: float,
                 give_up: Callable[[], None] | None = None) -> None:
        self.client = client
        self.peers = [p for p in peers if p]
        self.judge = LinkJudge(after_s)
        self.after_s = after_s
        # The native engine's publishes held to be sent again to the master fail when
        # the clients are sent away (a carried connection closes once they are answered).
        self.give_up = give_up

    async def run(self, clients: Clients) -> None:
        client = self.client
        while True:
            before = self.judge.state
            state = self.judge.judge(trio.current_time(), client.connected,
                                     client.master_elsewhere)
            if state == CUT_OFF and before != CUT_OFF:
                self._send_away(clients)
            elif before == CUT_OFF and state != CUT_OFF:
                clients.elsewhere = None
                log.warning("no longer cut off from the store's master (%s): this gateway "
                            "takes clients again", state)
            await trio.sleep(CHECK_S)

    def _send_away(self, clients: Clients) -> None:
        master = self.client.master_elsewhere
        ref = " ".join(self.peers)
        why = f"this gateway cannot reach the store's master {master}: use another gateway"
        clients.elsewhere = Elsewhere(why, ref)
        if self.give_up is not None:
            self.give_up()
        live = [s.connection for s in list(clients.sessions.values())
                if s.connection is not None]
        log.error("cut off from the store's master %s for %.0f s while the group has it "
                  "(%s): /readyz answers 503 and %d MQTT clients are sent %s, until it is "
                  "reachable again", master, self.after_s, self.client.last_failure,
                  len(live), f"to {ref}" if ref else "away (no --peers to name)")
        for conn in live:
            conn.close(Closing(why, True, rc.USE_ANOTHER_SERVER,
                               clients.elsewhere.properties))

    # -- /readyz -----------------------------------------------------------------------
    async def readyz(self, _: Request) -> JSONResponse:
        """200 while this gateway can serve (or is looking for a master after losing
        it, for less than --master-unreachable-s); else 503 and why."""
        state = self.judge.state
        if self.judge.ready:
            return JSONResponse({"status": "ready", "store": state})
        body: dict[str, Any] = {"status": "unready", "store": state,
                                "reason": self.client.last_failure or state}
        if state == CUT_OFF:
            body["master"] = self.client.master_elsewhere
            body["peers"] = self.peers
        return JSONResponse(body, status_code=503)

    def routes(self) -> list[Route]:
        return [Route("/readyz", self.readyz)]
