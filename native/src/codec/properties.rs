//! MQTT 5 properties (§2.2.2), table-driven as `gateway/mqtt/properties.py`: one row per
//! property id says its name, its value's shape and the packet types that may carry it.
//!
//! A decoded block keeps the properties in wire order (`encode` of what `decode` gave is
//! the same bytes); the Python side groups the repeatable ones into lists.

use super::error::{refuse, DecodeError, EncodeError};
use super::wire::{
    put_bin, put_str, put_varint, read_bin, read_str, read_varint, topic_name_problem,
};
use super::{
    AUTH, CONNACK, CONNECT, DISCONNECT, PUBACK, PUBCOMP, PUBLISH, PUBREC, PUBREL, SUBACK,
    SUBSCRIBE, UNSUBACK, UNSUBSCRIBE, WILL,
};

/// The shape of a property's value on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Byte,
    U16,
    U32,
    Varint,
    Str,
    Bin,
    Pair,
}

/// One row of the table.
#[derive(Debug)]
pub struct Spec {
    pub id: u8,
    pub name: &'static str,
    pub kind: Kind,
    /// Bit per packet type that may carry it (bit 0: the will, a pseudo type).
    allowed: u16,
}

impl Spec {
    pub fn allowed_on(&self, ptype: u8) -> bool {
        ptype < 16 && self.allowed & (1 << ptype) != 0
    }

    /// May appear more than once (a list on the Python side).
    pub fn repeatable(&self) -> bool {
        self.id == USER_PROPERTY || self.id == SUBSCRIPTION_IDENTIFIER
    }

    /// A 0/1 property (Python accepts a bool for these, and only for these).
    pub fn boolean(&self) -> bool {
        matches!(
            self.id,
            0x01 | 0x17 | 0x19 | 0x24 | 0x25 | 0x28 | 0x29 | 0x2A
        )
    }

    fn nonzero(&self) -> bool {
        matches!(
            self.id,
            RECEIVE_MAXIMUM | MAXIMUM_PACKET_SIZE | TOPIC_ALIAS | SUBSCRIPTION_IDENTIFIER
        )
    }

    /// The largest integer value this property may carry.
    fn max(&self) -> u32 {
        match self.kind {
            Kind::Byte if self.boolean() => 1,
            Kind::Byte => 0xFF,
            Kind::U16 => 0xFFFF,
            Kind::Varint => super::wire::MAX_VARINT,
            _ => u32::MAX,
        }
    }
}

pub const PAYLOAD_FORMAT_INDICATOR: u8 = 0x01;
pub const RESPONSE_TOPIC: u8 = 0x08;
pub const SUBSCRIPTION_IDENTIFIER: u8 = 0x0B;
pub const RECEIVE_MAXIMUM: u8 = 0x21;
pub const TOPIC_ALIAS: u8 = 0x23;
pub const USER_PROPERTY: u8 = 0x26;
pub const MAXIMUM_PACKET_SIZE: u8 = 0x27;

const fn types(list: &[u8]) -> u16 {
    let mut bits = 0u16;
    let mut i = 0;
    while i < list.len() {
        bits |= 1 << list[i];
        i += 1;
    }
    bits
}

const ACKS: [u8; 4] = [PUBACK, PUBREC, PUBREL, PUBCOMP];
const PUB: u16 = types(&[PUBLISH, WILL]);
const REASON_STRING_ON: u16 = types(&[CONNACK, SUBACK, UNSUBACK, DISCONNECT, AUTH]) | types(&ACKS);
const EVERY: u16 = types(&[
    CONNECT,
    CONNACK,
    PUBLISH,
    WILL,
    SUBSCRIBE,
    SUBACK,
    UNSUBSCRIBE,
    UNSUBACK,
    DISCONNECT,
    AUTH,
]) | types(&ACKS);

const fn spec(id: u8, name: &'static str, kind: Kind, allowed: u16) -> Spec {
    Spec {
        id,
        name,
        kind,
        allowed,
    }
}

pub static TABLE: [Spec; 27] = [
    spec(0x01, "payload_format_indicator", Kind::Byte, PUB),
    spec(0x02, "message_expiry_interval", Kind::U32, PUB),
    spec(0x03, "content_type", Kind::Str, PUB),
    spec(0x08, "response_topic", Kind::Str, PUB),
    spec(0x09, "correlation_data", Kind::Bin, PUB),
    spec(
        0x0B,
        "subscription_identifier",
        Kind::Varint,
        types(&[PUBLISH, SUBSCRIBE]),
    ),
    spec(
        0x11,
        "session_expiry_interval",
        Kind::U32,
        types(&[CONNECT, CONNACK, DISCONNECT]),
    ),
    spec(
        0x12,
        "assigned_client_identifier",
        Kind::Str,
        types(&[CONNACK]),
    ),
    spec(0x13, "server_keep_alive", Kind::U16, types(&[CONNACK])),
    spec(
        0x15,
        "authentication_method",
        Kind::Str,
        types(&[CONNECT, CONNACK, AUTH]),
    ),
    spec(
        0x16,
        "authentication_data",
        Kind::Bin,
        types(&[CONNECT, CONNACK, AUTH]),
    ),
    spec(
        0x17,
        "request_problem_information",
        Kind::Byte,
        types(&[CONNECT]),
    ),
    spec(0x18, "will_delay_interval", Kind::U32, types(&[WILL])),
    spec(
        0x19,
        "request_response_information",
        Kind::Byte,
        types(&[CONNECT]),
    ),
    spec(0x1A, "response_information", Kind::Str, types(&[CONNACK])),
    spec(
        0x1C,
        "server_reference",
        Kind::Str,
        types(&[CONNACK, DISCONNECT]),
    ),
    spec(0x1F, "reason_string", Kind::Str, REASON_STRING_ON),
    spec(
        0x21,
        "receive_maximum",
        Kind::U16,
        types(&[CONNECT, CONNACK]),
    ),
    spec(
        0x22,
        "topic_alias_maximum",
        Kind::U16,
        types(&[CONNECT, CONNACK]),
    ),
    spec(0x23, "topic_alias", Kind::U16, types(&[PUBLISH])),
    spec(0x24, "maximum_qos", Kind::Byte, types(&[CONNACK])),
    spec(0x25, "retain_available", Kind::Byte, types(&[CONNACK])),
    spec(0x26, "user_property", Kind::Pair, EVERY),
    spec(
        0x27,
        "maximum_packet_size",
        Kind::U32,
        types(&[CONNECT, CONNACK]),
    ),
    spec(
        0x28,
        "wildcard_subscription_available",
        Kind::Byte,
        types(&[CONNACK]),
    ),
    spec(
        0x29,
        "subscription_identifier_available",
        Kind::Byte,
        types(&[CONNACK]),
    ),
    spec(
        0x2A,
        "shared_subscription_available",
        Kind::Byte,
        types(&[CONNACK]),
    ),
];

/// The row for a property id, if there is one.
pub fn by_id(id: u8) -> Option<&'static Spec> {
    TABLE.iter().find(|s| s.id == id)
}

/// The row for a property name (`payload_format_indicator`...), if there is one.
pub fn by_name(name: &str) -> Option<&'static Spec> {
    TABLE.iter().find(|s| s.name == name)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value<'a> {
    /// Byte, U16, U32 or Varint (the table says which).
    Int(u32),
    Str(&'a str),
    Bin(&'a [u8]),
    Pair(&'a str, &'a str),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Property<'a> {
    pub id: u8,
    pub value: Value<'a>,
}

/// A property block in wire order; empty when there is none.
pub type Properties<'a> = Vec<Property<'a>>;

/// The integer value of property `id`, if the block has it.
pub fn get_int(props: &[Property<'_>], id: u8) -> Option<u32> {
    props.iter().find_map(|p| match (p.id == id, p.value) {
        (true, Value::Int(v)) => Some(v),
        _ => None,
    })
}

pub fn has(props: &[Property<'_>], id: u8) -> bool {
    props.iter().any(|p| p.id == id)
}

/// The property block (length, then the properties) at `pos` for packet type `ptype`:
/// (the properties, position after the block). An unknown or misplaced id or a value of
/// the wrong shape is malformed (0x81); a repeated single property or a forbidden value
/// is a protocol error (0x82), a Topic Alias of 0 is 0x94.
pub fn decode<'a>(
    data: &'a [u8],
    pos: usize,
    end: usize,
    ptype: u8,
) -> Result<(Properties<'a>, usize), DecodeError> {
    if pos < end && data[pos] == 0 {
        return Ok((Vec::new(), pos + 1)); // the common case: no properties
    }
    let (length, mut pos) = read_varint(data, pos, end)?;
    let stop = pos + length as usize;
    if stop > end {
        return Err(DecodeError::Malformed("property length exceeds packet"));
    }
    let mut props = Vec::new();
    let mut seen = 0u64; // bit per id (every id is below 64)
    while pos < stop {
        let id = data[pos];
        let spec = match by_id(id) {
            Some(spec) if spec.allowed_on(ptype) => spec,
            Some(_) => {
                return Err(DecodeError::Malformed(
                    "property not allowed on this packet type",
                ))
            }
            None => return Err(DecodeError::Malformed("unknown property id")),
        };
        pos += 1;
        let truncated = DecodeError::Malformed("truncated property");
        let value = match spec.kind {
            Kind::Byte => {
                let b = *data[..stop].get(pos).ok_or(truncated)?;
                pos += 1;
                Value::Int(u32::from(b))
            }
            Kind::U16 => {
                let v = super::wire::read_u16(data, pos, stop).ok_or(truncated)?;
                pos += 2;
                Value::Int(u32::from(v))
            }
            Kind::U32 => {
                let raw = data[..stop].get(pos..pos + 4).ok_or(truncated)?;
                pos += 4;
                Value::Int(u32::from_be_bytes([raw[0], raw[1], raw[2], raw[3]]))
            }
            Kind::Varint => {
                let (v, p) = read_varint(data, pos, stop)?;
                pos = p;
                Value::Int(v)
            }
            Kind::Str => {
                let (s, p) = read_str(data, pos, stop)?;
                pos = p;
                Value::Str(s)
            }
            Kind::Bin => {
                let (b, p) = read_bin(data, pos, stop)?;
                pos = p;
                Value::Bin(b)
            }
            Kind::Pair => {
                let (k, p) = read_str(data, pos, stop)?;
                let (v, p) = read_str(data, p, stop)?;
                pos = p;
                Value::Pair(k, v)
            }
        };
        let bit = 1u64 << id;
        if seen & bit != 0 {
            let list = id == USER_PROPERTY || (id == SUBSCRIPTION_IDENTIFIER && ptype == PUBLISH);
            if !list {
                return Err(DecodeError::Protocol("property repeated"));
            }
        }
        seen |= bit;
        check_value(spec, value)?;
        props.push(Property { id, value });
    }
    if pos != stop {
        return Err(DecodeError::Malformed("property overruns property length"));
    }
    Ok((props, stop))
}

fn check_value(spec: &Spec, value: Value<'_>) -> Result<(), DecodeError> {
    match value {
        Value::Int(v) if spec.boolean() && v > 1 => {
            Err(DecodeError::Protocol("boolean property must be 0 or 1"))
        }
        Value::Int(0) if spec.nonzero() => Err(if spec.id == TOPIC_ALIAS {
            // MQTT 5 §3.3.2.3.4: a Topic Alias of 0 is 0x94, not a plain protocol error.
            DecodeError::TopicAliasInvalid
        } else {
            DecodeError::Protocol("property must not be 0")
        }),
        Value::Str(topic) if spec.id == RESPONSE_TOPIC => match topic_name_problem(topic) {
            Some(_) => Err(DecodeError::Protocol(
                "response_topic is not a valid topic name",
            )),
            None => Ok(()),
        },
        _ => Ok(()),
    }
}

/// Append the property block (length, then `props` in their order) for packet `ptype`.
pub fn encode(props: &[Property<'_>], ptype: u8, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    let mut body = Vec::new();
    encode_body(props, ptype, &mut body)?;
    put_varint(out, u32::try_from(body.len()).unwrap_or(u32::MAX))?;
    out.extend_from_slice(&body);
    Ok(())
}

/// The properties without their length prefix.
pub fn encode_body(
    props: &[Property<'_>],
    ptype: u8,
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    for prop in props {
        let Some(spec) = by_id(prop.id) else {
            return refuse(format!("unknown property id 0x{:02X}", prop.id));
        };
        if !spec.allowed_on(ptype) {
            return refuse(format!(
                "property {:?} not allowed on this packet type",
                spec.name
            ));
        }
        encode_one(spec, prop.value, out)?;
    }
    if ptype != PUBLISH {
        let ids = props
            .iter()
            .filter(|p| p.id == SUBSCRIPTION_IDENTIFIER)
            .count();
        if ids > 1 {
            return refuse("SUBSCRIBE carries exactly one subscription_identifier");
        }
    }
    Ok(())
}

fn encode_one(spec: &Spec, value: Value<'_>, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    out.push(spec.id);
    match (spec.kind, value) {
        (Kind::Byte | Kind::U16 | Kind::U32 | Kind::Varint, Value::Int(v)) => {
            let lo = u32::from(spec.nonzero());
            if v < lo || v > spec.max() {
                return refuse(format!("property {} out of range: {v}", spec.name));
            }
            match spec.kind {
                Kind::Byte => out.push(v as u8),
                Kind::U16 => out.extend_from_slice(&(v as u16).to_be_bytes()),
                Kind::U32 => out.extend_from_slice(&v.to_be_bytes()),
                _ => put_varint(out, v)?,
            }
            Ok(())
        }
        (Kind::Str, Value::Str(s)) => {
            if spec.id == RESPONSE_TOPIC {
                if let Some(why) = topic_name_problem(s) {
                    return refuse(format!("response_topic: {why}"));
                }
            }
            put_str(out, s)
        }
        (Kind::Bin, Value::Bin(b)) => put_bin(out, b),
        (Kind::Pair, Value::Pair(k, v)) => {
            put_str(out, k)?;
            put_str(out, v)
        }
        _ => refuse(format!(
            "property {} has a value of the wrong kind",
            spec.name
        )),
    }
}
