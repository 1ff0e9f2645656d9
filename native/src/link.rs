//! What a connection's socket is to the reactors: a plain TCP stream (handed over by
//! Python after its CONNACK), or a TLS session the native side accepted and holds for
//! the connection's whole life (`tls`): a TLS session cannot move between Python's
//! `ssl` and rustls, so Python never has its socket, only its bytes (`LinkShare`).
//!
//! Reads and writes are of plaintext either way: a read decrypts what the socket has,
//! a write encrypts into rustls's buffer (at most `tls::BUFFER_LIMIT` of it) and writes
//! what the socket takes; what is encrypted but not yet on the wire (`pending`) is
//! written when the socket takes more.

use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use mio::net::TcpStream;
use rustls::ServerConnection;

pub enum Link {
    Plain(TcpStream),
    Tls(Box<TlsLink>),
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

    /// What Python shares of a TLS link (a plain one is Python's socket: nothing).
    pub fn share(&self) -> Option<&Arc<LinkShare>> {
        match self {
            Link::Plain(_) => None,
            Link::Tls(t) => Some(&t.share),
        }
    }

    /// The socket, for the poll's registry.
    pub fn socket(&mut self) -> &mut TcpStream {
        match self {
            Link::Plain(s) => s,
            Link::Tls(t) => &mut t.tcp,
        }
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, Link::Tls(_))
    }

    /// Plaintext from the client: Ok(0) at its end (a TLS peer that drops TCP without a
    /// close_notify ends too, as trio's `https_compatible` streams read it), WouldBlock
    /// when nothing more is there, an error for a broken TLS session (its alert sent).
    pub fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Link::Plain(s) => s.read(buf),
            Link::Tls(t) => t.read(buf),
        }
    }

    /// Write what the link takes of `data` now (0 when it takes nothing); an error when
    /// the connection is broken.
    pub fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        match self {
            Link::Plain(s) => write_plain(s, data),
            Link::Tls(t) => t.write(data),
        }
    }

    /// Encrypted bytes the socket has not taken yet.
    pub fn pending(&self) -> bool {
        match self {
            Link::Plain(_) => false,
            Link::Tls(t) => t.tls.wants_write(),
        }
    }

    /// Write what is encrypted and waits, as far as the socket takes it.
    pub fn flush(&mut self) -> io::Result<()> {
        match self {
            Link::Plain(_) => Ok(()),
            Link::Tls(t) => t.flush(),
        }
    }

    /// The end of the session from our side: a TLS close_notify queued (and written as
    /// far as the socket takes it). The socket closes when the link is dropped.
    pub fn close(&mut self) {
        if let Link::Tls(t) = self {
            t.tls.send_close_notify();
            let _ = t.flush();
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
