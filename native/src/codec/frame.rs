//! The fixed header and the streaming decoder of one connection (`Decoder.feed` and
//! `_parse` in `gateway/mqtt/codec.py`): bytes in, whole packets out, the partial tail
//! kept until the rest arrives.
//!
//! The budget holds before anything is buffered: a packet whose header announces more
//! than `max_packet` bytes is refused (0x95) as soon as its remaining length is read, so
//! the tail held is never more than one packet within the budget (`buffered`, what the
//! read budget counts). Nothing is allocated from a length in the input.

use super::decode::{decode_packet, Packet};
use super::error::DecodeError;
use super::wire::varint_or_none;
use super::{
    AUTH, CONNECT, DISCONNECT, PINGREQ, PUBACK, PUBCOMP, PUBLISH, PUBREC, PUBREL, SUBSCRIBE,
    UNSUBSCRIBE,
};

/// Which packet types a server accepts from a client (bit per type).
fn accept_mask(version: u8) -> u16 {
    let mut mask = [
        CONNECT,
        PUBLISH,
        PUBACK,
        PUBREC,
        PUBREL,
        PUBCOMP,
        SUBSCRIBE,
        UNSUBSCRIBE,
        PINGREQ,
        DISCONNECT,
    ]
    .iter()
    .fold(0u16, |m, t| m | 1 << t);
    if version == 5 {
        mask |= 1 << AUTH;
    }
    mask
}

/// The decoder of what one client sends after its CONNACK.
///
/// After an error the decoder is dead: every later `feed` returns the error again.
#[derive(Debug)]
pub struct Decoder {
    version: u8,
    max_packet: usize,
    mask: u16,
    /// An incomplete packet's bytes, held until `need` of them are there.
    buf: Vec<u8>,
    need: usize,
    error: Option<DecodeError>,
}

impl Decoder {
    /// For protocol level `version` (3, 4 or 5) and a limit on a whole packet.
    pub fn new(version: u8, max_packet: usize) -> Result<Self, String> {
        if !(3..=5).contains(&version) {
            return Err(format!("unsupported protocol version {version}"));
        }
        Ok(Decoder {
            version,
            max_packet,
            mask: accept_mask(version),
            buf: Vec::new(),
            need: 0,
            error: None,
        })
    }

    pub fn version(&self) -> u8 {
        self.version
    }

    /// Bytes of an incomplete packet held until the rest arrives.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The violation that stopped this decoder, if one did.
    pub fn error(&self) -> Option<&DecodeError> {
        self.error.as_ref()
    }

    /// Feed received bytes; `emit` gets each whole packet, in order, borrowed for the call.
    /// On an error, the packets before it have been emitted (as Python's `exc.packets`).
    pub fn feed<F>(&mut self, data: &[u8], mut emit: F) -> Result<(), DecodeError>
    where
        F: FnMut(Packet<'_>),
    {
        if let Some(err) = &self.error {
            return Err(err.clone());
        }
        let result = if self.buf.is_empty() {
            self.parse(data, &mut emit)
        } else {
            self.buf.extend_from_slice(data);
            if self.buf.len() < self.need {
                return Ok(());
            }
            // Parse the held bytes from a buffer of their own; a new tail goes to a new one
            // (an idle connection keeps no memory from its largest packet).
            let held = std::mem::take(&mut self.buf);
            self.parse(&held, &mut emit)
        };
        if let Err(err) = &result {
            self.error = Some(err.clone());
        }
        result
    }

    fn parse<F>(&mut self, data: &[u8], emit: &mut F) -> Result<(), DecodeError>
    where
        F: FnMut(Packet<'_>),
    {
        let n = data.len();
        let mut pos = 0;
        while pos < n {
            let b0 = data[pos];
            let Some((rl, p)) = varint_or_none(data, pos + 1, n)? else {
                // At least one more byte is needed: the header is not whole yet.
                self.stash(&data[pos..], n - pos + 1);
                return Ok(());
            };
            let ptype = b0 >> 4;
            self.check_type(ptype)?;
            let end = p + rl as usize;
            if end - pos > self.max_packet {
                return Err(DecodeError::PacketTooLarge {
                    size: end - pos,
                    max: self.max_packet,
                });
            }
            if end > n {
                self.stash(&data[pos..], end - pos);
                return Ok(());
            }
            emit(decode_packet(
                ptype,
                b0 & 0x0F,
                &data[p..end],
                self.version,
            )?);
            pos = end;
        }
        Ok(())
    }

    fn check_type(&self, ptype: u8) -> Result<(), DecodeError> {
        if (self.mask >> ptype) & 1 == 1 {
            Ok(())
        } else if ptype == 0 || ptype == AUTH {
            Err(DecodeError::Malformed("reserved packet type"))
        } else {
            Err(DecodeError::Protocol(
                "packet type not allowed in this direction",
            ))
        }
    }

    fn stash(&mut self, tail: &[u8], need: usize) {
        self.buf.extend_from_slice(tail);
        self.need = need;
    }
}
