//! MQTT over WebSocket for the native listeners: the HTTP upgrade and the frames
//! (`gateway/transports.py`'s `receive_upgrade` and `WebSocketStream`, on wsproto and
//! h11, are the reference, and their answers are given here byte for byte).
//!
//! - *The upgrade* (`read_head`): the request's head, parsed by httparse, bounded to
//!   `HEAD_LIMIT` as h11 bounds it, then held to wsproto's rules in wsproto's order:
//!   GET, `Connection: upgrade`, `Sec-WebSocket-Version: 13` (426 for another, 400 for
//!   none, with the version we speak), a key, `Upgrade: websocket`, a Host. What breaks
//!   them is refused with wsproto's answer (`refusal`). The subprotocol is the owner's
//!   to choose; `accept` is the 101 for the one it chose.
//! - *The frames* (`Codec`): headers read by tungstenite's `FrameHeader`, held to
//!   wsproto's checks (minimal lengths, no reserved bits, masked from a client, control
//!   frames whole and at most 125 bytes, continuation only inside a message). A
//!   message's bytes are unmasked in place and handed on as they arrive, never held
//!   whole: what a client sent of a packet waits in the MQTT decoder, as in
//!   `WebSocketStream`. A message past its limit closes with 1009, a text frame with
//!   1003 (MQTT-6.0.0-1); a ping is answered (the latest, if several wait); the peer's
//!   close is echoed, and read as the end (1000, 1001, 1005) or as a broken connection.
//!   Each write is one binary message, cut in frames of at most `FRAME_PAYLOAD`.
//!
//! What it holds is bounded whatever a client sends: a header (14 bytes), a control
//! frame's payload (125), the latest ping's, one close frame.

use std::io::Cursor;

use tungstenite::handshake::derive_accept_key;
use tungstenite::protocol::frame::coding::{Control, Data, OpCode};
use tungstenite::protocol::frame::FrameHeader;

/// Bytes a request's head may take before it is refused (h11's
/// `max_incomplete_event_size`, under wsproto).
pub const HEAD_LIMIT: usize = 16 * 1024;
/// Headers a request may have (a head within `HEAD_LIMIT` with more is refused).
const MAX_HEADERS: usize = 100;
/// Payload of one of our frames, at most: a larger write goes out in several messages.
pub const FRAME_PAYLOAD: usize = 64 * 1024;
/// How long our close frame may take to go out, and then how long the peer has to
/// answer it (`transports.WS_CLOSE_TIMEOUT`).
pub const CLOSE_TIMEOUT_S: f64 = 1.0;
/// Bytes read past while waiting for the peer's close frame (`WS_CLOSE_DRAIN`).
pub const CLOSE_DRAIN: usize = 256 * 1024;
/// Close codes that are the peer simply going away: read as the end of the stream.
const NORMAL_CLOSES: [u16; 3] = [1000, 1001, 1005];
/// The close codes a peer may send below 3000 (wsproto's `CloseReason`, less the ones
/// only an endpoint itself may use: 1005, 1006, 1015).
const PEER_CODES: [u16; 11] = [
    1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013,
];
const PROTOCOL_ERROR: u16 = 1002;
const UNSUPPORTED_DATA: u16 = 1003;
const INVALID_PAYLOAD: u16 = 1007;
const MESSAGE_TOO_BIG: u16 = 1009;

// ---------------------------------------------------------------------------------------
// The upgrade
// ---------------------------------------------------------------------------------------

/// A client's upgrade request, for its owner to choose a subprotocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub target: String,
    pub subprotocols: Vec<String>,
    pub key: Vec<u8>,
    /// HTTP/1.0: a refusal then says `Connection: close`, as h11's does.
    pub http10: bool,
}

/// What a head read so far is.
#[derive(Debug, PartialEq, Eq)]
pub enum Head {
    /// More bytes are needed.
    Incomplete,
    /// An upgrade request, its head this many bytes long (frames may follow).
    Request(Request, usize),
    /// Not an upgrade: this answer, then the connection closes.
    Refused(Vec<u8>),
}

/// The request at the start of `buf`, if it is there (see the module's notes).
pub fn read_head(buf: &[u8]) -> Head {
    // h11 refuses at once a request line whose first byte is not visible (MQTT bytes
    // on the WebSocket port, a blank line): nothing better can follow.
    if buf.first().is_some_and(|&b| b < 0x21) {
        return Head::Refused(refusal(400, &[], None, false));
    }
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => match check(&req) {
            Ok(request) => Head::Request(request, n),
            Err(answer) => Head::Refused(answer),
        },
        Ok(httparse::Status::Partial) if buf.len() <= HEAD_LIMIT => Head::Incomplete,
        _ => Head::Refused(refusal(400, &[], None, false)),
    }
}

/// A header's value without the whitespace around it (h11 strips it).
fn value<'a>(h: &httparse::Header<'a>) -> &'a [u8] {
    h.value.trim_ascii()
}

/// A comma-separated header's items, trimmed (wsproto's `split_comma_header`); None if
/// one is not ASCII.
fn items(v: &[u8]) -> Option<Vec<String>> {
    v.split(|&b| b == b',')
        .map(|p| {
            std::str::from_utf8(p.trim_ascii())
                .ok()
                .filter(|s| s.is_ascii())
                .map(str::to_owned)
        })
        .collect()
}

/// h11's checks of a request it parsed, then wsproto's of an upgrade, in their order.
fn check(req: &httparse::Request<'_, '_>) -> Result<Request, Vec<u8>> {
    let http10 = req.version == Some(0);
    let bad = || refusal(400, &[], None, http10);
    let named = |name: &'static str| {
        req.headers
            .iter()
            .filter(move |h| h.name.eq_ignore_ascii_case(name))
    };
    // h11: a target of visible ASCII; one Host at most, and one for HTTP/1.1; a body's
    // framing it can read.
    let target = req.path.unwrap_or_default();
    if target.is_empty() || !target.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(bad());
    }
    let hosts = named("host").count();
    if hosts > 1 || hosts == 0 && !http10 {
        return Err(bad());
    }
    let lengths: Vec<&[u8]> = named("content-length").map(value).collect();
    if lengths
        .iter()
        .any(|v| v.is_empty() || !v.iter().all(u8::is_ascii_digit) || *v != lengths[0])
    {
        return Err(bad());
    }
    let codings: Vec<&[u8]> = named("transfer-encoding").map(value).collect();
    if codings.len() > 1
        || codings
            .first()
            .is_some_and(|v| !v.eq_ignore_ascii_case(b"chunked"))
    {
        return Err(bad());
    }
    // wsproto.
    if req.method != Some("GET") {
        return Err(bad());
    }
    let mut connection: Option<Vec<String>> = None;
    let (mut key, mut version, mut upgrade) = (None, None, &b""[..]);
    let mut subprotocols = Vec::new();
    for h in req.headers.iter() {
        let v = value(h);
        match h.name.to_ascii_lowercase().as_str() {
            "connection" => connection = Some(items(v).ok_or_else(bad)?),
            "sec-websocket-key" => key = Some(v),
            "sec-websocket-protocol" => subprotocols.extend(items(v).ok_or_else(bad)?),
            "sec-websocket-version" => version = Some(v),
            "upgrade" => upgrade = v,
            _ => {}
        }
    }
    if !connection.is_some_and(|c| c.iter().any(|t| t.eq_ignore_ascii_case("upgrade"))) {
        return Err(bad());
    }
    if version != Some(b"13") {
        let status = if version.is_some() { 426 } else { 400 };
        return Err(refusal(
            status,
            &[("Sec-WebSocket-Version", "13")],
            None,
            http10,
        ));
    }
    let Some(key) = key else {
        return Err(bad());
    };
    if !upgrade.eq_ignore_ascii_case(b"websocket") || hosts == 0 {
        return Err(bad());
    }
    Ok(Request {
        target: target.to_owned(),
        subprotocols,
        key: key.to_vec(),
        http10,
    })
}

/// An HTTP answer that refuses the upgrade, as h11 writes wsproto's `RejectConnection`:
/// no reason phrase, `content-length: 0` when there is no body, `Connection: close` to
/// an HTTP/1.0 client.
pub fn refusal(
    status: u16,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
    http10: bool,
) -> Vec<u8> {
    let mut out = format!("HTTP/1.1 {status} \r\n").into_bytes();
    for (name, value) in headers {
        out.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
    }
    if body.is_none() {
        out.extend_from_slice(b"content-length: 0\r\n");
    }
    if http10 {
        out.extend_from_slice(b"Connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body.unwrap_or_default());
    out
}

/// The owner's refusal with a body (`transports.reject_upgrade`): plain text.
pub fn refusal_with(status: u16, body: &[u8], http10: bool) -> Vec<u8> {
    let length = body.len().to_string();
    refusal(
        status,
        &[("content-type", "text/plain"), ("content-length", &length)],
        Some(body),
        http10,
    )
}

/// The 101 that accepts `req` with `subprotocol` (one it offered), as wsproto's
/// `AcceptConnection` is written.
pub fn accept(req: &Request, subprotocol: Option<&str>) -> Result<Vec<u8>, String> {
    let mut out =
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            .to_vec();
    out.extend_from_slice(
        format!("Sec-WebSocket-Accept: {}\r\n", derive_accept_key(&req.key)).as_bytes(),
    );
    if let Some(p) = subprotocol {
        if !req.subprotocols.iter().any(|o| o == p) {
            return Err(format!("unexpected subprotocol {p}"));
        }
        out.extend_from_slice(format!("Sec-WebSocket-Protocol: {p}\r\n").as_bytes());
    }
    out.extend_from_slice(b"\r\n");
    Ok(out)
}

// ---------------------------------------------------------------------------------------
// The frames
// ---------------------------------------------------------------------------------------

/// A frame being read.
#[derive(Debug, Clone, Copy)]
struct FrameIn {
    opcode: OpCode,
    fin: bool,
    mask: [u8; 4],
    /// Payload bytes still to come, and how many came (the mask's phase).
    left: u64,
    seen: u64,
}

/// What a stream of frames is, on the server's side.
#[derive(Debug, Default)]
pub struct Codec {
    head: [u8; 14],
    head_len: usize,
    frame: Option<FrameIn>,
    /// A control frame's payload so far (125 bytes at most).
    control: Vec<u8>,
    /// A binary message under way: its bytes so far, and the most it may have (fixed
    /// as it began, as `WebSocketStream` asks `message_limit` then).
    message: Option<(u64, usize)>,
    /// The latest ping's payload, not answered yet.
    pong: Option<Vec<u8>>,
    /// Our close frame, not yet handed to the link.
    close_out: Option<Vec<u8>>,
    /// Our close frame is queued or out: no data frame may follow it.
    close_sent: bool,
    /// The peer's close frame came (or the connection ended): nothing more to wait for.
    peer_done: bool,
    /// The frames broke a rule wsproto's parser stops at: nothing more is read of them.
    dead: bool,
    /// What reads say from here on: the end (None) or why it broke.
    end: Option<Option<String>>,
    /// The limit a message ran past (it closed with 1009).
    over: Option<usize>,
}

/// Why decoding stopped for good.
enum Stop {
    /// The read's payload is given up (as `WebSocketStream` raises out of its read).
    Now(String),
    /// What was read before it is still handed on (wsproto reports it as a close).
    After,
}

impl Codec {
    pub fn new() -> Codec {
        Codec::default()
    }

    /// Decode the frames in `buf` (from the client, masked), leaving the message bytes
    /// they carry unmasked at its start: how many, or why the connection breaks now
    /// (its close frame queued). `limit`: the most a message that begins here may hold.
    /// Once the stream has ended (`ended`), frames are only read past, for the peer's
    /// close frame.
    pub fn decode(&mut self, buf: &mut [u8], limit: usize) -> Result<usize, String> {
        let mut at = 0;
        let mut out = 0;
        while at < buf.len() && !self.dead && !(self.peer_done && self.end.is_some()) {
            let Some(mut f) = self.frame else {
                match self.header(&buf[at..]) {
                    Ok((0, false)) => break, // (a header is 14 bytes at most)
                    Ok((used, done)) => {
                        at += used;
                        if done {
                            if let Err(stop) = self.begin(limit) {
                                return self.stopped(stop, out);
                            }
                        }
                    }
                    Err(stop) => return self.stopped(stop, out),
                }
                continue;
            };
            let take = (f.left.min((buf.len() - at) as u64)) as usize;
            let chunk = &mut buf[at..at + take];
            unmask(chunk, f.mask, f.seen);
            f.left -= take as u64;
            f.seen += take as u64;
            self.frame = Some(f);
            let draining = self.end.is_some();
            match f.opcode {
                OpCode::Control(_) => self.control.extend_from_slice(chunk),
                OpCode::Data(Data::Text) if !draining => {
                    if let Err(stop) = self.text(chunk) {
                        return self.stopped(stop, out);
                    }
                }
                OpCode::Data(_) if !draining && self.message.is_some() => {
                    if let Err(stop) = self.count(take) {
                        return self.stopped(stop, out);
                    }
                    buf.copy_within(at..at + take, out);
                    out += take;
                }
                OpCode::Data(_) => {}
            }
            at += take;
            if f.left == 0 {
                if let Err(stop) = self.finish(f) {
                    return self.stopped(stop, out);
                }
            }
        }
        Ok(out)
    }

    /// Read a frame's header from `data` into `head`: bytes used, and whether it is
    /// whole (then `frame` is set).
    fn header(&mut self, data: &[u8]) -> Result<(usize, bool), Stop> {
        let before = self.head_len;
        let copy = data.len().min(self.head.len() - before);
        self.head[before..before + copy].copy_from_slice(&data[..copy]);
        self.head_len += copy;
        if self.head_len >= 2 {
            self.first_two()?;
        }
        let head = self.head;
        let mut cursor = Cursor::new(&head[..self.head_len]);
        let parsed = FrameHeader::parse(&mut cursor)
            .map_err(|e| self.fail(PROTOCOL_ERROR, &e.to_string()))?;
        let Some((h, length)) = parsed else {
            return Ok((copy, false));
        };
        let size = cursor.position() as usize;
        self.head_len = 0;
        let extended = size - 2 - if h.mask.is_some() { 4 } else { 0 };
        if extended == 2 && length <= 125 {
            return Err(self.fail(
                PROTOCOL_ERROR,
                "Payload length used 2 bytes when 1 would have sufficed",
            ));
        }
        if extended == 8 && length <= 0xFFFF {
            return Err(self.fail(
                PROTOCOL_ERROR,
                "Payload length used 8 bytes when 2 would have sufficed",
            ));
        }
        if length >> 63 != 0 {
            return Err(self.fail(PROTOCOL_ERROR, "8-byte payload length with non-zero MSB"));
        }
        if h.rsv1 || h.rsv2 || h.rsv3 {
            return Err(self.fail(PROTOCOL_ERROR, "Reserved bit set unexpectedly"));
        }
        let Some(mask) = h.mask else {
            return Err(self.fail(PROTOCOL_ERROR, "server received unexpected unmasked frame"));
        };
        self.frame = Some(FrameIn {
            opcode: h.opcode,
            fin: h.is_final,
            mask,
            left: length,
            seen: 0,
        });
        Ok((size - before, true))
    }

    /// What wsproto refuses from a header's first two bytes, before the rest came.
    fn first_two(&mut self) -> Result<(), Stop> {
        let (b0, b1) = (self.head[0], self.head[1]);
        let opcode = b0 & 0x0F;
        if matches!(opcode, 3..=7 | 11..=15) {
            return Err(self.fail(PROTOCOL_ERROR, &format!("Invalid opcode {opcode:#x}")));
        }
        let control = opcode & 0x08 != 0;
        if control && b0 & 0x80 == 0 {
            return Err(self.fail(PROTOCOL_ERROR, "Invalid attempt to fragment control frame"));
        }
        if control && b1 & 0x7F > 125 {
            return Err(self.fail(PROTOCOL_ERROR, "Control frame with payload len > 125"));
        }
        Ok(())
    }

    /// A frame's header was read: where it stands in its message.
    fn begin(&mut self, limit: usize) -> Result<(), Stop> {
        let f = self.frame.expect("a header was read");
        if self.end.is_some() {
            // Read past for the close frame only (as wsproto keeps parsing).
        } else if let OpCode::Data(d) = f.opcode {
            match (d, self.message.is_some()) {
                (Data::Continue, false) => {
                    return Err(self.fail(PROTOCOL_ERROR, "unexpected CONTINUATION"))
                }
                (Data::Binary | Data::Text, true) => {
                    return Err(self.fail(
                        PROTOCOL_ERROR,
                        &format!("expected CONTINUATION, got {}", opcode_name(d)),
                    ))
                }
                (Data::Binary, false) => self.message = Some((0, limit)),
                _ => {}
            }
        }
        if f.left == 0 {
            if matches!(f.opcode, OpCode::Data(Data::Text)) && self.end.is_none() {
                self.text(&[])?;
            }
            self.finish(f)?;
        }
        Ok(())
    }

    /// A text frame's first bytes: MQTT needs binary frames (wsproto first decodes
    /// them, and a byte that is not UTF-8 is its own error).
    fn text(&mut self, chunk: &[u8]) -> Result<(), Stop> {
        if let Err(e) = std::str::from_utf8(chunk) {
            if e.error_len().is_some() {
                return Err(self.fail(INVALID_PAYLOAD, &utf8_error(chunk, &e)));
            }
        }
        self.queue_close(UNSUPPORTED_DATA, "MQTT needs binary frames");
        self.end = Some(Some("text frame on an MQTT websocket".into()));
        Err(Stop::Now("text frame on an MQTT websocket".into()))
    }

    /// `n` more bytes of the message under way, within its limit.
    fn count(&mut self, n: usize) -> Result<(), Stop> {
        let Some((size, limit)) = self.message.as_mut() else {
            return Ok(());
        };
        *size += n as u64;
        if *size > *limit as u64 {
            let limit = *limit;
            self.over = Some(limit);
            self.queue_close(MESSAGE_TOO_BIG, &format!("message over {limit} bytes"));
            let why = format!("websocket message over {limit} bytes");
            self.end = Some(Some(why.clone()));
            return Err(Stop::Now(why));
        }
        Ok(())
    }

    /// A frame's payload is all in.
    fn finish(&mut self, f: FrameIn) -> Result<(), Stop> {
        self.frame = None;
        match f.opcode {
            OpCode::Data(_) => {
                if f.fin && self.end.is_none() {
                    self.message = None;
                }
            }
            OpCode::Control(Control::Ping) => {
                if self.end.is_none() && !self.close_sent {
                    self.pong = Some(std::mem::take(&mut self.control));
                }
            }
            OpCode::Control(Control::Close) => return self.peer_close(),
            OpCode::Control(_) => {}
        }
        self.control.clear();
        if self.control.capacity() > 125 {
            self.control = Vec::new();
        }
        Ok(())
    }

    /// The peer's close frame: echoed (wsproto's `response()`), and the end of reading.
    fn peer_close(&mut self) -> Result<(), Stop> {
        let payload = std::mem::take(&mut self.control);
        let code = match payload.len() {
            0 => 1005,
            1 => return Err(self.fail(PROTOCOL_ERROR, "CLOSE with 1 byte payload")),
            _ => u16::from_be_bytes([payload[0], payload[1]]),
        };
        if !(1000..=4999).contains(&code) {
            return Err(self.fail(PROTOCOL_ERROR, "CLOSE with invalid code"));
        }
        if matches!(code, 1005 | 1006 | 1015) && payload.len() >= 2 {
            return Err(self.fail(PROTOCOL_ERROR, "remote CLOSE with local-only reason"));
        }
        if code < 3000 && payload.len() >= 2 && !PEER_CODES.contains(&code) {
            return Err(self.fail(PROTOCOL_ERROR, "CLOSE with unknown reserved code"));
        }
        let reason = payload.get(2..).unwrap_or_default();
        if let Err(e) = std::str::from_utf8(reason) {
            let why = format!("Error decoding CLOSE reason: {}", utf8_error(reason, &e));
            return Err(self.fail(INVALID_PAYLOAD, &why));
        }
        self.peer_done = true;
        if !self.close_sent {
            // Echoed as it came: its code and reason (none for 1005).
            self.close_sent = true;
            self.pong = None;
            self.close_out = Some(frame_bytes(OpCode::Control(Control::Close), &payload));
        }
        if self.end.is_none() {
            self.end = Some(if NORMAL_CLOSES.contains(&code) {
                None
            } else {
                Some(format!("websocket closed: {code}"))
            });
        }
        Err(Stop::After)
    }

    /// A rule wsproto's parser stops at: told to the peer as a close with `code`, and
    /// read as one (`WebSocketStream` sends it, then reports the code).
    fn fail(&mut self, code: u16, reason: &str) -> Stop {
        self.dead = true;
        self.frame = None;
        self.queue_close(code, reason);
        if self.end.is_none() {
            self.end = Some(Some(format!("websocket closed: {code}")));
        }
        Stop::After
    }

    fn stopped(&mut self, stop: Stop, out: usize) -> Result<usize, String> {
        match stop {
            Stop::Now(why) => Err(why),
            Stop::After => Ok(out),
        }
    }

    /// Our close frame, with `code` and `reason` (cut to fit a control frame at a
    /// character's boundary), unless one was sent already.
    fn queue_close(&mut self, code: u16, reason: &str) {
        if self.close_sent {
            return;
        }
        self.close_sent = true;
        self.pong = None;
        let mut payload = code.to_be_bytes().to_vec();
        let mut cut = reason.len().min(123);
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        payload.extend_from_slice(&reason.as_bytes()[..cut]);
        self.close_out = Some(frame_bytes(OpCode::Control(Control::Close), &payload));
    }

    /// Close from our side (`WebSocketStream.aclose`): 1000, unless a close was sent.
    /// Nothing more is read from here but the peer's close frame.
    pub fn close(&mut self) {
        if !self.peer_done {
            self.queue_close(1000, "");
        }
        if self.end.is_none() {
            self.end = Some(None);
        }
    }

    /// The limit of the message that ran past it, once one did (1009).
    pub fn too_big(&self) -> Option<usize> {
        self.over
    }

    /// The transport ended: reads end, broken unless the peer's close frame came.
    pub fn eof(&mut self) {
        self.peer_done = true;
        self.dead = true;
        if self.end.is_none() {
            self.end = Some(Some("websocket closed without a close frame".into()));
        }
    }

    /// What reads say once the message bytes are all handed on: None while the stream
    /// is open; Some(None) at its end; Some(Some(why)) when it broke.
    pub fn ended(&self) -> Option<Option<&str>> {
        self.end.as_ref().map(|e| e.as_deref())
    }

    /// Our close frame went out and the peer's answer is still to come.
    pub fn awaits_peer(&self) -> bool {
        self.close_sent && !self.peer_done && !self.dead
    }

    /// Our close frame is queued or out: nothing more may be sent.
    pub fn close_sent(&self) -> bool {
        self.close_sent
    }

    /// A control frame to send (a pong, then our close), if one waits.
    pub fn take_control(&mut self) -> Option<Vec<u8>> {
        if let Some(p) = self.pong.take() {
            return Some(frame_bytes(OpCode::Control(Control::Pong), &p));
        }
        self.close_out.take()
    }

    pub fn has_control(&self) -> bool {
        self.pong.is_some() || self.close_out.is_some()
    }

    /// Bytes it holds beyond itself (for the budgets' counts and the tests).
    pub fn held(&self) -> usize {
        self.control.capacity()
            + self.pong.as_ref().map_or(0, Vec::capacity)
            + self.close_out.as_ref().map_or(0, Vec::capacity)
    }
}

/// What Python says of bytes that are not UTF-8 (wsproto's close reason repeats it).
fn utf8_error(data: &[u8], e: &std::str::Utf8Error) -> String {
    let at = e.valid_up_to();
    let Some(&byte) = data.get(at) else {
        return "'utf-8' codec can't decode: unexpected end of data".into();
    };
    let what = if e.error_len().is_none() {
        "unexpected end of data"
    } else if matches!(byte, 0x80..=0xC1 | 0xF5..=0xFF) {
        "invalid start byte"
    } else {
        "invalid continuation byte"
    };
    format!("'utf-8' codec can't decode byte {byte:#04x} in position {at}: {what}")
}

fn opcode_name(d: Data) -> &'static str {
    match d {
        Data::Text => "<Opcode.TEXT: 1>",
        Data::Binary => "<Opcode.BINARY: 2>",
        _ => "<Opcode.CONTINUATION: 0>",
    }
}

/// XOR `data` with `mask`, `seen` bytes into the frame's payload.
fn unmask(data: &mut [u8], mask: [u8; 4], seen: u64) {
    let phase = (seen % 4) as usize;
    for (i, b) in data.iter_mut().enumerate() {
        *b ^= mask[(phase + i) % 4];
    }
}

/// A whole unmasked frame (ours: the server's are never masked).
fn frame_bytes(opcode: OpCode, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 10);
    frame_into(opcode, payload, &mut out);
    out
}

fn frame_into(opcode: OpCode, payload: &[u8], out: &mut Vec<u8>) {
    let header = FrameHeader {
        is_final: true,
        rsv1: false,
        rsv2: false,
        rsv3: false,
        opcode,
        mask: None,
    };
    header
        .format(payload.len() as u64, out)
        .expect("a Vec takes every byte");
    out.extend_from_slice(payload);
}

/// One binary message of `payload` at the end of `out`.
pub fn binary_into(payload: &[u8], out: &mut Vec<u8>) {
    frame_into(OpCode::Data(Data::Binary), payload, out);
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &[u8] = b"GET /mqtt HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: mqtt\r\n\r\n";
    const BAD: &[u8] = b"HTTP/1.1 400 \r\ncontent-length: 0\r\n\r\n";

    fn replaced(from: &str, to: &str) -> Vec<u8> {
        String::from_utf8(GOOD.to_vec())
            .unwrap()
            .replacen(from, to, 1)
            .into_bytes()
    }

    /// A masked client frame.
    pub fn client_frame(b0: u8, payload: &[u8], mask: [u8; 4]) -> Vec<u8> {
        let mut out = vec![b0];
        match payload.len() {
            n if n <= 125 => out.push(0x80 | n as u8),
            n if n <= 0xFFFF => {
                out.push(0x80 | 126);
                out.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                out.push(0x80 | 127);
                out.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        out.extend_from_slice(&mask);
        let mut body = payload.to_vec();
        unmask(&mut body, mask, 0);
        out.extend_from_slice(&body);
        out
    }

    #[test]
    fn a_good_upgrade_and_its_101() {
        let Head::Request(req, n) = read_head(GOOD) else {
            panic!("not read")
        };
        assert_eq!(n, GOOD.len());
        assert_eq!(req.target, "/mqtt");
        assert_eq!(req.subprotocols, vec!["mqtt"]);
        // wsproto's bytes for this request (RFC 6455's sample key).
        assert_eq!(
            accept(&req, Some("mqtt")).unwrap(),
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\nSec-WebSocket-Protocol: mqtt\r\n\r\n"
        );
        assert!(accept(&req, Some("chat")).is_err());
        for cut in 0..GOOD.len() {
            assert_eq!(read_head(&GOOD[..cut]), Head::Incomplete, "{cut}");
        }
    }

    #[test]
    fn what_wsproto_refuses_is_refused_as_it_refuses_it() {
        let cases: Vec<(Vec<u8>, &[u8])> = vec![
            (replaced("GET", "POST"), BAD),
            (replaced("GET", "get"), BAD),
            (replaced("Connection: Upgrade\r\n", ""), BAD),
            (
                replaced("Version: 13", "Version: 12"),
                b"HTTP/1.1 426 \r\nSec-WebSocket-Version: 13\r\ncontent-length: 0\r\n\r\n",
            ),
            (
                replaced("Sec-WebSocket-Version: 13\r\n", ""),
                b"HTTP/1.1 400 \r\nSec-WebSocket-Version: 13\r\ncontent-length: 0\r\n\r\n",
            ),
            (
                replaced("Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n", ""),
                BAD,
            ),
            (replaced("Upgrade: websocket\r\n", ""), BAD),
            (replaced("Upgrade: websocket", "Upgrade: h2c"), BAD),
            (replaced("Host: x\r\n", ""), BAD),
            (replaced("Host: x\r\n", "Host: x\r\nHost: y\r\n"), BAD),
            (replaced("/mqtt", "/\u{e9}"), BAD),
            (
                String::from_utf8(replaced("HTTP/1.1", "HTTP/1.0"))
                    .unwrap()
                    .replacen("Host: x\r\n", "", 1)
                    .into_bytes(),
                b"HTTP/1.1 400 \r\ncontent-length: 0\r\nConnection: close\r\n\r\n",
            ),
            (
                b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00".to_vec(),
                BAD,
            ),
            (b"\r\nGET /mqtt HTTP/1.1\r\n".to_vec(), BAD),
            (b" GET".to_vec(), BAD),
            (b"GET /mqtt HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(), BAD),
        ];
        for (head, answer) in cases {
            assert_eq!(
                read_head(&head),
                Head::Refused(answer.to_vec()),
                "{}",
                String::from_utf8_lossy(&head)
            );
        }
        let keep = replaced("Connection: Upgrade", "Connection: keep-alive, Upgrade");
        assert!(matches!(read_head(&keep), Head::Request(..)));
        let Head::Request(req, _) = read_head(&replaced("Protocol: mqtt", "Protocol: chat, mqtt"))
        else {
            panic!()
        };
        assert_eq!(req.subprotocols, vec!["chat", "mqtt"]);
        // A head that does not end within the limit.
        let mut long = b"GET /mqtt HTTP/1.1\r\nX: ".to_vec();
        long.resize(HEAD_LIMIT + 1, b'a');
        assert_eq!(read_head(&long), Head::Refused(BAD.to_vec()));
        assert_eq!(read_head(&long[..HEAD_LIMIT]), Head::Incomplete);
    }

    #[test]
    fn the_owners_refusal_as_reject_upgrade_writes_it() {
        assert_eq!(
            refusal_with(400, b"MQTT over WebSocket needs subprotocol mqtt\n", false),
            b"HTTP/1.1 400 \r\ncontent-type: text/plain\r\ncontent-length: 43\r\n\r\nMQTT over WebSocket needs subprotocol mqtt\n"
        );
        assert_eq!(
            refusal_with(400, b"body\n", true),
            b"HTTP/1.1 400 \r\ncontent-type: text/plain\r\ncontent-length: 5\r\nConnection: close\r\n\r\nbody\n"
        );
    }

    fn decode_all(c: &mut Codec, wire: &[u8], limit: usize) -> Result<Vec<u8>, String> {
        let mut buf = wire.to_vec();
        let n = c.decode(&mut buf, limit)?;
        Ok(buf[..n].to_vec())
    }

    const M: [u8; 4] = [0x12, 0x34, 0x56, 0x78];

    #[test]
    fn binary_frames_whole_split_and_fragmented() {
        let mut wire = client_frame(0x82, b"hello", M);
        wire.extend(client_frame(0x02, b"wor", M));
        wire.extend(client_frame(0x80, b"ld", [1, 2, 3, 4]));
        wire.extend(client_frame(0x82, &[7u8; 300], M));
        wire.extend(client_frame(0x82, &[9u8; 70_000], M));
        let mut whole = b"helloworld".to_vec();
        whole.extend([7u8; 300]);
        whole.extend([9u8; 70_000]);
        let mut c = Codec::new();
        assert_eq!(decode_all(&mut c, &wire, 100_000).unwrap(), whole);
        // Byte by byte, and in uneven pieces: the same bytes.
        for step in [1, 3, 13, 4096] {
            let mut c = Codec::new();
            let mut got = Vec::new();
            for piece in wire.chunks(step) {
                got.extend(decode_all(&mut c, piece, 100_000).unwrap());
            }
            assert_eq!(got, whole, "{step}");
            assert!(c.held() <= 125);
        }
    }

    #[test]
    fn pings_are_answered_and_text_frames_close_1003() {
        let mut c = Codec::new();
        let mut wire = client_frame(0x89, b"p1", M);
        wire.extend(client_frame(0x89, b"p2", M));
        wire.extend(client_frame(0x82, b"x", M));
        assert_eq!(decode_all(&mut c, &wire, 10).unwrap(), b"x");
        // The latest ping waiting is answered.
        assert_eq!(c.take_control().unwrap(), b"\x8a\x02p2");
        assert!(c.take_control().is_none());
        let mut wire = client_frame(0x82, b"before", M);
        wire.extend(client_frame(0x81, "\u{c0}\0".as_bytes(), M));
        assert_eq!(
            decode_all(&mut c, &wire, 10).unwrap_err(),
            "text frame on an MQTT websocket"
        );
        let close = c.take_control().unwrap();
        assert_eq!(&close[..4], b"\x88\x1a\x03\xeb");
        assert_eq!(&close[4..], b"MQTT needs binary frames");
        assert!(c.awaits_peer());
        // Now the peer's close is read past to.
        let mut wire = client_frame(0x82, b"late", M);
        wire.extend(client_frame(0x88, b"\x03\xe8", M));
        assert_eq!(decode_all(&mut c, &wire, 10).unwrap(), b"");
        assert!(!c.awaits_peer());
        assert!(c.take_control().is_none(), "no second close");
    }

    #[test]
    fn a_message_past_its_limit_closes_1009() {
        let mut c = Codec::new();
        // The limit is the one a message had as it began.
        let mut wire = client_frame(0x02, &[1u8; 8], M);
        assert_eq!(decode_all(&mut c, &wire, 10).unwrap().len(), 8);
        wire = client_frame(0x80, &[1u8; 3], M);
        assert_eq!(
            decode_all(&mut c, &wire, 1_000_000).unwrap_err(),
            "websocket message over 10 bytes"
        );
        assert_eq!(c.take_control().unwrap()[2..4], 1009u16.to_be_bytes());
        // A new message gets the limit given then.
        let mut c = Codec::new();
        let wire = client_frame(0x82, &[1u8; 8], M);
        assert_eq!(decode_all(&mut c, &wire, 8).unwrap().len(), 8);
        assert!(decode_all(&mut c, &wire, 7).is_err());
    }

    #[test]
    fn the_peers_close_is_echoed_and_read_as_the_end_or_a_break() {
        for (payload, end) in [
            (&b""[..], None),
            (b"\x03\xe8bye", None),
            (b"\x03\xe9", None),
            (b"\x0f\xa0app", Some("websocket closed: 4000")),
        ] {
            let mut c = Codec::new();
            let mut wire = client_frame(0x82, b"last", M);
            wire.extend(client_frame(0x88, payload, M));
            wire.extend(client_frame(0x82, b"after", M));
            assert_eq!(decode_all(&mut c, &wire, 100).unwrap(), b"last");
            assert_eq!(c.ended(), Some(end));
            let echo = c.take_control().unwrap();
            assert_eq!(echo[0], 0x88);
            assert_eq!(&echo[2..], payload);
            assert!(!c.awaits_peer());
            c.close();
            assert!(c.take_control().is_none(), "closed once");
        }
    }

    #[test]
    fn broken_frames_close_as_wsproto_closes_them() {
        let cases: Vec<(Vec<u8>, u16)> = vec![
            (b"\x82\x05hello".to_vec(), 1002),   // unmasked
            (client_frame(0x83, b"x", M), 1002), // reserved opcode
            (client_frame(0x09, b"x", M), 1002), // fragmented control
            (client_frame(0xc2, b"x", M), 1002), // RSV1
            (client_frame(0x80, b"x", M), 1002), // continuation first
            (b"\x82\xfe\x00\x05\x00\x00\x00\x00hello".to_vec(), 1002), // 2 bytes for 5
            (b"\x89\xfe".to_vec(), 1002),        // a long ping
            (client_frame(0x88, b"\x03", M), 1002), // 1-byte close
            (client_frame(0x88, b"\x03\xed", M), 1002), // 1005 from a peer
            (client_frame(0x88, b"\x03\xec", M), 1002), // 1004
            (client_frame(0x88, b"\x03\xe8\xff", M), 1007), // reason not UTF-8
            (client_frame(0x81, b"\xff", M), 1007), // text not UTF-8
        ];
        for (wire, code) in cases {
            let mut c = Codec::new();
            let mut all = client_frame(0x82, b"ok", M);
            all.extend(&wire);
            assert_eq!(decode_all(&mut c, &all, 100).unwrap(), b"ok", "{wire:x?}");
            let close = c.take_control().unwrap();
            assert_eq!(close[2..4], code.to_be_bytes(), "{wire:x?}");
            let expected = format!("websocket closed: {code}");
            assert_eq!(c.ended(), Some(Some(expected.as_str())));
            // A second message in a fragmented one.
            let mut c = Codec::new();
            let mut wire = client_frame(0x02, b"a", M);
            wire.extend(client_frame(0x82, b"b", M));
            assert_eq!(decode_all(&mut c, &wire, 100).unwrap(), b"a");
            assert_eq!(c.ended(), Some(Some("websocket closed: 1002")));
        }
    }

    #[test]
    fn our_frames() {
        let mut out = Vec::new();
        binary_into(b"ab", &mut out);
        binary_into(&[0; 200], &mut out);
        assert_eq!(&out[..4], b"\x82\x02ab");
        assert_eq!(&out[4..8], b"\x82\x7e\x00\xc8");
        let mut c = Codec::new();
        c.close();
        assert_eq!(c.take_control().unwrap(), b"\x88\x02\x03\xe8");
        assert!(c.close_sent() && c.awaits_peer());
        c.eof();
        assert!(!c.awaits_peer());
    }
}
