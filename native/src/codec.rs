//! MQTT framing, decoding and encoding for the per-message path, to the rules of
//! `gateway/mqtt/codec.py` (the specification): the same bytes decode to the same fields
//! or fail with the same reason code, for MQTT 3.1.1 and 5 (3.1 decodes as 3.1.1 here).
//!
//! The native plane takes a connection over after its CONNACK, so this is the server's
//! decoder with the protocol version known. It decodes what a device sends per message:
//! PUBLISH, its acks, PINGREQ and DISCONNECT. Every other packet a client may send
//! (SUBSCRIBE, UNSUBSCRIBE, AUTH, a second CONNECT) comes out as an undecoded `Frame` for
//! the Python side to decide on.
//!
//! - `frame`: the fixed header and the streaming `Decoder` (budget, partial tail).
//! - `decode`: one packet's body; `encode`: PUBLISH, PUBACK and PINGRESP.
//! - `properties`: the MQTT 5 property table; `wire`: the primitives.

pub mod decode;
pub mod encode;
pub mod error;
pub mod frame;
pub mod properties;
pub mod wire;

pub use decode::{decode_packet, payload_format_valid, Ack, Frame, Packet, Publish};
pub use encode::{encode_ack, encode_pingresp, encode_publish};
pub use error::{DecodeError, EncodeError};
pub use frame::Decoder;
pub use properties::{Properties, Property, Value};

// Packet types (the fixed header's high nibble). WILL is the pseudo type of a CONNECT's
// will properties, which have their own allowed set.
pub const WILL: u8 = 0;
pub const CONNECT: u8 = 1;
pub const CONNACK: u8 = 2;
pub const PUBLISH: u8 = 3;
pub const PUBACK: u8 = 4;
pub const PUBREC: u8 = 5;
pub const PUBREL: u8 = 6;
pub const PUBCOMP: u8 = 7;
pub const SUBSCRIBE: u8 = 8;
pub const SUBACK: u8 = 9;
pub const UNSUBSCRIBE: u8 = 10;
pub const UNSUBACK: u8 = 11;
pub const PINGREQ: u8 = 12;
pub const PINGRESP: u8 = 13;
pub const DISCONNECT: u8 = 14;
pub const AUTH: u8 = 15;

/// Default limit on a whole packet, fixed header included (the v5 Maximum Packet Size).
pub const MAX_PACKET_SIZE: usize = 268_435_455;

#[cfg(test)]
mod tests;
