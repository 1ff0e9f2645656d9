//! The native listeners (`serving/accepting.py` and `serving/fd_budget.py` are the
//! reference): Python binds the socket (so its start-up errors, port 0 and the ready
//! line stay Python's) and hands it over; thread 0 accepts on it, checks each new
//! connection against the descriptor reserve, begins its TLS session with the current
//! configuration (reloaded when its files changed) and hands it to the thread it
//! belongs to (`conn % N`), where its handshake runs (`relay`). A WebSocket listener's
//! connections (over TLS or not) then read their HTTP upgrade there.
//!
//! As Python's listeners do, a listener never stops for good and never spins: a
//! connection gone before it was accepted is skipped, running out of something
//! (descriptors, memory) rests the listener `ACCEPT_BACKOFF_S` and is said once in a
//! while; and past `Links::max_handshakes` under way it accepts nothing (the kernel's
//! backlog holds the rest) until some finish.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;

use mio::net::TcpListener;

use super::relay::{LogTarget, Relay};
use super::*;
use crate::link::Link;
use crate::tls::{Reload, TlsFiles};

/// How long a listener rests after accept(2) failed for want of something.
pub const ACCEPT_BACKOFF_S: f64 = 0.1;
/// Connections one listener accepts in one pass, at most.
const ACCEPTS_PER_PASS: usize = 256;
/// How often a listener that waits (for the handshake cap, a rest, or because it had
/// more than a pass's worth) is looked at.
const WAITING_LOOK: Duration = Duration::from_millis(10);

/// A listening socket and what its connections start with.
pub struct Listener {
    pub index: u32,
    /// As Python's logs name it ("MQTT over TLS").
    pub name: String,
    pub socket: TcpListener,
    /// Its TLS configuration (None: plain WebSocket).
    pub tls: Option<Arc<Mutex<TlsFiles>>>,
    /// A WebSocket listener: seconds a connection's upgrade may take (after its TLS
    /// handshake, over TLS).
    pub upgrade_timeout: Option<f64>,
    /// A connection on this descriptor or above is refused (serving.fd_budget).
    pub fd_ceiling: usize,
    /// Seconds a handshake may take from the accept.
    pub handshake_timeout: f64,
    /// Not before this (a rest after a failed accept).
    pub(super) resting_until: f64,
    /// Looked at again next pass (see `WAITING_LOOK`).
    pub(super) waiting: bool,
}

impl Listener {
    /// MQTT over TLS.
    pub fn new(
        index: u32,
        name: String,
        socket: std::net::TcpListener,
        tls: Arc<Mutex<TlsFiles>>,
        fd_ceiling: usize,
        handshake_timeout: f64,
    ) -> io::Result<Listener> {
        Listener::with(
            index,
            name,
            socket,
            Some(tls),
            fd_ceiling,
            handshake_timeout,
            None,
        )
    }

    /// MQTT over WebSocket, over TLS when `tls` is given; an upgrade may take
    /// `upgrade_timeout` seconds.
    pub fn websocket(
        index: u32,
        name: String,
        socket: std::net::TcpListener,
        tls: Option<Arc<Mutex<TlsFiles>>>,
        fd_ceiling: usize,
        handshake_timeout: f64,
        upgrade_timeout: f64,
    ) -> io::Result<Listener> {
        let timeout = Some(upgrade_timeout);
        Listener::with(
            index,
            name,
            socket,
            tls,
            fd_ceiling,
            handshake_timeout,
            timeout,
        )
    }

    fn with(
        index: u32,
        name: String,
        socket: std::net::TcpListener,
        tls: Option<Arc<Mutex<TlsFiles>>>,
        fd_ceiling: usize,
        handshake_timeout: f64,
        upgrade_timeout: Option<f64>,
    ) -> io::Result<Listener> {
        socket.set_nonblocking(true)?;
        Ok(Listener {
            index,
            name,
            socket: TcpListener::from_std(socket),
            tls,
            upgrade_timeout,
            fd_ceiling,
            handshake_timeout,
            resting_until: 0.0,
            waiting: false,
        })
    }
}

/// What accept(2) failing with `e` means: false, one connection's trouble (go on at
/// once); true, the listener must rest (as `serving.accepting.must_rest`).
fn must_rest(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    if matches!(
        e.kind(),
        WouldBlock
            | Interrupted
            | ConnectionAborted
            | ConnectionReset
            | PermissionDenied
            | TimedOut
            | HostUnreachable
            | NetworkUnreachable
            | NetworkDown
            | Unsupported
    ) {
        return false;
    }
    // EPROTO, ENOPROTOOPT, ENONET, EHOSTDOWN (Linux's numbers): the peer's, too.
    !matches!(e.raw_os_error(), Some(71 | 92 | 64 | 112))
}

fn errno_name(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(24) => "EMFILE".into(),
        Some(23) => "ENFILE".into(),
        Some(105) => "ENOBUFS".into(),
        Some(12) => "ENOMEM".into(),
        Some(n) => format!("errno {n}"),
        None => format!("{:?}", e.kind()),
    }
}

fn peer_of(addr: &SocketAddr) -> String {
    format!("{}:{}", addr.ip(), addr.port())
}

impl Worker {
    pub(super) fn listen(&mut self, mut listener: Box<Listener>) {
        let token = Token(self.next_token);
        self.next_token = (self.next_token + 1) % (usize::MAX - 1);
        if let Err(e) =
            self.poll
                .registry()
                .register(&mut listener.socket, token, Interest::READABLE)
        {
            let text = format!("{}: not listening: {e}", listener.name);
            self.say(LogTarget::AcceptFailed, text);
            return;
        }
        // Connections may wait already: look at once.
        listener.waiting = true;
        self.listeners.insert(token, listener);
    }

    /// The listeners that wait, if their time came.
    pub(super) fn accept_waiting(&mut self) {
        let waiting: Vec<Token> = self
            .listeners
            .iter()
            .filter(|(_, l)| l.waiting)
            .map(|(t, _)| *t)
            .collect();
        for token in waiting {
            self.accept(token);
        }
    }

    pub(super) fn listeners_wait(&self) -> Option<Duration> {
        self.listeners
            .values()
            .any(|l| l.waiting)
            .then_some(WAITING_LOOK)
    }

    /// Accept what waits on a listener, within the pass's share, the handshake cap and
    /// the descriptor reserve.
    pub(super) fn accept(&mut self, token: Token) {
        let now = self.now();
        let Some(l) = self.listeners.get_mut(&token) else {
            return;
        };
        l.waiting = false;
        if now < l.resting_until {
            l.waiting = true;
            return;
        }
        let mut refused = 0u64;
        let mut accepted = Vec::new();
        let mut said = Vec::new();
        let mut tries = 0;
        while tries < ACCEPTS_PER_PASS {
            tries += 1;
            let links = &self.links;
            if l.tls.is_some()
                && links.handshakes.load(Ordering::SeqCst)
                    >= links.max_handshakes.load(Ordering::Relaxed)
            {
                l.waiting = true; // the kernel's backlog holds the rest meanwhile
                break;
            }
            let (tcp, addr) = match l.socket.accept() {
                Ok(got) => got,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if !must_rest(&e) => continue,
                Err(e) => {
                    l.resting_until = now + ACCEPT_BACKOFF_S;
                    l.waiting = true;
                    said.push((
                        LogTarget::AcceptFailed,
                        format!(
                            "{}: accept failed with {} ({e}); retrying every {ACCEPT_BACKOFF_S} s",
                            l.name,
                            errno_name(&e)
                        ),
                    ));
                    break;
                }
            };
            if tcp.as_raw_fd() as usize >= l.fd_ceiling {
                refused += 1;
                continue; // closed here: the node's own files keep their reserve
            }
            let _ = tcp.set_nodelay(true); // small MQTT packets must not wait for Nagle
            let peer = peer_of(&addr);
            let id = links.next_id.fetch_add(1, Ordering::Relaxed);
            let Some(tls) = &l.tls else {
                // Plain WebSocket: its upgrade has its time from the accept.
                let timeout = l.upgrade_timeout.unwrap_or(l.handshake_timeout);
                let link = Link::ws(Link::Plain(tcp), &peer);
                accepted.push(Box::new(Relay::upgrade(
                    id,
                    l.index,
                    link,
                    peer,
                    now + timeout,
                )));
                continue;
            };
            let (config, reload) = match tls.lock() {
                Ok(mut files) => files.current(),
                Err(_) => break,
            };
            match reload {
                Some(Reload::Reloaded(text)) => said.push((LogTarget::Reloaded, text)),
                Some(Reload::Failed(text)) => said.push((LogTarget::ReloadFailed, text)),
                None => {}
            }
            let username_from = match tls.lock() {
                Ok(files) => files.settings.username_from,
                Err(_) => break,
            };
            let session = match rustls::ServerConnection::new(config) {
                Ok(mut s) => {
                    s.set_buffer_limit(Some(crate::tls::BUFFER_LIMIT));
                    s
                }
                Err(e) => {
                    let text = format!("TLS handshake with {peer} failed: {e}");
                    said.push((LogTarget::Handshake, text));
                    continue;
                }
            };
            let mut link = Link::tls(tcp, session);
            if l.upgrade_timeout.is_some() {
                link = Link::ws(link, &peer);
            }
            links.handshakes.fetch_add(1, Ordering::SeqCst);
            let mut relay = Relay::handshake(
                id,
                l.index,
                link,
                peer,
                username_from,
                now + l.handshake_timeout,
            );
            relay.upgrade_timeout = l.upgrade_timeout.unwrap_or(0.0);
            accepted.push(Box::new(relay));
        }
        if tries == ACCEPTS_PER_PASS {
            l.waiting = true; // more may wait: the edge said so once
        }
        let name = l.name.clone();
        for (target, text) in said {
            self.say(target, text);
        }
        if refused > 0 {
            self.say(LogTarget::Refused { count: refused }, name.clone());
        }
        let mut touched = Vec::new();
        for relay in accepted {
            let lane = (relay.id % self.lanes.len() as u64) as usize;
            if lane == self.index {
                self.insert_relay(relay, &mut touched);
            } else {
                self.lanes[lane].push([Command::Accepted(relay)]);
                self.lanes[lane].wake();
            }
        }
        // (Each new relay is read once `again` comes round: nothing to flush yet.)
        drop(touched);
    }
}
