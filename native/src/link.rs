//! What a connection's socket is to the reactors: a plain TCP stream (handed over by
//! Python after its CONNACK), or a TLS session the native side accepted and holds for
//! the connection's whole life (`tls`): a TLS session cannot move between Python's
//! `ssl` and rustls, so Python never has its socket, only its bytes (`LinkShare`).
//!
//! Reads and writes are of plaintext either way: a read decrypts what the socket has,
//! a write encrypts into rustls's buffer (at most `tls::BUFFER_LIMIT` of it) and writes
//! what the socket takes; what is encrypted but not yet on the wire (`pending`) is
//! written when the socket takes more.
//!
//! A WebSocket link (`ws`) is the same over either of them: after its HTTP upgrade, a
//! read hands out what the client's binary messages carry, a write goes out as binary
//! messages, and the frames the connection answers by itself (a pong, a close) go out
//! between ours.

use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use mio::net::TcpStream;
use rustls::ServerConnection;

use crate::partial::PartialBudget;
use crate::ws;

pub enum Link {
    Plain(TcpStream),
    Tls(Box<TlsLink>),
    Ws(Box<WsLink>),
}

pub struct TlsLink {
    pub tcp: TcpStream,
    pub tls: ServerConnection,
    /// What Python and the reactor share of the connection while it is relayed.
    pub share: Arc<LinkShare>,
}

impl Link {
    pub fn tls(tcp: TcpStream, tls: ServerConnection) -> Link {
        Link::Tls(Box::new(TlsLink {
            tcp,
            tls,
            share: Arc::new(LinkShare::default()),
        }))
    }

    /// A WebSocket link over `inner` (plain or TLS), its upgrade to come; `peer` names
    /// the client in what it has to say.
    pub fn ws(inner: Link, peer: &str) -> Link {
        let share = inner.share().cloned().unwrap_or_default();
        Link::Ws(Box::new(WsLink {
            inner,
            codec: ws::Codec::new(),
            upgrade: Some(Upgrade::default()),
            early: Vec::new(),
            out: Vec::new(),
            out_at: 0,
            drained: 0,
            peer: peer.into(),
            note: None,
            share,
        }))
    }

    /// What Python shares of a link it relays (a plain one is Python's socket: nothing).
    pub fn share(&self) -> Option<&Arc<LinkShare>> {
        match self {
            Link::Plain(_) => None,
            Link::Tls(t) => Some(&t.share),
            Link::Ws(w) => Some(&w.share),
        }
    }

    /// The socket, for the poll's registry.
    pub fn socket(&mut self) -> &mut TcpStream {
        match self {
            Link::Plain(s) => s,
            Link::Tls(t) => &mut t.tcp,
            Link::Ws(w) => w.inner.socket(),
        }
    }

    /// A plain TCP link: Python's socket, handed over and back whole.
    pub fn is_plain(&self) -> bool {
        matches!(self, Link::Plain(_))
    }

    /// Its TLS session, if it has one (a secure WebSocket's is under it).
    pub fn tls_mut(&mut self) -> Option<&mut TlsLink> {
        match self {
            Link::Plain(_) => None,
            Link::Tls(t) => Some(t),
            Link::Ws(w) => w.inner.tls_mut(),
        }
    }

    pub fn ws_mut(&mut self) -> Option<&mut WsLink> {
        match self {
            Link::Ws(w) => Some(w),
            _ => None,
        }
    }

    /// What the link has to say for the log since the last call (a WebSocket message
    /// past its limit).
    pub fn take_note(&mut self) -> Option<String> {
        match self {
            Link::Ws(w) => w.note.take(),
            _ => None,
        }
    }

    /// Closing, it waits for the client's part of the close (a WebSocket close frame).
    pub fn awaits_close(&self) -> bool {
        match self {
            Link::Ws(w) => w.awaits_close(),
            _ => false,
        }
    }

    /// Plaintext from the client: Ok(0) at its end (a TLS peer that drops TCP without a
    /// close_notify ends too, as trio's `https_compatible` streams read it), WouldBlock
    /// when nothing more is there, an error for a broken TLS session (its alert sent).
    pub fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Link::Plain(s) => s.read(buf),
            Link::Tls(t) => t.read(buf),
            Link::Ws(w) => w.read(buf),
        }
    }

    /// Write what the link takes of `data` now (0 when it takes nothing); an error when
    /// the connection is broken.
    pub fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        match self {
            Link::Plain(s) => write_plain(s, data),
            Link::Tls(t) => t.write(data),
            Link::Ws(w) => w.write(data),
        }
    }

    /// Bytes made for the client that the socket has not taken yet (encrypted, or
    /// frames).
    pub fn pending(&self) -> bool {
        match self {
            Link::Plain(_) => false,
            Link::Tls(t) => t.tls.wants_write(),
            Link::Ws(w) => w.pending(),
        }
    }

    /// Write what waits, as far as the socket takes it.
    pub fn flush(&mut self) -> io::Result<()> {
        match self {
            Link::Plain(_) => Ok(()),
            Link::Tls(t) => t.flush(),
            Link::Ws(w) => w.flush(),
        }
    }

    /// The end of the session from our side: a TLS close_notify, or a WebSocket close
    /// frame (1000, unless one went already), queued and written as far as the socket
    /// takes it. The socket closes when the link is dropped.
    pub fn close(&mut self) {
        match self {
            Link::Plain(_) => {}
            Link::Tls(t) => {
                t.tls.send_close_notify();
                let _ = t.flush();
            }
            Link::Ws(w) => w.close(),
        }
    }

    /// The socket of a plain link, for its owner; a TLS link stays a link.
    pub fn into_socket(self) -> Result<OwnedFd, Link> {
        match self {
            Link::Plain(s) => Ok(OwnedFd::from(s)),
            tls => Err(tls),
        }
    }
}

fn write_plain(stream: &mut TcpStream, data: &[u8]) -> io::Result<usize> {
    let mut sent = 0;
    while sent < data.len() {
        match stream.write(&data[sent..]) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "socket closed")),
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(sent)
}

impl TlsLink {
    /// Feed rustls what the socket has: Ok(false) when the socket had nothing (or
    /// ended), Ok(true) when records came in; an error for a broken session (its alert
    /// written as far as the socket takes it).
    pub fn receive(&mut self) -> io::Result<bool> {
        loop {
            match self.tls.read_tls(&mut self.tcp) {
                Ok(0) => return Ok(false), // rustls knows the socket ended
                Ok(_) => {
                    let processed = self.tls.process_new_packets();
                    // Handshake messages, alerts, key updates: out at once.
                    let flushed = self.flush();
                    if let Err(e) = processed {
                        return Err(io::Error::new(io::ErrorKind::InvalidData, e));
                    }
                    flushed?;
                    return Ok(true);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.tls.reader().read(buf) {
                Ok(n) => return Ok(n), // 0: the peer's close_notify
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                // TCP ended without a close_notify: an end as any other.
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(0),
                Err(e) => return Err(e),
            }
            if !self.receive()? {
                // The socket ended: the reader says how (close_notify or not) next.
                match self.tls.reader().read(buf) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        return Err(io::Error::new(io::ErrorKind::WouldBlock, "no data"))
                    }
                    Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(0),
                    other => return other,
                }
            }
        }
    }

    /// As a socket's write: as much as goes out before the socket would block. rustls
    /// takes at most its buffer's limit at a time, so a take short of `data` with the
    /// socket still taking more is written on: a caller waiting for the socket to be
    /// writable again would wait for an edge that never comes.
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let mut sent = 0;
        loop {
            self.flush()?;
            if sent == data.len() || self.tls.wants_write() {
                return Ok(sent); // all of it, or the socket is full
            }
            let n = self.tls.writer().write(&data[sent..])?;
            if n == 0 {
                return Ok(sent);
            }
            sent += n;
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        while self.tls.wants_write() {
            match self.tls.write_tls(&mut self.tcp) {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "socket closed")),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// The HTTP upgrade under way: the head read so far (`ws::HEAD_LIMIT` at most), then the
/// request Python answers.
#[derive(Default)]
pub struct Upgrade {
    head: Vec<u8>,
    request: Option<ws::Request>,
}

/// What reading the upgrade's head came to.
#[derive(Debug, PartialEq, Eq)]
pub enum HeadRead {
    /// Nothing whole yet (the socket has no more for now).
    Incomplete,
    /// An upgrade request: its target and the subprotocols it offers, for Python.
    Request(String, Vec<String>),
    /// Not an upgrade: the answer is on its way, then the connection closes.
    Refused,
    /// The client left (or the connection broke) before.
    Ended,
}

/// A WebSocket connection over a plain or TLS link (`Link::ws`).
pub struct WsLink {
    inner: Link,
    codec: ws::Codec,
    /// Until the upgrade is answered (then frames).
    upgrade: Option<Upgrade>,
    /// Bytes the client sent behind its request, before the answer: frames, read first.
    early: Vec<u8>,
    /// Bytes for the client the inner link did not take yet, from `out_at`: whole frames
    /// (and the answer to the upgrade), so a control frame can go between two.
    out: Vec<u8>,
    out_at: usize,
    /// Read past while waiting for the client's close frame (`ws::CLOSE_DRAIN`).
    drained: usize,
    peer: Box<str>,
    /// For the log (`Link::take_note`).
    note: Option<String>,
    share: Arc<LinkShare>,
}

impl WsLink {
    /// Read what the socket has of the upgrade request, and see what it is.
    pub fn read_head(&mut self) -> HeadRead {
        let Some(up) = self.upgrade.as_mut().filter(|u| u.request.is_none()) else {
            return HeadRead::Incomplete;
        };
        let mut chunk = [0u8; 4096];
        loop {
            let room = (ws::HEAD_LIMIT + 1 - up.head.len()).min(chunk.len());
            match self.inner.read(&mut chunk[..room]) {
                Ok(0) => return HeadRead::Ended,
                Ok(n) => up.head.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return HeadRead::Incomplete,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return HeadRead::Ended,
            }
            match ws::read_head(&up.head) {
                ws::Head::Incomplete => continue,
                ws::Head::Refused(answer) => {
                    self.upgrade = None;
                    self.codec.eof(); // no frames: nothing to close
                    self.out = answer;
                    let _ = self.flush();
                    return HeadRead::Refused;
                }
                ws::Head::Request(request, n) => {
                    self.early = up.head.split_off(n);
                    up.head = Vec::new();
                    let what =
                        HeadRead::Request(request.target.clone(), request.subprotocols.clone());
                    up.request = Some(request);
                    return what;
                }
            }
        }
    }

    /// Python accepts the upgrade with `subprotocol` (one the client offered): the 101
    /// goes out, and frames from here on.
    pub fn accept(&mut self, subprotocol: Option<&str>) -> Result<(), String> {
        let Some(request) = self.upgrade.as_ref().and_then(|u| u.request.as_ref()) else {
            return Err("no upgrade request to answer".into());
        };
        self.out = ws::accept(request, subprotocol)?;
        self.upgrade = None;
        let _ = self.flush();
        Ok(())
    }

    /// Python refuses the upgrade: `status` with `body`, then the connection closes.
    pub fn refuse(&mut self, status: u16, body: &[u8]) {
        let http10 = self
            .upgrade
            .as_ref()
            .and_then(|u| u.request.as_ref())
            .is_some_and(|r| r.http10);
        self.upgrade = None;
        self.codec.eof();
        self.out = ws::refusal_with(status, body, http10);
        let _ = self.flush();
    }

    /// Message bytes from the client (see `Link::read`): Ok(0) at the end of the stream
    /// (the client's close frame with 1000, 1001 or none), an error when it broke.
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.upgrade.is_some() {
            return Err(io::Error::new(io::ErrorKind::WouldBlock, "upgrading"));
        }
        loop {
            match self.codec.ended() {
                Some(None) => return Ok(0),
                Some(Some(why)) => return Err(io::Error::other(why.to_owned())),
                None => {}
            }
            let n = if self.early.is_empty() {
                match self.inner.read(buf) {
                    Ok(0) => {
                        self.codec.eof();
                        continue;
                    }
                    Ok(n) => n,
                    Err(e) => return Err(e),
                }
            } else {
                let n = self.early.len().min(buf.len());
                buf[..n].copy_from_slice(&self.early[..n]);
                self.early.drain(..n);
                if self.early.is_empty() {
                    self.early = Vec::new();
                }
                n
            };
            let limit = self.share.message_limit.load(Ordering::SeqCst);
            match self.codec.decode(&mut buf[..n], limit) {
                Ok(0) => {}
                Ok(m) => return Ok(m),
                Err(why) => return Err(io::Error::other(self.broke(why))),
            }
        }
    }

    /// Why reading stopped, as `WebSocketStream` says it; a message past its limit is
    /// said for the log too.
    fn broke(&mut self, why: String) -> String {
        let Some(limit) = self.codec.too_big() else {
            return why;
        };
        let setting = self.share.limit_setting();
        self.note = Some(format!(
            "websocket client {} closed: a message of more than {limit} bytes ({setting})",
            self.peer
        ));
        format!("{why} ({setting})")
    }

    /// `data` as binary messages, as far as the socket takes them (as a socket's
    /// write): what waits for it first, then each frame whole into `out`.
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.upgrade.is_some() {
            return Ok(0);
        }
        let mut sent = 0;
        loop {
            self.push_out()?;
            if self.out_at < self.out.len() {
                return Ok(sent); // the socket is full
            }
            if let Some(frame) = self.codec.take_control() {
                self.out.extend_from_slice(&frame);
                continue;
            }
            if self.codec.close_sent() {
                return Ok(data.len()); // nothing goes out after our close frame
            }
            if sent == data.len() {
                return Ok(sent);
            }
            let n = (data.len() - sent).min(ws::FRAME_PAYLOAD);
            ws::binary_into(&data[sent..sent + n], &mut self.out);
            sent += n;
        }
    }

    /// Write `out` as far as the inner link takes it.
    fn push_out(&mut self) -> io::Result<()> {
        while self.out_at < self.out.len() {
            let n = self.inner.write(&self.out[self.out_at..])?;
            if n == 0 {
                return Ok(());
            }
            self.out_at += n;
        }
        self.out_at = 0;
        self.out.clear();
        if self.out.capacity() > 4096 {
            self.out = Vec::new(); // an idle connection keeps no buffer
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        loop {
            self.push_out()?;
            if self.out_at < self.out.len() {
                break;
            }
            match self.codec.take_control() {
                Some(frame) => self.out = frame,
                None => break,
            }
        }
        self.inner.flush()
    }

    fn pending(&self) -> bool {
        self.out_at < self.out.len() || self.codec.has_control() || self.inner.pending()
    }

    fn close(&mut self) {
        if self.upgrade.is_some() {
            self.upgrade = None; // never upgraded: no frames, no close frame
            self.codec.eof();
        }
        self.codec.close();
        let _ = self.flush();
    }

    /// Our close frame is out, and the client's is still to come (and we read past
    /// less than `ws::CLOSE_DRAIN` waiting for it).
    fn awaits_close(&self) -> bool {
        self.codec.awaits_peer() && self.drained < ws::CLOSE_DRAIN
    }

    /// Read past what the client sends, for its close frame: whether to wait on.
    pub fn drain_close(&mut self, buf: &mut [u8]) -> bool {
        while self.awaits_close() {
            let n = match self.inner.read(buf) {
                Ok(0) => {
                    self.codec.eof();
                    break;
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    self.codec.eof();
                    break;
                }
            };
            self.drained += n;
            let _ = self.codec.decode(&mut buf[..n], 0);
        }
        self.awaits_close()
    }
}

/// Plaintext the native side relays to Python ahead of what Python has consumed, at
/// most: past it the link is not read (TCP holds the rest), as Python's own reads of a
/// socket take no more than it is ready for.
pub const RELAY_WINDOW: u64 = 64 * 1024;
/// Python's bytes waiting for a link past which Python waits for `Room` before it
/// writes more: what a socket's send buffer is to a writer.
pub const SEND_MARK: usize = 64 * 1024;
/// Set in `relayed` while Python hands the connection to the native steady state:
/// nothing more is relayed (it goes to the carried connection instead).
pub const CARRYING: u64 = 1 << 63;

/// What Python and the reactor that holds a relayed link share of it, without a lock.
#[derive(Debug, Default)]
pub struct LinkShare {
    /// Bytes Python sent that the link has not taken yet.
    pub queued: AtomicUsize,
    /// Plaintext relayed to Python over the connection's life (`CARRYING` aside).
    pub relayed: AtomicU64,
    /// Of it, what Python has consumed (it says so every half window).
    pub acked: AtomicU64,
    /// The reactor stopped reading it for the window: Python's next ack resumes it.
    pub stalled: AtomicBool,
    /// The link is closed: Python's writes go nowhere.
    pub gone: AtomicBool,
    /// A WebSocket's: the most a message that begins now may hold, and the setting that
    /// says so (Python's, changed once its CONNECT is read).
    pub message_limit: AtomicUsize,
    pub setting: std::sync::Mutex<String>,
    /// What of it is counted in the node's budget for partial packets (`recount`): the
    /// bytes relayed that Python has not consumed, which wait in its memory.
    counted: std::sync::Mutex<usize>,
}

impl LinkShare {
    /// Python sent `n` more bytes: whether it should wait for `Room` before more.
    pub fn sent(&self, n: usize) -> bool {
        self.queued.fetch_add(n, Ordering::SeqCst) + n > SEND_MARK
    }

    /// The link took `n` of Python's bytes: whether that brought it back under the mark
    /// (Python is told: it may be waiting).
    pub fn took(&self, n: usize) -> bool {
        if n == 0 {
            return false;
        }
        let before = self.queued.fetch_sub(n, Ordering::SeqCst);
        before > SEND_MARK && before - n <= SEND_MARK
    }

    /// Python consumed the relayed bytes up to `total`: whether the reactor must be
    /// told to read again.
    pub fn consumed(&self, total: u64) -> bool {
        self.acked.store(total, Ordering::SeqCst);
        self.stalled.swap(false, Ordering::SeqCst)
    }

    /// Room left in the window (0: stop reading).
    pub fn window(&self) -> u64 {
        let relayed = self.relayed.load(Ordering::SeqCst) & !CARRYING;
        let acked = self.acked.load(Ordering::SeqCst);
        RELAY_WINDOW.saturating_sub(relayed.saturating_sub(acked))
    }

    /// Count `n` bytes as relayed, unless a carry began: false then (they go to the
    /// carried connection).
    pub fn relay(&self, n: u64) -> bool {
        let mut cur = self.relayed.load(Ordering::SeqCst);
        loop {
            if cur & CARRYING != 0 {
                return false;
            }
            match self
                .relayed
                .compare_exchange(cur, cur + n, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return true,
                Err(now) => cur = now,
            }
        }
    }

    /// Python begins a carry, having taken `relayed` bytes: false (nothing changed)
    /// when more are on their way to it.
    pub fn begin_carry(&self, relayed: u64) -> bool {
        self.relayed
            .compare_exchange(
                relayed,
                relayed | CARRYING,
                Ordering::SeqCst,
                Ordering::SeqCst,
            )
            .is_ok()
    }

    /// The carry is over (taken, or refused): relaying may go on.
    pub fn end_carry(&self) {
        self.relayed.fetch_and(!CARRYING, Ordering::SeqCst);
    }

    pub fn carrying(&self) -> bool {
        self.relayed.load(Ordering::SeqCst) & CARRYING != 0
    }

    /// Bytes relayed that Python has not consumed yet.
    pub fn unconsumed(&self) -> usize {
        let relayed = self.relayed.load(Ordering::SeqCst) & !CARRYING;
        relayed.saturating_sub(self.acked.load(Ordering::SeqCst)) as usize
    }

    /// Count what waits for Python now in the node's budget for partial packets (they
    /// are bytes Python holds as surely as its decoder's; nothing once the link is
    /// gone), from either side: whether that took the node back within the budget.
    pub fn recount(&self, budget: &PartialBudget) -> bool {
        let Ok(mut counted) = self.counted.lock() else {
            return false;
        };
        let now = if self.gone.load(Ordering::SeqCst) {
            0
        } else {
            self.unconsumed()
        };
        if now == *counted {
            return false;
        }
        let freed = budget.update(*counted, now).freed;
        *counted = now;
        freed
    }

    /// A WebSocket message may hold `limit` bytes from now on, as `setting` says.
    pub fn set_message_limit(&self, limit: usize, setting: &str) {
        if let Ok(mut s) = self.setting.lock() {
            if *s != setting {
                *s = setting.to_owned();
            }
        }
        self.message_limit.store(limit, Ordering::SeqCst);
    }

    fn limit_setting(&self) -> String {
        self.setting.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_send_mark_is_crossed_once_each_way() {
        let share = LinkShare::default();
        assert!(!share.sent(SEND_MARK));
        assert!(share.sent(1), "past the mark: wait");
        assert!(!share.took(0));
        assert!(share.took(1), "back at the mark: told");
        assert!(!share.took(SEND_MARK), "already under it");
    }

    #[test]
    fn a_carry_stops_the_relay_and_only_from_what_python_took() {
        let share = LinkShare::default();
        assert!(share.relay(10));
        assert!(!share.begin_carry(5), "5 more are on their way to Python");
        assert!(share.begin_carry(10));
        assert!(!share.relay(3), "carrying: kept for the carried connection");
        share.end_carry();
        assert!(share.relay(3));
        assert_eq!(share.relayed.load(Ordering::SeqCst), 13);
    }

    #[test]
    fn what_waits_for_python_counts_in_the_node_budget_until_consumed() {
        let budget = PartialBudget::default();
        budget.set_limit(1000);
        let share = LinkShare::default();
        assert!(share.relay(1200));
        assert!(!share.recount(&budget));
        assert_eq!(budget.held(), 1200);
        assert!(budget.must_wait(share.unconsumed()), "over, holding it all");
        share.consumed(700);
        assert!(share.recount(&budget), "back within the budget");
        assert_eq!(budget.held(), 500);
        share.gone.store(true, Ordering::SeqCst);
        share.recount(&budget);
        assert_eq!(budget.held(), 0, "a link gone holds nothing");
        share.consumed(1200);
        share.recount(&budget);
        assert_eq!(budget.held(), 0);
    }

    #[test]
    fn the_window_and_the_ack_that_resumes() {
        let share = LinkShare::default();
        assert!(share.relay(RELAY_WINDOW));
        assert_eq!(share.window(), 0);
        share.stalled.store(true, Ordering::SeqCst);
        assert!(
            share.consumed(RELAY_WINDOW / 2),
            "stalled: told to read again"
        );
        assert_eq!(share.window(), RELAY_WINDOW / 2);
        assert!(
            !share.consumed(RELAY_WINDOW),
            "not stalled: nothing to tell"
        );
    }
}
