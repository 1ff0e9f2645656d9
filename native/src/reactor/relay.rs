//! Connections the native side accepted (a TLS listener's): their handshake, and the
//! spells in which Python serves them. A TLS session cannot move between Python's
//! `ssl` and rustls, so the reactor holds it from the accept to the close, and a
//! connection is in one of three modes, on one thread, under one token:
//!
//! - *handshake*: the TLS handshake, under a deadline, with the engine's handshakes in
//!   flight capped (`Links::max_handshakes`, the listener waits past it) and at most
//!   `HANDSHAKE_SLICE` of a pass spent on them (the rest wait for the next pass), so a
//!   storm of reconnecting devices does not stall the connections already carried;
//! - *relayed* (`Relay`): Python's rules read and write it as bytes. What the client
//!   sends is decrypted and handed to Python as `Data` events, at most `RELAY_WINDOW`
//!   ahead of what Python consumed (past it the link is not read: TCP holds the rest,
//!   as when Python does not read a socket); what Python writes (`Command::Send`) waits
//!   here in order until the link takes it, and Python writes no more past `SEND_MARK`
//!   until told (`Room`), as a socket's full send buffer makes a writer wait;
//! - *carried* (a `Conn` in `conns`): the steady state, as for a plain-TCP connection
//!   Python promoted. A promotion (`Command::Carry`) and a demotion are switches of
//!   mode here: the link, its session and the bytes waiting for it stay.
//!
//! A WebSocket listener's connection (`Link::ws`, over TLS or not) reads its HTTP
//! upgrade after its handshake (*upgrade*, under its own deadline), and waits while
//! Python chooses its subprotocol (*deciding*, not read); Python's answer writes the
//! 101 (`Command::Upgrade`) or its refusal (`Command::Refuse`). Relayed or carried, its
//! bytes are a WebSocket's messages; closing, it waits a moment for the client's close
//! frame, as `WebSocketStream.aclose` does.

use std::cmp::Reverse;
use std::sync::atomic::AtomicUsize;

use super::*;
use crate::link::{HeadRead, LinkShare};
use crate::tls::{self, UsernameFrom};
use crate::ws;

/// Time a thread spends on TLS handshakes in one pass, at most (the rest wait for the
/// next one): an RSA-2048 signature is 1-2 ms, an ECDSA one a tenth of that.
pub const HANDSHAKE_SLICE: Duration = Duration::from_millis(1);
/// Socket reads of one handshake in one go, at most.
const HANDSHAKE_READS: usize = 16;
/// How long a closing link may take to write what Python sent before it (a client
/// that reads nothing is not waited for longer).
pub const CLOSE_LINGER_S: f64 = 1.0;
/// Log lines waiting for Python past which more are dropped (a flood of failed
/// handshakes is said, not queued without bound).
pub const LOG_BACKLOG: usize = 1024;

/// What the reactor threads share of the connections the native side accepts.
#[derive(Debug)]
pub struct Links {
    /// The next connection id (above the ids Python gives the connections it hands
    /// over, so the two never meet).
    pub next_id: AtomicU64,
    /// Handshakes under way, on every thread; a listener accepts no more past the
    /// maximum, until some finish.
    pub handshakes: AtomicUsize,
    pub max_handshakes: AtomicUsize,
    /// Log lines waiting for Python (`LOG_BACKLOG`).
    pub logs: AtomicUsize,
}

/// The first id of a connection the native side accepts.
pub const FIRST_LINK_ID: u64 = 1 << 40;

impl Default for Links {
    fn default() -> Self {
        Links {
            next_id: AtomicU64::new(FIRST_LINK_ID),
            handshakes: AtomicUsize::new(0),
            max_handshakes: AtomicUsize::new(usize::MAX),
            logs: AtomicUsize::new(0),
        }
    }
}

/// Whose log a line is for, and how it is said there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogTarget {
    /// A handshake that failed or timed out (INFO, as Python's listener says it).
    Handshake,
    /// The certificate files were reloaded (INFO), or did not load (ERROR).
    Reloaded,
    ReloadFailed,
    /// accept(2) failed and the listener rests (Python's rate-limited line).
    AcceptFailed,
    /// Connections refused for the descriptor reserve: `count` of them
    /// (serving.fd_budget's rate-limited line and counter).
    Refused {
        count: u64,
    },
    /// A WebSocket upgrade that failed or timed out (INFO, as the listener says it).
    Upgrade,
    /// A WebSocket message past its limit (WARNING, as `WebSocketStream` says it).
    MessageLimit,
}

/// What Python hears of a connection the native side accepted.
#[derive(Debug)]
pub enum LinkEvent {
    /// The handshake is done: Python's rules take the connection from here. A
    /// WebSocket's comes with its upgrade request (target, subprotocols offered), for
    /// Python to answer.
    Opened {
        conn: u64,
        listener: u32,
        share: Arc<LinkShare>,
        peer: String,
        identity: Option<String>,
        upgrade: Option<(String, Vec<String>)>,
    },
    /// Plaintext from the client.
    Data {
        conn: u64,
        data: Vec<u8>,
    },
    /// The client ended the connection (`eof`), or it broke (`why`).
    Ended {
        conn: u64,
        eof: bool,
        why: String,
    },
    /// What Python sent is down to `SEND_MARK`: it may write more.
    Room {
        conn: u64,
    },
    Log {
        target: LogTarget,
        text: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    Handshake,
    /// A WebSocket's HTTP upgrade is read.
    Upgrade,
    /// Python chooses what to answer the upgrade: not read meanwhile.
    Deciding,
    /// Relayed: read for Python.
    Open,
    /// The client ended it (or it broke): nothing more to read; Python closes it.
    Ended,
    /// Python closed it: what it sent goes out, then it is dropped.
    Closing,
}

/// A connection in its handshake or relayed to Python.
pub struct Relay {
    pub(super) id: u64,
    pub(super) listener: u32,
    pub(super) link: Link,
    pub(super) peer: String,
    pub(super) username_from: UsernameFrom,
    pub(super) phase: Phase,
    /// The handshake's deadline, or the close's (seconds on the threads' clock).
    pub(super) deadline: f64,
    /// Python's bytes the link did not take yet, in order.
    pub(super) unsent: Vec<u8>,
    /// Read while a carry began: the carried connection reads them first (or, the
    /// carry refused, Python does).
    pub(super) held_back: Vec<u8>,
    /// Watched for writability.
    pub(super) writing: bool,
    /// Closing: the close_notify (or close frame) is queued.
    pub(super) notified: bool,
    /// Closing a WebSocket: its close frame is out, the client's answer awaited.
    pub(super) awaiting: bool,
    /// Seconds a WebSocket's upgrade may take after its TLS handshake.
    pub(super) upgrade_timeout: f64,
    /// A secure WebSocket's certificate identity, from the handshake to the upgrade.
    pub(super) identity: Option<String>,
}

impl Relay {
    /// A connection just accepted, its TLS handshake to come by `deadline` (`link`: a
    /// TLS one, or a WebSocket over one).
    pub fn handshake(
        id: u64,
        listener: u32,
        link: Link,
        peer: String,
        username_from: UsernameFrom,
        deadline: f64,
    ) -> Relay {
        Relay {
            id,
            listener,
            link,
            peer,
            username_from,
            phase: Phase::Handshake,
            deadline,
            unsent: Vec::new(),
            held_back: Vec::new(),
            writing: false,
            notified: false,
            awaiting: false,
            upgrade_timeout: 0.0,
            identity: None,
        }
    }

    /// A plain WebSocket connection just accepted, its upgrade to come by `deadline`.
    pub fn upgrade(id: u64, listener: u32, link: Link, peer: String, deadline: f64) -> Relay {
        let mut relay = Relay::handshake(id, listener, link, peer, UsernameFrom::None, deadline);
        relay.phase = Phase::Upgrade;
        relay
    }

    /// What Python shares of it (a relayed link is a TLS one).
    pub(super) fn share(&self) -> Arc<LinkShare> {
        self.link.share().cloned().unwrap_or_default()
    }

    fn interest(&self) -> Option<Interest> {
        let write = !self.unsent.is_empty() || self.link.pending();
        // Closing, it is read only for a WebSocket's close frame.
        let read = self.phase != Phase::Closing || self.link.awaits_close();
        match (read, write) {
            (true, false) => Some(Interest::READABLE),
            (true, true) => Some(Interest::READABLE | Interest::WRITABLE),
            (false, true) => Some(Interest::WRITABLE),
            (false, false) => None,
        }
    }
}

/// One handshake fewer under way (the listeners may accept again).
fn handshake_over(links: &Links) {
    links.handshakes.fetch_sub(1, Ordering::SeqCst);
}

fn millis(at: f64) -> u64 {
    (at.max(0.0) * 1000.0).ceil() as u64
}

impl Worker {
    /// A line for Python's log (dropped past `LOG_BACKLOG` waiting).
    pub(super) fn say(&mut self, target: LogTarget, text: String) {
        if self.links.logs.fetch_add(1, Ordering::Relaxed) >= LOG_BACKLOG {
            self.links.logs.fetch_sub(1, Ordering::Relaxed);
            return;
        }
        self.events.push(LinkEvent::Log { target, text });
    }

    /// The pass's news to Python, in one go.
    pub(super) fn send_events(&mut self) {
        if !self.events.is_empty() {
            self.sink.link_events(std::mem::take(&mut self.events));
        }
    }

    pub(super) fn next_relay_deadline(&self) -> f64 {
        self.relay_timers
            .peek()
            .map_or(f64::INFINITY, |Reverse((ms, _))| *ms as f64 / 1000.0)
    }

    fn arm(&mut self, token: Token, deadline: f64) {
        self.relay_timers.push(Reverse((millis(deadline), token.0)));
    }

    /// A connection accepted for this thread: watched, its handshake begun.
    pub(super) fn insert_relay(&mut self, mut relay: Box<Relay>, touched: &mut Vec<Token>) {
        let token = Token(self.next_token);
        self.next_token = (self.next_token + 1) % (usize::MAX - 1);
        if let Err(e) =
            self.poll
                .registry()
                .register(relay.link.socket(), token, Interest::READABLE)
        {
            if relay.phase == Phase::Handshake {
                handshake_over(&self.links);
                Counters::add(&self.counters.tls_handshake_failures, 1);
                let text = format!("TLS handshake with {} failed: {e}", relay.peer);
                self.say(LogTarget::Handshake, text);
            } else {
                let text = format!("websocket handshake with {} failed: {e}", relay.peer);
                self.say(LogTarget::Upgrade, text);
            }
            return;
        }
        relay.writing = false;
        self.arm(token, relay.deadline);
        self.tokens.insert(relay.id, token);
        self.relays.insert(token, relay);
        // What the client sent before it was watched: read now.
        self.again.push(token);
        touched.push(token);
    }

    /// Readable or writable (or read again): the handshake, or relay what came.
    pub(super) fn relay_ready(&mut self, token: Token, buf: &mut [u8]) {
        let Some(phase) = self.relays.get(&token).map(|r| r.phase) else {
            return;
        };
        match phase {
            Phase::Handshake => self.handshake_step(token, buf),
            Phase::Upgrade => self.upgrade_step(token),
            Phase::Open => self.relay_read(token, buf),
            Phase::Closing => {
                // Read past for a WebSocket's close frame; dropped once it came.
                if let Some(w) = self.relays.get_mut(&token).and_then(|r| r.link.ws_mut()) {
                    w.drain_close(buf);
                }
            }
            Phase::Deciding | Phase::Ended => {}
        }
    }

    fn handshake_step(&mut self, token: Token, buf: &mut [u8]) {
        if self.handshake_spent >= HANDSHAKE_SLICE {
            self.again.push(token); // this pass's share is spent: the next one
            return;
        }
        let began = Instant::now();
        let Some(r) = self.relays.get_mut(&token) else {
            return;
        };
        let Some(t) = r.link.tls_mut() else {
            return;
        };
        let mut reads = 0;
        let outcome = loop {
            match t.receive() {
                Ok(true) if !t.tls.is_handshaking() => break Ok(true),
                Ok(true) if reads >= HANDSHAKE_READS => {
                    // A handshake is a few records: one that goes on is read on in
                    // the next pass, after the others'.
                    self.again.push(token);
                    break Ok(false);
                }
                Ok(true) => reads += 1,
                Ok(false) => break Err("connection closed".to_string()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break Ok(false),
                Err(e) => break Err(e.to_string()),
            }
        };
        let identity = match (&outcome, t.tls.peer_certificates()) {
            (Ok(true), Some([first, ..])) => tls::identity(first.as_ref(), r.username_from),
            _ => None,
        };
        self.handshake_spent += began.elapsed();
        match outcome {
            Ok(false) => {}
            Ok(true) => {
                handshake_over(&self.links);
                Counters::add(&self.counters.tls_handshakes, 1);
                let now = self.now();
                let r = self.relays.get_mut(&token).expect("looked up above");
                if r.link.ws_mut().is_some() {
                    // A secure WebSocket: its upgrade next, with a time of its own.
                    r.phase = Phase::Upgrade;
                    r.identity = identity;
                    r.deadline = now + r.upgrade_timeout;
                    let deadline = r.deadline;
                    self.arm(token, deadline);
                    self.upgrade_step(token);
                    return;
                }
                r.phase = Phase::Open;
                self.events.push(LinkEvent::Opened {
                    conn: r.id,
                    listener: r.listener,
                    share: r.share(),
                    peer: r.peer.clone(),
                    identity,
                    upgrade: None,
                });
                // The client's first bytes (its CONNECT) may have come with its Finished.
                self.relay_read(token, buf);
            }
            Err(why) => {
                handshake_over(&self.links);
                Counters::add(&self.counters.tls_handshake_failures, 1);
                let peer = self.relays.get(&token).map(|r| r.peer.clone());
                self.drop_relay(token);
                if let Some(peer) = peer {
                    self.say(
                        LogTarget::Handshake,
                        format!("TLS handshake with {peer} failed: {why}"),
                    );
                }
            }
        }
    }

    /// Read a WebSocket's upgrade request; once whole, Python hears of the connection
    /// and answers it. One that is no upgrade is refused here, as wsproto refuses it.
    fn upgrade_step(&mut self, token: Token) {
        let Some(r) = self.relays.get_mut(&token) else {
            return;
        };
        let Some(w) = r.link.ws_mut() else {
            return;
        };
        match w.read_head() {
            HeadRead::Incomplete => {}
            HeadRead::Request(target, subprotocols) => {
                r.phase = Phase::Deciding;
                r.deadline = f64::INFINITY;
                self.events.push(LinkEvent::Opened {
                    conn: r.id,
                    listener: r.listener,
                    share: r.share(),
                    peer: r.peer.clone(),
                    identity: r.identity.take(),
                    upgrade: Some((target, subprotocols)),
                });
            }
            HeadRead::Refused => {
                let text = format!(
                    "websocket handshake with {} failed: no upgrade request",
                    r.peer
                );
                self.close_unheard(token);
                self.say(LogTarget::Upgrade, text);
            }
            HeadRead::Ended => {
                let text = format!(
                    "websocket handshake with {} failed: no upgrade request",
                    r.peer
                );
                self.drop_relay(token);
                self.say(LogTarget::Upgrade, text);
            }
        }
    }

    /// A connection Python never heard of closes once what waits for it went out (a
    /// moment at most).
    fn close_unheard(&mut self, token: Token) {
        let deadline = self.now() + CLOSE_LINGER_S;
        if let Some(r) = self.relays.get_mut(&token) {
            r.phase = Phase::Closing;
            r.deadline = deadline;
            self.arm(token, deadline);
            self.again.push(token); // flushed, and dropped once written
        }
    }

    /// Python's answer to a WebSocket's upgrade: the 101 with `subprotocol`, then
    /// frames (the client's read from here, what it sent behind its request first).
    pub(super) fn ws_accept(
        &mut self,
        conn: u64,
        subprotocol: Option<String>,
        touched: &mut Vec<Token>,
    ) {
        let Some(&token) = self.tokens.get(&conn) else {
            return;
        };
        let Some(r) = self.relays.get_mut(&token) else {
            return;
        };
        if r.phase != Phase::Deciding {
            return;
        }
        let Some(w) = r.link.ws_mut() else {
            return;
        };
        if let Err(e) = w.accept(subprotocol.as_deref()) {
            let text = format!("websocket handshake with {} failed: {e}", r.peer);
            self.close_unheard(token);
            self.say(LogTarget::Upgrade, text);
            return;
        }
        r.phase = Phase::Open;
        self.again.push(token);
        touched.push(token);
    }

    /// Python refuses a WebSocket's upgrade: `status` and `body`, then the close.
    pub(super) fn ws_refuse(&mut self, conn: u64, status: u16, body: &[u8]) {
        let Some(&token) = self.tokens.get(&conn) else {
            return;
        };
        let Some(r) = self.relays.get_mut(&token) else {
            return;
        };
        if r.phase != Phase::Deciding {
            return;
        }
        if let Some(w) = r.link.ws_mut() {
            w.refuse(status, body);
        }
        self.close_unheard(token);
    }

    /// Relay what the client sent, within the window.
    fn relay_read(&mut self, token: Token, buf: &mut [u8]) {
        let Some(r) = self.relays.get_mut(&token) else {
            return;
        };
        let share = r.share();
        if r.phase != Phase::Open || share.carrying() {
            return; // a carry began: the carried connection reads it
        }
        let mut read = 0;
        loop {
            if read >= READ_PASS {
                self.again.push(token);
                return;
            }
            // What waits for Python counts in the node's budget: while the node is over
            // it, one that holds its share is not read (TCP holds the client back), the
            // others read as little as Python's own connections do.
            let held = share.unconsumed();
            let window = if self.partial.must_wait(held) {
                0
            } else {
                (share.window() as usize).min(self.partial.read_size(held, buf.len()))
            };
            if window == 0 {
                share.stalled.store(true, Ordering::SeqCst);
                // Python may have consumed meanwhile: then it did not see the stall.
                let still = share.window() == 0 || self.partial.must_wait(share.unconsumed());
                if still || !share.stalled.swap(false, Ordering::SeqCst) {
                    return;
                }
                continue;
            }
            let size = window.min(buf.len());
            match r.link.read(&mut buf[..size]) {
                Ok(0) => {
                    r.phase = Phase::Ended;
                    let conn = r.id;
                    self.events.push(LinkEvent::Ended {
                        conn,
                        eof: true,
                        why: "connection closed by the client".into(),
                    });
                    return;
                }
                Ok(n) => {
                    read += n;
                    Counters::add(&self.counters.bytes_in, n as u64);
                    if !share.relay(n as u64) {
                        r.held_back.extend_from_slice(&buf[..n]);
                        return;
                    }
                    let data = buf[..n].to_vec();
                    self.events.push(LinkEvent::Data { conn: r.id, data });
                    if share.recount(&self.partial) {
                        self.sink.partial_freed();
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    r.phase = Phase::Ended;
                    let conn = r.id;
                    let note = r.link.take_note();
                    self.events.push(LinkEvent::Ended {
                        conn,
                        eof: false,
                        why: format!("connection lost: {e}"),
                    });
                    if let Some(text) = note {
                        self.say(LogTarget::MessageLimit, text);
                    }
                    return;
                }
            }
        }
    }

    /// Python's bytes for a connection: behind what waits, out as the link takes them.
    pub(super) fn relay_send(&mut self, conn: u64, data: Vec<u8>, touched: &mut Vec<Token>) {
        let Some(&token) = self.tokens.get(&conn) else {
            return; // gone: `gone` tells Python
        };
        let now = self.now();
        if let Some(c) = self.conns.get_mut(&token) {
            // Carried already (it was sent before the promotion): in order, first.
            let rule = c.drain;
            c.backlog().wait(&data, &rule, now);
            if let Some(share) = c.link.share() {
                share.took(data.len());
            }
            touched.push(token);
            return;
        }
        let Some(r) = self.relays.get_mut(&token) else {
            return;
        };
        if r.phase == Phase::Closing {
            r.share().took(data.len());
            return;
        }
        r.unsent.extend_from_slice(&data);
        touched.push(token);
    }

    pub(super) fn relay_close(&mut self, conn: u64, touched: &mut Vec<Token>) {
        let Some(&token) = self.tokens.get(&conn) else {
            return;
        };
        let deadline = self.now() + CLOSE_LINGER_S;
        let Some(r) = self.relays.get_mut(&token) else {
            return;
        };
        if r.phase == Phase::Handshake {
            handshake_over(&self.links);
        }
        r.phase = Phase::Closing;
        r.deadline = deadline;
        self.arm(token, deadline);
        touched.push(token);
    }

    /// Python consumed what was relayed, or a carry was refused: read on (what was
    /// held back for the carry first).
    pub(super) fn relay_resume(&mut self, conn: u64, touched: &mut Vec<Token>) {
        let Some(&token) = self.tokens.get(&conn) else {
            return;
        };
        let Some(r) = self.relays.get_mut(&token) else {
            return;
        };
        let share = r.share();
        if !r.held_back.is_empty() && !share.carrying() {
            let data = std::mem::take(&mut r.held_back);
            share.relay(data.len() as u64);
            self.events.push(LinkEvent::Data { conn, data });
        }
        if share.recount(&self.partial) {
            self.sink.partial_freed();
        }
        self.again.push(token);
        touched.push(token);
    }

    /// Write what waits for a relayed connection; watch it as it needs; drop it once
    /// closed and written (or past its linger).
    pub(super) fn relay_flush(&mut self, token: Token) {
        let Some(r) = self.relays.get_mut(&token) else {
            return;
        };
        let mut failed = None;
        if let Err(e) = r.link.flush() {
            failed = Some(e);
        } else if !r.unsent.is_empty() {
            match r.link.write(&r.unsent) {
                Ok(n) => {
                    r.unsent.drain(..n);
                    if r.unsent.is_empty() {
                        r.unsent = Vec::new();
                    }
                    Counters::add(&self.counters.bytes_out, n as u64);
                    if r.share().took(n) {
                        let conn = r.id;
                        self.events.push(LinkEvent::Room { conn });
                    }
                }
                Err(e) => failed = Some(e),
            }
        }
        let r = self.relays.get_mut(&token).expect("looked up above");
        if let Some(e) = failed {
            if r.phase == Phase::Handshake {
                // Python never heard of it: it goes here.
                let text = format!("TLS handshake with {} failed: {e}", r.peer);
                handshake_over(&self.links);
                Counters::add(&self.counters.tls_handshake_failures, 1);
                self.drop_relay(token);
                self.say(LogTarget::Handshake, text);
                return;
            }
            // Nothing more goes out: what waits is given up, and Python told.
            let n = std::mem::take(&mut r.unsent).len();
            let share = r.share();
            share.took(n);
            share.gone.store(true, Ordering::SeqCst);
            if r.phase == Phase::Open {
                r.phase = Phase::Ended;
                let conn = r.id;
                self.events.push(LinkEvent::Ended {
                    conn,
                    eof: false,
                    why: format!("connection lost while writing: {e}"),
                });
            }
        }
        let now = self.now();
        let r = self.relays.get_mut(&token).expect("looked up above");
        if r.phase == Phase::Closing && r.unsent.is_empty() && !r.notified {
            // What Python sent is with the link: the close_notify (or the WebSocket's
            // close frame) goes behind it.
            r.notified = true;
            r.link.close();
        }
        let written = r.notified && !r.link.pending();
        let gone = r.share().gone.load(Ordering::SeqCst);
        if r.phase == Phase::Closing && written && !gone && r.link.awaits_close() {
            if !r.awaiting {
                // The close frame is out: the client has a moment to answer it.
                r.awaiting = true;
                r.deadline = now + ws::CLOSE_TIMEOUT_S;
                let deadline = r.deadline;
                self.arm(token, deadline);
                // It may have come already (its edge seen while it was not read).
                self.again.push(token);
            }
        } else if r.phase == Phase::Closing && (written || gone) {
            self.drop_relay(token);
            return;
        }
        let r = self.relays.get_mut(&token).expect("looked up above");
        let want = r.interest().is_some_and(|i| i.is_writable());
        if want != r.writing {
            r.writing = want;
            watch(&self.poll, r, token);
        }
    }

    /// Forget a relayed connection: its socket closes.
    pub(super) fn drop_relay(&mut self, token: Token) {
        let Some(mut r) = self.relays.remove(&token) else {
            return;
        };
        let _ = self.poll.registry().deregister(r.link.socket());
        let share = r.share();
        share.gone.store(true, Ordering::SeqCst);
        share.took(std::mem::take(&mut r.unsent).len());
        if share.recount(&self.partial) {
            self.sink.partial_freed(); // what waited for Python counts no more
        }
        self.tokens.remove(&r.id);
        if r.id % self.lanes.len() as u64 != self.index as u64 {
            if let Ok(mut routes) = self.routes.write() {
                routes.remove(&r.id); // it moved here once: its route goes with it
            }
        }
    }

    /// Stopping: what Python sent its relayed connections goes out as far as their
    /// sockets take it now (a shutdown's DISCONNECTs), with their close_notify.
    pub(super) fn last_words(&mut self) {
        let tokens: Vec<Token> = self.relays.keys().copied().collect();
        for token in tokens {
            if let Some(r) = self.relays.get_mut(&token) {
                r.phase = Phase::Closing;
            }
            self.relay_flush(token);
        }
    }

    /// Handshakes past their deadline, and closes past their linger.
    pub(super) fn check_relays(&mut self, touched: &mut Vec<Token>) {
        let now_ms = millis(self.now());
        while let Some(&Reverse((due, token))) = self.relay_timers.peek() {
            if due > now_ms {
                break;
            }
            self.relay_timers.pop();
            let token = Token(token);
            let Some(r) = self.relays.get(&token) else {
                continue;
            };
            if millis(r.deadline) > due {
                continue; // armed again since
            }
            match r.phase {
                Phase::Handshake => {
                    let peer = r.peer.clone();
                    handshake_over(&self.links);
                    Counters::add(&self.counters.tls_handshake_timeouts, 1);
                    self.drop_relay(token);
                    self.say(
                        LogTarget::Handshake,
                        format!("TLS handshake with {peer} timed out"),
                    );
                }
                Phase::Upgrade => {
                    let peer = r.peer.clone();
                    self.drop_relay(token);
                    self.say(
                        LogTarget::Upgrade,
                        format!("websocket handshake with {peer} timed out"),
                    );
                }
                Phase::Closing => self.drop_relay(token),
                Phase::Open | Phase::Ended | Phase::Deciding => touched.push(token),
            }
        }
    }

    /// Promote a relayed connection: carried from here, on the same link (its unsent
    /// bytes kept, what was held back for the carry read after Python's).
    pub(super) fn carry(
        &mut self,
        conn: u64,
        mut a: Adoption,
        touched: &mut Vec<Token>,
        published: &mut Vec<Inbound>,
    ) {
        let Some(&token) = self.tokens.get(&conn) else {
            return;
        };
        let Some(r) = self.relays.remove(&token) else {
            return;
        };
        let share = r.share();
        let Relay {
            link,
            unsent,
            held_back,
            phase,
            ..
        } = *r;
        share.end_carry();
        // Python took all that was relayed (its ack follows): carried, what the
        // connection holds is counted as its unfinished packet.
        share.acked.fetch_max(
            share.relayed.load(Ordering::SeqCst) & !crate::link::CARRYING,
            Ordering::SeqCst,
        );
        if share.recount(&self.partial) {
            self.sink.partial_freed();
        }
        a.unread.extend_from_slice(&held_back);
        // What waits for the client stays, first: the carried connection's now.
        share.took(unsent.len());
        let (mut c, unread, unacked, last_read) = self.conn_of(conn, link, a);
        if !unsent.is_empty() {
            let now = self.now();
            let rule = c.drain;
            c.backlog().wait(&unsent, &rule, now);
        }
        if phase != Phase::Open {
            c.demoting = Some(Why::Lost("connection closed by the client".into()));
        }
        self.take_in(c, token, &unread, unacked, last_read, published);
        self.again.push(token); // what came while it was not read
        touched.push(token);
    }

    /// A carried TLS connection goes back to Python: reported as any other, its link
    /// relayed from here (under the same token), its unsent bytes still first.
    pub(super) fn report_demoted_tls(&mut self, token: Token, c: Box<Conn>) {
        let lost = matches!(c.demoting, Some(Why::Lost(_)));
        let id = c.id;
        let (mut report, link) = self.demoted(*c);
        let Some(link) = link else {
            self.sink.report(Report::Demoted(Box::new(report)));
            return;
        };
        // The owner gets no unsent bytes: they stay here, in front of what it sends.
        let unsent = std::mem::take(&mut report.unsent);
        if let Some(share) = link.share() {
            share.queued.fetch_add(unsent.len(), Ordering::SeqCst);
        }
        let mut relay = Box::new(Relay {
            id,
            listener: 0,
            link,
            peer: String::new(),
            username_from: UsernameFrom::None,
            phase: if lost { Phase::Ended } else { Phase::Open },
            deadline: f64::INFINITY,
            unsent,
            held_back: Vec::new(),
            writing: false,
            notified: false,
            awaiting: false,
            upgrade_timeout: 0.0,
            identity: None,
        });
        relay.writing = relay.interest().is_some_and(|i| i.is_writable());
        watch(&self.poll, &mut relay, token);
        self.relays.insert(token, relay);
        self.sink.report(Report::Demoted(Box::new(report)));
        self.again.push(token); // read on, for Python now
    }
}

/// Watch a relay for what it needs now (registered anew if it was not watched).
fn watch(poll: &Poll, r: &mut Relay, token: Token) {
    let registry = poll.registry();
    match r.interest() {
        Some(i) => {
            if registry.reregister(r.link.socket(), token, i).is_err() {
                let _ = registry.register(r.link.socket(), token, i);
            }
        }
        None => {
            let _ = registry.deregister(r.link.socket());
        }
    }
}
