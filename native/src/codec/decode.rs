//! One packet's body, as `Decoder._publish`, `_ack_decoder`, `_pingreq` and `_disconnect`
//! in `gateway/mqtt/codec.py` decode it, check for check and in the same order (the first
//! violation found decides the reason code). Everything borrows from the input.

use super::error::DecodeError;
use super::properties::{self, get_int, has, Properties, PAYLOAD_FORMAT_INDICATOR};
use super::wire::{read_u16, topic_name_problem};
use super::{DISCONNECT, PINGREQ, PUBACK, PUBCOMP, PUBLISH, PUBREC, PUBREL};

const PUBACK_REASONS: &[u8] = &[0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99];
const PUBREL_REASONS: &[u8] = &[0x00, 0x92];
const DISCONNECT_REASONS: &[u8] = &[
    0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F, 0x90, 0x93, 0x94, 0x95,
    0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9E, 0x9F, 0xA0, 0xA1, 0xA2,
];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Publish<'a> {
    /// Empty only with a v5 topic alias (the connection resolves it).
    pub topic: &'a str,
    pub payload: &'a [u8],
    pub qos: u8,
    pub retain: bool,
    pub dup: bool,
    /// None exactly when qos is 0.
    pub packet_id: Option<u16>,
    pub properties: Properties<'a>,
}

/// PUBACK, PUBREC, PUBREL or PUBCOMP (`ptype` says which).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ack<'a> {
    pub ptype: u8,
    pub packet_id: u16,
    pub reason_code: u8,
    pub properties: Properties<'a>,
}

/// A packet left for the Python side: its type, the fixed header's flags and the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame<'a> {
    pub ptype: u8,
    pub flags: u8,
    pub body: &'a [u8],
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Packet<'a> {
    Publish(Publish<'a>),
    Ack(Ack<'a>),
    Pingreq,
    Disconnect {
        reason_code: u8,
        properties: Properties<'a>,
    },
    Other(Frame<'a>),
}

/// Decode the body of one packet a client sent, of a type the frame layer accepted.
pub fn decode_packet<'a>(
    ptype: u8,
    flags: u8,
    body: &'a [u8],
    version: u8,
) -> Result<Packet<'a>, DecodeError> {
    match ptype {
        PUBLISH => publish(flags, body, version).map(Packet::Publish),
        PUBACK | PUBREC | PUBREL | PUBCOMP => ack(ptype, flags, body, version).map(Packet::Ack),
        PINGREQ => {
            if flags != 0 || !body.is_empty() {
                return Err(DecodeError::Malformed("PINGREQ must be exactly c0 00"));
            }
            Ok(Packet::Pingreq)
        }
        DISCONNECT => disconnect(flags, body, version),
        _ => Ok(Packet::Other(Frame { ptype, flags, body })),
    }
}

fn publish(flags: u8, body: &[u8], version: u8) -> Result<Publish<'_>, DecodeError> {
    let end = body.len();
    let qos = (flags >> 1) & 3;
    if qos == 3 {
        return Err(DecodeError::Malformed("PUBLISH with QoS 3"));
    }
    let tlen = read_u16(body, 0, end).ok_or(DecodeError::Malformed("truncated PUBLISH topic"))?;
    let mut p = 2 + usize::from(tlen);
    let raw = body
        .get(2..p)
        .ok_or(DecodeError::Malformed("truncated PUBLISH topic"))?;
    let topic =
        std::str::from_utf8(raw).map_err(|_| DecodeError::Malformed("topic is not valid UTF-8"))?;
    let dup = flags & 0x08 != 0;
    let packet_id = if qos > 0 {
        let id =
            read_u16(body, p, end).ok_or(DecodeError::Malformed("truncated PUBLISH packet id"))?;
        if id == 0 {
            return Err(DecodeError::Protocol("packet id 0"));
        }
        p += 2;
        Some(id)
    } else {
        if dup {
            return Err(DecodeError::Malformed("DUP set on a QoS 0 PUBLISH"));
        }
        None
    };
    let mut props = Vec::new();
    if version == 5 {
        (props, p) = properties::decode(body, p, end, PUBLISH)?;
        if has(&props, properties::SUBSCRIPTION_IDENTIFIER) {
            return Err(DecodeError::Protocol(
                "subscription_identifier in a PUBLISH from a client",
            ));
        }
    }
    let aliased = topic.is_empty() && has(&props, properties::TOPIC_ALIAS);
    if !aliased {
        check_topic(topic)?;
    }
    Ok(Publish {
        topic,
        payload: &body[p..],
        qos,
        retain: flags & 1 != 0,
        dup,
        packet_id,
        properties: props,
    })
}

/// `Decoder._check_topic`: U+0000 is malformed, empty is a protocol error (no alias),
/// wildcards are 0x90.
fn check_topic(topic: &str) -> Result<(), DecodeError> {
    if topic.contains('\0') {
        return Err(DecodeError::Malformed("topic contains U+0000"));
    }
    if topic.is_empty() {
        return Err(DecodeError::Protocol(
            "empty topic name without a topic alias",
        ));
    }
    match topic_name_problem(topic) {
        Some(why) => Err(DecodeError::TopicNameInvalid(why)),
        None => Ok(()),
    }
}

/// PUBACK/PUBREC/PUBREL/PUBCOMP: v5 may leave out the reason code and the properties.
fn ack(ptype: u8, flags: u8, body: &[u8], version: u8) -> Result<Ack<'_>, DecodeError> {
    let (want, reasons) = match ptype {
        PUBREL => (2, PUBREL_REASONS),
        PUBCOMP => (0, PUBREL_REASONS),
        _ => (0, PUBACK_REASONS),
    };
    if flags != want {
        return Err(DecodeError::Malformed("wrong fixed header flags on an ack"));
    }
    let packet_id =
        read_u16(body, 0, body.len()).ok_or(DecodeError::Malformed("truncated packet id"))?;
    if packet_id == 0 {
        return Err(DecodeError::Protocol("packet id 0"));
    }
    let mut out = Ack {
        ptype,
        packet_id,
        reason_code: 0,
        properties: Vec::new(),
    };
    if body.len() == 2 {
        return Ok(out);
    }
    if version != 5 {
        return Err(DecodeError::Malformed(
            "ack longer than 2 bytes before MQTT 5",
        ));
    }
    out.reason_code = body[2];
    if !reasons.contains(&out.reason_code) {
        return Err(DecodeError::Protocol("invalid ack reason code"));
    }
    if body.len() == 3 {
        return Ok(out);
    }
    let (props, q) = properties::decode(body, 3, body.len(), ptype)?;
    if q != body.len() {
        return Err(DecodeError::Malformed("trailing bytes after ack"));
    }
    out.properties = props;
    Ok(out)
}

fn disconnect(flags: u8, body: &[u8], version: u8) -> Result<Packet<'_>, DecodeError> {
    if flags != 0 {
        return Err(DecodeError::Malformed("DISCONNECT flags must be 0"));
    }
    let Some(&reason_code) = body.first() else {
        return Ok(Packet::Disconnect {
            reason_code: 0,
            properties: Vec::new(),
        });
    };
    if version != 5 {
        return Err(DecodeError::Malformed(
            "DISCONNECT must have no body before MQTT 5",
        ));
    }
    if !DISCONNECT_REASONS.contains(&reason_code) {
        return Err(DecodeError::Protocol("invalid DISCONNECT reason code"));
    }
    let mut props = Vec::new();
    if body.len() > 1 {
        let (got, q) = properties::decode(body, 1, body.len(), DISCONNECT)?;
        if q != body.len() {
            return Err(DecodeError::Malformed("trailing bytes after DISCONNECT"));
        }
        props = got;
    }
    Ok(Packet::Disconnect {
        reason_code,
        properties: props,
    })
}

/// MQTT 5 §3.3.2.3.2, as the connection checks it after decoding: a payload that says it
/// is UTF-8 (Payload Format Indicator 1) must be (the server answers 0x99).
pub fn payload_format_valid(publish: &Publish<'_>) -> Result<(), DecodeError> {
    if get_int(&publish.properties, PAYLOAD_FORMAT_INDICATOR) == Some(1)
        && std::str::from_utf8(publish.payload).is_err()
    {
        return Err(DecodeError::PayloadFormatInvalid);
    }
    Ok(())
}
