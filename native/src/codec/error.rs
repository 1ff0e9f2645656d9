//! What a decode or encode can fail with. A decode error carries the MQTT 5 reason code
//! the Python codec's `ProtocolError` carries for the same bytes (`gateway/mqtt/reason.py`):
//! a v5 server sends it in DISCONNECT, a 3.1.1 server just closes.

use std::fmt;

pub const MALFORMED_PACKET: u8 = 0x81;
pub const PROTOCOL_ERROR: u8 = 0x82;
pub const TOPIC_NAME_INVALID: u8 = 0x90;
pub const TOPIC_ALIAS_INVALID: u8 = 0x94;
pub const PACKET_TOO_LARGE: u8 = 0x95;
pub const PAYLOAD_FORMAT_INVALID: u8 = 0x99;

/// The peer broke the protocol; the variant is the reason code, the text says how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// 0x81: bytes that are not a well-formed packet.
    Malformed(&'static str),
    /// 0x82: well-formed, but not allowed (packet id 0, a repeated property...).
    Protocol(&'static str),
    /// 0x90: a topic name the rules refuse (wildcards).
    TopicNameInvalid(&'static str),
    /// 0x94: a Topic Alias of 0.
    TopicAliasInvalid,
    /// 0x95: a packet over the budget, refused before its body is buffered.
    PacketTooLarge { size: usize, max: usize },
    /// 0x99: a payload that says it is UTF-8 and is not.
    PayloadFormatInvalid,
}

impl DecodeError {
    pub fn reason_code(&self) -> u8 {
        match self {
            DecodeError::Malformed(_) => MALFORMED_PACKET,
            DecodeError::Protocol(_) => PROTOCOL_ERROR,
            DecodeError::TopicNameInvalid(_) => TOPIC_NAME_INVALID,
            DecodeError::TopicAliasInvalid => TOPIC_ALIAS_INVALID,
            DecodeError::PacketTooLarge { .. } => PACKET_TOO_LARGE,
            DecodeError::PayloadFormatInvalid => PAYLOAD_FORMAT_INVALID,
        }
    }
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Malformed(why)
            | DecodeError::Protocol(why)
            | DecodeError::TopicNameInvalid(why) => f.write_str(why),
            DecodeError::TopicAliasInvalid => f.write_str("topic_alias must not be 0"),
            DecodeError::PacketTooLarge { size, max } => {
                write!(f, "packet of {size} bytes exceeds {max}")
            }
            DecodeError::PayloadFormatInvalid => f.write_str("payload is not UTF-8"),
        }
    }
}

impl std::error::Error for DecodeError {}

/// A packet the encoder refuses to put on the wire (Python's `ValueError`): a broker bug
/// must not become a malformed packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodeError(pub String);

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for EncodeError {}

pub(crate) fn refuse<T>(why: impl Into<String>) -> Result<T, EncodeError> {
    Err(EncodeError(why.into()))
}
