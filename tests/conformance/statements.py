"""The normative statements of MQTT 5.0 (OASIS Standard, 7 March 2019), chapters 1 to 4
and 6, as data: identifier, text (abridged to one line), and whom it binds; and the MQTT
3.1.1 (OASIS Standard, 29 October 2014) statements where 3.1.1 differs, and those of its
chapters 1, 2 and 6.

`binds` is "server", "client" or "both". A statement addressed to the Client still counts
as server-side when the Server has an observable duty because of it (a Client that breaks
it sends a Malformed Packet or a Protocol Error, which the Server must refuse); those say
so in their text after "Server:".

A few requirements of the normative text carry no [MQTT-x.y.z-n] identifier (a Variable
Byte Integer has four bytes at most; an unknown property is a Malformed Packet; a property
twice is a Protocol Error). They are listed under their section with a letter,
`§1.5.5/a`, and their test is named `test_spec_1_5_5_a`.

A statement with neither `na` nor `untestable` must have a test named after it
(`MQTT-3.3.2-8` -> `test_mqtt_3_3_2_8`, in 3.1.1 `test_mqtt311_3_3_2_8`) in this
directory; `report.py` checks both ways.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Statement:
    id: str
    binds: str
    text: str
    na: str = ""  # why it does not apply to this server
    untestable: str = ""  # why a test from outside cannot observe it

    @property
    def chapter(self) -> str:
        return self.id.removeprefix("MQTT-").removeprefix("§").split(".", 1)[0]

    @property
    def numbered(self) -> bool:
        """False for a requirement the specification gives no identifier (`§1.5.5/a`)."""
        return self.id.startswith("MQTT-")

    @property
    def test_name(self) -> str:
        if not self.numbered:
            return "test_spec_" + re.sub(r"[^0-9a-z]+", "_", self.id[1:].lower()).strip("_")
        return "test_" + re.sub(r"[.-]", "_", self.id.lower())

    @property
    def server_side(self) -> bool:
        return self.binds != "client"


S = Statement
CLIENT = "binds the Client only; the Server has nothing observable to do"
NO_USER_PROPS = "the Server never puts User Properties on this packet (test_claims.py)"
NO_REASON = "the Server never puts a Reason String on this packet (test_claims.py)"
WS_CLIENT = ("binds the Client only: the specification asks nothing of the Server about a "
             "Client that does not offer \"mqtt\" (this one refuses the upgrade, 400: "
             "test_ch6_websocket.py::test_an_upgrade_without_mqtt_is_refused)")

STATEMENTS: tuple[Statement, ...] = (
    # 1.5 Data representation
    S("MQTT-1.5.4-1", "both", "A UTF-8 Encoded String MUST be well-formed UTF-8, with no "
      "encoding of U+D800..U+DFFF. Server: ill-formed UTF-8 makes a Malformed Packet (0x81)."),
    S("MQTT-1.5.4-2", "both", "A UTF-8 Encoded String MUST NOT include U+0000. Server: one "
      "that does makes a Malformed Packet (0x81)."),
    S("MQTT-1.5.4-3", "both", "0xEF 0xBB 0xBF is always U+FEFF and MUST NOT be skipped over "
      "or stripped off by a receiver."),
    S("MQTT-1.5.5-1", "both", "A Variable Byte Integer MUST be encoded in the fewest bytes. "
      "Server: its own are; a Client's that are not make a Malformed Packet (0x81)."),
    S("§1.5.5/a", "both", "A Variable Byte Integer has four bytes at most. Server: a longer "
      "one makes a Malformed Packet (0x81)."),
    S("MQTT-1.5.7-1", "both", "Both strings of a UTF-8 String Pair MUST follow the rules of "
      "UTF-8 Encoded Strings. Server: a pair that does not makes a Malformed Packet (0x81)."),
    # 2 MQTT Control Packet format
    S("MQTT-2.1.3-1", "both", "Reserved fixed header flags MUST have the values of Table 2-2. "
      "Server: other values make a Malformed Packet (0x81)."),
    S("MQTT-2.2.1-2", "both", "A QoS 0 PUBLISH MUST NOT contain a Packet Identifier (a "
      "Client's would be read as the start of its properties: the Server's are tested)."),
    S("MQTT-2.2.1-3", "client", "A Client's new SUBSCRIBE, UNSUBSCRIBE and QoS 1/2 PUBLISH "
      "MUST carry a non-zero Packet Identifier not in use. Server: 0 is refused."),
    S("MQTT-2.2.1-4", "server", "A Server's new QoS 1/2 PUBLISH MUST carry a non-zero Packet "
      "Identifier not in use."),
    S("MQTT-2.2.1-5", "both", "PUBACK, PUBREC, PUBREL and PUBCOMP MUST carry the Packet "
      "Identifier of their PUBLISH."),
    S("MQTT-2.2.1-6", "server", "SUBACK and UNSUBACK MUST carry the Packet Identifier of their "
      "SUBSCRIBE and UNSUBSCRIBE."),
    S("MQTT-2.2.2-1", "both", "No properties MUST be written as a Property Length of 0. "
      "Server: a PUBLISH without it reads its payload as properties (here: malformed)."),
    S("§2.2.2.2/a", "both", "A property identifier not valid for the packet type, or a value "
      "not of the property's data type, makes a Malformed Packet (0x81)."),
    S("§2.2.2.2/b", "both", "A property other than a User Property included more than once "
      "is a Protocol Error (0x82) (said of each property in chapter 3; a Server's PUBLISH "
      "may repeat the Subscription Identifier)."),
    # 3.1 CONNECT
    S("MQTT-3.1.0-1", "both", "The first packet from Client to Server MUST be CONNECT. "
      "Server: close a connection that starts otherwise."),
    S("MQTT-3.1.0-2", "server", "The Server MUST process a second CONNECT as a Protocol Error "
      "and close the Network Connection."),
    S("MQTT-3.1.2-1", "server", "The protocol name MUST be \"MQTT\"; otherwise the Server MAY "
      "send CONNACK 0x84 and MUST close the Network Connection."),
    S("MQTT-3.1.2-2", "server", "If the Protocol Version is not 5 and the Server does not "
      "accept it, it MAY send CONNACK 0x84 and then MUST close the Network Connection."),
    S("MQTT-3.1.2-3", "server", "The Server MUST validate that the reserved flag in CONNECT "
      "is 0 (a Malformed Packet otherwise)."),
    S("MQTT-3.1.2-4", "both", "With Clean Start 1 the Client and Server MUST discard any "
      "existing Session and start a new one."),
    S("MQTT-3.1.2-5", "server", "With Clean Start 0 and an existing Session, the Server MUST "
      "resume communications based on it."),
    S("MQTT-3.1.2-6", "server", "With Clean Start 0 and no Session, the Server MUST create a "
      "new Session."),
    S("MQTT-3.1.2-7", "server", "With the Will Flag 1, a Will Message MUST be stored on the "
      "Server and associated with the Session."),
    S("MQTT-3.1.2-8", "server", "The Will Message MUST be published after the connection "
      "closes (after the Will Delay or at Session end), unless deleted by DISCONNECT 0x00 or "
      "a new connection before the Will Delay."),
    S("MQTT-3.1.2-9", "client", "With the Will Flag 1, Will Properties, Will Topic and Will "
      "Payload MUST be present. Server: a CONNECT without them is malformed."),
    S("MQTT-3.1.2-10", "server", "The Will Message MUST be removed from the Session State once "
      "published or on DISCONNECT 0x00."),
    S("MQTT-3.1.2-11", "client", "With the Will Flag 0, Will QoS MUST be 0. Server: otherwise "
      "malformed."),
    S("MQTT-3.1.2-12", "client", "With the Will Flag 1, Will QoS MUST be 0, 1 or 2, not 3. "
      "Server: 3 is malformed."),
    S("MQTT-3.1.2-13", "client", "With the Will Flag 0, Will Retain MUST be 0. Server: "
      "otherwise malformed."),
    S("MQTT-3.1.2-14", "server", "With Will Retain 0 the Server MUST publish the Will Message "
      "as non-retained."),
    S("MQTT-3.1.2-15", "server", "With Will Retain 1 the Server MUST publish the Will Message "
      "as retained."),
    S("MQTT-3.1.2-16", "client", "With the User Name Flag 0, a User Name MUST NOT be present. "
      "Server: trailing bytes make it malformed."),
    S("MQTT-3.1.2-17", "client", "With the User Name Flag 1, a User Name MUST be present. "
      "Server: otherwise malformed."),
    S("MQTT-3.1.2-18", "client", "With the Password Flag 0, a Password MUST NOT be present. "
      "Server: trailing bytes make it malformed."),
    S("MQTT-3.1.2-19", "client", "With the Password Flag 1, a Password MUST be present. "
      "Server: otherwise malformed."),
    S("MQTT-3.1.2-20", "client", "With a non-zero Keep Alive and nothing else to send, the "
      "Client MUST send PINGREQ.", na=CLIENT),
    S("MQTT-3.1.2-21", "client", "The Client MUST use the Server Keep Alive from CONNACK "
      "instead of its own.", na=CLIENT),
    S("MQTT-3.1.2-22", "server", "With a non-zero Keep Alive, the Server MUST close a "
      "connection that sends nothing for 1.5 times the Keep Alive."),
    S("MQTT-3.1.2-23", "both", "The Client and Server MUST store the Session State after the "
      "connection closes if the Session Expiry Interval is greater than 0."),
    S("MQTT-3.1.2-24", "server", "The Server MUST NOT send packets exceeding the Client's "
      "Maximum Packet Size."),
    S("MQTT-3.1.2-25", "server", "A packet too large to send MUST be discarded without sending, "
      "as if its delivery had completed."),
    S("MQTT-3.1.2-26", "server", "The Server MUST NOT send a Topic Alias greater than the "
      "Client's Topic Alias Maximum."),
    S("MQTT-3.1.2-27", "server", "If the Client's Topic Alias Maximum is absent or 0, the "
      "Server MUST NOT send Topic Aliases."),
    S("MQTT-3.1.2-28", "server", "Request Response Information 0: the Server MUST NOT return "
      "Response Information.", na="the Server never returns Response Information, asked "
      "for or not (test_claims.py)"),
    S("MQTT-3.1.2-29", "server", "Request Problem Information 0: the Server MUST NOT send a "
      "Reason String or User Properties on packets other than PUBLISH, CONNACK, DISCONNECT."),
    S("MQTT-3.1.2-30", "client", "A Client that sets an Authentication Method MUST NOT send "
      "packets other than AUTH or DISCONNECT before CONNACK. Server: Protocol Error."),
    S("MQTT-3.1.3-1", "client", "CONNECT payload fields MUST appear in the order Client "
      "Identifier, Will Properties, Will Topic, Will Payload, User Name, Password.",
      na="binds the Client's encoding: fields out of order read as other fields, refused by "
         "the presence and UTF-8 checks tested under 3.1.2-9/16..19 and 3.1.3-4/11/12"),
    S("MQTT-3.1.3-2", "both", "The ClientID MUST be used by Client and Server to identify the "
      "Session State they hold."),
    S("MQTT-3.1.3-3", "client", "The ClientID MUST be present, first in the payload. Server: a "
      "CONNECT without one is malformed."),
    S("MQTT-3.1.3-4", "client", "The ClientID MUST be a UTF-8 Encoded String. Server: invalid "
      "UTF-8 is malformed."),
    S("MQTT-3.1.3-5", "server", "The Server MUST allow ClientIDs of 1 to 23 bytes of "
      "[0-9a-zA-Z]."),
    S("MQTT-3.1.3-6", "server", "If the Server allows a zero-length ClientID it MUST assign "
      "a unique ClientID."),
    S("MQTT-3.1.3-7", "server", "It MUST then process the CONNECT as if given that ClientID "
      "and return it as Assigned Client Identifier in CONNACK."),
    S("MQTT-3.1.3-8", "server", "If the Server rejects the ClientID it MAY send CONNACK 0x85 "
      "and MUST close the Network Connection.",
      na="in 5.0 the Server rejects no ClientID (an empty one is assigned one); the 3.1.1 "
         "rejection is test_mqtt311_3_1_3_8"),
    S("MQTT-3.1.3-9", "server", "If a new connection to the Session is made before the Will "
      "Delay Interval has passed, the Server MUST NOT send the Will Message."),
    S("MQTT-3.1.3-10", "server", "The Server MUST maintain the order of User Properties when "
      "publishing the Will Message."),
    S("MQTT-3.1.3-11", "client", "The Will Topic MUST be a UTF-8 Encoded String. Server: "
      "invalid UTF-8 is malformed."),
    S("MQTT-3.1.3-12", "client", "The User Name MUST be a UTF-8 Encoded String. Server: "
      "invalid UTF-8 is malformed."),
    S("MQTT-3.1.4-1", "server", "The Server MUST validate that CONNECT conforms to section 3.1 "
      "and close the Network Connection if not."),
    S("MQTT-3.1.4-2", "server", "If authentication or other checks on CONNECT fail, the Server "
      "MUST close the Network Connection."),
    S("MQTT-3.1.4-3", "server", "If the ClientID is already connected, the Server sends the "
      "existing Client DISCONNECT 0x8E and MUST close its connection."),
    S("MQTT-3.1.4-4", "server", "The Server MUST perform the processing of Clean Start."),
    S("MQTT-3.1.4-5", "server", "The Server MUST acknowledge the CONNECT with CONNACK 0x00 "
      "(Success)."),
    S("MQTT-3.1.4-6", "server", "If the Server rejects the CONNECT it MUST NOT process data "
      "sent after it except AUTH."),
    # 3.2 CONNACK
    S("MQTT-3.2.0-1", "server", "The Server MUST send CONNACK 0x00 before any packet other "
      "than AUTH."),
    S("MQTT-3.2.0-2", "server", "The Server MUST NOT send more than one CONNACK on a "
      "connection."),
    S("MQTT-3.2.2-1", "server", "CONNACK flags bits 7-1 are reserved and MUST be 0."),
    S("MQTT-3.2.2-2", "server", "Accepting Clean Start 1, the Server MUST set Session Present "
      "0 with reason 0x00."),
    S("MQTT-3.2.2-3", "server", "Accepting Clean Start 0, Session Present MUST be 1 if the "
      "Server has Session State for the ClientID, else 0."),
    S("MQTT-3.2.2-4", "client", "A Client without Session State receiving Session Present 1 "
      "MUST close the connection.", na=CLIENT),
    S("MQTT-3.2.2-5", "client", "A Client with Session State receiving Session Present 0 MUST "
      "discard it.", na=CLIENT),
    S("MQTT-3.2.2-6", "server", "A CONNACK with a non-zero Reason Code MUST have Session "
      "Present 0."),
    S("MQTT-3.2.2-7", "server", "After a CONNACK with a Reason Code of 0x80 or more the Server "
      "MUST close the Network Connection."),
    S("MQTT-3.2.2-8", "server", "The Server MUST use one of the Connect Reason Code values."),
    S("MQTT-3.2.2-9", "server", "A Server not supporting QoS 1 or 2 MUST send Maximum QoS in "
      "CONNACK.", na="the Server supports QoS 2 (there is no setting to lower it)"),
    S("MQTT-3.2.2-10", "server", "A Server not supporting QoS 1 or 2 MUST still accept "
      "SUBSCRIBE with Requested QoS 0, 1 or 2.",
      na="the Server supports QoS 2 (there is no setting to lower it)"),
    S("MQTT-3.2.2-11", "client", "A Client MUST NOT publish above the Server's Maximum QoS.",
      na="the Server announces no Maximum QoS: it supports QoS 2"),
    S("MQTT-3.2.2-12", "server", "A Will QoS above the Server's capability MUST be rejected "
      "(SHOULD 0x9B) and the connection closed.",
      na="the Server supports QoS 2, so every Will QoS"),
    S("MQTT-3.2.2-13", "server", "A Will Retain 1 on a Server without retained messages MUST "
      "be rejected (SHOULD 0x9A) and the connection closed.",
      na="the Server supports retained messages (Retain Available is always 1)"),
    S("MQTT-3.2.2-14", "client", "A Client told Retain Available 0 MUST NOT publish with "
      "RETAIN 1.", na="Retain Available is always 1"),
    S("MQTT-3.2.2-15", "client", "The Client MUST NOT send packets exceeding the Server's "
      "Maximum Packet Size. Server: such a packet is refused (0x95)."),
    S("MQTT-3.2.2-16", "server", "For a zero-length ClientID the CONNACK MUST carry an "
      "Assigned Client Identifier not used by any other Session."),
    S("MQTT-3.2.2-17", "client", "The Client MUST NOT send a Topic Alias above the Server's "
      "Topic Alias Maximum. Server: that is 0x94 (Topic Alias invalid)."),
    S("MQTT-3.2.2-18", "client", "If the Server's Topic Alias Maximum is absent or 0 the "
      "Client MUST NOT send Topic Aliases.",
      na="the Server always announces a Topic Alias Maximum (64); an alias above it is "
         "test_mqtt_3_2_2_17"),
    S("MQTT-3.2.2-19", "server", "The Server MUST NOT send a Reason String on CONNACK if it "
      "would exceed the Client's Maximum Packet Size."),
    S("MQTT-3.2.2-20", "server", "The Server MUST NOT send User Properties on CONNACK if they "
      "would exceed the Client's Maximum Packet Size.", na=NO_USER_PROPS),
    S("MQTT-3.2.2-21", "client", "The Client MUST use the Server Keep Alive instead of its "
      "own.", na=CLIENT),
    S("MQTT-3.2.2-22", "server", "Without a Server Keep Alive, the Server MUST use the Client's "
      "Keep Alive."),
    # 3.3 PUBLISH
    S("MQTT-3.3.1-1", "both", "The DUP flag MUST be 1 when a PUBLISH is re-delivered."),
    S("MQTT-3.3.1-2", "both", "The DUP flag MUST be 0 for all QoS 0 messages."),
    S("MQTT-3.3.1-3", "server", "The outgoing DUP flag MUST depend only on whether the "
      "outgoing PUBLISH is a retransmission."),
    S("MQTT-3.3.1-4", "client", "A PUBLISH MUST NOT have both QoS bits set. Server: QoS 3 is "
      "malformed."),
    S("MQTT-3.3.1-5", "server", "RETAIN 1: the Server MUST replace any retained message for "
      "the topic and store this one."),
    S("MQTT-3.3.1-6", "server", "A retained PUBLISH with an empty payload MUST remove the "
      "retained message for the topic."),
    S("MQTT-3.3.1-7", "server", "A retained message with an empty payload MUST NOT be stored."),
    S("MQTT-3.3.1-8", "server", "RETAIN 0: the Server MUST NOT store the message as retained "
      "nor remove or replace the retained one."),
    S("MQTT-3.3.1-9", "server", "Retain Handling 0: the Server MUST send matching retained "
      "messages on subscribe."),
    S("MQTT-3.3.1-10", "server", "Retain Handling 1: retained messages MUST be sent only if "
      "the subscription did not exist."),
    S("MQTT-3.3.1-11", "server", "Retain Handling 2: the Server MUST NOT send retained "
      "messages."),
    S("MQTT-3.3.1-12", "server", "Retain As Published 0: the Server MUST forward with RETAIN 0."),
    S("MQTT-3.3.1-13", "server", "Retain As Published 1: the Server MUST forward with RETAIN as "
      "published."),
    S("MQTT-3.3.2-1", "client", "The Topic Name MUST be present and a UTF-8 Encoded String. "
      "Server: invalid UTF-8 is malformed."),
    S("MQTT-3.3.2-2", "client", "The Topic Name MUST NOT contain wildcards. Server: refuse it."),
    S("MQTT-3.3.2-3", "server", "The Topic Name sent to a subscriber MUST match the "
      "subscription's Topic Filter."),
    S("MQTT-3.3.2-4", "server", "The Server MUST forward the Payload Format Indicator "
      "unaltered."),
    S("MQTT-3.3.2-5", "server", "A message whose Message Expiry has passed before onward "
      "delivery started MUST be deleted for that subscriber."),
    S("MQTT-3.3.2-6", "server", "The forwarded Message Expiry Interval MUST be the received "
      "value minus the time waited in the Server."),
    S("MQTT-3.3.2-7", "both", "A receiver MUST NOT carry Topic Alias mappings from one "
      "connection to another."),
    S("MQTT-3.3.2-8", "both", "A sender MUST NOT send a Topic Alias of 0. Server: 0x94."),
    S("MQTT-3.3.2-9", "client", "A Client MUST NOT send a Topic Alias above the Server's "
      "Topic Alias Maximum. Server: 0x94."),
    S("MQTT-3.3.2-10", "client", "A Client MUST accept every Topic Alias from 1 to its own "
      "Topic Alias Maximum.", na=CLIENT),
    S("MQTT-3.3.2-11", "server", "The Server MUST NOT send a Topic Alias above the Client's "
      "Topic Alias Maximum."),
    S("MQTT-3.3.2-12", "server", "The Server MUST accept every Topic Alias from 1 to the Topic "
      "Alias Maximum it returned."),
    S("MQTT-3.3.2-13", "client", "The Response Topic MUST be a UTF-8 Encoded String. Server: "
      "invalid UTF-8 is malformed."),
    S("MQTT-3.3.2-14", "client", "The Response Topic MUST NOT contain wildcards. Server: "
      "refuse it."),
    S("MQTT-3.3.2-15", "server", "The Server MUST forward the Response Topic unaltered."),
    S("MQTT-3.3.2-16", "server", "The Server MUST forward the Correlation Data unaltered."),
    S("MQTT-3.3.2-17", "server", "The Server MUST forward all User Properties unaltered."),
    S("MQTT-3.3.2-18", "server", "The Server MUST keep the order of User Properties when "
      "forwarding."),
    S("MQTT-3.3.2-19", "client", "The Content Type MUST be a UTF-8 Encoded String. Server: "
      "invalid UTF-8 is malformed."),
    S("MQTT-3.3.2-20", "server", "The Server MUST forward the Content Type unaltered."),
    S("MQTT-3.3.4-1", "both", "The receiver of a PUBLISH MUST respond as its QoS requires."),
    S("MQTT-3.3.4-2", "server", "For overlapping subscriptions the Server MUST deliver "
      "respecting the maximum QoS of the matching subscriptions."),
    S("MQTT-3.3.4-3", "server", "For overlapping subscriptions with Subscription Identifiers "
      "the Server MUST send those identifiers."),
    S("MQTT-3.3.4-4", "server", "Sending a single copy, the Server MUST include the "
      "Subscription Identifiers of all matching subscriptions."),
    S("MQTT-3.3.4-5", "server", "Sending several copies, the Server MUST include in each the "
      "Subscription Identifier of its matching subscription."),
    S("MQTT-3.3.4-6", "client", "A PUBLISH from Client to Server MUST NOT contain a "
      "Subscription Identifier. Server: Protocol Error."),
    S("MQTT-3.3.4-7", "client", "The Client MUST NOT have more than the Server's Receive "
      "Maximum QoS 1/2 PUBLISH unacknowledged. Server: 0x93."),
    S("MQTT-3.3.4-8", "client", "The Client MUST NOT delay packets other than PUBLISH because "
      "of Receive Maximum.", na=CLIENT),
    S("MQTT-3.3.4-9", "server", "The Server MUST NOT have more than the Client's Receive "
      "Maximum QoS 1/2 PUBLISH unacknowledged."),
    S("MQTT-3.3.4-10", "server", "The Server MUST NOT delay packets other than PUBLISH because "
      "of Receive Maximum."),
    # 3.4 - 3.7 acknowledgements
    S("MQTT-3.4.2-1", "both", "The sender of PUBACK MUST use a PUBACK Reason Code."),
    S("MQTT-3.4.2-2", "both", "A PUBACK Reason String MUST NOT be sent if it would exceed the "
      "receiver's Maximum Packet Size."),
    S("MQTT-3.4.2-3", "both", "PUBACK User Properties MUST NOT be sent if they would exceed "
      "the receiver's Maximum Packet Size.", na=NO_USER_PROPS),
    S("MQTT-3.5.2-1", "both", "The sender of PUBREC MUST use a PUBREC Reason Code."),
    S("MQTT-3.5.2-2", "both", "A PUBREC Reason String MUST NOT be sent if it would exceed the "
      "receiver's Maximum Packet Size."),
    S("MQTT-3.5.2-3", "both", "PUBREC User Properties MUST NOT be sent if they would exceed "
      "the receiver's Maximum Packet Size.", na=NO_USER_PROPS),
    S("MQTT-3.6.1-1", "server", "PUBREL fixed header flags MUST be 0010; the Server MUST treat "
      "others as malformed and close."),
    S("MQTT-3.6.2-1", "both", "The sender of PUBREL MUST use a PUBREL Reason Code."),
    S("MQTT-3.6.2-2", "both", "A PUBREL Reason String MUST NOT be sent if it would exceed the "
      "receiver's Maximum Packet Size.",
      na=NO_REASON),
    S("MQTT-3.6.2-3", "both", "PUBREL User Properties MUST NOT be sent if they would exceed "
      "the receiver's Maximum Packet Size.", na=NO_USER_PROPS),
    S("MQTT-3.7.2-1", "both", "The sender of PUBCOMP MUST use a PUBCOMP Reason Code."),
    S("MQTT-3.7.2-2", "both", "A PUBCOMP Reason String MUST NOT be sent if it would exceed the "
      "receiver's Maximum Packet Size.", na=NO_REASON),
    S("MQTT-3.7.2-3", "both", "PUBCOMP User Properties MUST NOT be sent if they would exceed "
      "the receiver's Maximum Packet Size.", na=NO_USER_PROPS),
    # 3.8 - 3.11 SUBSCRIBE .. UNSUBACK
    S("MQTT-3.8.1-1", "server", "SUBSCRIBE fixed header flags MUST be 0010; the Server MUST "
      "treat others as malformed and close."),
    S("MQTT-3.8.3-1", "client", "Topic Filters MUST be UTF-8 Encoded Strings. Server: invalid "
      "UTF-8 is malformed."),
    S("MQTT-3.8.3-2", "client", "SUBSCRIBE MUST contain at least one Topic Filter. Server: "
      "Protocol Error."),
    S("MQTT-3.8.3-3", "server", "No Local 1: messages MUST NOT be forwarded to the publishing "
      "ClientID."),
    S("MQTT-3.8.3-4", "client", "No Local 1 on a Shared Subscription is a Protocol Error."),
    S("MQTT-3.8.3-5", "server", "The Server MUST treat SUBSCRIBE as malformed if reserved "
      "bits of the Subscription Options are non-zero."),
    S("MQTT-3.8.4-1", "server", "The Server MUST answer SUBSCRIBE with SUBACK."),
    S("MQTT-3.8.4-2", "server", "SUBACK MUST have the Packet Identifier of its SUBSCRIBE."),
    S("MQTT-3.8.4-3", "server", "A SUBSCRIBE with an existing non-shared Topic Filter MUST "
      "replace that Subscription."),
    S("MQTT-3.8.4-4", "server", "On replacement with Retain Handling 0, retained messages MUST "
      "be re-sent and no messages lost."),
    S("MQTT-3.8.4-5", "server", "A SUBSCRIBE with several filters MUST be handled as a "
      "sequence of SUBSCRIBEs with one combined SUBACK."),
    S("MQTT-3.8.4-6", "server", "SUBACK MUST contain a Reason Code for each Topic Filter."),
    S("MQTT-3.8.4-7", "server", "Each Reason Code MUST show the granted QoS or a failure."),
    S("MQTT-3.8.4-8", "server", "Delivered QoS MUST be the minimum of the published QoS and "
      "the granted QoS."),
    S("MQTT-3.9.2-1", "server", "A SUBACK Reason String MUST NOT be sent if it would exceed "
      "the Client's Maximum Packet Size.", na=NO_REASON),
    S("MQTT-3.9.2-2", "server", "SUBACK User Properties MUST NOT be sent if they would exceed "
      "the Client's Maximum Packet Size.", na=NO_USER_PROPS),
    S("MQTT-3.9.3-1", "server", "SUBACK Reason Codes MUST be in the order of the Topic "
      "Filters."),
    S("MQTT-3.9.3-2", "server", "The Server MUST use Subscribe Reason Codes."),
    S("MQTT-3.10.1-1", "server", "UNSUBSCRIBE fixed header flags MUST be 0010; the Server MUST "
      "treat others as malformed and close."),
    S("MQTT-3.10.3-1", "client", "UNSUBSCRIBE Topic Filters MUST be UTF-8 Encoded Strings. "
      "Server: invalid UTF-8 is malformed."),
    S("MQTT-3.10.3-2", "client", "UNSUBSCRIBE MUST contain at least one Topic Filter. Server: "
      "Protocol Error."),
    S("MQTT-3.10.4-1", "server", "UNSUBSCRIBE filters MUST be compared character by character; "
      "an exact match MUST delete the Subscription."),
    S("MQTT-3.10.4-2", "server", "After UNSUBSCRIBE the Server MUST stop adding new matching "
      "messages for the Client."),
    S("MQTT-3.10.4-3", "server", "After UNSUBSCRIBE the Server MUST complete the delivery of "
      "QoS 1/2 messages it started."),
    S("MQTT-3.10.4-4", "server", "The Server MUST answer UNSUBSCRIBE with UNSUBACK."),
    S("MQTT-3.10.4-5", "server", "UNSUBACK MUST have the Packet Identifier of its UNSUBSCRIBE, "
      "even when nothing was deleted."),
    S("MQTT-3.10.4-6", "server", "An UNSUBSCRIBE with several filters MUST be handled as a "
      "sequence, with one UNSUBACK."),
    S("MQTT-3.11.2-1", "server", "An UNSUBACK Reason String MUST NOT be sent if it would exceed "
      "the Client's Maximum Packet Size.", na=NO_REASON),
    S("MQTT-3.11.2-2", "server", "UNSUBACK User Properties MUST NOT be sent if they would "
      "exceed the Client's Maximum Packet Size.", na=NO_USER_PROPS),
    S("MQTT-3.11.3-1", "server", "UNSUBACK Reason Codes MUST be in the order of the Topic "
      "Filters."),
    S("MQTT-3.11.3-2", "server", "The Server MUST use Unsubscribe Reason Codes."),
    # 3.12 - 3.15
    S("MQTT-3.12.4-1", "server", "The Server MUST answer PINGREQ with PINGRESP."),
    S("MQTT-3.14.0-1", "server", "The Server MUST NOT send DISCONNECT before a CONNACK with a "
      "Reason Code below 0x80."),
    S("MQTT-3.14.1-1", "both", "DISCONNECT reserved bits MUST be 0; otherwise Malformed Packet "
      "(0x81)."),
    S("MQTT-3.14.2-1", "both", "The sender of DISCONNECT MUST use a DISCONNECT Reason Code."),
    S("MQTT-3.14.2-2", "server", "The Server MUST NOT send a Session Expiry Interval on "
      "DISCONNECT."),
    S("MQTT-3.14.2-3", "both", "A DISCONNECT Reason String MUST NOT be sent if it would exceed "
      "the receiver's Maximum Packet Size."),
    S("MQTT-3.14.2-4", "both", "DISCONNECT User Properties MUST NOT be sent if they would "
      "exceed the receiver's Maximum Packet Size.", na=NO_USER_PROPS),
    S("MQTT-3.14.4-1", "both", "After sending DISCONNECT the sender MUST NOT send more packets "
      "on that connection."),
    S("MQTT-3.14.4-2", "both", "After sending DISCONNECT the sender MUST close the connection."),
    S("MQTT-3.14.4-3", "server", "On DISCONNECT 0x00 the Server MUST discard the Will Message "
      "without publishing it."),
    S("MQTT-3.15.1-1", "both", "AUTH fixed header flags MUST be 0; others are malformed and "
      "the connection closed."),
    S("MQTT-3.15.2-1", "both", "The sender of AUTH MUST use an Authenticate Reason Code."),
    S("MQTT-3.15.2-2", "both", "An AUTH Reason String MUST NOT be sent if it would exceed the "
      "receiver's Maximum Packet Size.", na=NO_REASON),
    S("MQTT-3.15.2-3", "both", "AUTH User Properties MUST NOT be sent if they would exceed the "
      "receiver's Maximum Packet Size.", na=NO_USER_PROPS),
    # 4.1 Session State
    S("MQTT-4.1.0-1", "both", "Client and Server MUST NOT discard the Session State while the "
      "connection is open."),
    S("MQTT-4.1.0-2", "server", "The Server MUST discard the Session State when the connection "
      "is closed and the Session Expiry Interval has passed."),
    S("MQTT-4.2-1", "both", "Client and Server MUST use a transport giving an ordered, "
      "lossless, two-way stream of bytes.",
      na="a property of the transports offered (TCP, TLS, WebSocket), not of the broker's "
         "behaviour; the tests here run over TCP and WebSocket"),
    # 4.3 QoS
    S("MQTT-4.3.1-1", "both", "QoS 0: the sender MUST send PUBLISH with QoS 0 and DUP 0."),
    S("MQTT-4.3.2-1", "both", "QoS 1: the sender MUST assign an unused Packet Identifier to "
      "each new message."),
    S("MQTT-4.3.2-2", "both", "QoS 1: the sender MUST send PUBLISH with that Packet "
      "Identifier, QoS 1 and DUP 0."),
    S("MQTT-4.3.2-3", "both", "QoS 1: the sender MUST treat the PUBLISH as unacknowledged "
      "until the PUBACK."),
    S("MQTT-4.3.2-4", "both", "QoS 1: the receiver MUST answer with PUBACK carrying the "
      "Packet Identifier."),
    S("MQTT-4.3.2-5", "both", "QoS 1: after PUBACK, a PUBLISH with the same Packet Identifier "
      "MUST be treated as a new message."),
    S("MQTT-4.3.3-1", "both", "QoS 2: the sender MUST assign an unused Packet Identifier."),
    S("MQTT-4.3.3-2", "both", "QoS 2: the sender MUST send PUBLISH with QoS 2 and DUP 0."),
    S("MQTT-4.3.3-3", "both", "QoS 2: the sender MUST treat the PUBLISH as unacknowledged "
      "until the PUBREC."),
    S("MQTT-4.3.3-4", "both", "QoS 2: the sender MUST send PUBREL with the same Packet "
      "Identifier on a PUBREC below 0x80."),
    S("MQTT-4.3.3-5", "both", "QoS 2: the sender MUST treat the PUBREL as unacknowledged "
      "until the PUBCOMP."),
    S("MQTT-4.3.3-6", "both", "QoS 2: the sender MUST NOT re-send the PUBLISH once it has sent "
      "the PUBREL."),
    S("MQTT-4.3.3-7", "both", "QoS 2: the sender MUST NOT apply Message Expiry once the "
      "PUBLISH has been sent."),
    S("MQTT-4.3.3-8", "both", "QoS 2: the receiver MUST answer with PUBREC carrying the "
      "Packet Identifier."),
    S("MQTT-4.3.3-9", "both", "QoS 2: after a PUBREC of 0x80 or more, a PUBLISH with that "
      "Packet Identifier MUST be a new message."),
    S("MQTT-4.3.3-10", "both", "QoS 2: until the PUBREL the receiver MUST answer a repeated "
      "PUBLISH with PUBREC and MUST NOT deliver it twice."),
    S("MQTT-4.3.3-11", "both", "QoS 2: the receiver MUST answer PUBREL with PUBCOMP carrying "
      "the same Packet Identifier."),
    S("MQTT-4.3.3-12", "both", "QoS 2: after PUBCOMP, a PUBLISH with that Packet Identifier "
      "MUST be a new message."),
    S("MQTT-4.3.3-13", "both", "QoS 2: the receiver MUST continue the acknowledgement "
      "sequence even if it applied Message Expiry."),
    # 4.4 - 4.6
    S("MQTT-4.4.0-1", "both", "On reconnect with a Session, unacknowledged PUBLISH and PUBREL "
      "MUST be re-sent with their Packet Identifiers, and at no other time."),
    S("MQTT-4.4.0-2", "both", "A PUBLISH answered with PUBACK/PUBREC of 0x80 or more is "
      "acknowledged and MUST NOT be retransmitted."),
    S("MQTT-4.5.0-1", "server", "A message the Server takes ownership of MUST be added to the "
      "Session State of every matching subscriber."),
    S("MQTT-4.5.0-2", "client", "The Client MUST acknowledge every PUBLISH by its QoS rules.",
      na=CLIENT),
    S("MQTT-4.6.0-1", "client", "The Client MUST re-send PUBLISH packets in their original "
      "order.", na=CLIENT),
    S("MQTT-4.6.0-2", "client", "The Client MUST send PUBACKs in the order of the PUBLISHes.",
      na=CLIENT),
    S("MQTT-4.6.0-3", "client", "The Client MUST send PUBRECs in the order of the PUBLISHes.",
      na=CLIENT),
    S("MQTT-4.6.0-4", "client", "The Client MUST send PUBRELs in the order of the PUBRECs.",
      na=CLIENT),
    S("MQTT-4.6.0-5", "server", "For an Ordered Topic the Server MUST send messages of the "
      "same topic and QoS in the order received from a Client."),
    S("MQTT-4.6.0-6", "server", "By default every Topic MUST be an Ordered Topic on "
      "non-shared Subscriptions."),
    # 4.7 Topics
    S("MQTT-4.7.0-1", "client", "Wildcards MUST NOT be used in a Topic Name. Server: refuse "
      "it."),
    S("MQTT-4.7.1-1", "client", "'#' MUST be alone or after '/', and last. Server: refuse "
      "such a filter."),
    S("MQTT-4.7.1-2", "client", "'+' MUST occupy a whole level. Server: refuse such a filter."),
    S("MQTT-4.7.2-1", "server", "Filters starting with a wildcard MUST NOT match Topic Names "
      "starting with '$'."),
    S("MQTT-4.7.3-1", "client", "Topic Names and Filters MUST be at least one character. "
      "Server: refuse empty ones."),
    S("MQTT-4.7.3-2", "client", "Topic Names and Filters MUST NOT include U+0000. Server: "
      "refuse them."),
    S("MQTT-4.7.3-3", "client", "Topic Names and Filters MUST NOT encode to more than 65,535 "
      "bytes.", na="cannot be broken on the wire: the two-byte length prefix says at most "
                   "65,535"),
    S("MQTT-4.7.3-4", "server", "The Server MUST NOT normalize Topic Names or Filters when "
      "matching."),
    # 4.8 Shared Subscriptions
    S("MQTT-4.8.2-1", "client", "A Shared Subscription filter MUST start with $share/ and a "
      "ShareName of at least one character. Server: refuse others."),
    S("MQTT-4.8.2-2", "client", "The ShareName MUST NOT contain '/', '+' or '#' and MUST be "
      "followed by '/' and a Topic Filter. Server: refuse others."),
    S("MQTT-4.8.2-3", "server", "The Server MUST respect the granted QoS of the Client's "
      "shared subscription."),
    S("MQTT-4.8.2-4", "server", "A QoS 2 message in flight to a member whose connection "
      "breaks MUST be completed to that Client when it reconnects."),
    S("MQTT-4.8.2-5", "server", "If that member's Session ends first, the Server MUST NOT send "
      "the message to another subscriber."),
    S("MQTT-4.8.2-6", "server", "On PUBACK/PUBREC of 0x80 or more from a member, the Server "
      "MUST discard the message, not send it to another subscriber."),
    # 4.9 Flow control
    S("MQTT-4.9.0-1", "both", "The initial send quota MUST be non-zero and not above Receive "
      "Maximum."),
    S("MQTT-4.9.0-2", "both", "With the send quota at zero, no more QoS 1/2 PUBLISH MUST be "
      "sent."),
    S("MQTT-4.9.0-3", "both", "With the quota at zero, all other packets MUST still be "
      "processed and answered."),
    # 4.12 Enhanced authentication
    S("MQTT-4.12.0-1", "server", "If the Server does not support the Authentication Method it "
      "MAY send CONNACK 0x8C or 0x87 and MUST close the connection."),
    S("MQTT-4.12.0-2", "server", "A Server AUTH during authentication MUST carry 0x18 "
      "(Continue authentication)."),
    S("MQTT-4.12.0-3", "client", "The Client's answering AUTH MUST carry 0x18.", na=CLIENT),
    S("MQTT-4.12.0-4", "server", "The Server can reject authentication at any point; it MUST "
      "then close the connection."),
    S("MQTT-4.12.0-5", "both", "With an Authentication Method in CONNECT, every AUTH and a "
      "successful CONNACK MUST carry the same method."),
    S("MQTT-4.12.0-6", "server", "Without an Authentication Method in CONNECT, the Server MUST "
      "NOT send AUTH nor an Authentication Method in CONNACK."),
    S("MQTT-4.12.0-7", "client", "Without an Authentication Method in CONNECT, the Client MUST "
      "NOT send AUTH. Server: Protocol Error."),
    S("MQTT-4.12.1-1", "client", "Re-authentication MUST use the original Authentication "
      "Method. Server: Protocol Error."),
    S("MQTT-4.12.1-2", "both", "If re-authentication fails, Client or Server SHOULD send "
      "DISCONNECT."),
    # 4.13 Handling errors
    S("MQTT-4.13.1-1", "server", "On a Malformed Packet or Protocol Error with a Reason Code "
      "given, the Server MUST close the connection."),
    S("MQTT-4.13.2-1", "both", "After a CONNACK or DISCONNECT with a Reason Code of 0x80 or "
      "more, the connection MUST be closed."),
    # 6 WebSocket
    S("MQTT-6.0.0-1", "both", "MQTT Control Packets MUST be sent in WebSocket binary data "
      "frames; on any other data frame the receiver MUST close the Network Connection."),
    S("MQTT-6.0.0-2", "both", "The receiver MUST NOT assume that MQTT Control Packets are "
      "aligned on WebSocket frame boundaries."),
    S("MQTT-6.0.0-3", "client", "The Client MUST include \"mqtt\" in the WebSocket "
      "subprotocols it offers.", na=WS_CLIENT),
    S("MQTT-6.0.0-4", "server", "The WebSocket subprotocol the Server selects and returns "
      "MUST be \"mqtt\"."),
)

# MQTT 3.1.1 statements where 3.1.1 differs from 5.0 (return codes, CleanSession, no
# properties), and those of chapters 1, 2 and 6 (3.1.1 numbers them differently: its 1.5.3
# is 5.0's 1.5.4, its 2.2.2 and 2.3.1 are 5.0's 2.1.3 and 2.2.1); each has a
# `test_mqtt311_*` test.
STATEMENTS_311: tuple[Statement, ...] = (
    S("MQTT-1.5.3-1", "both", "A UTF-8 encoded string MUST be well-formed UTF-8, with no "
      "U+D800..U+DFFF. Server: on ill-formed UTF-8 it MUST close the connection."),
    S("MQTT-1.5.3-2", "both", "A UTF-8 encoded string MUST NOT include U+0000. Server: on "
      "U+0000 it MUST close the connection."),
    S("MQTT-1.5.3-3", "both", "0xEF 0xBB 0xBF is always U+FEFF and MUST NOT be skipped over "
      "or stripped off by a receiver."),
    S("MQTT-2.2.2-1", "both", "Reserved fixed header flags MUST have the values of Table 2.2."),
    S("MQTT-2.2.2-2", "server", "On invalid flags the receiver MUST close the connection."),
    S("MQTT-2.3.1-1", "client", "SUBSCRIBE, UNSUBSCRIBE and QoS 1/2 PUBLISH MUST carry a "
      "non-zero Packet Identifier. Server: 0 closes the connection."),
    S("MQTT-2.3.1-2", "client", "A Client MUST give each new such packet a Packet Identifier "
      "not in use.", na=CLIENT),
    S("MQTT-2.3.1-3", "client", "A Client MUST re-send a packet with the same Packet "
      "Identifier; it is free again once acknowledged.", na=CLIENT),
    S("MQTT-2.3.1-4", "server", "The same holds for the Server's QoS 1/2 PUBLISH."),
    S("MQTT-2.3.1-5", "both", "A QoS 0 PUBLISH MUST NOT contain a Packet Identifier."),
    S("MQTT-2.3.1-6", "both", "PUBACK, PUBREC and PUBREL MUST carry the Packet Identifier of "
      "their PUBLISH."),
    S("MQTT-2.3.1-7", "server", "SUBACK and UNSUBACK MUST carry the Packet Identifier of "
      "their SUBSCRIBE and UNSUBSCRIBE."),
    S("MQTT-3.1.2-2", "server", "An unsupported Protocol Level MUST be answered with CONNACK "
      "return code 0x01 and the connection closed."),
    S("MQTT-3.1.2-4", "server", "CleanSession 0: the Server MUST resume the Session for the "
      "ClientId, or create one if there is none."),
    S("MQTT-3.1.2-6", "server", "CleanSession 1: the Server MUST discard any previous Session "
      "and start a new one lasting as long as the connection."),
    S("MQTT-3.1.3-6", "server", "A zero-byte ClientId (CleanSession 1) MUST be given a unique "
      "ClientId."),
    S("MQTT-3.1.3-8", "server", "A zero-byte ClientId with CleanSession 0 MUST be answered "
      "with CONNACK 0x02 (Identifier rejected) and the connection closed."),
    S("MQTT-3.1.4-1", "server", "A CONNECT not conforming to 3.1 MUST close the connection "
      "without sending a CONNACK."),
    S("MQTT-3.2.2-1", "server", "Accepting CleanSession 1, Session Present MUST be 0."),
    S("MQTT-3.2.2-2", "server", "Accepting CleanSession 0 with stored Session state, Session "
      "Present MUST be 1."),
    S("MQTT-3.2.2-3", "server", "Accepting CleanSession 0 without stored Session state, "
      "Session Present MUST be 0."),
    S("MQTT-3.2.2-4", "server", "A CONNACK with a non-zero return code MUST have Session "
      "Present 0."),
    S("MQTT-3.2.2-5", "server", "After a non-zero CONNACK return code the Server MUST close "
      "the connection."),
    S("MQTT-3.9.3-2", "server", "SUBACK return codes other than 0x00, 0x01, 0x02 and 0x80 are "
      "reserved and MUST NOT be used."),
    S("MQTT-3.14.1-1", "server", "The Server MUST validate that DISCONNECT's reserved bits are "
      "0 and disconnect the Client if not."),
    S("MQTT-6.0.0-1", "both", "MQTT Control Packets MUST be sent in WebSocket binary data "
      "frames; on any other data frame the receiver MUST close the connection."),
    S("MQTT-6.0.0-2", "both", "The receiver MUST NOT assume that Control Packets are aligned "
      "on WebSocket frame boundaries."),
    S("MQTT-6.0.0-3", "client", "The Client MUST include \"mqtt\" in the WebSocket "
      "subprotocols it offers.", na=WS_CLIENT),
    S("MQTT-6.0.0-4", "server", "The WebSocket subprotocol the Server selects and returns "
      "MUST be \"mqtt\"."),
)
