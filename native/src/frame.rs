//! The store's native protocol, its framing (`store/protocol.py`: `encode_frame`,
//! `FrameDecoder`), byte for byte: what a gateway node's appends and a store node's
//! answers will travel in once they are native (a Rust client of the store, the store's
//! hot requests answered here). The header is a JSON object kept as its bytes: this
//! layer frames, the requests' modules read the headers they carry.
//!
//! `length u32 | version u8 | kind u8 | code u16 | request id u32 | header length u32 |
//! JSON header | body`, big-endian; `length` counts every byte after itself.

/// The protocol version every frame carries (`VERSION`).
pub const VERSION: u8 = 1;
/// The fixed head: length, version, kind, code, request id, header length.
pub const HEAD: usize = 16;
/// The largest frame, all of it (`MAX_FRAME`).
pub const MAX_FRAME: usize = 64 * 1024 * 1024;

/// What a frame is (`REQUEST`, `RESPONSE`, `ERROR`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Request = 0,
    Response = 1,
    Error = 2,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        match b {
            0 => Some(Kind::Request),
            1 => Some(Kind::Response),
            2 => Some(Kind::Error),
            _ => None,
        }
    }
}

/// One frame; `header` is the JSON object's bytes (empty for `{}`, as Python sends it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: Kind,
    pub code: u16,
    pub request_id: u32,
    pub header: Vec<u8>,
    pub body: Vec<u8>,
}

/// Why bytes are not frames (`ProtocolError`'s messages, so both sides say the same).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    Version(u8),
    TooLarge { size: usize, max: usize },
    Malformed,
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Version(v) => write!(f, "unsupported protocol version {v}"),
            FrameError::TooLarge { size, max } => write!(f, "frame of {size} bytes exceeds {max}"),
            FrameError::Malformed => write!(f, "malformed frame header"),
        }
    }
}

impl std::error::Error for FrameError {}

/// The frame's bytes, appended to `out` (one allocation for a run of frames that go out
/// in one write). A frame over MAX_FRAME is refused before anything is written.
pub fn encode_into(frame: &Frame, out: &mut Vec<u8>) -> Result<(), FrameError> {
    let size = HEAD + frame.header.len() + frame.body.len();
    if size > MAX_FRAME {
        return Err(FrameError::TooLarge {
            size,
            max: MAX_FRAME,
        });
    }
    out.reserve(size);
    out.extend_from_slice(&((size - 4) as u32).to_be_bytes());
    out.push(VERSION);
    out.push(frame.kind as u8);
    out.extend_from_slice(&frame.code.to_be_bytes());
    out.extend_from_slice(&frame.request_id.to_be_bytes());
    out.extend_from_slice(&(frame.header.len() as u32).to_be_bytes());
    out.extend_from_slice(&frame.header);
    out.extend_from_slice(&frame.body);
    Ok(())
}

pub fn encode(frame: &Frame) -> Result<Vec<u8>, FrameError> {
    let mut out = Vec::new();
    encode_into(frame, &mut out)?;
    Ok(out)
}

/// Bytes in, frames out, across any chunk boundaries. What it holds is one incomplete
/// frame at most (`buffered`), never past `max_frame`: a peer announcing a larger one is
/// refused from its head, before its bytes are held.
pub struct Decoder {
    max_frame: usize,
    buf: Vec<u8>,
}

impl Decoder {
    pub fn new(max_frame: usize) -> Decoder {
        Decoder {
            max_frame,
            buf: Vec::new(),
        }
    }

    /// Bytes of an incomplete frame held until the rest arrives.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The frames `data` completes, in order. An error leaves the decoder unusable (the
    /// connection ends after an error frame, as the Python server does).
    pub fn feed(&mut self, data: &[u8]) -> Result<Vec<Frame>, FrameError> {
        self.buf.extend_from_slice(data);
        let mut out = Vec::new();
        let mut pos = 0;
        while self.buf.len() - pos >= HEAD {
            let head = &self.buf[pos..pos + HEAD];
            let length = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
            if head[4] != VERSION {
                return Err(FrameError::Version(head[4]));
            }
            if length + 4 > self.max_frame {
                return Err(FrameError::TooLarge {
                    size: length + 4,
                    max: self.max_frame,
                });
            }
            let kind = Kind::from_u8(head[5]);
            let hlen = u32::from_be_bytes([head[12], head[13], head[14], head[15]]) as usize;
            let Some(kind) = kind.filter(|_| length >= HEAD - 4 && hlen <= length - (HEAD - 4))
            else {
                return Err(FrameError::Malformed);
            };
            let end = pos + 4 + length;
            if self.buf.len() < end {
                break;
            }
            let hstart = pos + HEAD;
            out.push(Frame {
                kind,
                code: u16::from_be_bytes([head[6], head[7]]),
                request_id: u32::from_be_bytes([head[8], head[9], head[10], head[11]]),
                header: self.buf[hstart..hstart + hlen].to_vec(),
                body: self.buf[hstart + hlen..end].to_vec(),
            });
            pos = end;
        }
        self.buf.drain(..pos);
        Ok(out)
    }
}

/// `s` as a JSON string into `out`, as serde_json writes it (the headers' strings):
/// quotes, backslashes and control characters escaped, the rest as it is.
pub fn push_json_str(out: &mut String, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push('"');
        out.push_str(s);
        out.push('"');
    } else {
        out.push_str(&serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `encode_frame(Frame(REQUEST, PUBLISH, 7, {"messages": [{"topic": "dev/1/t",
    /// "size": 2, "qos": 1}]}, b"hi"))` as store/protocol.py encodes it.
    const PY_PUBLISH: [u8; 69] = [
        0, 0, 0, 65, 1, 0, 0, 11, 0, 0, 0, 7, 0, 0, 0, 51, 123, 34, 109, 101, 115, 115, 97, 103,
        101, 115, 34, 58, 91, 123, 34, 116, 111, 112, 105, 99, 34, 58, 34, 100, 101, 118, 47, 49,
        47, 116, 34, 44, 34, 115, 105, 122, 101, 34, 58, 50, 44, 34, 113, 111, 115, 34, 58, 49,
        125, 93, 125, 104, 105,
    ];
    /// `encode_frame(Frame(RESPONSE, HELLO, 1, {}, b""))`: an empty header is no bytes.
    const PY_HELLO_ANSWER: [u8; 16] = [0, 0, 0, 12, 1, 1, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0];

    fn publish() -> Frame {
        Frame {
            kind: Kind::Request,
            code: 11,
            request_id: 7,
            header: br#"{"messages":[{"topic":"dev/1/t","size":2,"qos":1}]}"#.to_vec(),
            body: b"hi".to_vec(),
        }
    }

    #[test]
    fn encodes_as_python_does() {
        assert_eq!(encode(&publish()).unwrap(), PY_PUBLISH);
        let hello = Frame {
            kind: Kind::Response,
            code: 1,
            request_id: 1,
            header: Vec::new(),
            body: Vec::new(),
        };
        assert_eq!(encode(&hello).unwrap(), PY_HELLO_ANSWER);
    }

    #[test]
    fn decodes_pythons_frames_split_anywhere() {
        let mut all = PY_PUBLISH.to_vec();
        all.extend_from_slice(&PY_HELLO_ANSWER);
        for cut in 0..=all.len() {
            let mut d = Decoder::new(MAX_FRAME);
            let mut got = d.feed(&all[..cut]).unwrap();
            got.extend(d.feed(&all[cut..]).unwrap());
            assert_eq!(got.len(), 2, "cut at {cut}");
            assert_eq!(got[0], publish());
            assert_eq!(
                (got[1].kind, got[1].code, got[1].request_id),
                (Kind::Response, 1, 1)
            );
            assert_eq!(d.buffered(), 0);
        }
    }

    #[test]
    fn refuses_what_python_refuses() {
        let mut bad_version = PY_HELLO_ANSWER;
        bad_version[4] = 2;
        assert_eq!(
            Decoder::new(MAX_FRAME)
                .feed(&bad_version)
                .unwrap_err()
                .to_string(),
            "unsupported protocol version 2"
        );
        let mut huge = PY_HELLO_ANSWER;
        huge[..4].copy_from_slice(&(MAX_FRAME as u32).to_be_bytes());
        assert_eq!(
            Decoder::new(MAX_FRAME)
                .feed(&huge[..HEAD])
                .unwrap_err()
                .to_string(),
            format!("frame of {} bytes exceeds {MAX_FRAME}", MAX_FRAME + 4)
        );
        let mut long_header = PY_HELLO_ANSWER;
        long_header[15] = 1; // a header longer than the frame
        assert_eq!(
            Decoder::new(MAX_FRAME).feed(&long_header),
            Err(FrameError::Malformed)
        );
        let mut kind = PY_HELLO_ANSWER;
        kind[5] = 3;
        assert_eq!(
            Decoder::new(MAX_FRAME).feed(&kind),
            Err(FrameError::Malformed)
        );
        // A small budget (an unauthenticated connection's) refuses from the head alone.
        assert!(matches!(
            Decoder::new(64).feed(&PY_PUBLISH[..HEAD]),
            Err(FrameError::TooLarge { size: 69, max: 64 })
        ));
    }

    fn any_frame() -> impl Strategy<Value = Frame> {
        (
            0u8..3,
            any::<u16>(),
            any::<u32>(),
            proptest::collection::vec(any::<u8>(), 0..64),
            proptest::collection::vec(any::<u8>(), 0..256),
        )
            .prop_map(|(k, code, request_id, header, body)| Frame {
                kind: Kind::from_u8(k).unwrap(),
                code,
                request_id,
                header,
                body,
            })
    }

    proptest! {
        #[test]
        fn header_strings_are_written_as_serde_json_writes_them(s in any::<String>()) {
            let mut out = String::from("x");
            push_json_str(&mut out, &s);
            prop_assert_eq!(&out[1..], serde_json::to_string(&s).unwrap());
        }

        #[test]
        fn round_trips_in_any_chunks(
            frames in proptest::collection::vec(any_frame(), 1..8),
            chunk in 1usize..40,
        ) {
            let mut wire = Vec::new();
            for f in &frames {
                encode_into(f, &mut wire).unwrap();
            }
            let mut d = Decoder::new(MAX_FRAME);
            let mut got = Vec::new();
            for part in wire.chunks(chunk) {
                got.extend(d.feed(part).unwrap());
                prop_assert!(d.buffered() < HEAD + 64 + 256);
            }
            prop_assert_eq!(got, frames);
            prop_assert_eq!(d.buffered(), 0);
        }
    }
}
