//! The CommitLog record, byte for byte as `store/record.py` writes and reads it: the
//! native writer and the Python readers share one on-disk format.
//!
//! ```text
//! magic u32 | total_len u32 | crc32 u32            <- 12-byte frame; crc covers the rest
//! store_ts u64 | born_ts u64 | qos u8 | flags u8 | client_len u16 | topic_len u16 |
//! key_len u16 | props_len u32 | body_len u32 | nqueues u16 (u32 in an LGM2 record)
//! client_id | topic | key | properties (JSON) | body | nqueues x (len u16, name, offset u64)
//! ```
//! All integers big-endian. Properties are stored as the JSON the Python side made of
//! them; this module carries those bytes through untouched.

pub const MAGIC: u32 = 0x4C47_4D31; // "LGM1"
pub const MAGIC_WIDE: u32 = 0x4C47_4D32; // "LGM2": nqueues is a u32
pub const FRAME_SIZE: usize = 12;
pub const FIXED_SIZE: usize = 34;
pub const FIXED_WIDE_SIZE: usize = 36;
pub const HEADER_SIZE: usize = FRAME_SIZE + FIXED_SIZE;
pub const MAX_RECORD: usize = 512 * 1024 * 1024;
pub const MAX_QUEUES: usize = 0xFFFF;
pub const FLAG_RETAIN: u8 = 0x01;
/// An idempotent producer's first record of an append, and the rest of it
/// (`store/record.py`): the first carries the producer's sequence in its properties.
pub const MARK_FIRST: u8 = 0x02;
pub const MARKS: u8 = 0x06;

/// A message as the log keeps it, borrowed from wherever its fields live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record<'a> {
    pub store_ts: u64,
    pub born_ts: u64,
    pub qos: u8,
    pub retain: bool,
    /// The flag bits beside retain (an idempotent producer's marks), kept as given.
    pub marks: u8,
    pub client_id: &'a str,
    pub topic: &'a str,
    pub key: &'a str,
    /// The properties as stored (JSON), empty when there are none.
    pub properties: &'a [u8],
    pub body: &'a [u8],
    /// (light queue, offset in it), the exact-topic queue first.
    pub queues: Vec<(&'a str, u64)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordError {
    /// A field does not fit its length prefix.
    FieldTooLong(&'static str),
    /// Past the 512 MiB a record may take.
    TooLarge(usize),
    /// Not a whole, valid record (the text says what is wrong).
    Corrupt(&'static str),
}

impl std::fmt::Display for RecordError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecordError::FieldTooLong(what) => write!(f, "{what} too long for a record"),
            RecordError::TooLarge(n) => {
                write!(f, "record of {n} bytes exceeds the {MAX_RECORD}-byte limit")
            }
            RecordError::Corrupt(why) => write!(f, "corrupt record: {why}"),
        }
    }
}

impl std::error::Error for RecordError {}

fn u16_len(n: usize, what: &'static str) -> Result<u16, RecordError> {
    u16::try_from(n).map_err(|_| RecordError::FieldTooLong(what))
}

fn u32_len(n: usize, what: &'static str) -> Result<u32, RecordError> {
    u32::try_from(n).map_err(|_| RecordError::FieldTooLong(what))
}

/// The encoded size of `rec`, or why it cannot be encoded.
pub fn encoded_len(rec: &Record<'_>) -> Result<usize, RecordError> {
    let fixed = if rec.queues.len() > MAX_QUEUES {
        FIXED_WIDE_SIZE
    } else {
        FIXED_SIZE
    };
    let names: usize = rec.queues.iter().map(|(name, _)| 2 + name.len() + 8).sum();
    let total = FRAME_SIZE
        + fixed
        + rec.client_id.len()
        + rec.topic.len()
        + rec.key.len()
        + rec.properties.len()
        + rec.body.len()
        + names;
    if total > MAX_RECORD {
        return Err(RecordError::TooLarge(total));
    }
    Ok(total)
}

/// Append the encoding of `rec` to `out`; returns its size.
pub fn encode_into(rec: &Record<'_>, out: &mut Vec<u8>) -> Result<usize, RecordError> {
    let total = encoded_len(rec)?;
    let wide = rec.queues.len() > MAX_QUEUES;
    let start = out.len();
    out.reserve(total);
    out.extend_from_slice(&(if wide { MAGIC_WIDE } else { MAGIC }).to_be_bytes());
    out.extend_from_slice(&(total as u32).to_be_bytes());
    out.extend_from_slice(&[0; 4]); // the CRC, once the rest is there
    out.extend_from_slice(&rec.store_ts.to_be_bytes());
    out.extend_from_slice(&rec.born_ts.to_be_bytes());
    out.push(rec.qos);
    out.push((if rec.retain { FLAG_RETAIN } else { 0 }) | (rec.marks & !FLAG_RETAIN));
    out.extend_from_slice(&u16_len(rec.client_id.len(), "client id")?.to_be_bytes());
    out.extend_from_slice(&u16_len(rec.topic.len(), "topic")?.to_be_bytes());
    out.extend_from_slice(&u16_len(rec.key.len(), "key")?.to_be_bytes());
    out.extend_from_slice(&u32_len(rec.properties.len(), "properties")?.to_be_bytes());
    out.extend_from_slice(&u32_len(rec.body.len(), "body")?.to_be_bytes());
    if wide {
        out.extend_from_slice(&u32_len(rec.queues.len(), "queue list")?.to_be_bytes());
    } else {
        out.extend_from_slice(&(rec.queues.len() as u16).to_be_bytes());
    }
    out.extend_from_slice(rec.client_id.as_bytes());
    out.extend_from_slice(rec.topic.as_bytes());
    out.extend_from_slice(rec.key.as_bytes());
    out.extend_from_slice(rec.properties);
    out.extend_from_slice(rec.body);
    for (name, offset) in &rec.queues {
        out.extend_from_slice(&u16_len(name.len(), "queue name")?.to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&offset.to_be_bytes());
    }
    let crc = crc32fast::hash(&out[start + FRAME_SIZE..]);
    out[start + 8..start + FRAME_SIZE].copy_from_slice(&crc.to_be_bytes());
    debug_assert_eq!(out.len() - start, total);
    Ok(total)
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], RecordError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        let end = end.ok_or(RecordError::Corrupt(
            "field lengths disagree with the record length",
        ))?;
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, RecordError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, RecordError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, RecordError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, RecordError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }

    fn text(&mut self, n: usize) -> Result<&'a str, RecordError> {
        std::str::from_utf8(self.take(n)?)
            .map_err(|_| RecordError::Corrupt("text that is not UTF-8"))
    }
}

/// Decode and verify the record at the start of `buf`; returns it and its size. Every
/// length comes from the bytes, so none is trusted before it is checked against them.
pub fn decode(buf: &[u8]) -> Result<(Record<'_>, usize), RecordError> {
    if buf.len() < HEADER_SIZE {
        return Err(RecordError::Corrupt("truncated header"));
    }
    let mut r = Reader { buf, pos: 0 };
    let magic = r.u32()?;
    let total = r.u32()? as usize;
    let crc = r.u32()?;
    let wide = match magic {
        MAGIC => false,
        MAGIC_WIDE => true,
        _ => return Err(RecordError::Corrupt("bad magic")),
    };
    let fixed = if wide { FIXED_WIDE_SIZE } else { FIXED_SIZE };
    if total < FRAME_SIZE + fixed || total > MAX_RECORD || total > buf.len() {
        return Err(RecordError::Corrupt("bad length"));
    }
    if crc32fast::hash(&buf[FRAME_SIZE..total]) != crc {
        return Err(RecordError::Corrupt("CRC mismatch"));
    }
    let mut r = Reader {
        buf: &buf[..total],
        pos: FRAME_SIZE,
    };
    let store_ts = r.u64()?;
    let born_ts = r.u64()?;
    let qos = r.u8()?;
    let flags = r.u8()?;
    let lc = r.u16()? as usize;
    let lt = r.u16()? as usize;
    let lk = r.u16()? as usize;
    let lp = r.u32()? as usize;
    let lb = r.u32()? as usize;
    let nq = if wide {
        r.u32()? as usize
    } else {
        r.u16()? as usize
    };
    let client_id = r.text(lc)?;
    let topic = r.text(lt)?;
    let key = r.text(lk)?;
    let properties = r.take(lp)?;
    let body = r.take(lb)?;
    // Each queue takes at least 10 bytes: a count the rest cannot hold is a lie, not an
    // allocation to make.
    if nq > (total - r.pos) / 10 {
        return Err(RecordError::Corrupt(
            "field lengths disagree with the record length",
        ));
    }
    let mut queues = Vec::with_capacity(nq);
    for _ in 0..nq {
        let ln = r.u16()? as usize;
        let name = r.text(ln)?;
        queues.push((name, r.u64()?));
    }
    if r.pos != total {
        return Err(RecordError::Corrupt(
            "field lengths disagree with the record length",
        ));
    }
    let rec = Record {
        store_ts,
        born_ts,
        qos,
        retain: flags & FLAG_RETAIN != 0,
        marks: flags & !FLAG_RETAIN,
        client_id,
        topic,
        key,
        properties,
        body,
        queues,
    };
    Ok((rec, total))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Record<'static> {
        Record {
            store_ts: 1_700_000_000_123,
            born_ts: 1_700_000_000_100,
            qos: 1,
            retain: true,
            marks: 0x02,
            client_id: "dev-1",
            topic: "home/bath/temp",
            key: "",
            properties: b"{\"content_type\":\"text/plain\"}",
            body: b"21.5",
            queues: vec![("home/bath/temp", 7), ("home/+/temp", 3), ("home#2", 99)],
        }
    }

    #[test]
    fn round_trip() {
        let rec = sample();
        let mut out = Vec::new();
        let n = encode_into(&rec, &mut out).unwrap();
        assert_eq!(n, out.len());
        let (back, size) = decode(&out).unwrap();
        assert_eq!(size, n);
        assert_eq!(back, rec);
    }

    #[test]
    fn known_bytes() {
        // The frame and fixed part of the sample, as store/record.py packs them.
        let mut out = Vec::new();
        encode_into(&sample(), &mut out).unwrap();
        assert_eq!(&out[..4], b"LGM1");
        assert_eq!(
            u32::from_be_bytes(out[4..8].try_into().unwrap()) as usize,
            out.len()
        );
        assert_eq!(out[28], 1); // qos
        assert_eq!(out[29], FLAG_RETAIN | 0x02);
        assert_eq!(&out[HEADER_SIZE..HEADER_SIZE + 5], b"dev-1");
    }

    #[test]
    fn corruption_is_caught() {
        let mut out = Vec::new();
        encode_into(&sample(), &mut out).unwrap();
        for i in 0..out.len() {
            let mut bad = out.clone();
            bad[i] ^= 0x40;
            assert!(decode(&bad).is_err(), "a flipped byte {i} went unnoticed");
        }
        for n in 0..out.len() {
            assert!(decode(&out[..n]).is_err());
        }
    }

    #[test]
    fn wide_records_use_u32_counts() {
        let names: Vec<String> = (0..MAX_QUEUES + 1).map(|i| format!("q/{i}")).collect();
        let mut rec = sample();
        rec.queues = names.iter().map(|n| (n.as_str(), 1)).collect();
        let mut out = Vec::new();
        encode_into(&rec, &mut out).unwrap();
        assert_eq!(&out[..4], b"LGM2");
        assert_eq!(decode(&out).unwrap().0.queues.len(), MAX_QUEUES + 1);
    }

    proptest! {
        #[test]
        fn any_record_round_trips(
            store_ts: u64, born_ts: u64, qos in 0u8..3, retain: bool, marks in 0u8..8,
            client in "\\PC{0,20}", topic in "\\PC{1,40}", key in "\\PC{0,10}",
            props in proptest::collection::vec(any::<u8>(), 0..64),
            body in proptest::collection::vec(any::<u8>(), 0..256),
            queues in proptest::collection::vec(("\\PC{1,20}", any::<u64>()), 0..5),
        ) {
            let rec = Record {
                store_ts, born_ts, qos, retain, marks: marks & !FLAG_RETAIN, client_id: &client,
                topic: &topic, key: &key,
                properties: &props, body: &body,
                queues: queues.iter().map(|(n, o)| (n.as_str(), *o)).collect(),
            };
            let mut out = Vec::new();
            encode_into(&rec, &mut out).unwrap();
            let (back, size) = decode(&out).unwrap();
            prop_assert_eq!(size, out.len());
            prop_assert_eq!(back, rec);
        }

        #[test]
        fn hostile_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(&bytes);
        }
    }
}
