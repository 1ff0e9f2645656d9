//! The native reactors (`gateway/reactor.py` is the Python one): `--io-threads N`
//! threads, each with its own epoll set (mio), owning the plain-TCP connections handed
//! to it after their CONNACK. A pass reads every socket that has data, runs each
//! connection's steady state (`protocol`), reports what was published as one batch to
//! the owner (`Sink`), and writes what waits. No interpreter runs here: the owner is
//! Rust (the engine that appends and delivers), and Python hears of what needs it
//! (a demotion, with the socket and the connection's state) through the same sink.
//!
//! A connection is demoted when its core hands a packet back, when its keepalive runs
//! out, when the client closes, or when its backlog passes the budget (unless the owner
//! serves a subscriber past it from the store: `Sink::catches_up`, `backlog`): the
//! reactor stops reading it, waits until every publish it took is answered, and hands
//! the socket, the unread bytes, the unsent bytes and what is in flight to the owner.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token, Waker};

use crate::link::Link;
use crate::partial::PartialBudget;
use crate::protocol::{Acl, Connection, Event, Outgoing, Settings, TopicLimits};

mod accept;
mod keep;
mod relay;

use keep::Keeper;
pub use keep::{KeepSends, Resume, ROUND_BYTES, ROUND_MESSAGES};

pub use accept::Listener;
pub use relay::{LinkEvent, Links, LogTarget, Relay};

const WAKER: Token = Token(usize::MAX);
const READ_SIZE: usize = 64 * 1024;
/// What one connection may read in one pass: the rest waits for the next pass, after
/// this one's answers are written (or found unread, past the backlog budget: then it is
/// handed back), as Python's read budget does. Without it a client that sends faster
/// than the loop reads, and never reads, grows its answers without bound.
const READ_PASS: usize = 4 * READ_SIZE;
/// Delivery bytes queued for one thread past which every thread stops reading its
/// clients (their publishes make more) until that thread has taken them: publishers
/// flooding a busy thread are paced by it, as TCP paces them, not by memory.
const LANE_BUDGET: usize = 8 * 1024 * 1024;
/// How often a thread that stopped reading looks whether it may read again.
const STALL_LOOK: Duration = Duration::from_millis(1);
/// Output a burst of deliveries may gather before it is written, within one batch of
/// commands.
const WRITE_AT: usize = 64 * 1024;

/// A connection that gets this many deliveries in a row from one other thread, while
/// both threads are lightly loaded, moves there (its state, socket and waiting commands
/// go over whole): a message read on one thread and written on another costs a wake-up
/// of the second, which at a few thousand messages a second was a third of the CPU per
/// message.
pub const MOVE_AFTER: u32 = 64;
/// Busy below this (per mille of the last second) is lightly loaded: under load, work
/// spread over the threads is worth more than the wake-ups it costs.
pub const LIGHT_LOAD: u32 = 250;
/// Seconds a connection that moved stays on its new thread before it may move again
/// (bounds the moves of a connection whose traffic comes from one thread, then another).
pub const MOVE_SETTLE_S: f64 = 1.0;
/// A publisher whose deliveries all went to one other thread this many publishes in a
/// row, while both threads are lightly loaded, moves there. Fewer than a subscriber's
/// `MOVE_AFTER`: a device publishes every few seconds, and each of its messages to an
/// application on another thread wakes that thread (in a fleet of 5,000 devices to one
/// subscriber, the second thread's wake-ups were a quarter of the CPU per message).
pub const LEAN_AFTER: u16 = 2;

thread_local! {
    /// The reactor thread this is (its lane), or None outside the reactors.
    static LANE: Cell<Option<usize>> = const { Cell::new(None) };
}

/// The reactor thread the caller runs on, if it is one: a delivery says where it came
/// from.
pub fn current_lane() -> Option<usize> {
    LANE.with(|l| l.get())
}

/// A publish a connection made, to be appended; `ticket` is answered with
/// `Command::PublishDone` (QoS 1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inbound {
    pub conn: u64,
    pub client_id: Arc<str>,
    pub topic: String,
    pub payload: Vec<u8>,
    pub qos: u8,
    pub packet_id: Option<u16>,
    pub ticket: Option<u64>,
}

/// Why a connection went back to its owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Why {
    /// A packet the steady state does not carry (it is first in `unread`).
    Packet,
    /// The keepalive ran out.
    Timeout,
    /// The client closed the connection, or it failed.
    Lost(String),
    /// More waits for the client than the budget allows.
    Backlog,
    /// The client took less of what waits for it than its `DrainRule` asks: its owner
    /// disconnects it.
    Stuck,
    /// It holds its share of an unfinished packet while the node is over its budget
    /// for them (`PartialBudget::must_wait`): the owner holds it back, as its own.
    Partial,
    /// The owner asked for it back (`Command::Release`): a takeover, a kick, changed
    /// credentials, a shutdown.
    Released,
}

impl Why {
    /// What the owner is told, as a word (and the loss's text for `Lost`).
    pub fn name(&self) -> &str {
        match self {
            Why::Packet => "packet",
            Why::Timeout => "timeout",
            Why::Lost(_) => "lost",
            Why::Backlog => "backlog",
            Why::Stuck => "stuck",
            Why::Partial => "partial",
            Why::Released => "released",
        }
    }
}

/// A connection handed back, with what its owner needs to go on from here without a
/// gap or a duplicate: the packet that needed it first in `unread`, what the socket did
/// not take yet (`unsent`, to be written before anything else), the QoS 1 deliveries in
/// flight, and for each light queue delivered from, the offset after the last message
/// that went into `unsent` or out (deliveries still `held` are not counted: the owner
/// delivers them again from the store).
#[derive(Debug)]
pub struct Demoted {
    pub conn: u64,
    /// The socket, for a plain-TCP connection; None for a TLS one, which the reactor
    /// keeps and relays (its session cannot leave it): its unsent bytes stay with it.
    pub socket: Option<OwnedFd>,
    pub why: Why,
    pub unread: Vec<u8>,
    pub unsent: Vec<u8>,
    pub outgoing: BTreeMap<u16, Outgoing>,
    pub next_packet_id: u16,
    pub aliases_in: HashMap<u16, String>,
    /// QoS 1 publishes not acknowledged yet when `unread` was read (their PUBACKs are
    /// out or in `unsent`): counted against our Receive Maximum by whoever reads on.
    pub inbound_unacked: u32,
    /// Deliveries accepted but not yet sent (the window was full).
    pub held: Vec<Delivery>,
    /// Queue -> the next offset to deliver from it.
    pub positions: HashMap<Arc<str>, u64>,
    /// Of a persistent session's: the queue and offset of each send in `outgoing` whose
    /// record the owner kept (`Report::Keep`): (packet id, queue, offset).
    pub sends: Vec<(u16, Arc<str>, u64)>,
    /// Seconds since the client last sent anything.
    pub idle_for: f64,
    /// Bytes of `unread` counted in the node's `PartialBudget`: the owner's to count
    /// from here (it releases them, or counts what it keeps of them instead). Released
    /// here, they would count nowhere until the owner has them, and connections read
    /// meanwhile would find room that is not there.
    pub partial: usize,
}

/// What the reactors tell their owner.
#[derive(Debug)]
pub enum Report {
    Published(Vec<Inbound>),
    Acked {
        conn: u64,
        packet_id: u16,
        source: (u64, u64),
    },
    Demoted(Box<Demoted>),
    /// What happened on a connection the native side accepted (`relay`).
    Link(LinkEvent),
    /// A connection that fell behind (`Sink::catches_up`) has room for its next batch
    /// from the store: round `round` starts at `positions` (queue -> next offset; a
    /// queue it has not been delivered from yet is missing).
    Behind {
        conn: u64,
        round: u64,
        positions: Vec<(Arc<str>, u64)>,
    },
    /// A persistent session's batch of QoS 1 sends, held until the owner has their
    /// record in the store (`Command::Kept`).
    Keep {
        conn: u64,
        batch: u64,
        sends: KeepSends,
    },
    /// Where a persistent session's queues resume (queue, lowest offset in flight or
    /// next, next), and the batches it completed (their records go).
    Progress {
        conn: u64,
        positions: Resume,
        done: Vec<u64>,
    },
}

pub trait Sink: Send + Sync + 'static {
    fn report(&self, report: Report);

    /// A pass's publishes, to be appended: and, per publishing connection, where their
    /// deliveries went (a publisher whose deliveries all go to one other thread may
    /// move there, as a subscriber does: `LEAN_AFTER`).
    fn publish(&self, batch: Vec<Inbound>) -> Vec<(u64, Lean)> {
        self.report(Report::Published(batch));
        Vec::new()
    }

    /// What a topic of a connection that may publish anywhere is held to.
    fn topic_limits(&self) -> TopicLimits {
        TopicLimits::NONE
    }

    /// Whether a connection that falls behind its budget stays, served from the store
    /// a batch at a time (`Report::Behind`, `Command::Catch`), instead of going back.
    fn catches_up(&self) -> bool {
        false
    }

    /// A connection fell behind (`catches_up`): live deliveries for it are dropped
    /// from here on, so the owner need not make them.
    fn fell_behind(&self, _conn: u64) {}

    /// Whether what was reported waits too long to be taken further (the dispatch of
    /// the appends behind): the reactors then stop reading publishers for a moment.
    fn behind(&self) -> bool {
        false
    }

    /// A connection's finished packet took the node back within its budget for partial
    /// packets: whoever the owner holds back for it may read again.
    fn partial_freed(&self) {}

    /// A pass's news of the connections the native side accepted, in order.
    fn link_events(&self, events: Vec<LinkEvent>) {
        for e in events {
            self.report(Report::Link(e));
        }
    }
}

/// Where the deliveries of one publish went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lean {
    /// All to connections of this one reactor thread.
    To(usize),
    /// To connections of several threads (or one that goes back to the owner).
    Spread,
}

/// Queues and a message's offset in each.
pub type Positions = Vec<(Arc<str>, u64)>;

/// A message for one connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    pub topic: Arc<str>,
    pub payload: Arc<[u8]>,
    pub qos: u8,
    pub retain: bool,
    pub source: (u64, u64),
    /// The connection's queues this message is in, with its offset in each: sent (or
    /// dropped as too large), it moves each one's position past it.
    pub positions: Positions,
    /// The reactor thread whose publish this is (`current_lane`), or None.
    pub from_lane: Option<usize>,
}

/// What the allocator keeps beside each allocation, at least (its header, rounding).
const ALLOC_OVERHEAD: usize = 16;
/// An `Arc`'s counts, before the value it shares.
const ARC_COUNTS: usize = 2 * std::mem::size_of::<usize>();

impl Delivery {
    /// The heap a delivery holds while it waits: its topic and payload (each message
    /// has its own, shared by its subscribers) and its positions. Counted whole for
    /// every connection that holds it, as each may be the last to. Counted by its
    /// payload alone, an empty message on a long topic cost nothing: 100,000 of them
    /// (a 256-byte topic) held for a client that never acknowledged grew the process by
    /// 50-56 MiB, and it was never handed back.
    pub fn cost(&self) -> usize {
        let positions = self.positions.capacity() * std::mem::size_of::<(Arc<str>, u64)>();
        (ARC_COUNTS + self.topic.len() + ALLOC_OVERHEAD)
            + (ARC_COUNTS + self.payload.len() + ALLOC_OVERHEAD)
            + (positions + ALLOC_OVERHEAD)
    }
}

/// What an adopted connection resumes with (the Python core's state at the handover).
#[derive(Debug, Clone, Default)]
pub struct Restore {
    pub aliases_in: HashMap<u16, String>,
    pub next_packet_id: u16,
    /// Whose publishes these are: each one's record carries it, as Python's do.
    pub client_id: Arc<str>,
    /// QoS 1 publishes the owner had not acknowledged when it read `unread`.
    pub inbound_unacked: u32,
}

/// What the reactors have done, for the owner's metrics (read without a lock).
#[derive(Debug, Default)]
pub struct Counters {
    pub messages_in: AtomicU64,
    pub messages_out: AtomicU64,
    /// Of those, at QoS 1 (the rest are QoS 0: QoS 2 is the owner's).
    pub messages_in_qos1: AtomicU64,
    pub messages_out_qos1: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub dropped: AtomicU64,
    pub adopted: AtomicU64,
    pub demoted: AtomicU64,
    pub connections: AtomicU64,
    /// Connections moved to the thread their deliveries come from.
    pub moved: AtomicU64,
    /// Subscribers that fell behind their budget and were served from the store, and
    /// those of them that caught up and went live again.
    pub fell_behind: AtomicU64,
    pub caught_up: AtomicU64,
    /// Rounds of those served from the engine's ring of recent index entries, and from
    /// the owner's index (a reader below the ring, or one whose ring is not kept).
    pub rounds_from_ring: AtomicU64,
    pub rounds_from_store: AtomicU64,
    /// TLS handshakes the native listeners completed, failed, and gave up on (the
    /// client said nothing in time).
    pub tls_handshakes: AtomicU64,
    pub tls_handshake_failures: AtomicU64,
    pub tls_handshake_timeouts: AtomicU64,
}

impl Counters {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// (name, value) of each, in a fixed order.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        vec![
            ("messages_in", get(&self.messages_in)),
            ("messages_out", get(&self.messages_out)),
            ("messages_in_qos1", get(&self.messages_in_qos1)),
            ("messages_out_qos1", get(&self.messages_out_qos1)),
            ("bytes_in", get(&self.bytes_in)),
            ("bytes_out", get(&self.bytes_out)),
            ("dropped", get(&self.dropped)),
            ("fell_behind", get(&self.fell_behind)),
            ("caught_up", get(&self.caught_up)),
            ("rounds_from_ring", get(&self.rounds_from_ring)),
            ("rounds_from_store", get(&self.rounds_from_store)),
            ("adopted", get(&self.adopted)),
            ("demoted", get(&self.demoted)),
            ("connections", get(&self.connections)),
            ("moved", get(&self.moved)),
            ("tls_handshakes", get(&self.tls_handshakes)),
            ("tls_handshake_failures", get(&self.tls_handshake_failures)),
            ("tls_handshake_timeouts", get(&self.tls_handshake_timeouts)),
        ]
    }
}

pub enum Command {
    /// Take this connection (its socket) over, as `adoption` says.
    Adopt {
        conn: u64,
        socket: OwnedFd,
        adoption: Box<Adoption>,
    },
    /// The record of a persistent session's batch is in the store: it may go out.
    Kept {
        conn: u64,
        batch: u64,
    },
    /// Hand this connection back now (it is demoted as for any other reason, once the
    /// publishes it made are answered). Unknown (being handed back already): nothing.
    Release {
        conn: u64,
    },
    PublishDone {
        conn: u64,
        ticket: u64,
        packet_id: u16,
        code: u8,
        /// Why it was not stored (`code` != 0), in the owner's words.
        reason: Option<Arc<str>>,
    },
    Deliver {
        conn: u64,
        delivery: Delivery,
    },
    /// The batch of round `round` for a connection that fell behind, read from the
    /// store (`backlog::batch`).
    Catch {
        conn: u64,
        round: u64,
        batch: Box<crate::backlog::Batch>,
    },
    /// A connection that fell behind caught up: live deliveries from here on.
    Live {
        conn: u64,
    },
    /// A connection moving in from another thread, with the commands it had waiting
    /// there (applied first, in order).
    Arrive(Migrant),
    /// Accept on this listener (it goes to thread 0).
    Listen(Box<Listener>),
    /// A connection a listener accepted, for the thread it belongs to (`conn % N`).
    Accepted(Box<Relay>),
    /// Python's bytes for a relayed connection.
    Send {
        conn: u64,
        data: Vec<u8>,
    },
    /// Python closes a relayed connection: what it sent goes out first (a moment at
    /// most), then the close_notify.
    Close {
        conn: u64,
    },
    /// Python consumed what was relayed (or a carry was refused): read it again.
    Resume {
        conn: u64,
    },
    /// Carry a relayed connection from here on (a promotion: the same link, the same
    /// thread, its unsent bytes kept).
    Carry {
        conn: u64,
        adoption: Box<Adoption>,
    },
    /// Python accepts a WebSocket's upgrade with this subprotocol: the 101, then frames.
    Upgrade {
        conn: u64,
        subprotocol: Option<String>,
    },
    /// Python refuses a WebSocket's upgrade: this answer, then the close.
    Refuse {
        conn: u64,
        status: u16,
        body: Vec<u8>,
    },
    Stop,
}

/// A connection on its way between threads.
pub struct Migrant {
    conn: Box<Conn>,
    waiting: Vec<Command>,
}

impl Command {
    fn conn(&self) -> u64 {
        match self {
            Command::Adopt { conn, .. }
            | Command::Release { conn }
            | Command::PublishDone { conn, .. }
            | Command::Deliver { conn, .. }
            | Command::Catch { conn, .. }
            | Command::Live { conn }
            | Command::Kept { conn, .. }
            | Command::Send { conn, .. }
            | Command::Close { conn }
            | Command::Resume { conn }
            | Command::Carry { conn, .. }
            | Command::Upgrade { conn, .. }
            | Command::Refuse { conn, .. } => *conn,
            Command::Arrive(m) => m.conn.id,
            Command::Accepted(r) => r.id,
            Command::Listen(_) | Command::Stop => 0,
        }
    }

    /// Bytes it holds that a client is waiting for (`LANE_BUDGET`).
    fn weight(&self) -> usize {
        match self {
            Command::Deliver { delivery, .. } => std::mem::size_of::<Command>() + delivery.cost(),
            Command::Catch { batch, .. } => {
                std::mem::size_of::<Command>()
                    + batch.deliveries.iter().map(Delivery::cost).sum::<usize>()
            }
            _ => 0,
        }
    }
}

struct Lane {
    commands: Mutex<Vec<Command>>,
    /// Delivery bytes in `commands`, kept under its lock (`LANE_BUDGET`).
    queued: AtomicUsize,
    waker: Waker,
    /// How busy its thread was over the last second, per mille.
    busy: AtomicU32,
    /// The lane's own thread: what it sends itself (the deliveries of a publish it just
    /// read) needs no wake-up, as it applies its commands again before it writes.
    thread: OnceLock<ThreadId>,
}

impl Lane {
    fn push(&self, commands: impl IntoIterator<Item = Command>) {
        if let Ok(mut queue) = self.commands.lock() {
            let before = queue.len();
            queue.extend(commands);
            let added: usize = queue[before..].iter().map(Command::weight).sum();
            self.queued.fetch_add(added, Ordering::Relaxed);
        }
    }

    fn take(&self) -> Option<Vec<Command>> {
        let mut queue = self.commands.lock().ok()?;
        self.queued.store(0, Ordering::Relaxed);
        Some(std::mem::take(&mut *queue))
    }

    /// The commands waiting for connection `conn` (it moves to another thread).
    fn take_conn(&self, conn: u64) -> Vec<Command> {
        let Ok(mut queue) = self.commands.lock() else {
            return Vec::new();
        };
        let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut *queue)
            .into_iter()
            .partition(|cmd| !matches!(cmd, Command::Stop) && cmd.conn() == conn);
        let weight = rest.iter().map(Command::weight).sum();
        self.queued.store(weight, Ordering::Relaxed);
        *queue = rest;
        mine
    }

    fn over_budget(&self) -> bool {
        self.queued.load(Ordering::Relaxed) > LANE_BUDGET
    }

    fn wake(&self) {
        if self.thread.get() != Some(&std::thread::current().id()) {
            let _ = self.waker.wake();
        }
    }
}

/// The running reactors; a connection lives on thread `conn % N` unless it moved
/// (`Handle::routes`).
pub struct Reactor {
    handle: Handle,
    threads: Vec<JoinHandle<()>>,
}

/// Where commands go: cloneable, for whoever must answer the reactors (the engine).
#[derive(Clone)]
pub struct Handle {
    lanes: Vec<Arc<Lane>>,
    counters: Arc<Counters>,
    partial: Arc<PartialBudget>,
    /// The threads of connections that moved. A command is queued under its read lock,
    /// a move switches a route under its write lock: then no command for the moving
    /// connection is on its way to the old thread, and every later one queues behind
    /// the connection's arrival on the new one.
    routes: Arc<RwLock<HashMap<u64, usize>>>,
    /// What the threads share of the connections the native side accepts.
    links: Arc<Links>,
}

impl Handle {
    fn index(&self, routes: &HashMap<u64, usize>, conn: u64) -> usize {
        match routes.get(&conn) {
            Some(&lane) => lane,
            None => (conn % self.lanes.len() as u64) as usize,
        }
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// The node's budget for partly received packets, which the connections of every
    /// thread count in.
    pub fn partial(&self) -> &PartialBudget {
        &self.partial
    }

    pub fn links(&self) -> &Links {
        &self.links
    }

    pub fn send(&self, command: Command) {
        let Ok(routes) = self.routes.read() else {
            return;
        };
        let lane = &self.lanes[self.index(&routes, command.conn())];
        lane.push([command]);
        drop(routes);
        lane.wake();
    }

    /// Many commands, one lock and one wake-up per thread (a fan-out's deliveries).
    /// Returns the thread each went to, in order.
    pub fn send_many(&self, commands: Vec<Command>) -> Vec<usize> {
        let n = self.lanes.len();
        let mut per_lane: Vec<Vec<Command>> = (0..n).map(|_| Vec::new()).collect();
        let Ok(routes) = self.routes.read() else {
            return Vec::new();
        };
        let mut went = Vec::with_capacity(commands.len());
        for c in commands {
            let lane = self.index(&routes, c.conn());
            went.push(lane);
            per_lane[lane].push(c);
        }
        let mut woken = Vec::new();
        for (lane, batch) in self.lanes.iter().zip(per_lane) {
            if batch.is_empty() {
                continue;
            }
            lane.push(batch);
            woken.push(lane);
        }
        drop(routes);
        for lane in woken {
            lane.wake();
        }
        went
    }
}

/// Bytes waiting for one client past which it is handed back (a slow reader costs the
/// store, not the gateway's memory), unless the owner gives its own: those the socket
/// did not take, and what the deliveries held for its window cost (`Delivery::cost`).
pub const BACKLOG_BUDGET: usize = 2 * 1024 * 1024;

/// How fast a client must take what waits for its socket, the owner's rule
/// (`gateway/backpressure.py`, --min-drain-bytes per --write-timeout): while bytes
/// wait, `min_bytes` of them (all of them, if fewer wait) within `timeout` seconds,
/// then as many within the next `timeout`, and so on. A client that takes a byte now
/// and then is as stuck as one that takes none: it is handed back (`Why::Stuck`), and
/// its owner disconnects it. A timeout of 0: no rule.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DrainRule {
    pub min_bytes: usize,
    pub timeout: f64,
}

impl DrainRule {
    /// Bytes the client must take within the next `timeout`, of `waiting`.
    fn due(&self, waiting: usize) -> usize {
        self.min_bytes.max(1).min(waiting)
    }
}

/// Bytes of an incomplete packet held for one client past which it is handed back: a
/// large packet in pieces is the owner's, whose read budget bounds what all clients
/// hold at once.
pub const PARTIAL_BUDGET: usize = READ_SIZE;

impl Reactor {
    pub fn start(threads: usize, sink: Arc<dyn Sink>) -> io::Result<Reactor> {
        let mut lanes = Vec::new();
        let mut handles = Vec::new();
        let counters = Arc::new(Counters::default());
        let partial = Arc::new(PartialBudget::default());
        let mut polls = Vec::new();
        let routes = Arc::new(RwLock::new(HashMap::new()));
        let links = Arc::new(Links::default());
        // One clock for all: a connection's deadlines go with it when it moves.
        let epoch = Instant::now();
        for _ in 0..threads.max(1) {
            let poll = Poll::new()?;
            let waker = Waker::new(poll.registry(), WAKER)?;
            lanes.push(Arc::new(Lane {
                commands: Mutex::new(Vec::new()),
                queued: AtomicUsize::new(0),
                waker,
                busy: AtomicU32::new(0),
                thread: OnceLock::new(),
            }));
            polls.push(poll);
        }
        for (i, poll) in polls.into_iter().enumerate() {
            let mut worker = Worker {
                poll,
                index: i,
                lanes: lanes.clone(),
                routes: Arc::clone(&routes),
                moves: Vec::new(),
                busy: Duration::ZERO,
                busy_since: Instant::now(),
                sink: Arc::clone(&sink),
                counters: Arc::clone(&counters),
                partial: Arc::clone(&partial),
                conns: HashMap::new(),
                tokens: HashMap::new(),
                next_token: 0,
                epoch,
                again: Vec::new(),
                stalled: Vec::new(),
                next_deadline: f64::INFINITY,
                writers: HashSet::new(),
                drain_look: 0.0,
                links: Arc::clone(&links),
                relays: HashMap::new(),
                listeners: HashMap::new(),
                relay_timers: std::collections::BinaryHeap::new(),
                events: Vec::new(),
                handshake_spent: Duration::ZERO,
            };
            let handle = std::thread::Builder::new()
                .name(format!("lightgate-io-{i}"))
                .spawn(move || worker.run())?;
            handles.push(handle);
        }
        Ok(Reactor {
            handle: Handle {
                lanes,
                counters,
                partial,
                routes,
                links,
            },
            threads: handles,
        })
    }

    pub fn threads(&self) -> usize {
        self.handle.lanes.len()
    }

    pub fn handle(&self) -> Handle {
        self.handle.clone()
    }

    pub fn handle_ref(&self) -> &Handle {
        &self.handle
    }

    pub fn send(&self, command: Command) {
        self.handle.send(command);
    }

    /// Stop every thread; connections still held are dropped (closed).
    pub fn stop(self) {
        for lane in &self.handle.lanes {
            lane.push([Command::Stop]);
            let _ = lane.waker.wake();
        }
        for t in self.threads {
            let _ = t.join();
        }
    }
}

struct Conn {
    id: u64,
    client_id: Arc<str>,
    link: Link,
    core: Connection,
    /// None while nothing waits for the client (an idle connection's case).
    backlog: Option<Box<Backlog>>,
    max_unsent: usize,
    drain: DrainRule,
    /// Bytes of an unfinished packet it holds, as counted in the `PartialBudget`.
    partial: usize,
    // B-trees: empty (an idle connection's), each is half a hash map's size; they hold
    // a connection's few queues and (at most 1,024) topics.
    positions: BTreeMap<Arc<str>, u64>,
    acl: Option<BTreeSet<String>>,
    demoting: Option<Why>,
    writing: bool,
    /// It read its `READ_PASS` in this pass and waits in `again` for the next one: not
    /// read again in this pass (another edge of it would read it again, and an `again`
    /// that named it twice read it twice in the next pass, then three times...).
    spent: bool,
    /// The other thread its last deliveries came from, how many in a row, and when it
    /// came to this one (`MOVE_AFTER`).
    streak_lane: u32,
    streak: u32,
    /// The other thread its last publishes' deliveries all went to, how many in a row
    /// (`LEAN_AFTER`).
    lean_lane: u16,
    lean: u16,
    adopted_at: f64,
    /// Fell behind (`Sink::catches_up`): served from the store, a batch at a time.
    behind: Option<Box<Behind>>,
    /// A persistent session's: its sends wait for their records (`keep`).
    keep: Option<Box<Keeper>>,
}

/// A connection served from the store: the round it asked for, if one is asked and
/// not come yet, and whether it goes back once what it holds is out (a record that
/// needs the owner is next).
struct Behind {
    round: u64,
    asked: bool,
    release: bool,
    /// The batch of a round asked for before what it held was out (`ASK_AT`): taken
    /// once it is, as it would have been had it been asked for then.
    next: Option<Box<crate::backlog::Batch>>,
}

/// Deliveries a connection served from the store may still hold when it asks for its
/// next round: the round's trip (to the ring or the owner's index, the segment reads)
/// goes on while these go out, and the client does not wait for it.
const ASK_AT: usize = crate::backlog::BATCH_MESSAGES / 2;

/// Rounds are numbered across the node, so that an answer to an old one is known.
static ROUNDS: AtomicU64 = AtomicU64::new(1);

/// What waits for a client that does not take it as fast as it comes: made when the
/// first byte or delivery has to wait, dropped once all of it went out, so that a
/// connection that fell behind once keeps no buffers.
#[derive(Default)]
struct Backlog {
    /// Bytes the socket did not take yet: written before anything else.
    unsent: Vec<u8>,
    /// Deliveries waiting for the client's window.
    held: VecDeque<Delivery>,
    /// The `cost` of each delivery in `held`.
    held_cost: usize,
    /// Bytes of `unsent` the client must take by `drain_by` (`DrainRule`).
    due: usize,
    drain_by: f64,
}

impl Backlog {
    /// `data` the socket did not take, behind what waits already: the first byte to
    /// wait starts the drain rule's clock.
    fn wait(&mut self, data: &[u8], rule: &DrainRule, now: f64) {
        if data.is_empty() {
            return;
        }
        if self.unsent.is_empty() {
            self.due = rule.due(data.len());
            self.drain_by = now + rule.timeout;
        }
        self.unsent.extend_from_slice(data);
    }

    /// The socket took `n` bytes of what waits: once what was due is in, the next
    /// share is due within the next `timeout`.
    fn took(&mut self, n: usize, rule: &DrainRule, now: f64) {
        self.unsent.drain(..n);
        if n >= self.due {
            self.due = rule.due(self.unsent.len());
            self.drain_by = now + rule.timeout;
        } else {
            self.due -= n;
        }
    }
}

impl Conn {
    fn backlog(&mut self) -> &mut Backlog {
        self.backlog.get_or_insert_with(Box::default)
    }

    fn unsent(&self) -> usize {
        self.backlog.as_ref().map_or(0, |b| b.unsent.len())
    }

    /// What the held deliveries cost: their slots (as many as the queue has room for)
    /// and what each holds; and a round's batch kept until they are out.
    fn held_bytes(&self) -> usize {
        let held = self.backlog.as_ref().map_or(0, |b| {
            b.held.capacity() * std::mem::size_of::<Delivery>() + b.held_cost
        });
        let next = self
            .behind
            .as_ref()
            .and_then(|b| b.next.as_ref())
            .map_or(0, |batch| {
                batch.deliveries.capacity() * std::mem::size_of::<Delivery>()
                    + batch.deliveries.iter().map(Delivery::cost).sum::<usize>()
            });
        held + next
    }

    fn holds(&self) -> bool {
        self.backlog.as_ref().is_some_and(|b| !b.held.is_empty())
            || self.keep.as_ref().is_some_and(|k| k.holds())
    }

    /// The client took less of what waits than its drain rule asks, in time.
    fn stuck(&self, now: f64) -> bool {
        self.drain.timeout > 0.0
            && self
                .backlog
                .as_ref()
                .is_some_and(|b| !b.unsent.is_empty() && b.due > 0 && now > b.drain_by)
    }

    /// Everything that waits for the client: past `max_unsent`, it is handed back.
    fn waiting(&self) -> usize {
        self.unsent() + self.held_bytes() + self.keep.as_ref().map_or(0, |k| k.cost)
    }

    /// Let the backlog's buffers go once they are empty.
    fn settle(&mut self) {
        if let Some(b) = self.backlog.as_mut() {
            if b.held.is_empty() && b.unsent.is_empty() {
                self.backlog = None;
            } else if b.unsent.is_empty() {
                b.unsent = Vec::new();
            } else if b.held.is_empty() {
                b.held = VecDeque::new(); // its slots count while they are kept
            }
        }
    }
}

struct Worker {
    poll: Poll,
    /// This thread's lane, and all of them (how busy the others are).
    index: usize,
    lanes: Vec<Arc<Lane>>,
    routes: Arc<RwLock<HashMap<u64, usize>>>,
    /// Connections to move after this pass: (token, thread).
    moves: Vec<(Token, usize)>,
    /// Time spent in passes since `busy_since`.
    busy: Duration,
    busy_since: Instant,
    sink: Arc<dyn Sink>,
    counters: Arc<Counters>,
    partial: Arc<PartialBudget>,
    /// Boxed: a map grows by doubling, and a table of whole `Conn`s had up to half its
    /// slots (each a `Conn`'s size) empty; a box costs one `Conn` a connection.
    conns: HashMap<Token, Box<Conn>>,
    tokens: HashMap<u64, Token>,
    next_token: usize,
    epoch: Instant,
    /// Connections that had more to read when their pass's budget ran out. The poll is
    /// edge-triggered: it says nothing more of them, so the next pass reads them first.
    again: Vec<Token>,
    /// Clients with bytes to read, not read while a thread is over `LANE_BUDGET`.
    stalled: Vec<Token>,
    /// No keepalive of this thread's connections runs out before (`check_timeouts`).
    next_deadline: f64,
    /// Connections with bytes waiting for their sockets, and when their drain rules
    /// are looked at next (`check_drains`).
    writers: HashSet<Token>,
    drain_look: f64,
    /// The connections the native side accepted, of all threads (`relay::Links`).
    links: Arc<Links>,
    /// This thread's connections in their handshake or relayed to Python (a carried
    /// one is in `conns`; the same token either way).
    relays: HashMap<Token, Box<Relay>>,
    listeners: HashMap<Token, Box<Listener>>,
    /// Relays' deadlines (a handshake's, a close's): (ms since `epoch`, token), the
    /// earliest first; checked against the relay when due.
    relay_timers: std::collections::BinaryHeap<std::cmp::Reverse<(u64, usize)>>,
    /// News for Python, sent at the end of the pass in one go.
    events: Vec<LinkEvent>,
    /// Time spent on TLS handshakes this pass (`relay::HANDSHAKE_SLICE`).
    handshake_spent: Duration,
}

impl Worker {
    fn now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64()
    }

    fn lane(&self) -> &Lane {
        &self.lanes[self.index]
    }

    /// Count a pass's time; once a second, publish how busy the thread was.
    fn account(&mut self, pass: Duration) {
        self.busy += pass;
        let window = self.busy_since.elapsed();
        if window >= Duration::from_secs(1) {
            let permille = (self.busy.as_secs_f64() / window.as_secs_f64() * 1000.0) as u32;
            self.lane()
                .busy
                .store(permille.min(1000), Ordering::Relaxed);
            self.busy = Duration::ZERO;
            self.busy_since = Instant::now();
        }
    }

    /// A delivery from thread `from` reached `c` on thread `index`: the thread `c`
    /// should move to, if any.
    fn should_move(
        index: usize,
        lanes: &[Arc<Lane>],
        c: &mut Conn,
        from: Option<usize>,
        now: f64,
    ) -> Option<usize> {
        let from = from?;
        if from == index {
            c.streak = 0;
            return None;
        }
        if c.streak_lane != from as u32 {
            c.streak_lane = from as u32;
            c.streak = 0;
        }
        c.streak = c.streak.saturating_add(1);
        (c.streak >= MOVE_AFTER && Self::may_move(index, lanes, c, from, now)).then_some(from)
    }

    /// A publish of `c`'s on thread `index` went where `lean` says: the thread `c`
    /// should move to, if any.
    fn should_follow(
        index: usize,
        lanes: &[Arc<Lane>],
        c: &mut Conn,
        lean: Lean,
        now: f64,
    ) -> Option<usize> {
        let to = match lean {
            Lean::To(to) if to != index => to,
            _ => {
                c.lean = 0;
                return None;
            }
        };
        if c.lean_lane as usize != to {
            c.lean_lane = to as u16;
            c.lean = 0;
        }
        c.lean = c.lean.saturating_add(1);
        (c.lean >= LEAN_AFTER && Self::may_move(index, lanes, c, to, now)).then_some(to)
    }

    /// Whether `c` may move from thread `index` to `to` now: it settled here, and both
    /// threads are lightly loaded.
    fn may_move(index: usize, lanes: &[Arc<Lane>], c: &Conn, to: usize, now: f64) -> bool {
        let light = |lane: usize| {
            lanes
                .get(lane)
                .is_some_and(|l| l.busy.load(Ordering::Relaxed) < LIGHT_LOAD)
        };
        now - c.adopted_at >= MOVE_SETTLE_S && light(index) && light(to)
    }

    /// Publishers whose deliveries went to one other thread (`Sink::publish`).
    fn follow(&mut self, leans: Vec<(u64, Lean)>) {
        let now = self.now();
        for (conn, lean) in leans {
            let Some(&token) = self.tokens.get(&conn) else {
                continue;
            };
            let Some(c) = self.conns.get_mut(&token) else {
                continue;
            };
            if let Some(to) = Self::should_follow(self.index, &self.lanes, c, lean, now) {
                c.lean = 0;
                self.moves.push((token, to));
            }
        }
    }

    fn run(&mut self) {
        let _ = self.lane().thread.set(std::thread::current().id());
        LANE.with(|l| l.set(Some(self.index)));
        let mut events = Events::with_capacity(512);
        let mut buf = vec![0u8; READ_SIZE];
        loop {
            let timeout = if !self.again.is_empty() {
                Duration::ZERO
            } else if !self.stalled.is_empty() {
                STALL_LOOK.min(self.next_timeout())
            } else if let Some(look) = self.listeners_wait() {
                look.min(self.next_timeout())
            } else {
                self.next_timeout()
            };
            if let Err(e) = self.poll.poll(&mut events, Some(timeout)) {
                if e.kind() != io::ErrorKind::Interrupted {
                    return;
                }
            }
            let pass = Instant::now();
            self.handshake_spent = Duration::ZERO;
            let mut published = Vec::new();
            let mut touched = std::mem::take(&mut self.again);
            let (relays, rest): (Vec<Token>, Vec<Token>) = touched
                .into_iter()
                .partition(|t| self.relays.contains_key(t));
            touched = rest;
            for &token in &relays {
                self.relay_ready(token, &mut buf);
            }
            for token in &touched {
                if let Some(c) = self.conns.get_mut(token) {
                    c.spent = false;
                }
            }
            let stall = self.lanes.iter().any(|l| l.over_budget()) || self.sink.behind();
            if stall {
                self.stalled.append(&mut touched);
            } else {
                touched.append(&mut self.stalled);
                for &token in &touched {
                    self.read(token, &mut buf, &mut published, false);
                }
            }
            for ev in events.iter() {
                let token = ev.token();
                if token == WAKER {
                    continue;
                }
                if self.listeners.contains_key(&token) {
                    self.accept(token);
                    continue;
                }
                touched.push(token);
                if self.relays.contains_key(&token) {
                    self.relay_ready(token, &mut buf);
                    continue;
                }
                if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                    if stall {
                        self.stalled.push(token);
                    } else {
                        // Closed by the client: read on to the end, whatever is short.
                        let closed = ev.is_read_closed() || ev.is_error();
                        self.read(token, &mut buf, &mut published, !closed);
                    }
                }
            }
            if stall {
                self.stalled.sort_unstable();
                self.stalled.dedup();
            }
            touched.extend(relays);
            if !self.commands(&mut touched, &mut published) {
                self.last_words();
                return;
            }
            if !published.is_empty() {
                let leans = self.sink.publish(published);
                self.follow(leans);
                // What that sent this thread (acks, local deliveries) goes out now.
                let mut more = Vec::new();
                if !self.commands(&mut touched, &mut more) {
                    return;
                }
                if !more.is_empty() {
                    let leans = self.sink.publish(more);
                    self.follow(leans);
                }
            }
            self.check_timeouts(&mut touched);
            self.check_drains(&mut touched);
            self.check_relays(&mut touched);
            self.accept_waiting();
            touched.sort_unstable();
            touched.dedup();
            for token in touched {
                if self.relays.contains_key(&token) {
                    self.relay_flush(token);
                } else {
                    self.flush(token);
                }
            }
            if !self.moves.is_empty() {
                self.migrate();
            }
            self.send_events();
            self.account(pass.elapsed());
        }
    }

    fn next_timeout(&self) -> Duration {
        let wait = self.next_deadline.min(self.next_relay_deadline()) - self.now();
        Duration::from_secs_f64(if wait.is_nan() {
            0.0
        } else {
            wait.clamp(0.0, 1.0)
        })
    }

    /// What the client sent, READ_PASS at most. `short_ends`: a short read ends it (the
    /// event was an edge of new data, and a later arrival is another).
    fn read(
        &mut self,
        token: Token,
        buf: &mut [u8],
        published: &mut Vec<Inbound>,
        short_ends: bool,
    ) {
        let now = self.now();
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        if c.demoting.is_some() || c.spent {
            return;
        }
        let mut read = 0;
        let mut note = None;
        loop {
            if read >= READ_PASS {
                c.spent = true;
                self.again.push(token);
                break;
            }
            if self.partial.must_wait(c.partial) {
                // Over the node's budget, and holding its share: held back by the
                // owner, whose timeout closes it should the node stay over.
                c.demoting = Some(Why::Partial);
                break;
            }
            let size = self.partial.read_size(c.partial, buf.len());
            match c.link.read(&mut buf[..size]) {
                Ok(0) => {
                    c.demoting = Some(Why::Lost("connection closed by the client".into()));
                    break;
                }
                Ok(n) => {
                    read += n;
                    Counters::add(&self.counters.bytes_in, n as u64);
                    Self::feed(c, &buf[..n], now, &*self.sink, &self.counters, published);
                    Self::count_partial(c, &self.partial, &*self.sink);
                    if c.core.demoted() {
                        break;
                    }
                    if c.core.unread().len() > PARTIAL_BUDGET {
                        c.demoting = Some(Why::Packet);
                        break;
                    }
                    if short_ends && n < size && c.link.is_plain() {
                        // A short read emptied the socket: what comes later is a new
                        // edge for epoll, so no second read only to hear WouldBlock.
                        // (Not so of TLS or WebSocket: a record's plaintext, a frame's
                        // payload, can be short while the socket holds more.)
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    c.demoting = Some(Why::Lost(format!("connection lost: {e}")));
                    note = c.link.take_note();
                    break;
                }
            }
        }
        if let Some(text) = note {
            self.say(LogTarget::MessageLimit, text); // a WebSocket message past its limit
        }
    }

    /// Bytes from the client through its core: publishes into this pass's batch, acks
    /// free the window for what is held, a packet handed back starts the demotion.
    fn feed(
        c: &mut Conn,
        data: &[u8],
        now: f64,
        sink: &dyn Sink,
        counters: &Counters,
        published: &mut Vec<Inbound>,
    ) {
        let mut events = Vec::new();
        let acl = &c.acl;
        let limits = sink.topic_limits();
        c.core.receive(
            data,
            now,
            |topic| Acl::from_cache(acl, topic, limits),
            &mut events,
        );
        for ev in events {
            match ev {
                Event::Publish {
                    topic,
                    payload,
                    qos,
                    packet_id,
                    ticket,
                } => {
                    Counters::add(&counters.messages_in, 1);
                    if qos == 1 {
                        Counters::add(&counters.messages_in_qos1, 1);
                    }
                    published.push(Inbound {
                        conn: c.id,
                        client_id: c.client_id.clone(),
                        topic,
                        payload,
                        qos,
                        packet_id,
                        ticket,
                    })
                }
                Event::Acked { packet_id, source } => {
                    if let Some(k) = c.keep.as_mut() {
                        k.acked(packet_id);
                    }
                    sink.report(Report::Acked {
                        conn: c.id,
                        packet_id,
                        source,
                    });
                    Self::send_held(c, counters);
                }
                Event::Demote => {
                    c.demoting.get_or_insert(Why::Packet);
                }
            }
        }
    }

    /// What the client's core holds unparsed now, counted in the node's budget: an
    /// unfinished packet (or, once it is to be handed back, everything from the packet
    /// that needs the owner: the owner takes the count over with it).
    fn count_partial(c: &mut Conn, budget: &PartialBudget, sink: &dyn Sink) {
        let held = c.core.unread().len();
        if held != c.partial && budget.update(c.partial, held).freed {
            sink.partial_freed();
        }
        c.partial = held;
    }

    fn send_held(c: &mut Conn, counters: &Counters) {
        if c.demoting.is_some() {
            // Handed back soon: what is held stays unsent, so the positions say exactly
            // what went out and the owner delivers the rest, in order.
            return;
        }
        let Some(backlog) = c.backlog.as_mut() else {
            Self::send_ready(c, counters);
            return;
        };
        while let Some(d) = backlog.held.front() {
            if d.qos > 0 && c.core.window() == 0 {
                break;
            }
            if backlog.unsent.len() + c.core.pending_output() > c.max_unsent {
                // The client is a budget behind: the rest waits for the socket to drain
                // (or past its own budget, hands the connection back).
                break;
            }
            let d = backlog.held.pop_front().expect("front exists");
            backlog.held_cost -= d.cost();
            Self::send(&mut c.core, &mut c.positions, d, counters);
        }
        if backlog.held.is_empty() {
            if let Some(next) = c.behind.as_mut().and_then(|b| b.next.take()) {
                // The round asked for ahead: its turn (it sends what it can).
                Self::take_batch(c, *next, counters);
            }
        }
        c.settle();
        Self::send_ready(c, counters);
    }

    /// A persistent session's deliveries whose records are kept, as the window allows,
    /// each under the packet id its record names.
    fn send_ready(c: &mut Conn, counters: &Counters) {
        let Some(k) = c.keep.as_mut() else {
            return;
        };
        loop {
            let unsent = c.backlog.as_ref().map_or(0, |b| b.unsent.len());
            let room = unsent + c.core.pending_output() <= c.max_unsent;
            let Some(s) = k.next_ready(c.core.window(), room) else {
                return;
            };
            let d = s.delivery;
            let sent = c
                .core
                .deliver_as(s.pid, &d.topic, &d.payload, d.qos, d.retain, d.source);
            match sent {
                Ok(_) => {
                    Counters::add(&counters.messages_out, 1);
                    if d.qos == 1 {
                        Counters::add(&counters.messages_out_qos1, 1);
                    }
                }
                Err(_) => Counters::add(&counters.dropped, 1),
            }
            k.sent(s.pid, sent.is_err());
            for (queue, offset) in d.positions {
                let next = c.positions.entry(queue).or_insert(0);
                *next = (*next).max(offset + 1);
            }
        }
    }

    /// More waits for the client than its budget: it goes back, or (when the owner
    /// serves it from the store, and deliveries are what waits: one comes, or some are
    /// held) it takes no more live deliveries and is served from the store from past
    /// what it holds, a batch at a time. What it holds goes on out as the client takes
    /// it, within the budget and a batch (more is dropped: its positions were not
    /// passed, and the store serves it): the rounds that follow start where the
    /// engine's ring of the queue does, not below it. One served so holds, past that,
    /// a batch and a half at most, and takes one only with room: past the budget by more than a
    /// batch, what waits is its own answers (a publisher that does not read them), and
    /// it goes back.
    fn over_budget(c: &mut Conn, sink: &dyn Sink, delivering: bool, counters: &Counters) {
        let catches_up = sink.catches_up();
        if c.keep.is_some() {
            // A persistent session's: what it holds stays (its ids are reserved, its
            // records may be written); what comes next comes from the store, from
            // where its last staged delivery left each queue.
            if c.unsent() > c.max_unsent + keep::ROUND_BYTES {
                c.demoting.get_or_insert(Why::Backlog);
            } else if c.behind.is_none() && delivering {
                Self::fall_behind(c, sink, counters);
            }
            return;
        }
        if c.behind.is_some() || !(delivering || c.holds()) {
            // What waits is bytes: a last delivery's share past the mark (the next one
            // makes it fall behind), or its own answers.
            let slack = if catches_up {
                crate::backlog::BATCH_BYTES
            } else {
                0
            };
            if c.unsent() > c.max_unsent + slack {
                c.demoting.get_or_insert(Why::Backlog);
            }
            return;
        }
        if !catches_up {
            c.demoting.get_or_insert(Why::Backlog);
            return;
        }
        if c.waiting() > c.max_unsent + crate::backlog::BATCH_BYTES {
            if let Some(b) = c.backlog.as_mut() {
                b.held = VecDeque::new();
                b.held_cost = 0;
            }
        }
        c.settle();
        Self::fall_behind(c, sink, counters);
    }

    /// From here on `c` is served from the store, a round at a time.
    fn fall_behind(c: &mut Conn, sink: &dyn Sink, counters: &Counters) {
        Counters::add(&counters.fell_behind, 1);
        c.behind = Some(Box::new(Behind {
            round: 0,
            asked: false,
            release: false,
            next: None,
        }));
        sink.fell_behind(c.id);
    }

    /// A connection served from the store asks for its next batch once the last one
    /// is nearly out (`ASK_AT`) and its socket has room, from past what it holds; or
    /// goes back, once all of it is out, when the next record needs the owner.
    fn ask(c: &mut Conn, sink: &dyn Sink) {
        // A clean session's next round is asked for while it still holds half a batch
        // (`ASK_AT`); a persistent session's once the last one's batch began to go out
        // (less than a round staged, within its budget): either way the round trip for
        // the next read overlaps the sends. (For a persistent session two rounds ahead
        // was slower, 165-177k msg/s against 200-240k in one comparison: the owner's
        // reads and records, overlapped, contend for its interpreter, and each is woken
        // for separately.)
        let held = c.backlog.as_ref().map_or(0, |b| b.held.len());
        let ahead = match c.keep.as_ref() {
            Some(k) => k.pending() < keep::ROUND_MESSAGES && c.waiting() <= c.max_unsent,
            None => held <= ASK_AT,
        };
        let room = ahead && c.unsent() + c.core.pending_output() <= c.max_unsent / 2;
        let Some(b) = c
            .behind
            .as_mut()
            .filter(|b| !b.asked && b.next.is_none() && room)
        else {
            return;
        };
        if b.release {
            // (A persistent session's deliveries not sent yet are the owner's again.)
            if c.keep.is_some() || held == 0 {
                c.demoting = Some(Why::Released);
            }
            return;
        }
        b.asked = true;
        b.round = ROUNDS.fetch_add(1, Ordering::Relaxed);
        let positions = match c.keep.as_ref() {
            Some(k) => k.upto.iter().map(|(q, n)| (Arc::clone(q), *n)).collect(),
            None => {
                let mut past: BTreeMap<Arc<str>, u64> = c.positions.clone();
                for d in c.backlog.iter().flat_map(|b| b.held.iter()) {
                    for (queue, offset) in &d.positions {
                        let next = past.entry(Arc::clone(queue)).or_insert(0);
                        *next = (*next).max(offset + 1);
                    }
                }
                past.into_iter().collect()
            }
        };
        sink.report(Report::Behind {
            conn: c.id,
            round: b.round,
            positions,
        });
    }

    /// The batch of the round a connection asked for (another's is stale: dropped);
    /// kept until what the connection holds is out, if some is (a persistent session
    /// stages it behind what it holds at once).
    fn catch(c: &mut Conn, round: u64, batch: crate::backlog::Batch, counters: &Counters) {
        let holds = c.keep.is_none() && c.holds();
        let Some(b) = c.behind.as_mut().filter(|b| b.asked && b.round == round) else {
            return;
        };
        b.asked = false;
        if holds {
            b.next = Some(Box::new(batch));
            return;
        }
        Self::take_batch(c, batch, counters);
    }

    /// A round's batch, once nothing is held before it.
    fn take_batch(c: &mut Conn, batch: crate::backlog::Batch, counters: &Counters) {
        let Some(b) = c.behind.as_mut() else {
            return;
        };
        b.release = batch.release;
        if let Some(k) = c.keep.as_mut() {
            // Staged behind what it holds: the next round starts past them.
            for (queue, start) in batch.jumps {
                k.upto.insert(queue, start);
            }
            Counters::add(&counters.dropped, batch.dropped);
            for d in batch.deliveries {
                if !k.stage(&c.core, d, counters) {
                    c.demoting.get_or_insert(Why::Released);
                    break;
                }
            }
            return;
        }
        // Where each queue starts now (nothing went out since it asked), then past what
        // was skipped: as Python's delivery moves a cursor to where a pull started.
        for (queue, start) in batch.jumps {
            c.positions.insert(queue, start);
        }
        Counters::add(&counters.dropped, batch.dropped);
        if batch.deliveries.is_empty() {
            return;
        }
        let backlog = c.backlog();
        for d in batch.deliveries {
            backlog.held_cost += d.cost();
            backlog.held.push_back(d);
        }
        Self::send_held(c, counters);
    }

    /// One delivery into the client's output, its queues' positions past it.
    fn send(
        core: &mut Connection,
        positions: &mut BTreeMap<Arc<str>, u64>,
        d: Delivery,
        counters: &Counters,
    ) {
        // A delivery the client cannot take (too large) is dropped, as in Python.
        match core.deliver(&d.topic, &d.payload, d.qos, d.retain, d.source) {
            Ok(_) => {
                Counters::add(&counters.messages_out, 1);
                if d.qos == 1 {
                    Counters::add(&counters.messages_out_qos1, 1);
                }
            }
            Err(_) => Counters::add(&counters.dropped, 1),
        }
        for (queue, offset) in d.positions {
            let next = positions.entry(queue).or_insert(0);
            *next = (*next).max(offset + 1);
        }
    }

    /// Apply the owner's commands; false when told to stop.
    fn commands(&mut self, touched: &mut Vec<Token>, published: &mut Vec<Inbound>) -> bool {
        let Some(commands) = self.lane().take() else {
            return false;
        };
        commands
            .into_iter()
            .all(|command| self.apply(command, touched, published))
    }

    /// One command; false when told to stop.
    fn apply(
        &mut self,
        command: Command,
        touched: &mut Vec<Token>,
        published: &mut Vec<Inbound>,
    ) -> bool {
        {
            match command {
                Command::Stop => return false,
                Command::Listen(listener) => self.listen(listener),
                Command::Accepted(relay) => self.insert_relay(relay, touched),
                Command::Send { conn, data } => self.relay_send(conn, data, touched),
                Command::Close { conn } => self.relay_close(conn, touched),
                Command::Resume { conn } => self.relay_resume(conn, touched),
                Command::Carry { conn, adoption } => {
                    self.carry(conn, *adoption, touched, published);
                }
                Command::Upgrade { conn, subprotocol } => {
                    self.ws_accept(conn, subprotocol, touched);
                }
                Command::Refuse { conn, status, body } => self.ws_refuse(conn, status, &body),
                Command::Arrive(m) => {
                    if let Some(token) = self.arrive(m, touched, published) {
                        touched.push(token);
                    }
                }
                Command::Adopt {
                    conn,
                    socket,
                    adoption,
                } => {
                    if let Some(token) = self.adopt(conn, socket, *adoption, published) {
                        touched.push(token);
                    }
                }
                Command::Catch { conn, round, batch } => {
                    if let Some(&token) = self.tokens.get(&conn) {
                        if let Some(c) = self.conns.get_mut(&token) {
                            Self::catch(c, round, *batch, &self.counters);
                            touched.push(token);
                        }
                    }
                }
                Command::Kept { conn, batch } => {
                    if let Some(&token) = self.tokens.get(&conn) {
                        if let Some(c) = self.conns.get_mut(&token) {
                            if let Some(k) = c.keep.as_mut() {
                                k.kept(batch);
                                Self::send_held(c, &self.counters);
                                touched.push(token);
                            }
                        }
                    }
                }
                Command::Live { conn } => {
                    if let Some(&token) = self.tokens.get(&conn) {
                        if let Some(c) = self.conns.get_mut(&token) {
                            if c.behind.as_ref().is_some_and(|b| b.asked) {
                                c.behind = None;
                                Counters::add(&self.counters.caught_up, 1);
                            }
                        }
                    }
                }
                Command::Release { conn } => {
                    if let Some(&token) = self.tokens.get(&conn) {
                        if let Some(c) = self.conns.get_mut(&token) {
                            c.demoting.get_or_insert(Why::Released);
                            touched.push(token);
                        }
                    }
                }
                Command::PublishDone {
                    conn,
                    ticket,
                    packet_id,
                    code,
                    reason,
                } => {
                    if let Some(&token) = self.tokens.get(&conn) {
                        if let Some(c) = self.conns.get_mut(&token) {
                            c.core
                                .publish_done(ticket, packet_id, code, reason.as_deref());
                            if c.core.store_failed() {
                                c.demoting.get_or_insert(Why::Lost(
                                    "store error: a publish was not stored".into(),
                                ));
                            }
                            touched.push(token);
                        }
                    }
                }
                Command::Deliver { conn, delivery } => {
                    let now = self.now();
                    if let Some(&token) = self.tokens.get(&conn) {
                        if let Some(c) = self.conns.get_mut(&token) {
                            let (index, lanes) = (self.index, &self.lanes);
                            if let Some(to) =
                                Self::should_move(index, lanes, c, delivery.from_lane, now)
                            {
                                self.moves.push((token, to));
                            }
                            if c.demoting.is_some() || c.behind.is_some() {
                                // Its positions say what went out; the rest comes from
                                // the store (the owner's delivery, or its batches).
                            } else if c.keep.is_some() {
                                if c.waiting() + delivery.cost() > c.max_unsent {
                                    Self::over_budget(c, &*self.sink, true, &self.counters);
                                } else if let Some(k) = c.keep.as_mut() {
                                    if !k.stage(&c.core, delivery, &self.counters) {
                                        c.demoting.get_or_insert(Why::Released);
                                    }
                                }
                            } else if c.backlog.is_some()
                                && c.waiting() + delivery.cost() > c.max_unsent
                            {
                                Self::over_budget(c, &*self.sink, true, &self.counters);
                            } else if c.backlog.is_none()
                                && (delivery.qos == 0 || c.core.window() > 0)
                            {
                                // Nothing waits before it: straight out, no backlog made.
                                Self::send(&mut c.core, &mut c.positions, delivery, &self.counters);
                                if c.core.pending_output() >= WRITE_AT {
                                    // A burst in one batch of commands: out to the socket
                                    // as it grows, so the output stays bounded.
                                    Self::write_out(c, now, &self.counters);
                                }
                            } else {
                                let backlog = c.backlog();
                                backlog.held_cost += delivery.cost();
                                backlog.held.push_back(delivery);
                                Self::send_held(c, &self.counters);
                            }
                            touched.push(token);
                        }
                    }
                }
            }
        }
        true
    }

    /// A connection moving in: watched here, then what waited for it on its old thread.
    fn arrive(
        &mut self,
        m: Migrant,
        touched: &mut Vec<Token>,
        published: &mut Vec<Inbound>,
    ) -> Option<Token> {
        let Migrant { mut conn, waiting } = m;
        let token = Token(self.next_token);
        self.next_token = (self.next_token + 1) % (usize::MAX - 1);
        let interest = if conn.unsent() == 0 {
            Interest::READABLE
        } else {
            Interest::READABLE | Interest::WRITABLE
        };
        if let Err(e) = self
            .poll
            .registry()
            .register(conn.link.socket(), token, interest)
        {
            // Not watched: handed back to the owner, as an adoption that failed is.
            conn.demoting = Some(Why::Lost(format!("not moved: {e}")));
            self.report_demoted(*conn);
            return None;
        }
        conn.streak = 0;
        conn.lean = 0;
        conn.spent = false; // in the old thread's `again`, not in this one's
        conn.adopted_at = self.now();
        self.next_deadline = self.next_deadline.min(conn.core.deadline());
        self.tokens.insert(conn.id, token);
        self.conns.insert(token, conn);
        for command in waiting {
            self.apply(command, touched, published);
        }
        Some(token)
    }

    /// Move the connections this pass chose to the threads their deliveries come from.
    fn migrate(&mut self) {
        for (token, to) in std::mem::take(&mut self.moves) {
            let Some(c) = self.conns.get(&token) else {
                continue;
            };
            if c.demoting.is_some() || to >= self.lanes.len() || to == self.index {
                continue;
            }
            let Some(mut c) = self.conns.remove(&token) else {
                continue;
            };
            self.writers.remove(&token);
            self.tokens.remove(&c.id);
            let _ = self.poll.registry().deregister(c.link.socket());
            let Ok(mut routes) = self.routes.write() else {
                return;
            };
            // Under the write lock nothing is on its way here for it: what waits here
            // goes along, and what comes later queues behind its arrival there.
            let waiting = self.lanes[self.index].take_conn(c.id);
            if to as u64 == c.id % self.lanes.len() as u64 {
                routes.remove(&c.id);
            } else {
                routes.insert(c.id, to);
            }
            self.lanes[to].push([Command::Arrive(Migrant { conn: c, waiting })]);
            drop(routes);
            Counters::add(&self.counters.moved, 1);
            self.lanes[to].wake();
        }
    }

    fn adopt(
        &mut self,
        conn: u64,
        socket: OwnedFd,
        a: Adoption,
        published: &mut Vec<Inbound>,
    ) -> Option<Token> {
        let mut link = Link::Plain(TcpStream::from(socket));
        let token = Token(self.next_token);
        self.next_token = (self.next_token + 1) % (usize::MAX - 1);
        let registered = self
            .poll
            .registry()
            .register(link.socket(), token, Interest::READABLE);
        let (mut c, unread, unacked, last_read) = self.conn_of(conn, link, a);
        if let Err(e) = registered {
            // Not watched: handed straight back, so the owner's state never waits on it.
            c.demoting = Some(Why::Lost(format!("not adopted: {e}")));
            c.core.restore(
                c.core.aliases_in(),
                c.core.next_packet_id(),
                BTreeMap::new(),
                unread,
            );
            self.report_demoted(c);
            return None;
        }
        self.take_in(c, token, &unread, unacked, last_read, published);
        Some(token)
    }

    /// A carried connection made of an adoption's parts, on `link`; and what it has to
    /// read first (`take_in`): the bytes the owner read and did not parse, the QoS 1
    /// publishes the owner had not acknowledged when it read them, and when the client
    /// last sent anything.
    fn conn_of(&self, conn: u64, link: Link, a: Adoption) -> (Conn, Vec<u8>, u32, f64) {
        let last_read = self.now() - a.idle_for.max(0.0);
        let mut core = Connection::new(a.settings, last_read);
        let client_id = a.restore.client_id.clone();
        core.restore(
            a.restore.aliases_in,
            a.restore.next_packet_id,
            BTreeMap::new(),
            Vec::new(),
        );
        Counters::add(&self.counters.adopted, 1);
        Counters::add(&self.counters.connections, 1);
        let keep = a
            .keep
            .map(|every| Box::new(Keeper::new(core.next_packet_id(), every)));
        let behind = (a.behind && keep.is_some()).then(|| {
            Counters::add(&self.counters.fell_behind, 1);
            Box::new(Behind {
                round: 0,
                asked: false,
                release: false,
                next: None,
            })
        });
        let c = Conn {
            id: conn,
            client_id,
            link,
            core,
            backlog: None,
            behind,
            keep,
            max_unsent: if a.max_unsent == 0 {
                BACKLOG_BUDGET
            } else {
                a.max_unsent
            },
            drain: a.drain,
            partial: 0,
            positions: BTreeMap::new(),
            acl: a.acl.map(|topics| topics.into_iter().collect()),
            demoting: None,
            writing: false,
            spent: false,
            streak_lane: self.index as u32,
            streak: 0,
            lean_lane: self.index as u16,
            lean: 0,
            // Settled from the start: its first move need not wait (at 2,000 msg/s, a
            // second of deliveries across threads was 2 us a message of the run).
            adopted_at: f64::NEG_INFINITY,
        };
        (c, a.unread, a.restore.inbound_unacked, last_read)
    }

    /// A carried connection joins this thread's, under `token`, after reading what the
    /// owner read but had not parsed (a partial packet), behind what the owner had not
    /// acknowledged when it read it.
    fn take_in(
        &mut self,
        mut c: Conn,
        token: Token,
        unread: &[u8],
        unacked: u32,
        last_read: f64,
        published: &mut Vec<Inbound>,
    ) {
        if !unread.is_empty() {
            c.core.behind(unacked);
            Self::feed(
                &mut c,
                unread,
                last_read,
                &*self.sink,
                &self.counters,
                published,
            );
            c.core.caught_up(unacked);
            Self::count_partial(&mut c, &self.partial, &*self.sink);
        }
        self.next_deadline = self.next_deadline.min(c.core.deadline());
        self.tokens.insert(c.id, token);
        self.conns.insert(token, Box::new(c));
    }

    /// Keepalives that ran out. A deadline only moves later (a read), so the earliest
    /// one found by the last scan bounds them all: no scan of every connection before it.
    fn check_timeouts(&mut self, touched: &mut Vec<Token>) {
        let now = self.now();
        if now < self.next_deadline {
            return;
        }
        let mut next = f64::INFINITY;
        for (token, c) in self.conns.iter_mut() {
            if c.demoting.is_some() {
                continue;
            }
            let deadline = c.core.deadline();
            if now >= deadline {
                c.demoting = Some(Why::Timeout);
                touched.push(*token);
            } else {
                next = next.min(deadline);
            }
        }
        self.next_deadline = next;
    }

    /// Clients that took too little of what waits for them (`DrainRule`): looked at
    /// once a second, as the owner looks at its own (the poll wakes at least as often).
    fn check_drains(&mut self, touched: &mut Vec<Token>) {
        if self.writers.is_empty() {
            return;
        }
        let now = self.now();
        if now < self.drain_look {
            return;
        }
        self.drain_look = now + 1.0;
        let conns = &mut self.conns;
        self.writers.retain(|token| {
            let Some(c) = conns.get_mut(token) else {
                return false;
            };
            if c.demoting.is_none() && c.stuck(now) {
                c.demoting = Some(Why::Stuck);
                touched.push(*token);
            }
            true
        });
    }

    /// Write what the socket takes: first the bytes it refused before, then the
    /// output, then deliveries that waited for room, until the socket is full or
    /// nothing is left.
    fn write_out(c: &mut Conn, now: f64, counters: &Counters) {
        Self::write_some_out(c, now, counters);
        // What the socket did not take waits behind what it refused before: counted
        // against the budget, and handed back whole should the connection go back.
        let out = c.core.take_output();
        if !out.is_empty() {
            let rule = c.drain;
            c.backlog().wait(&out, &rule, now);
        }
        c.settle();
    }

    fn write_some_out(c: &mut Conn, now: f64, counters: &Counters) {
        if let Err(e) = c.link.flush() {
            c.demoting
                .get_or_insert(Why::Lost(format!("connection lost while writing: {e}")));
            return;
        }
        loop {
            if let Some(b) = c.backlog.as_mut().filter(|b| !b.unsent.is_empty()) {
                let Some(n) = write_counted(&mut c.link, &b.unsent, &mut c.demoting, counters)
                else {
                    return;
                };
                b.took(n, &c.drain, now);
                if !b.unsent.is_empty() {
                    return;
                }
                // Room again: what waited for it goes out next.
                Self::send_held(c, counters);
            }
            let out = c.core.take_output();
            if out.is_empty() {
                return;
            }
            let Some(n) = write_counted(&mut c.link, &out, &mut c.demoting, counters) else {
                return;
            };
            if n < out.len() {
                let rule = c.drain;
                c.backlog().wait(&out[n..], &rule, now);
                return;
            }
            if !c.holds() {
                return;
            }
            Self::send_held(c, counters);
        }
    }

    fn flush(&mut self, token: Token) {
        let now = self.now();
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        if c.demoting.is_none() {
            Self::report_keep(c, &*self.sink, now);
        }
        Self::write_out(c, now, &self.counters);
        if c.unsent() > 0 {
            self.writers.insert(token);
        } else {
            self.writers.remove(&token);
        }
        if c.waiting() > c.max_unsent && c.demoting.is_none() {
            Self::over_budget(c, &*self.sink, false, &self.counters);
        }
        if c.demoting.is_none() {
            Self::ask(c, &*self.sink);
        }
        let want_write = c.unsent() > 0 || c.link.pending();
        if c.demoting.is_some() && c.core.answers_pending() == 0 {
            self.demote(token);
            return;
        }
        let interest = match (c.demoting.is_some(), want_write) {
            (false, false) => Some(Interest::READABLE),
            (false, true) => Some(Interest::READABLE | Interest::WRITABLE),
            (true, true) => Some(Interest::WRITABLE),
            (true, false) => None,
        };
        if want_write != c.writing || c.demoting.is_some() {
            c.writing = want_write;
            let registry = self.poll.registry();
            let _ = match interest {
                Some(i) => registry.reregister(c.link.socket(), token, i),
                None => registry.deregister(c.link.socket()),
            };
        }
    }

    /// A persistent session's staged batch to the owner, to be kept; and where its
    /// queues resume, when a batch completed (or a while passed).
    fn report_keep(c: &mut Conn, sink: &dyn Sink, now: f64) {
        let Some(k) = c.keep.as_mut() else {
            return;
        };
        if let Some((batch, sends)) = k.take_batch() {
            sink.report(Report::Keep {
                conn: c.id,
                batch,
                sends,
            });
        }
        if let Some((positions, done)) = k.progress(&c.positions, now) {
            sink.report(Report::Progress {
                conn: c.id,
                positions,
                done,
            });
        }
    }

    fn demote(&mut self, token: Token) {
        self.writers.remove(&token);
        let Some(mut c) = self.conns.remove(&token) else {
            return;
        };
        if !c.link.is_plain() {
            // The session stays here, relayed to Python: same token, same thread.
            self.report_demoted_tls(token, c);
            return;
        }
        self.tokens.remove(&c.id);
        let _ = self.poll.registry().deregister(c.link.socket());
        self.report_demoted(*c);
    }

    fn report_demoted(&mut self, c: Conn) {
        if c.id % self.lanes.len() as u64 != self.index as u64 {
            if let Ok(mut routes) = self.routes.write() {
                routes.remove(&c.id); // it moved here once: its route goes with it
            }
        }
        let (report, link) = self.demoted(c);
        // A TLS link that cannot be relayed here (its move failed) is closed.
        drop(link);
        self.sink.report(Report::Demoted(Box::new(report)));
    }

    /// What a connection's owner is told of it at its demotion, and its link when it
    /// is a TLS one (the owner gets a plain one's socket in the report).
    fn demoted(&mut self, mut c: Conn) -> (Demoted, Option<Link>) {
        self.send_events(); // what was relayed before it comes first
        let why = c.demoting.take().unwrap_or(Why::Packet);
        let idle_for = (self.now() - c.core.read_at()).max(0.0);
        let backlog = c.backlog.take().map(|b| *b).unwrap_or_default();
        Counters::add(&self.counters.demoted, 1);
        self.counters.connections.fetch_sub(1, Ordering::Relaxed);
        let (socket, link) = match c.link.into_socket() {
            Ok(fd) => (Some(fd), None),
            Err(link) => (None, Some(link)),
        };
        let sends = match c.keep.as_mut() {
            Some(k) => k.hand_back(c.core.outgoing().keys().copied(), &mut c.positions),
            None => Vec::new(),
        };
        let report = Demoted {
            conn: c.id,
            why,
            unread: c.core.unread().to_vec(),
            unsent: backlog.unsent,
            outgoing: c.core.outgoing().clone(),
            next_packet_id: c.core.next_packet_id(),
            aliases_in: c.core.aliases_in(),
            inbound_unacked: c.core.unacked_at_demote(),
            held: backlog.held.into(),
            positions: std::mem::take(&mut c.positions).into_iter().collect(),
            sends,
            idle_for,
            partial: c.partial,
            socket,
        };
        (report, link)
    }
}

/// The parts of an Adopt (or Carry) command the new connection is made of.
pub struct Adoption {
    pub settings: Settings,
    /// What the owner read and did not parse (read first).
    pub unread: Vec<u8>,
    /// Seconds since the client last sent anything.
    pub idle_for: f64,
    /// The topics it may publish to, or None for every topic.
    pub acl: Option<HashSet<String>>,
    pub restore: Restore,
    /// Bytes waiting for the client past which it is handed back (the owner's
    /// --max-unsent-bytes); 0: `BACKLOG_BUDGET`.
    pub max_unsent: usize,
    /// How fast the client must take what waits for it.
    pub drain: DrainRule,
    /// A persistent session's: its sends are kept (`Report::Keep`), and where it
    /// resumes is reported at most this often (seconds) while no batch completes.
    pub keep: Option<f64>,
    /// It starts served from the store (it is behind its queues' ends).
    pub behind: bool,
}

impl Adoption {
    /// A clean session's, with nothing read ahead and the default budgets.
    pub fn new(settings: Settings) -> Self {
        Adoption {
            settings,
            unread: Vec::new(),
            idle_for: 0.0,
            acl: None,
            restore: Restore::default(),
            max_unsent: 0,
            drain: DrainRule::default(),
            keep: None,
            behind: false,
        }
    }
}

/// What the link takes of `data`, counted in `bytes_out`; None (and the connection
/// lost) on an error.
fn write_counted(
    link: &mut Link,
    data: &[u8],
    demoting: &mut Option<Why>,
    counters: &Counters,
) -> Option<usize> {
    match link.write(data) {
        Ok(n) => {
            Counters::add(&counters.bytes_out, n as u64);
            Some(n)
        }
        Err(e) => {
            demoting.get_or_insert(Why::Lost(format!("connection lost while writing: {e}")));
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(bytes: usize) -> Command {
        Command::Deliver {
            conn: 1,
            delivery: Delivery {
                topic: "t".into(),
                payload: vec![0; bytes].into(),
                qos: 0,
                retain: false,
                source: (0, 0),
                positions: Vec::new(),
                from_lane: None,
            },
        }
    }

    #[test]
    fn a_lane_counts_the_delivery_bytes_it_holds() {
        let poll = Poll::new().unwrap();
        let lane = Lane {
            commands: Mutex::new(Vec::new()),
            queued: AtomicUsize::new(0),
            waker: Waker::new(poll.registry(), WAKER).unwrap(),
            busy: AtomicU32::new(0),
            thread: OnceLock::new(),
        };
        lane.push([delivery(LANE_BUDGET / 2), Command::Release { conn: 1 }]);
        assert!(!lane.over_budget());
        lane.push([delivery(LANE_BUDGET / 2)]);
        // Each counts what it holds beside its payload: its topic, positions, itself.
        let beside = std::mem::size_of::<Command>() + 1 + 2 * (2 * 8 + 16) + 16;
        assert_eq!(
            lane.queued.load(Ordering::Relaxed),
            LANE_BUDGET + 2 * beside
        );
        assert!(
            lane.over_budget(),
            "past the budget, publishers are not read"
        );
        assert_eq!(lane.take().unwrap().len(), 3);
        assert!(!lane.over_budget(), "taken: read again");
    }
}
