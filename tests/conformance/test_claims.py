"""The reasons statements.py gives for "not applicable" that are claims about this
Server's behaviour, checked. A statement marked n/a is not tested; if its reason stops
holding (the Server starts sending a Reason String on SUBACK, say), the test here fails
and the statement needs its test back."""

from __future__ import annotations

from gateway import mqtt
from tests.conformance.conftest import PASSWORD
from tests.conformance.reader import (
    Auth,
    Connack,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
)
from tests.conformance.test_ch4_enhanced_auth import _reauthenticate, scram_connect
from tests.conformance.wire import Peer, sweep, uid
from tests.conftest import Server


def test_no_user_properties_from_the_server(port: int, auth_broker: Server) -> None:
    """NO_USER_PROPS: no packet the Server makes carries User Properties (a PUBLISH
    carries those of its publisher only)."""
    got = [p for p in sweep(port) if not isinstance(p, Publish)]
    c, auth = scram_connect(auth_broker.port)
    got += auth + _reauthenticate(c, PASSWORD)
    kinds = {type(p).__name__ for p in got}
    assert kinds >= {"Connack", "Puback", "Pubrec", "Pubrel", "Pubcomp", "Suback", "Unsuback",
                     "Disconnect", "Auth"}, kinds
    assert [p for p in got if "user_property" in getattr(p, "properties", {})] == []


def test_no_reason_string_on_suback_unsuback_pubrel_pubcomp_auth(
        port: int, auth_broker: Server) -> None:
    """SUBACK, UNSUBACK, PUBREL, PUBCOMP and AUTH never carry a Reason String, failures
    (SUBACK 0x8F, UNSUBACK 0x11, PUBREL and PUBCOMP 0x92) included; PUBACK, PUBREC,
    CONNACK and DISCONNECT refusals do (their size limits are tested)."""
    got = sweep(port)
    c, auth = scram_connect(auth_broker.port)
    got += auth + _reauthenticate(c, PASSWORD)
    silent = [p for p in got if type(p).__name__ in
              ("Suback", "Unsuback", "Pubrel", "Pubcomp", "Auth")]
    assert {p.reason_code for p in silent if isinstance(p, (Pubrel, Pubcomp))} == {0, 0x92}
    assert [p for p in silent if "reason_string" in p.properties] == []
    refusals = [p for p in got if isinstance(p, (Puback, Pubrec, Connack))
                and p.reason_code >= 0x80]
    assert [(type(p).__name__, "reason_string" in p.properties) for p in refusals] == \
        [("Puback", True), ("Pubrec", True), ("Connack", True)]
    assert [type(p) for p in got if isinstance(p, Auth)] == [Auth] * 3


def test_capabilities_in_connack(port: int) -> None:
    """QoS 2 and retained messages supported (no Maximum QoS, Retain Available absent or
    1), a Topic Alias Maximum always announced."""
    props = Peer(port).connect(uid()).properties
    assert "maximum_qos" not in props and props.get("retain_available", 1) == 1
    assert props["topic_alias_maximum"] > 0


def test_no_response_information(port: int) -> None:
    """Response Information is never returned, even when asked for (Request Response
    Information 1)."""
    for asked in (0, 1):
        ack = Peer(port).connect(uid(), request_response_information=asked)
        assert "response_information" not in ack.properties


def test_no_enhanced_authentication_without_auth(port: int) -> None:
    """Without --auth no Authentication Method is offered: any is refused (0x8C)."""
    c = Peer(port)
    c.send(mqtt.Connect(uid(), 5, properties={"authentication_method": "SCRAM-SHA-256"}))
    c.refused_with(0x8C)

