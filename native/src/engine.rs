//! The native per-message path end to end, as the Python store and gateway do it in
//! `gateway/inbound.py`, `store/commitlog.py` and `gateway/delivery.py`: each batch the
//! reactors read is routed (`router::Routes`), given its light-queue offsets, encoded
//! (`record`) and appended once (`commitlog::LogWriter`), made as durable as the flush
//! mode asks, acknowledged to its publishers, and delivered to the native subscribers
//! it matches. What the light-queue index and notify need of each batch waits for the
//! Python side (`take_dispatched`), which follows the log as RocketMQ's dispatch does.
//!
//! One lock covers the log's tail, the routes and the queue offsets, so offsets are
//! given out in log order and never twice, whichever reactor thread appends.

use std::collections::HashMap;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::commitlog::LogWriter;
use crate::reactor::{
    Command, Counters, Delivery, Handle, Inbound, Positions, Reactor, Report, Sink,
};
use crate::record::{self, Record};
use crate::router::{FilterError, Routes, TopicTrie};

/// Where a queue the engine has not appended to yet ends (the index knows).
pub type QueueEnd = Box<dyn Fn(&str) -> u64 + Send + Sync>;

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
}

struct Log {
    writer: LogWriter,
    routes: Routes,
    next: HashMap<String, u64>,
    queue_end: QueueEnd,
}

struct Sub {
    conn: u64,
    qos: u8,
    /// The connection's protocol version: what a message must not lose for it.
    version: u8,
    /// The filter, which names the light queue the subscription reads.
    filter: Arc<str>,
}

#[derive(Default)]
struct Subs {
    trie: TopicTrie<u64>,
    table: HashMap<u64, Sub>,
    by_conn: HashMap<(u64, String), u64>,
    next_id: u64,
}

struct Inner {
    config: Config,
    log: Mutex<Log>,
    subs: RwLock<Subs>,
    handle: OnceLock<Handle>,
    dispatched: Mutex<Vec<Dispatched>>,
    reports: Mutex<Vec<Report>>,
    failed: Mutex<Option<String>>,
    /// A byte written here wakes the owner: reports wait (`Engine::wake_fd`).
    wake: UnixStream,
}

pub struct Engine {
    inner: Arc<Inner>,
    reactor: Reactor,
    /// The owner's end of the wake-up pair: readable while reports wait.
    woken: UnixStream,
}

struct EngineSink(Arc<Inner>);

impl Sink for EngineSink {
    fn report(&self, report: Report) {
        match report {
            Report::Published(batch) => self.0.append(batch),
            // Our deliveries are all of clean sessions: an ack only frees the window,
            // which the reactor did already.
            Report::Acked { .. } => {}
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
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Engine {
    pub fn start(dir: &Path, config: Config, queue_end: QueueEnd) -> io::Result<Engine> {
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
        };
        let threads = config.io_threads;
        let (wake, woken) = UnixStream::pair()?;
        wake.set_nonblocking(true)?;
        woken.set_nonblocking(true)?;
        let inner = Arc::new(Inner {
            config,
            log: Mutex::new(log),
            subs: RwLock::new(Subs::default()),
            handle: OnceLock::new(),
            dispatched: Mutex::new(Vec::new()),
            reports: Mutex::new(Vec::new()),
            failed: Mutex::new(None),
            wake,
        });
        let reactor = Reactor::start(threads, Arc::new(EngineSink(Arc::clone(&inner))))?;
        let _ = inner.handle.set(reactor.handle());
        Ok(Engine {
            inner,
            reactor,
            woken,
        })
    }

    pub fn send(&self, command: Command) {
        self.reactor.send(command);
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
        for (filter, _, position) in subscriptions {
            let end = match log.next.get(filter.as_str()) {
                Some(&n) => n,
                None => {
                    let n = (log.queue_end)(filter);
                    log.next.insert(filter.clone(), n);
                    n
                }
            };
            if *position != end {
                return Ok(false);
            }
        }
        self.reactor.send(adopt());
        for (filter, qos, _) in subscriptions {
            self.subscribe_v(conn, filter, *qos, version)?;
        }
        drop(log);
        Ok(true)
    }

    pub fn register_wildcard(&self, topic_filter: &str) -> Result<bool, FilterError> {
        let mut log = self.inner.log.lock().map_err(|_| FilterError::Empty)?;
        log.routes.register_wildcard(topic_filter)
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
        let mut subs = self.inner.subs.write().map_err(|_| FilterError::Empty)?;
        let key = (conn, topic_filter.to_string());
        if let Some(&id) = subs.by_conn.get(&key) {
            if let Some(s) = subs.table.get_mut(&id) {
                s.qos = qos; // a repeated SUBSCRIBE replaces its options
            }
            return Ok(());
        }
        let id = subs.next_id;
        subs.trie.add(topic_filter, id)?;
        subs.next_id += 1;
        subs.table.insert(
            id,
            Sub {
                conn,
                qos,
                version,
                filter: Arc::from(topic_filter),
            },
        );
        subs.by_conn.insert(key, id);
        Ok(())
    }

    pub fn unsubscribe(&self, conn: u64, topic_filter: &str) -> bool {
        let Ok(mut subs) = self.inner.subs.write() else {
            return false;
        };
        let Some(id) = subs.by_conn.remove(&(conn, topic_filter.to_string())) else {
            return false;
        };
        subs.table.remove(&id);
        subs.trie.remove(topic_filter, id)
    }

    /// Every subscription of `conn` goes (it was demoted or it left).
    pub fn forget(&self, conn: u64) {
        self.inner.forget(conn);
    }

    /// What was appended since the last call, in log order, for the index.
    pub fn take_dispatched(&self) -> Vec<Dispatched> {
        self.inner
            .dispatched
            .lock()
            .map(|mut d| std::mem::take(&mut *d))
            .unwrap_or_default()
    }

    /// Demotions and acks of deliveries, for the owner.
    pub fn take_reports(&self) -> Vec<Report> {
        self.inner
            .reports
            .lock()
            .map(|mut r| std::mem::take(&mut *r))
            .unwrap_or_default()
    }

    pub fn write_pos(&self) -> u64 {
        self.inner
            .log
            .lock()
            .map(|l| l.writer.write_pos())
            .unwrap_or(0)
    }

    /// Why appends stopped (a failed write or fsync), if they did.
    pub fn failed(&self) -> Option<String> {
        self.inner.failed.lock().ok().and_then(|f| f.clone())
    }

    pub fn sync(&self) -> io::Result<u64> {
        match self.inner.log.lock() {
            Ok(mut log) => log.writer.sync(),
            Err(_) => Err(io::Error::other("engine lock poisoned")),
        }
    }

    /// Stop the reactors (their connections close) and make the log durable.
    pub fn stop(self) -> io::Result<u64> {
        let Engine { inner, reactor, .. } = self;
        reactor.stop();
        let synced = match inner.log.lock() {
            Ok(mut log) => log.writer.sync(),
            Err(_) => Err(io::Error::other("engine lock poisoned")),
        };
        synced
    }
}

impl Inner {
    /// Every subscription of `conn` goes (it was demoted or it left).
    pub fn forget(&self, conn: u64) {
        let Ok(mut subs) = self.subs.write() else {
            return;
        };
        let filters: Vec<String> = subs
            .by_conn
            .keys()
            .filter(|(c, _)| *c == conn)
            .map(|(_, f)| f.clone())
            .collect();
        for f in filters {
            if let Some(id) = subs.by_conn.remove(&(conn, f.clone())) {
                subs.table.remove(&id);
                subs.trie.remove(&f, id);
            }
        }
    }

    /// One pass's publishes: appended, acknowledged, delivered, left for dispatch.
    fn append(&self, batch: Vec<Inbound>) {
        let Some(handle) = self.handle.get() else {
            return;
        };
        // The log's lock is held until the deliveries are queued: two reactors that
        // append at once queue them in log order, so each subscriber gets them in
        // order and a demotion's positions never pass a message not sent yet.
        let Ok(mut log) = self.log.lock() else {
            return;
        };
        let appended = self.write(&mut log, &batch);
        let mut commands = Vec::new();
        let code = if appended.is_ok() { 0 } else { 0x80 };
        for inb in &batch {
            if let (Some(ticket), Some(packet_id)) = (inb.ticket, inb.packet_id) {
                commands.push(Command::PublishDone {
                    conn: inb.conn,
                    ticket,
                    packet_id,
                    code,
                });
            }
        }
        if let Ok(done) = appended {
            self.deliver(&batch, &done, &mut commands);
            if let Ok(mut d) = self.dispatched.lock() {
                d.extend(done);
            }
        }
        handle.send_many(commands);
        drop(log);
    }

    fn write(&self, log: &mut Log, batch: &[Inbound]) -> Result<Vec<Dispatched>, ()> {
        if self.failed.lock().map(|f| f.is_some()).unwrap_or(true) {
            return Err(());
        }
        let store_ts = now_ms();
        let mut encoded: Vec<Vec<u8>> = Vec::with_capacity(batch.len());
        let mut done = Vec::with_capacity(batch.len());
        let mut assigned: Vec<(String, u64)> = Vec::new();
        for inb in batch {
            let names = log.routes.route(&inb.topic);
            let mut queues = Vec::with_capacity(names.len());
            for name in names {
                let offset = match log.next.get(&name) {
                    Some(&n) => n,
                    None => (log.queue_end)(&name),
                };
                log.next.insert(name.clone(), offset + 1);
                assigned.push((name.clone(), offset));
                queues.push((name, offset));
            }
            let rec = Record {
                store_ts,
                born_ts: store_ts,
                qos: inb.qos,
                retain: false,
                marks: 0,
                client_id: "",
                topic: &inb.topic,
                key: "",
                properties: b"",
                body: &inb.payload,
                queues: queues.iter().map(|(n, o)| (n.as_str(), *o)).collect(),
            };
            let mut buf = Vec::new();
            if record::encode_into(&rec, &mut buf).is_err() {
                unassign(log, &assigned);
                return Err(());
            }
            done.push(Dispatched {
                phys_offset: 0,
                size: buf.len() as u32,
                store_ts,
                queues,
            });
            encoded.push(buf);
        }
        let refs: Vec<&[u8]> = encoded.iter().map(Vec::as_slice).collect();
        let written = log.writer.append(&refs).and_then(|w| {
            if self.config.sync {
                log.writer.sync()?;
            }
            Ok(w)
        });
        match written {
            Ok(w) => {
                for (d, pos) in done.iter_mut().zip(w.positions) {
                    d.phys_offset = pos;
                }
                Ok(done)
            }
            Err(e) => {
                unassign(log, &assigned);
                if let Ok(mut f) = self.failed.lock() {
                    *f = Some(format!("commitlog write failed: {e}"));
                }
                Err(())
            }
        }
    }

    /// Each message once to each connection with a matching subscription, at the
    /// smaller of its QoS and the highest QoS of the connection's matching filters.
    fn deliver(&self, batch: &[Inbound], done: &[Dispatched], commands: &mut Vec<Command>) {
        let Ok(subs) = self.subs.read() else { return };
        if subs.table.is_empty() {
            return;
        }
        for (inb, d) in batch.iter().zip(done) {
            let mut best: HashMap<u64, Target> = HashMap::new();
            subs.trie.for_each_match(&inb.topic, |_, id| {
                if let Some(s) = subs.table.get(&id) {
                    let t = best.entry(s.conn).or_insert(Target {
                        qos: 0,
                        version: s.version,
                        positions: Vec::new(),
                    });
                    t.qos = t.qos.max(s.qos);
                    if let Some((_, offset)) = d.queues.iter().find(|(name, _)| **name == *s.filter)
                    {
                        t.positions.push((Arc::clone(&s.filter), *offset));
                    }
                }
            });
            if best.is_empty() {
                continue;
            }
            let topic: Arc<str> = Arc::from(inb.topic.as_str());
            let payload: Arc<[u8]> = Arc::from(inb.payload.as_slice());
            for (conn, t) in best {
                let qos = inb.qos.min(t.qos);
                if qos > 1 || (t.version == 5 && !no_properties(b"")) {
                    // QoS 2, or properties a v5 client must get: Python carries this
                    // message, so the connection goes back before it.
                    commands.push(Command::Release { conn });
                    continue;
                }
                commands.push(Command::Deliver {
                    conn,
                    delivery: Delivery {
                        topic: Arc::clone(&topic),
                        payload: Arc::clone(&payload),
                        qos,
                        retain: false,
                        source: (0, d.phys_offset),
                        positions: t.positions,
                    },
                });
            }
        }
    }
}

/// One connection a message goes to: the highest QoS of its matching filters, its
/// protocol version, and the message's offset in each of their queues.
struct Target {
    qos: u8,
    version: u8,
    positions: Positions,
}

/// Whether a record's properties (JSON, as `store/record.py` keeps them) are none.
fn no_properties(properties: &[u8]) -> bool {
    properties.is_empty() || properties == b"{}"
}

fn unassign(log: &mut Log, assigned: &[(String, u64)]) {
    for (name, offset) in assigned.iter().rev() {
        if log.next.get(name).is_some_and(|n| *n > *offset) {
            log.next.insert(name.clone(), *offset);
        }
    }
}
