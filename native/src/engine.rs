//! The native per-message path end to end, as the Python store and gateway do it in
//! `gateway/inbound.py`, `store/commitlog.py` and `gateway/delivery.py`: each batch the
//! reactors read is routed (`router::Routes`), given its light-queue offsets, encoded
//! (`record`) and appended once (`commitlog::LogWriter`), made as durable as the flush
//! mode asks, acknowledged to its publishers, and delivered to the native subscribers
//! it matches. What the light-queue index and notify need of each batch waits for the
//! dispatch (`take_pending_upto`; Python takes it as one batch, `py.rs` DispatchBatch),
//! which follows the log as RocketMQ's dispatch does; with it go the records of the
//! queues the owner's readers read (`want_queues`).
//!
//! One lock covers the log's tail, the routes and the queue offsets, so offsets are
//! given out in log order and never twice, whichever reactor thread appends.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::backlog::{self, no_properties, Job, QueueRuns, Reader, Rounds, Worker};
use crate::commitlog::LogWriter;
use crate::partial::PartialBudget;
use crate::protocol::TopicLimits;
use crate::reactor::{
    Command, Counters, Delivery, Handle, Inbound, Lean, LinkEvent, Reactor, Report, Sink,
};
use crate::record::{self, Record, RecordError};
use crate::ring::Rings;
use crate::router::{FilterError, Routes};
use crate::subs::{Subs, Target};

/// Linux's "no space left on device" (`io::ErrorKind::StorageFull` is newer than the
/// crate's minimum Rust).
const ENOSPC: i32 = 28;
/// Appended rows the dispatch (the index, notify, readers of new messages) may be
/// behind by before native publishers are paced to it: what waits for it in memory, and
/// how far the index may lag the log, stay bounded whatever a client floods.
pub const DISPATCH_BUDGET: usize = 16 * 1024;
/// Bytes of records the rows waiting for dispatch may keep for the owner's readers
/// (`Engine::want_queues`): past it a record is not kept, and its readers read it from
/// the log as they would any other.
pub const KEPT_BYTES: usize = 8 << 20;
/// Queues the owner may want at once (`Engine::want_queues`): names come from readers,
/// and a table that only time empties must not grow with every name ever read.
pub const WANTED_MAX: usize = 100_000;

/// Where a queue the engine has not appended to yet ends (the index knows).
pub type QueueEnd = Box<dyn Fn(&str) -> u64 + Send + Sync>;

/// Raise the marks of these (queue, offset) pairs past their offsets, durably; their
/// marks after it, in order.
pub type RaiseMarks = Box<dyn Fn(&[(String, u64)]) -> io::Result<Vec<u64>> + Send + Sync>;

/// The queues' high-water marks (`store/highwater.py`): no offset at or past its queue's
/// mark is given to a message before the mark is raised, durably, past it. After a
/// crash that took records, recovery starts each queue at its mark, so an offset a
/// reader was given is never given again.
pub struct Marks {
    /// A queue's mark now (0: none), asked once per queue.
    pub mark: Box<dyn Fn(&str) -> u64 + Send + Sync>,
    pub raise: RaiseMarks,
}

pub struct Config {
    pub segment_size: u64,
    pub active_base: u64,
    pub write_pos: u64,
    pub default_partitions: u32,
    /// `--flush sync`: fsync before acknowledging; else the page cache is enough.
    pub sync: bool,
    pub io_threads: usize,
}

/// One appended message, as the index needs it: where it is and its queue offsets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dispatched {
    pub phys_offset: u64,
    pub size: u32,
    pub store_ts: u64,
    pub queues: Vec<(String, u64)>,
    /// The message's key ("" for none): the index refers to it by position.
    pub key: String,
    /// Appended by the owner (`Engine::append`), which holds the message already.
    pub own: bool,
    /// The record, kept for a reader of one of its queues (`Engine::want_queues`): the
    /// dispatch hands it over without reading it back.
    pub record: Option<Arc<[u8]>>,
}

/// A message appended from outside the reactors (Python's: TLS and WebSocket clients,
/// QoS 2, retained messages, the SDK's sends, wills): the record's fields but its store
/// time and queue offsets, and the queues it goes to (Python routed it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Message {
    pub born_ts: u64,
    pub qos: u8,
    pub retain: bool,
    /// An idempotent producer's flag bits (`store/record.py`), kept as given.
    pub marks: u8,
    pub client_id: String,
    pub topic: String,
    pub key: String,
    /// The properties as the record stores them (JSON), empty when there are none.
    pub properties: Vec<u8>,
    pub body: Vec<u8>,
    pub queues: Vec<String>,
}

#[derive(Debug)]
pub enum AppendError {
    /// Message `index` of the batch cannot be a record; nothing of the batch was written.
    Invalid(usize, RecordError),
    /// The write failed and was undone, offsets included (a full disk: ENOSPC).
    Io(io::Error),
    /// The log stopped taking writes before (a failed fsync): why.
    Failed(String),
}

impl std::fmt::Display for AppendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AppendError::Invalid(i, e) => write!(f, "message {i}: {e}"),
            AppendError::Io(e) => write!(f, "commitlog write failed: {e}"),
            AppendError::Failed(why) => write!(f, "commitlog unavailable: {why}"),
        }
    }
}

impl std::error::Error for AppendError {}

/// What the index has not taken yet, in log order, and the segments begun meanwhile
/// (their bases, oldest first): readers must know a segment before its records.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pending {
    pub rows: Vec<Dispatched>,
    pub new_segments: Vec<u64>,
}

/// `Pending` as the engine keeps it: taken from the front in bounded steps, without
/// moving what stays (a `Vec` split moved the whole rest at every step).
#[derive(Default)]
struct Waiting {
    rows: VecDeque<Dispatched>,
    new_segments: Vec<u64>,
}

impl Waiting {
    /// The oldest `limit` rows at most, and every new segment.
    fn take(&mut self, limit: usize) -> Pending {
        let rows = if self.rows.len() <= limit {
            Vec::from(std::mem::take(&mut self.rows))
        } else {
            self.rows.drain(..limit).collect()
        };
        Pending {
            rows,
            new_segments: std::mem::take(&mut self.new_segments),
        }
    }
}

/// The queues whose new records the owner reads, each until when (`Engine::want_queues`).
#[derive(Default)]
struct Wanted {
    until: HashMap<String, Instant>,
    /// When the expired ones go next (a sweep a second, not one per call).
    sweep: Option<Instant>,
}

impl Wanted {
    /// Whether any of these queues is wanted at `now`.
    fn any(&self, queues: &[(String, u64)], now: Instant) -> bool {
        queues
            .iter()
            .any(|(name, _)| self.until.get(name).is_some_and(|until| *until > now))
    }
}

/// One record to append, borrowed: a native publish's (`queues` None: routed under the
/// log lock) or an outside `Message`'s.
struct Item<'a> {
    born_ts: Option<u64>,
    qos: u8,
    retain: bool,
    marks: u8,
    client_id: &'a str,
    topic: &'a str,
    key: &'a str,
    properties: &'a [u8],
    body: &'a [u8],
    queues: Option<&'a [String]>,
}

impl<'a> Item<'a> {
    fn of(m: &'a Message) -> Self {
        Item {
            born_ts: Some(m.born_ts),
            qos: m.qos,
            retain: m.retain,
            marks: m.marks,
            client_id: &m.client_id,
            topic: &m.topic,
            key: &m.key,
            properties: &m.properties,
            body: &m.body,
            queues: Some(&m.queues),
        }
    }
}

struct Log {
    writer: LogWriter,
    routes: Routes,
    next: HashMap<String, u64>,
    queue_end: QueueEnd,
    /// Each queue's mark, as far as the engine asked (`Marks`); None: no marks kept.
    marks: Option<(Marks, HashMap<String, u64>)>,
    /// The newest index entries of the queues that connections which fell behind read,
    /// filled by every append (`Inner::write`).
    rings: Rings,
}

impl Log {
    /// Where `queue` ends: the next offset it gives out.
    fn end(&mut self, queue: &str) -> u64 {
        if let Some(&n) = self.next.get(queue) {
            return n;
        }
        let n = (self.queue_end)(queue);
        self.next.insert(queue.to_string(), n);
        n
    }
}

struct Inner {
    config: Config,
    log: Mutex<Log>,
    subs: RwLock<Subs>,
    handle: OnceLock<Handle>,
    /// Taken only after `log` (or alone): rows enter it in log order.
    pending: Mutex<Waiting>,
    /// Rows in `pending`, kept under its lock: past `DISPATCH_BUDGET` the reactors stop
    /// reading publishers until the dispatch took them.
    pending_rows: AtomicUsize,
    /// Bytes of the records `pending` keeps (`Dispatched::record`), under its lock.
    kept_bytes: AtomicUsize,
    /// Queues the owner reads new records of (`Engine::want_queues`); `wanted_len`: how
    /// many, so that an append looks no further while there are none.
    wanted: RwLock<Wanted>,
    wanted_len: AtomicUsize,
    /// Rows the dispatch took and is done with (`Engine::recycle`), and how many: the next
    /// native append frees them, on the reactor thread that allocated them, not the
    /// dispatch's thread, which runs Python.
    spent: Mutex<Vec<Vec<Dispatched>>>,
    spent_rows: AtomicUsize,
    appended: Condvar,
    /// Set (and `hurried` told) when the dispatch should not wait out its pause: the
    /// reactors are paced to it, or a reader came (`Engine::hurry`).
    hurry: Mutex<bool>,
    hurried: Condvar,
    stopping: AtomicBool,
    write_pos: AtomicU64,
    flushed: AtomicU64,
    active_base: AtomicU64,
    reports: Mutex<Vec<Report>>,
    failed: Mutex<Option<String>>,
    /// Failed appends of native publishes since Python last looked (for its log; the
    /// publishers were answered): the first few, and how many in all.
    refused: Mutex<(Vec<String>, u64)>,
    /// A byte written here wakes the owner: reports wait (`Engine::wake_fd`).
    wake: UnixStream,
    /// The owner's topic limits (`Engine::set_topic_limits`): length, levels.
    topic_limits: (AtomicUsize, AtomicUsize),
    /// What a refused publish's PUBACK says, in the owner's words (`Engine::set_not_stored`).
    not_stored: RwLock<NotStored>,
    /// How long native publishes took to append (`Engine::append_latency`).
    append_latency: Latency,
    /// Whether the owner serves connections that fall behind from the store
    /// (`Engine::set_catch_up`), and those it serves so: what they subscribed with,
    /// their live subscriptions gone meanwhile.
    catch_up: AtomicBool,
    behind: Mutex<HashMap<u64, Reader>>,
    /// Their rounds, for the backlog thread (`Engine::backlog`), which reads the log's
    /// segment files for them.
    rounds: Rounds,
    /// The persistent sessions' connections (`Engine::promote_kept`): their rounds from
    /// the store are larger (`reactor::ROUND_MESSAGES`).
    kept: Mutex<std::collections::HashSet<u64>>,
}

/// Upper bounds (seconds) of the append latency histogram: the gateway's own
/// (`gateway/stats.py` APPEND_BUCKETS), so that the two add up bucket by bucket.
pub const APPEND_BUCKETS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// A histogram of `APPEND_BUCKETS` (each observation counted in the first bucket it
/// fits, one atomic add on the append's path; made cumulative when read), its count
/// and sum.
#[derive(Default)]
struct Latency {
    buckets: [AtomicU64; 12],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Latency {
    fn observe(&self, took: Duration) {
        let seconds = took.as_secs_f64();
        if let Some(i) = APPEND_BUCKETS.iter().position(|bound| seconds <= *bound) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }
}

/// The reason strings of a publish the store refused, as the owner words them: one
/// for a full disk, and how any other begins (what went wrong follows). Empty until
/// the owner says: no reason string then.
#[derive(Debug, Clone, Default)]
pub struct NotStored {
    pub disk_full: Arc<str>,
    pub prefix: Arc<str>,
}

pub struct Engine {
    inner: Arc<Inner>,
    reactor: Reactor,
    /// The thread that makes the rounds of connections that fell behind.
    backlog: Worker,
    /// The owner's end of the wake-up pair: readable while reports wait.
    woken: UnixStream,
}

struct EngineSink(Arc<Inner>);

impl Sink for EngineSink {
    fn topic_limits(&self) -> TopicLimits {
        TopicLimits {
            max_length: self.0.topic_limits.0.load(Ordering::Relaxed),
            max_levels: self.0.topic_limits.1.load(Ordering::Relaxed),
        }
    }

    fn catches_up(&self) -> bool {
        self.0.catch_up.load(Ordering::Relaxed)
    }

    fn fell_behind(&self, conn: u64) {
        self.0.reader(conn);
    }

    fn behind(&self) -> bool {
        let behind = self.0.pending_rows.load(Ordering::Relaxed) > DISPATCH_BUDGET;
        if behind {
            self.0.hurry();
        }
        behind
    }

    fn publish(&self, batch: Vec<Inbound>) -> Vec<(u64, Lean)> {
        self.0.append(batch)
    }

    fn report(&self, report: Report) {
        match report {
            Report::Published(batch) => {
                self.0.append(batch);
            }
            // Our deliveries are all of clean sessions: an ack only frees the window,
            // which the reactor did already.
            Report::Acked { .. } => {}
            Report::Link(e) => self.link_events(vec![e]),
            Report::Behind {
                conn,
                round,
                positions,
            } => {
                if self.0.fall_behind(conn, &positions) {
                    // Live again.
                } else if let Some(job) = self.0.round_from_ring(conn, round, &positions) {
                    if let Some(handle) = self.0.handle.get() {
                        let counters = handle.counters();
                        counters.rounds_from_ring.fetch_add(1, Ordering::Relaxed);
                    }
                    self.0.rounds.push(job);
                } else {
                    if let Ok(mut r) = self.0.reports.lock() {
                        r.push(Report::Behind {
                            conn,
                            round,
                            positions,
                        });
                    }
                    let _ = (&self.0.wake).write(&[1]);
                }
            }
            Report::Keep { .. } | Report::Progress { .. } => {
                if let Ok(mut r) = self.0.reports.lock() {
                    r.push(report);
                }
                let _ = (&self.0.wake).write(&[1]);
            }
            Report::Demoted(d) => {
                // Its subscriptions go first: nothing is delivered to it after the
                // positions it hands back.
                self.0.forget(d.conn);
                if let Ok(mut r) = self.0.reports.lock() {
                    r.push(Report::Demoted(d));
                }
                // Full (a wake-up waits already) or closed (stopping): either is fine.
                let _ = (&self.0.wake).write(&[1]);
            }
        }
    }

    fn partial_freed(&self) {
        // The owner looks at the budget again when it wakes (`partial_budget`).
        let _ = (&self.0.wake).write(&[1]);
    }

    fn link_events(&self, events: Vec<LinkEvent>) {
        if let Ok(mut r) = self.0.reports.lock() {
            r.extend(events.into_iter().map(Report::Link));
        }
        let _ = (&self.0.wake).write(&[1]);
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Engine {
    pub fn start(dir: &Path, config: Config, queue_end: QueueEnd) -> io::Result<Engine> {
        Self::start_marked(dir, config, queue_end, None)
    }

    /// `start`, with the queues' high-water marks kept (`Marks`).
    pub fn start_marked(
        dir: &Path,
        config: Config,
        queue_end: QueueEnd,
        marks: Option<Marks>,
    ) -> io::Result<Engine> {
        let writer = LogWriter::open(
            dir,
            config.segment_size,
            config.active_base,
            config.write_pos,
        )?;
        let log = Log {
            writer,
            routes: Routes::new(config.default_partitions),
            next: HashMap::new(),
            queue_end,
            marks: marks.map(|m| (m, HashMap::new())),
            rings: Rings::default(),
        };
        let threads = config.io_threads;
        let (write_pos, base) = (config.write_pos, config.active_base);
        let (wake, woken) = UnixStream::pair()?;
        wake.set_nonblocking(true)?;
        woken.set_nonblocking(true)?;
        let inner = Arc::new(Inner {
            config,
            log: Mutex::new(log),
            subs: RwLock::new(Subs::default()),
            handle: OnceLock::new(),
            pending: Mutex::new(Waiting::default()),
            pending_rows: AtomicUsize::new(0),
            kept_bytes: AtomicUsize::new(0),
            wanted: RwLock::new(Wanted::default()),
            wanted_len: AtomicUsize::new(0),
            spent: Mutex::new(Vec::new()),
            spent_rows: AtomicUsize::new(0),
            hurry: Mutex::new(false),
            hurried: Condvar::new(),
            appended: Condvar::new(),
            stopping: AtomicBool::new(false),
            write_pos: AtomicU64::new(write_pos),
            flushed: AtomicU64::new(write_pos),
            active_base: AtomicU64::new(base),
            reports: Mutex::new(Vec::new()),
            failed: Mutex::new(None),
            refused: Mutex::new((Vec::new(), 0)),
            wake,
            topic_limits: (AtomicUsize::new(usize::MAX), AtomicUsize::new(usize::MAX)),
            not_stored: RwLock::new(NotStored::default()),
            append_latency: Latency::default(),
            catch_up: AtomicBool::new(false),
            behind: Mutex::new(HashMap::new()),
            rounds: Rounds::default(),
            kept: Mutex::new(std::collections::HashSet::new()),
        });
        let reactor = Reactor::start(threads, Arc::new(EngineSink(Arc::clone(&inner))))?;
        let _ = inner.handle.set(reactor.handle());
        let handle = reactor.handle();
        let backlog = inner
            .rounds
            .serve(dir, move |command| handle.send(command))?;
        Ok(Engine {
            inner,
            reactor,
            backlog,
            woken,
        })
    }

    pub fn send(&self, command: Command) {
        self.reactor.send(command);
    }

    /// Where commands go (a relayed connection's handle keeps one).
    pub fn handle(&self) -> Handle {
        self.reactor.handle()
    }

    /// The native publishes' append latency: per bucket of `APPEND_BUCKETS` (cumulative),
    /// the count and the sum in seconds.
    pub fn append_latency(&self) -> (Vec<u64>, u64, f64) {
        let l = &self.inner.append_latency;
        let mut below = 0;
        (
            l.buckets
                .iter()
                .map(|b| {
                    below += b.load(Ordering::Relaxed);
                    below
                })
                .collect(),
            l.count.load(Ordering::Relaxed),
            l.sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
        )
    }

    /// What a topic is held to on a connection that may publish anywhere (adopted with
    /// no ACL cache): past these, its publish goes to the owner, who refuses it.
    pub fn set_topic_limits(&self, limits: TopicLimits) {
        let (length, levels) = &self.inner.topic_limits;
        length.store(limits.max_length, Ordering::Relaxed);
        levels.store(limits.max_levels, Ordering::Relaxed);
    }

    /// How a native publish the store refused is explained to its client (a v5 PUBACK's
    /// Reason String, when the client asked for problem information).
    pub fn set_not_stored(&self, words: NotStored) {
        if let Ok(mut w) = self.inner.not_stored.write() {
            *w = words;
        }
    }

    /// The reactor threads (connection `conn` starts on thread `conn % io_threads`).
    pub fn io_threads(&self) -> usize {
        self.reactor.threads()
    }

    /// A descriptor that is readable while demotions wait for `take_reports` (the
    /// owner reads it empty, non-blocking, then takes them).
    pub fn wake_fd(&self) -> RawFd {
        self.woken.as_raw_fd()
    }

    /// Read the wake-up descriptor empty.
    pub fn clear_wake(&self) {
        let mut buf = [0u8; 256];
        while matches!(io::Read::read(&mut &self.woken, &mut buf), Ok(n) if n > 0) {}
    }

    pub fn counters(&self) -> &Counters {
        self.reactor.handle_ref().counters()
    }

    /// The node's budget for partly received packets: the reactors' connections count
    /// in it, and so do the owner's (it wakes the owner when a count it made freed it).
    pub fn partial_budget(&self) -> &PartialBudget {
        self.reactor.handle_ref().partial()
    }

    /// Promote a connection: `adopt` makes its Adopt command, sent only if every
    /// subscription's position (filter, QoS, next offset) is at its queue's end, and
    /// then the subscriptions are registered, all under the log's lock, so every
    /// message appended after it is delivered natively and none before it is. False:
    /// some queue holds more than the owner delivered (it delivers the rest first),
    /// and nothing changed.
    pub fn promote(
        &self,
        conn: u64,
        version: u8,
        subscriptions: &[(String, u8, u64)],
        adopt: impl FnOnce() -> Command,
    ) -> Result<bool, FilterError> {
        for (filter, _, _) in subscriptions {
            crate::router::validate_filter(filter)?;
        }
        let Ok(mut log) = self.inner.log.lock() else {
            return Ok(false);
        };
        if behind(&mut log, subscriptions) {
            return Ok(false);
        }
        self.adopt_live(conn, version, subscriptions, adopt())?;
        drop(log);
        Ok(true)
    }

    /// The adoption goes to the reactors and the subscriptions are registered (under
    /// the log's lock, which the caller holds: see `promote`).
    fn adopt_live(
        &self,
        conn: u64,
        version: u8,
        subscriptions: &[(String, u8, u64)],
        adopt: Command,
    ) -> Result<(), FilterError> {
        self.reactor.send(adopt);
        for (filter, qos, _) in subscriptions {
            self.subscribe_v(conn, filter, *qos, version)?;
        }
        Ok(())
    }

    /// Promote a persistent session's connection (`Command::Adopt` with `keep`): at its
    /// queues' ends, as `promote` does (`adopt(false)`); behind them, when the owner
    /// serves connections from the store (`set_catch_up`), it starts served so from
    /// its positions (`adopt(true)`), its live subscriptions made once it reaches the
    /// ends (`Inner::resume`). False, and nothing changed, if it is behind and the
    /// owner does not serve from the store.
    pub fn promote_kept(
        &self,
        conn: u64,
        version: u8,
        subscriptions: &[(String, u8, u64)],
        adopt: impl FnOnce(bool) -> Command,
    ) -> Result<bool, FilterError> {
        for (filter, _, _) in subscriptions {
            crate::router::validate_filter(filter)?;
        }
        let Ok(mut log) = self.inner.log.lock() else {
            return Ok(false);
        };
        if !behind(&mut log, subscriptions) {
            self.keep_rounds(conn);
            self.adopt_live(conn, version, subscriptions, adopt(false))?;
            return Ok(true);
        }
        if !self.inner.catch_up.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let reader = Reader {
            version,
            qos: subscriptions
                .iter()
                .map(|(filter, qos, _)| (Arc::from(filter.as_str()), *qos))
                .collect(),
        };
        let Ok(mut readers) = self.inner.behind.lock() else {
            return Ok(false);
        };
        // Its queues' rings start at their ends now, as a clean session's start when
        // it falls behind: once its rounds from the index reach them, the rest comes
        // from the rings.
        for queue in reader.qos.keys() {
            let end = log.end(queue);
            log.rings.register(queue, end);
        }
        readers.insert(conn, reader);
        drop(readers);
        self.keep_rounds(conn);
        self.reactor.send(adopt(true));
        drop(log);
        Ok(true)
    }

    /// `conn` is a persistent session's: its rounds from the store are larger
    /// (`Inner::round_size`).
    fn keep_rounds(&self, conn: u64) {
        if let Ok(mut kept) = self.inner.kept.lock() {
            kept.insert(conn);
        }
    }

    pub fn register_wildcard(&self, topic_filter: &str) -> Result<bool, FilterError> {
        let mut log = self.inner.log.lock().map_err(|_| FilterError::Empty)?;
        log.routes.register_wildcard(topic_filter)
    }

    pub fn unregister_wildcard(&self, topic_filter: &str) -> bool {
        match self.inner.log.lock() {
            Ok(mut log) => log.routes.unregister_wildcard(topic_filter),
            Err(_) => false,
        }
    }

    pub fn set_partitions(&self, first_level: &str, partitions: u32) {
        if let Ok(mut log) = self.inner.log.lock() {
            log.routes.set_partitions(first_level, partitions);
        }
    }

    /// `conn` receives what matches `topic_filter`, at most at `qos`.
    pub fn subscribe(&self, conn: u64, topic_filter: &str, qos: u8) -> Result<(), FilterError> {
        self.subscribe_v(conn, topic_filter, qos, 4)
    }

    /// `subscribe`, for a connection of protocol `version`.
    pub fn subscribe_v(
        &self,
        conn: u64,
        topic_filter: &str,
        qos: u8,
        version: u8,
    ) -> Result<(), FilterError> {
        self.inner.subscribe(conn, topic_filter, qos, version)
    }

    /// Serve connections that fall behind their budget from the store (the owner
    /// answers their `Report::Behind` with `feed_runs`), instead of handing them back.
    pub fn set_catch_up(&self, on: bool) {
        self.inner.catch_up.store(on, Ordering::Relaxed);
    }

    /// The answer to a connection's `Report::Behind` of `round`: what the index holds
    /// of its queues from its positions, and the log position the index covers. Its
    /// next batch is made on the backlog thread (`backlog::batch`) and goes to it;
    /// this returns at once. False: it is not served from the store (any more).
    pub fn feed_runs(&self, conn: u64, round: u64, queues: &[QueueRuns], horizon: u64) -> bool {
        let reader = match self.inner.behind.lock() {
            Ok(b) => b.get(&conn).cloned(),
            Err(_) => None,
        };
        let Some(reader) = reader else {
            return false;
        };
        self.counters()
            .rounds_from_store
            .fetch_add(1, Ordering::Relaxed);
        let (max_messages, max_bytes) = self.inner.round_size(conn);
        self.inner.rounds.push(Job {
            conn,
            round,
            reader,
            queues: queues.to_vec(),
            horizon,
            max_messages,
            max_bytes,
        });
        true
    }
}

impl Inner {
    fn subscribe(
        &self,
        conn: u64,
        topic_filter: &str,
        qos: u8,
        version: u8,
    ) -> Result<(), FilterError> {
        let mut subs = self.subs.write().map_err(|_| FilterError::Empty)?;
        subs.add(conn, topic_filter, qos, version)
    }

    /// A connection fell behind (`Report::Behind`): at its first round its live
    /// subscriptions go (kept, to come back to), and at each round it goes live again
    /// if it reached every queue's end. Whether it did.
    fn fall_behind(&self, conn: u64, positions: &[(Arc<str>, u64)]) -> bool {
        match self.reader(conn) {
            Some(reader) => self.resume(conn, &reader, positions),
            None => false,
        }
    }

    /// What a connection that fell behind subscribed with: at the first call its live
    /// subscriptions go, kept here to come back to.
    /// Its queues' rings (`ring`) start then, under the log's lock, so that every
    /// message its live subscriptions no longer take is in them.
    fn reader(&self, conn: u64) -> Option<Reader> {
        if let Some(reader) = self.behind.lock().ok()?.get(&conn) {
            return Some(reader.clone());
        }
        let mut log = self.log.lock().ok()?;
        let mut behind = self.behind.lock().ok()?;
        if let std::collections::hash_map::Entry::Vacant(first) = behind.entry(conn) {
            let mut subs = self.subs.write().ok()?;
            let mut reader = Reader {
                version: 4,
                qos: HashMap::new(),
            };
            for (f, id) in subs.by_conn.remove(&conn).unwrap_or_default() {
                if let Some(s) = subs.table.remove(&id) {
                    reader.version = s.version;
                    reader.qos.insert(Arc::clone(&s.filter), s.qos);
                }
                subs.trie.remove(&f, id);
            }
            for queue in reader.qos.keys() {
                let end = log.end(queue);
                log.rings.register(queue, end);
            }
            first.insert(reader);
        }
        behind.get(&conn).cloned()
    }

    /// The round `round` of a connection that fell behind, from its queues' rings, if
    /// they hold every one of its positions: the runs from there, and the log position
    /// they are known to cover (the log's end as they are read). None: the owner's index
    /// serves it.
    fn round_from_ring(&self, conn: u64, round: u64, positions: &[(Arc<str>, u64)]) -> Option<Job> {
        let reader = self.behind.lock().ok()?.get(&conn).cloned()?;
        let at: HashMap<&str, u64> = positions.iter().map(|(q, n)| (&**q, *n)).collect();
        let (max_messages, max_bytes) = self.round_size(conn);
        let log = self.log.lock().ok()?;
        let mut queues = Vec::with_capacity(reader.qos.len());
        for queue in reader.qos.keys() {
            let position = *at.get(&**queue)?;
            queues.push(log.rings.runs(queue, position, max_messages)?);
        }
        let horizon = log.writer.write_pos();
        drop(log);
        Some(Job {
            conn,
            round,
            reader,
            queues,
            horizon,
            max_messages,
            max_bytes,
        })
    }

    /// The messages and bytes of a round of `conn`: a persistent session's are larger
    /// (each round costs its owner a record, whatever its size).
    fn round_size(&self, conn: u64) -> (usize, usize) {
        if self.kept.lock().is_ok_and(|k| k.contains(&conn)) {
            (crate::reactor::ROUND_MESSAGES, crate::reactor::ROUND_BYTES)
        } else {
            (backlog::BATCH_MESSAGES, backlog::BATCH_BYTES)
        }
    }

    /// Live again, if every queue's position is its end: under the log's lock, as a
    /// promotion is, so every message appended after it is delivered live and none
    /// before it is.
    fn resume(&self, conn: u64, reader: &Reader, positions: &[(Arc<str>, u64)]) -> bool {
        let at: HashMap<&str, u64> = positions.iter().map(|(q, n)| (&**q, *n)).collect();
        let Ok(mut log) = self.log.lock() else {
            return false;
        };
        for queue in reader.qos.keys() {
            let Some(&position) = at.get(&**queue) else {
                return false; // never delivered from: where it is is the owner's to say
            };
            if position != log.end(queue) {
                return false;
            }
        }
        let Some(handle) = self.handle.get() else {
            return false;
        };
        handle.send(Command::Live { conn });
        for (queue, qos) in &reader.qos {
            let _ = self.subscribe(conn, queue, *qos, reader.version);
        }
        if let Ok(mut behind) = self.behind.lock() {
            behind.remove(&conn);
        }
        for queue in reader.qos.keys() {
            log.rings.unregister(queue);
        }
        drop(log);
        true
    }
}

impl Engine {
    pub fn unsubscribe(&self, conn: u64, topic_filter: &str) -> bool {
        let Ok(mut subs) = self.inner.subs.write() else {
            return false;
        };
        let Some(filters) = subs.by_conn.get_mut(&conn) else {
            return false;
        };
        let Some(id) = filters.remove(topic_filter) else {
            return false;
        };
        if filters.is_empty() {
            subs.by_conn.remove(&conn);
        }
        subs.table.remove(&id);
        subs.trie.remove(topic_filter, id)
    }

    /// Every subscription of `conn` goes (it was demoted or it left).
    pub fn forget(&self, conn: u64) {
        self.inner.forget(conn);
    }

    /// Append messages from outside the reactors, after and before whatever the
    /// reactors append (one log lock gives out offsets in log order), and deliver them
    /// to the native subscribers as a native publish is. `store_ts`: the store time of
    /// the batch (None: now). Returns each message's row, also left for dispatch.
    pub fn append(
        &self,
        messages: &[Message],
        store_ts: Option<u64>,
    ) -> Result<Vec<Dispatched>, AppendError> {
        let items: Vec<Item<'_>> = messages.iter().map(Item::of).collect();
        Ok(self
            .inner
            .write(&items, store_ts, true, true, Vec::new())?
            .rows)
    }

    /// The store's native server's way in (`server`): appends of its own, not Python's.
    pub fn appender(&self) -> Appender {
        Appender(Arc::clone(&self.inner))
    }

    /// What was appended since the last call, in log order, for the index, and the
    /// segments begun meanwhile.
    pub fn take_pending(&self) -> Pending {
        self.take_pending_upto(usize::MAX)
    }

    /// At most `limit` rows of what was appended (the oldest), and every new segment:
    /// a dispatch far behind catches up in bounded steps.
    pub fn take_pending_upto(&self, limit: usize) -> Pending {
        let Ok(mut p) = self.inner.pending.lock() else {
            return Pending::default();
        };
        let taken = p.take(limit);
        self.inner
            .pending_rows
            .store(p.rows.len(), Ordering::Relaxed);
        self.inner
            .kept_bytes
            .fetch_sub(record_bytes(&taken.rows), Ordering::Relaxed);
        taken
    }

    /// Rows taken (`take_pending_upto`) that the caller is done with: freed by the next
    /// native append's reactor thread, or here once `DISPATCH_BUDGET` rows wait so (no
    /// native append comes).
    pub fn recycle(&self, rows: Vec<Dispatched>) {
        let n = rows.len();
        if n == 0 || self.inner.spent_rows.load(Ordering::Relaxed) + n > DISPATCH_BUDGET {
            return; // (dropped here)
        }
        if let Ok(mut spent) = self.inner.spent.lock() {
            spent.push(rows);
            self.inner.spent_rows.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// The owner reads the new records of these queues for the next `for_` (zero: no
    /// longer): their rows keep their records (`Dispatched::record`, within `KEPT_BYTES`)
    /// and the dispatch hands them over, where it would read them back from the log.
    pub fn want_queues(&self, names: &[String], for_: Duration) {
        let Ok(mut w) = self.inner.wanted.write() else {
            return;
        };
        let now = Instant::now();
        if for_.is_zero() {
            for name in names {
                w.until.remove(name);
            }
        } else {
            let until = now + for_;
            for name in names {
                match w.until.get_mut(name.as_str()) {
                    Some(u) => *u = until,
                    None => {
                        w.until.insert(name.clone(), until);
                    }
                }
            }
        }
        if w.sweep.is_none_or(|at| at <= now) {
            w.until.retain(|_, until| *until > now);
            w.sweep = Some(now + Duration::from_secs(1));
        }
        if w.until.len() > WANTED_MAX {
            w.until.clear(); // never read again, most of them (store/recent.py does so too)
        }
        self.inner
            .wanted_len
            .store(w.until.len(), Ordering::Relaxed);
    }

    /// What was appended since the last call, in log order, for the index.
    pub fn take_dispatched(&self) -> Vec<Dispatched> {
        self.take_pending().rows
    }

    /// Wait until something is left for dispatch, `timeout` at most, or `wake`; true
    /// if something is.
    pub fn wait_dispatched(&self, timeout: Duration) -> bool {
        let Ok(pending) = self.inner.pending.lock() else {
            return false;
        };
        if !pending.rows.is_empty() || self.inner.stopping.load(Ordering::Acquire) {
            return !pending.rows.is_empty();
        }
        match self.inner.appended.wait_timeout(pending, timeout) {
            Ok((p, _)) => !p.rows.is_empty(),
            Err(_) => false,
        }
    }

    /// End every `wait_dispatched` now, and the ones to come (a dispatcher stopping).
    pub fn wake(&self) {
        let _guard = self.inner.pending.lock();
        self.inner.stopping.store(true, Ordering::Release);
        self.inner.appended.notify_all();
        drop(_guard);
        self.hurry();
    }

    /// Cut the dispatch's current (or next) pause short (`wait_hurry`).
    pub fn hurry(&self) {
        self.inner.hurry();
    }

    /// The dispatch's pause between batches: `timeout` at most, less when hurried.
    /// Whether it was.
    pub fn wait_hurry(&self, timeout: Duration) -> bool {
        let Ok(h) = self.inner.hurry.lock() else {
            return true;
        };
        let Ok((mut h, _)) = self
            .inner
            .hurried
            .wait_timeout_while(h, timeout, |hurried| !*hurried)
        else {
            return true;
        };
        std::mem::take(&mut *h)
    }

    /// Take the reports (demotions, acks of deliveries) for the owner.
    pub fn take_reports(&self) -> Vec<Report> {
        self.inner
            .reports
            .lock()
            .map(|mut r| std::mem::take(&mut *r))
            .unwrap_or_default()
    }

    /// The end of the log (what was written, durable or not).
    pub fn write_pos(&self) -> u64 {
        self.inner.write_pos.load(Ordering::Acquire)
    }

    /// Up to where the log is durable.
    pub fn flushed(&self) -> u64 {
        self.inner.flushed.load(Ordering::Acquire)
    }

    /// The base of the segment being written.
    pub fn active_base(&self) -> u64 {
        self.inner.active_base.load(Ordering::Acquire)
    }

    /// Why native publishes were refused since the last call (the first few), and how
    /// many batches were.
    pub fn take_refused(&self) -> (Vec<String>, u64) {
        self.inner
            .refused
            .lock()
            .map(|mut r| std::mem::take(&mut *r))
            .unwrap_or_default()
    }

    /// Why appends stopped (a failed fsync, a tail that could not be restored), if so.
    pub fn failed(&self) -> Option<String> {
        self.inner.failed()
    }

    /// Make everything written durable (`--flush async`'s flusher); the durable end.
    /// A failed fsync stops the log (the page cache's state is unknown after it).
    /// The fsync runs outside the log's lock: appends (the reactors') go on meanwhile,
    /// where holding it stalled every publisher for the disk's time.
    pub fn sync(&self) -> io::Result<u64> {
        let lock = || {
            self.inner
                .log
                .lock()
                .map_err(|_| io::Error::other("engine lock poisoned"))
        };
        let ticket = lock()?.writer.sync_ticket();
        let synced = match ticket {
            Ok(None) => Ok(self.flushed()),
            Ok(Some(ticket)) => {
                let done = ticket.sync();
                let mut log = lock()?;
                let synced = log.writer.synced(&ticket, done);
                self.inner.publish_tail(&log.writer);
                synced
            }
            Err(e) => Err(e),
        };
        if let Err(e) = &synced {
            if let Ok(mut f) = self.inner.failed.lock() {
                *f = Some(format!("fsync failed: {e}"));
            }
        }
        synced
    }

    /// Stop the reactors (their connections close) and make the log durable.
    pub fn stop(self) -> io::Result<u64> {
        self.stop_and_take().0
    }

    /// `stop`, and what was left for dispatch (the last appends, for the index).
    pub fn stop_and_take(self) -> (io::Result<u64>, Pending) {
        self.wake();
        let Engine {
            inner,
            reactor,
            backlog,
            ..
        } = self;
        drop(backlog); // (no round is made for a connection that is going)
        reactor.stop();
        let synced = match inner.log.lock() {
            Ok(mut log) => {
                let s = log.writer.sync();
                inner.publish_tail(&log.writer);
                s
            }
            Err(_) => Err(io::Error::other("engine lock poisoned")),
        };
        let left = inner
            .pending
            .lock()
            .map(|mut p| p.take(usize::MAX))
            .unwrap_or_default();
        (synced, left)
    }
}

impl Inner {
    fn hurry(&self) {
        if let Ok(mut h) = self.hurry.lock() {
            *h = true;
            self.hurried.notify_all();
        }
    }

    /// Every subscription of `conn` goes (it was demoted or it left).
    pub fn forget(&self, conn: u64) {
        let reader = match self.behind.lock() {
            Ok(mut behind) => behind.remove(&conn),
            Err(_) => None,
        };
        if let Some(reader) = reader {
            if let Ok(mut log) = self.log.lock() {
                for queue in reader.qos.keys() {
                    log.rings.unregister(queue);
                }
            }
        }
        if let Ok(mut kept) = self.kept.lock() {
            kept.remove(&conn);
        }
        let Ok(mut subs) = self.subs.write() else {
            return;
        };
        for (f, id) in subs.by_conn.remove(&conn).unwrap_or_default() {
            subs.table.remove(&id);
            subs.trie.remove(&f, id);
        }
    }

    /// One pass's publishes: appended, acknowledged, delivered, left for dispatch.
    /// Returns where each one's deliveries went, by its connection.
    fn append(&self, batch: Vec<Inbound>) -> Vec<(u64, Lean)> {
        let Some(handle) = self.handle.get() else {
            return Vec::new();
        };
        let items: Vec<Item<'_>> = batch
            .iter()
            .map(|inb| Item {
                born_ts: None,
                qos: inb.qos,
                retain: false,
                marks: 0,
                client_id: &inb.client_id,
                topic: &inb.topic,
                key: "",
                properties: b"",
                body: &inb.payload,
                queues: None,
            })
            .collect();
        let acks = |code: u8, reason: Option<Arc<str>>| -> Vec<Command> {
            batch
                .iter()
                .filter_map(|inb| {
                    Some(Command::PublishDone {
                        conn: inb.conn,
                        ticket: inb.ticket?,
                        packet_id: inb.packet_id?,
                        code,
                        reason: reason.clone(),
                    })
                })
                .collect()
        };
        let started = std::time::Instant::now();
        // Stored, the acks are queued before the deliveries (`write`).
        let appended = self.write(&items, None, false, false, acks(0, None));
        self.append_latency.observe(started.elapsed());
        match appended {
            Ok(written) => batch
                .iter()
                .zip(written.leans)
                .filter_map(|(inb, lean)| Some((inb.conn, lean?)))
                .collect(),
            Err(e) => {
                let (code, reason) = self.refusal(&e);
                if let Ok(mut r) = self.refused.lock() {
                    if r.0.len() < 8 {
                        r.0.push(e.to_string());
                    }
                    r.1 += 1;
                }
                handle.send_many(acks(code, Some(reason)));
                Vec::new()
            }
        }
    }

    /// How a refused append is answered, as Python answers: a full disk is Quota
    /// exceeded (0x97), anything else 0x80; each with the owner's words.
    fn refusal(&self, e: &AppendError) -> (u8, Arc<str>) {
        let words = self
            .not_stored
            .read()
            .map(|w| w.clone())
            .unwrap_or_default();
        match e {
            AppendError::Io(io) if io.raw_os_error() == Some(ENOSPC) => (0x97, words.disk_full),
            _ => (0x80, format!("{}{e}", words.prefix).into()),
        }
    }

    /// Append `items` under the log lock: route the ones without queues, give each
    /// queue its next offset, encode, write (and sync, in sync mode), and leave the rows
    /// for dispatch in log order, and queue the deliveries to native subscribers before
    /// the lock goes: two appends at once queue theirs in log order, so a subscriber
    /// gets them in order and a demotion's positions never pass a message not sent yet.
    /// Returns (`keep`) the rows, and where each one's deliveries went. `acks`: the
    /// publishers' acks, queued before the deliveries once written (a client subscribed
    /// to what it publishes gets its PUBACK first, as from Python). `own`: the owner
    /// holds the messages (its dispatch takes them as its own, and it dispatches itself).
    fn write(
        &self,
        items: &[Item<'_>],
        store_ts: Option<u64>,
        keep: bool,
        own: bool,
        acks: Vec<Command>,
    ) -> Result<Written, AppendError> {
        if let Some(why) = self.failed() {
            return Err(AppendError::Failed(why));
        }
        let Ok(mut log) = self.log.lock() else {
            return Err(AppendError::Failed("engine lock poisoned".into()));
        };
        let store_ts = store_ts.unwrap_or_else(now_ms);
        // The owner's readers (`want_queues`): looked at only while there are some.
        let wanted = if !own && self.wanted_len.load(Ordering::Relaxed) > 0 {
            self.wanted.read().ok()
        } else {
            None
        };
        let mut kept_bytes = self.kept_bytes.load(Ordering::Relaxed);
        let now = Instant::now();
        let mut buf: Vec<u8> = Vec::new();
        let mut ends = Vec::with_capacity(items.len());
        let mut rows = Vec::with_capacity(items.len());
        let mut assigned: Vec<(String, u64)> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let names = match item.queues {
                Some(given) => given.to_vec(),
                None => log.routes.route(item.topic),
            };
            let mut queues = Vec::with_capacity(names.len());
            for name in names {
                // (a queue seen before: its counter moves on, no key allocated again)
                let offset = match log.next.get_mut(&name) {
                    Some(n) => {
                        *n += 1;
                        *n - 1
                    }
                    None => {
                        let offset = (log.queue_end)(&name);
                        log.next.insert(name.clone(), offset + 1);
                        offset
                    }
                };
                assigned.push((name.clone(), offset));
                queues.push((name, offset));
            }
            let rec = Record {
                store_ts,
                born_ts: item.born_ts.unwrap_or(store_ts),
                qos: item.qos,
                retain: item.retain,
                marks: item.marks,
                client_id: item.client_id,
                topic: item.topic,
                key: item.key,
                properties: item.properties,
                body: item.body,
                queues: queues.iter().map(|(n, o)| (n.as_str(), *o)).collect(),
            };
            let start = buf.len();
            match record::encode_into(&rec, &mut buf) {
                Ok(size) => {
                    ends.push(buf.len());
                    let record = match &wanted {
                        Some(w) if kept_bytes < KEPT_BYTES && w.any(&queues, now) => {
                            kept_bytes += size;
                            Some(Arc::from(&buf[start..]))
                        }
                        _ => None,
                    };
                    rows.push(Dispatched {
                        phys_offset: 0,
                        size: size as u32,
                        store_ts,
                        queues,
                        key: item.key.to_string(),
                        own,
                        record,
                    });
                }
                Err(e) => {
                    buf.truncate(start);
                    unassign(&mut log, &assigned);
                    return Err(AppendError::Invalid(i, e));
                }
            }
        }
        if let Err(e) = cover(&mut log, &assigned) {
            unassign(&mut log, &assigned);
            return Err(AppendError::Io(e));
        }
        let mut refs: Vec<&[u8]> = Vec::with_capacity(ends.len());
        let mut start = 0;
        for &end in &ends {
            refs.push(&buf[start..end]);
            start = end;
        }
        let written = log.writer.append_synced(&refs, self.config.sync);
        let appended = match written {
            Ok(w) => w,
            Err(e) => {
                unassign(&mut log, &assigned);
                if let Some(why) = log.writer.broken() {
                    if let Ok(mut f) = self.failed.lock() {
                        *f = Some(format!("commitlog write failed: {why}"));
                    }
                }
                self.publish_tail(&log.writer);
                return Err(AppendError::Io(e));
            }
        };
        for (d, pos) in rows.iter_mut().zip(&appended.positions) {
            d.phys_offset = *pos;
        }
        if !log.rings.is_empty() {
            fill_rings(&mut log.rings, &rows);
        }
        let mut leans = vec![None; items.len()];
        if let Some(handle) = self.handle.get() {
            let acked = acks.len();
            let mut commands = acks;
            let mut whose = Vec::new();
            self.deliver(items, &rows, &mut commands, &mut whose);
            if !commands.is_empty() {
                let went = handle.send_many(commands);
                let went = went.get(acked..).unwrap_or_default();
                for (&(item, released), &lane) in whose.iter().zip(went) {
                    leans[item] = Some(match leans[item] {
                        _ if released => Lean::Spread,
                        None => Lean::To(lane),
                        Some(Lean::To(l)) if l == lane => Lean::To(l),
                        Some(_) => Lean::Spread,
                    });
                }
            }
        }
        drop(wanted);
        let kept = if keep { rows.clone() } else { Vec::new() };
        let mut first = false;
        if let Ok(mut p) = self.pending.lock() {
            first = p.rows.is_empty();
            self.kept_bytes
                .fetch_add(record_bytes(&rows), Ordering::Relaxed);
            p.rows.extend(rows);
            p.new_segments.extend(&appended.new_segments);
            self.pending_rows.store(p.rows.len(), Ordering::Relaxed);
        }
        self.publish_tail(&log.writer);
        drop(log);
        if !own && first {
            // A native publish wakes the dispatcher, which waits only while nothing is
            // pending (a notify is a syscall, waiter or not); an outside append's caller
            // dispatches itself before its ack (a wake-up each would cost more).
            self.appended.notify_all();
        }
        if !own && self.spent_rows.load(Ordering::Relaxed) > 0 {
            self.free_spent();
        }
        Ok(Written { rows: kept, leans })
    }

    /// Free the rows the dispatch is done with (`Engine::recycle`), outside every lock.
    fn free_spent(&self) {
        let spent = match self.spent.lock() {
            Ok(mut s) => {
                self.spent_rows.store(0, Ordering::Relaxed);
                std::mem::take(&mut *s)
            }
            Err(_) => return,
        };
        drop(spent);
    }

    /// Where the tail is, for readers that do not take the log lock.
    fn publish_tail(&self, writer: &LogWriter) {
        self.write_pos.store(writer.write_pos(), Ordering::Release);
        self.flushed.store(writer.flushed(), Ordering::Release);
        self.active_base
            .store(writer.active_base(), Ordering::Release);
    }

    fn failed(&self) -> Option<String> {
        match self.failed.lock() {
            Ok(f) => f.clone(),
            Err(_) => Some("engine lock poisoned".into()),
        }
    }

    /// Each message once to each connection with a matching subscription, at the
    /// smaller of its QoS and the highest QoS of the connection's matching filters,
    /// with the message's offset in each of those filters' queues.
    /// `whose`: for each command, the index of its item and whether it hands the
    /// connection back (`Release`).
    fn deliver(
        &self,
        items: &[Item<'_>],
        rows: &[Dispatched],
        commands: &mut Vec<Command>,
        whose: &mut Vec<(usize, bool)>,
    ) {
        let Ok(subs) = self.subs.read() else { return };
        if subs.table.is_empty() {
            return;
        }
        for (i, (item, d)) in items.iter().zip(rows).enumerate() {
            let best: HashMap<u64, Target> = subs.targets(item.topic, &d.queues);
            if best.is_empty() {
                continue;
            }
            let topic: Arc<str> = Arc::from(item.topic);
            let payload: Arc<[u8]> = Arc::from(item.body);
            for (conn, t) in best {
                let qos = item.qos.min(t.qos);
                if qos > 1 || (t.version == 5 && !no_properties(item.properties)) {
                    // QoS 2, or properties a v5 client must get: Python carries this
                    // message, so the connection goes back before it.
                    commands.push(Command::Release { conn });
                    whose.push((i, true));
                    continue;
                }
                whose.push((i, false));
                commands.push(Command::Deliver {
                    conn,
                    delivery: Delivery {
                        topic: Arc::clone(&topic),
                        payload: Arc::clone(&payload),
                        qos,
                        retain: false,
                        source: (0, d.phys_offset),
                        positions: t.positions,
                        from_lane: crate::reactor::current_lane(),
                    },
                });
            }
        }
    }
}

/// Whether some subscription's position (filter, QoS, next offset) is short of its
/// queue's end.
fn behind(log: &mut Log, subscriptions: &[(String, u8, u64)]) -> bool {
    subscriptions
        .iter()
        .any(|(filter, _, position)| *position != log.end(filter))
}

/// Appends of the store's native server (`server`): PUBLISH frames' messages, routed
/// under the log's lock and left for dispatch as the reactors' publishes are.
#[derive(Clone)]
pub struct Appender(Arc<Inner>);

impl Appender {
    /// Append `messages` (their `queues` are routed here, not read): each one's row
    /// (where it went), also left for dispatch as a native publish's.
    pub fn publish(&self, messages: &[Message]) -> Result<Vec<Dispatched>, AppendError> {
        let items: Vec<Item<'_>> = messages
            .iter()
            .map(|m| Item {
                queues: None,
                ..Item::of(m)
            })
            .collect();
        let started = Instant::now();
        let written = self.0.write(&items, None, true, false, Vec::new());
        self.0.append_latency.observe(started.elapsed());
        Ok(written?.rows)
    }

    /// A replica's copy of its master's bytes (`CommitLog.write_raw`): whole records
    /// written at `offset`, which must be the log's end, rolling first where the
    /// master's segment starts (`base == offset`); each record's row left for dispatch
    /// as an append's, the index and readers following in log order. The records of an
    /// idempotent producer's appends are kept with their rows (the dispatch's
    /// producers' table follows them), and the one after such a run (it ends it);
    /// `marked` carries whether the last record copied was one. Records that do not
    /// check, or an offset that is not the end: `InvalidData`, nothing written.
    pub fn copy_raw(
        &self,
        offset: u64,
        data: &[u8],
        base: u64,
        marked: &mut bool,
    ) -> io::Result<usize> {
        let inner = &self.0;
        if let Some(why) = inner.failed() {
            return Err(io::Error::other(why));
        }
        let Ok(mut log) = inner.log.lock() else {
            return Err(io::Error::other("engine lock poisoned"));
        };
        let end = log.writer.write_pos();
        if end != offset {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("replica log ends at {end}, not {offset}"),
            ));
        }
        let mut rows = Vec::new();
        let mut pos = 0;
        let mut last_marked = *marked;
        while pos < data.len() {
            let (rec, size) = record::decode(&data[pos..]).map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("record at {}: {e}", offset + pos as u64),
                )
            })?;
            let keep = rec.marks != 0 || last_marked;
            last_marked = rec.marks != 0;
            rows.push(Dispatched {
                phys_offset: offset + pos as u64,
                size: size as u32,
                store_ts: rec.store_ts,
                queues: rec
                    .queues
                    .iter()
                    .map(|(n, o)| (n.to_string(), *o))
                    .collect(),
                key: rec.key.to_string(),
                own: false,
                record: keep.then(|| Arc::from(&data[pos..pos + size])),
            });
            pos += size;
        }
        let roll = base == offset && log.writer.active_base() != offset && offset > 0;
        let began = match log.writer.append_raw(data, roll, inner.config.sync) {
            Ok(b) => b,
            Err(e) => {
                if let Some(why) = log.writer.broken() {
                    if let Ok(mut f) = inner.failed.lock() {
                        *f = Some(format!("commitlog write failed: {why}"));
                    }
                }
                inner.publish_tail(&log.writer);
                return Err(e);
            }
        };
        *marked = last_marked;
        // The queues' next offsets follow the master's (an append after a promotion,
        // before the engine is handed back, continues them).
        for row in &rows {
            for (name, off) in &row.queues {
                let next = log.next.entry(name.clone()).or_insert(0);
                *next = (*next).max(off + 1);
            }
        }
        if !log.rings.is_empty() {
            fill_rings(&mut log.rings, &rows);
        }
        let count = rows.len();
        let mut first = false;
        if let Ok(mut p) = inner.pending.lock() {
            first = p.rows.is_empty();
            inner
                .kept_bytes
                .fetch_add(record_bytes(&rows), Ordering::Relaxed);
            p.rows.extend(rows);
            p.new_segments.extend(began);
            inner.pending_rows.store(p.rows.len(), Ordering::Relaxed);
        }
        inner.publish_tail(&log.writer);
        drop(log);
        if first {
            inner.appended.notify_all();
        }
        Ok(count)
    }

    /// Whether the dispatch is more than `DISPATCH_BUDGET` rows behind: appends wait.
    pub fn behind(&self) -> bool {
        let behind = self.0.pending_rows.load(Ordering::Relaxed) > DISPATCH_BUDGET;
        if behind {
            self.0.hurry();
        }
        behind
    }

    /// The end of the log (what was written, durable or not).
    pub fn write_pos(&self) -> u64 {
        self.0.write_pos.load(Ordering::Acquire)
    }

    /// The base of the segment being written (stored after `write_pos`: read it after).
    pub fn active_base(&self) -> u64 {
        self.0.active_base.load(Ordering::Acquire)
    }

    /// The node's budget for partly received frames and packets (the reactors' and
    /// the owner's connections count in it too).
    pub fn partial(&self) -> Option<&PartialBudget> {
        self.0.handle.get().map(Handle::partial)
    }
}

/// What an append leaves its caller.
struct Written {
    /// Each record's row, if it asked to keep them (their positions are in them).
    rows: Vec<Dispatched>,
    /// Per record, where its deliveries went (None: to nobody).
    leans: Vec<Option<Lean>>,
}

/// Each row's entry into the rings of its queues that are kept (`ring`).
fn fill_rings(rings: &mut Rings, rows: &[Dispatched]) {
    for d in rows {
        let entry = crate::index::pack_entry(d.phys_offset, d.size, d.store_ts);
        for (queue, offset) in &d.queues {
            rings.push(queue, *offset, &entry);
        }
    }
}

/// Bytes of the records these rows keep (`Dispatched::record`).
fn record_bytes(rows: &[Dispatched]) -> usize {
    rows.iter()
        .filter_map(|d| d.record.as_ref())
        .map(|r| r.len())
        .sum()
}

/// Raise the marks that these offsets reach (one call for the append), before any of
/// them is written: from then on a reader may be given them.
fn cover(log: &mut Log, assigned: &[(String, u64)]) -> io::Result<()> {
    let Some((source, marks)) = log.marks.as_mut() else {
        return Ok(());
    };
    let mut wanted: HashMap<&str, u64> = HashMap::new();
    for (name, offset) in assigned {
        let mark = match marks.get(name) {
            Some(&m) => m,
            None => {
                let m = (source.mark)(name);
                marks.insert(name.clone(), m);
                m
            }
        };
        if *offset >= mark {
            let w = wanted.entry(name.as_str()).or_insert(*offset);
            *w = (*w).max(*offset);
        }
    }
    if wanted.is_empty() {
        return Ok(());
    }
    let wanted: Vec<(String, u64)> = wanted
        .into_iter()
        .map(|(n, o)| (n.to_string(), o))
        .collect();
    let raised = (source.raise)(&wanted)?;
    if raised.len() != wanted.len() {
        return Err(io::Error::other(
            "offset marks: one mark per queue expected",
        ));
    }
    for ((name, offset), mark) in wanted.into_iter().zip(raised) {
        if mark <= offset {
            return Err(io::Error::other(format!(
                "offset mark of {name} not raised"
            )));
        }
        marks.insert(name, mark);
    }
    Ok(())
}

fn unassign(log: &mut Log, assigned: &[(String, u64)]) {
    for (name, offset) in assigned.iter().rev() {
        if log.next.get(name).is_some_and(|n| *n > *offset) {
            log.next.insert(name.clone(), *offset);
        }
    }
}
