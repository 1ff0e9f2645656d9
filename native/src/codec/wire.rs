//! The primitives every packet is made of (`gateway/mqtt/properties.py`'s readers and
//! writers): variable byte integers, length-prefixed strings and binary data, topic
//! names. Readers take the packet body and a position, and never read past `end`.

use super::error::{refuse, DecodeError, EncodeError};

pub const MAX_VARINT: u32 = 268_435_455;

/// A variable byte integer at `pos` (at most 4 bytes, minimally encoded), or None when
/// `end` comes first (a stream decoder waits for more; a packet body is malformed).
pub fn varint_or_none(
    data: &[u8],
    pos: usize,
    end: usize,
) -> Result<Option<(u32, usize)>, DecodeError> {
    let mut value = 0u32;
    let mut pos = pos;
    for i in 0..4 {
        if pos >= end {
            return Ok(None);
        }
        let b = data[pos];
        pos += 1;
        value |= u32::from(b & 0x7F) << (7 * i);
        if b < 0x80 {
            if b == 0 && i > 0 {
                return Err(DecodeError::Malformed(
                    "variable byte integer not minimally encoded",
                ));
            }
            return Ok(Some((value, pos)));
        }
    }
    Err(DecodeError::Malformed(
        "variable byte integer longer than 4 bytes",
    ))
}

pub fn read_varint(data: &[u8], pos: usize, end: usize) -> Result<(u32, usize), DecodeError> {
    varint_or_none(data, pos, end)?.ok_or(DecodeError::Malformed("truncated variable byte integer"))
}

pub fn read_u16(data: &[u8], pos: usize, end: usize) -> Option<u16> {
    if pos + 2 > end {
        return None;
    }
    Some(u16::from_be_bytes([data[pos], data[pos + 1]]))
}

/// Length-prefixed bytes at `pos`: (the bytes, position after them).
fn read_prefixed<'a>(
    data: &'a [u8],
    pos: usize,
    end: usize,
    what: &'static str,
) -> Result<(&'a [u8], usize), DecodeError> {
    let len = read_u16(data, pos, end).ok_or(DecodeError::Malformed(what))?;
    let stop = pos + 2 + usize::from(len);
    if stop > end {
        return Err(DecodeError::Malformed(what));
    }
    Ok((&data[pos + 2..stop], stop))
}

/// A UTF-8 string: valid UTF-8 (surrogates are not, as in Python's strict codec), no U+0000.
pub fn read_str(data: &[u8], pos: usize, end: usize) -> Result<(&str, usize), DecodeError> {
    let (raw, stop) = read_prefixed(data, pos, end, "truncated string")?;
    let text = std::str::from_utf8(raw)
        .map_err(|_| DecodeError::Malformed("string is not valid UTF-8"))?;
    if raw.contains(&0) {
        return Err(DecodeError::Malformed("string contains U+0000"));
    }
    Ok((text, stop))
}

pub fn read_bin(data: &[u8], pos: usize, end: usize) -> Result<(&[u8], usize), DecodeError> {
    read_prefixed(data, pos, end, "truncated binary data")
}

/// Why `topic` is not a valid topic name for PUBLISH (`lightqueue.topic.validate_topic_name`).
pub fn topic_name_problem(topic: &str) -> Option<&'static str> {
    if topic.is_empty() {
        Some("topic name must be at least one character long")
    } else if topic.contains('\0') {
        Some("topic name must not contain U+0000")
    } else if topic.len() > 65535 {
        Some("topic name is longer than 65535 bytes")
    } else if topic.contains(['+', '#']) {
        Some("topic name must not contain wildcards")
    } else {
        None
    }
}

pub fn put_varint(out: &mut Vec<u8>, value: u32) -> Result<(), EncodeError> {
    if value > MAX_VARINT {
        return refuse(format!("variable byte integer out of range: {value}"));
    }
    let mut v = value;
    loop {
        let b = (v & 0x7F) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return Ok(());
        }
        out.push(b | 0x80);
    }
}

pub fn varint_len(value: usize) -> usize {
    match value {
        0..=127 => 1,
        128..=16_383 => 2,
        16_384..=2_097_151 => 3,
        _ => 4,
    }
}

pub fn put_str(out: &mut Vec<u8>, text: &str) -> Result<(), EncodeError> {
    if text.contains('\0') {
        return refuse(format!("string {text:?} contains U+0000"));
    }
    put_bin(out, text.as_bytes()).map_err(|_| EncodeError("string longer than 65535 bytes".into()))
}

pub fn put_bin(out: &mut Vec<u8>, data: &[u8]) -> Result<(), EncodeError> {
    let len = u16::try_from(data.len())
        .map_err(|_| EncodeError("binary data longer than 65535 bytes".into()))?;
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(data);
    Ok(())
}
