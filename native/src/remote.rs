//! The reactors on a gateway node whose store is elsewhere (`lightgate gateway`): each
//! pass's publishes go to the store as one native-protocol PUBLISH frame (`client`),
//! laid out as `store/protocol.py`'s `pack_messages` lays them out (routing stays in
//! the store), and each publisher's PUBACK is sent when the store's answer says the
//! frame is stored, never before. A refusal is answered as Python's gateway answers it
//! (`gateway/inbound.py`): Quota exceeded (0x97) for a full disk, 0x80 otherwise, and a
//! 3.1.1 client, which has no negative ack, loses its connection and resends. The frames
//! are idempotent (`Client::try_submit_once`): one whose answer a lost store connection
//! took is sent again, stamped the same, to the next master the client finds, and the
//! store keeps it once, answering it as stored; publishes meanwhile wait for it, in
//! order. Only past the delivery timeout (`client::DELIVERY_TIMEOUT`) do they fail, as
//! a refusal.
//!
//! No log here. Clean sessions' subscribers are carried too (`readers`): each stored
//! message of this gateway's publishers goes to them from the store's answer, with
//! its queue offsets, and the rest (another gateway's publishes, Python's) from raw
//! pulls of their queues, asked when the store's notify says a queue grew (`grew`) or
//! a reader finds a gap; one that falls past its budget is served in rounds of such
//! pulls (`Report::Behind`). Python keeps the other subscribers (persistent sessions, the
//! TLS and WebSocket ones it serves itself, shared subscriptions...): this gateway's
//! own acknowledged publishes of the queues those read (`set_stored_queues`) are
//! handed to Python (`take_stored`), which serves them at once, as it does its own.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::client::{self, Answer, Client, Options};
use crate::engine::{Engine, NotStored, APPEND_BUCKETS};
use crate::frame::{self, Frame, Kind};
use crate::partial::PartialBudget;
use crate::protocol::TopicLimits;
use crate::reactor::{Command, Counters, Handle, Inbound, Lean, LinkEvent, Reactor, Report, Sink};
use crate::readers::{self, Answered, QueuePull, Readers, RoundPlan};
use crate::record;
use crate::router::FilterError;

/// The PUBLISH request's code (`store/protocol.py`).
pub const PUBLISH: u16 = 11;
/// The PULL request's code (`store/protocol.py`).
pub const PULL: u16 = 20;
/// Bytes of PUBLISH frames not answered yet past which the reactors stop reading
/// publishers for a moment (`Sink::behind`): the store paces them, not memory.
pub const BEHIND_BYTES: usize = 4 << 20;
/// PUBLISH frames in flight at once: the passes' publishes that come meanwhile wait
/// and go as one frame when an answer comes (or once `STAGED_MAX` bytes wait). With a
/// device's one message in flight each, a reactor pass holds a few messages: a frame
/// each cost the store its per-frame work per few messages (its CPU a message doubled).
pub const FRAMES_IN_FLIGHT: usize = 2;
/// Bytes of publishes waiting for a frame past which they go at once.
pub const STAGED_MAX: usize = 1 << 20;
/// Acknowledged messages kept for Python (`take_stored`) at most: past it they are not
/// kept (Python's subscribers then get them through the store's notify, as those of
/// another gateway's publishes).
pub const STORED_MAX: usize = 16 * 1024;
/// A full disk's status in the store's ERROR frames (`_raise_for`).
const DISK_FULL: u16 = 507;

/// A message this gateway's publisher sent and the store acknowledged, as Python's
/// `Message` after `publish` (its record's place, time, size and queue offsets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub topic: String,
    pub payload: Vec<u8>,
    pub qos: u8,
    pub client_id: Arc<str>,
    pub born_ts: u64,
    pub phys: u64,
    pub store_ts: u64,
    pub rsize: u64,
    pub queues: Vec<(String, u64)>,
}

#[derive(Default)]
struct Latency {
    buckets: [AtomicU64; 12],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Latency {
    fn observe(&self, took: Duration) {
        let seconds = took.as_secs_f64();
        if let Some(i) = APPEND_BUCKETS.iter().position(|b| seconds <= *b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }

    fn snapshot(&self) -> (Vec<u64>, u64, f64) {
        let mut below = 0;
        let buckets = self
            .buckets
            .iter()
            .map(|b| {
                below += b.load(Ordering::Relaxed);
                below
            })
            .collect();
        (
            buckets,
            self.count.load(Ordering::Relaxed),
            self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
        )
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A pass's publishes as a PUBLISH request: the header's `messages` (`pack_messages`:
/// topic, size, then qos, client_id and born_ts where set) and the bodies concatenated.
pub fn publish_request(batch: &[Inbound], born_ts: u64) -> (Vec<u8>, Vec<u8>) {
    // Written out here rather than through a JSON map: its keys in the order Python
    // writes them (serde_json's map sorts them), strings escaped by serde_json.
    let mut header = String::with_capacity(16 + batch.len() * 96);
    header.push_str(r#"{"messages":["#);
    let mut body = Vec::with_capacity(batch.iter().map(|i| i.payload.len()).sum());
    for (i, inb) in batch.iter().enumerate() {
        if i > 0 {
            header.push(',');
        }
        header.push_str(r#"{"topic":"#);
        frame::push_json_str(&mut header, &inb.topic);
        let _ = write!(header, r#","size":{}"#, inb.payload.len());
        if inb.qos != 0 {
            let _ = write!(header, r#","qos":{}"#, inb.qos);
        }
        if !inb.client_id.is_empty() {
            header.push_str(r#","client_id":"#);
            frame::push_json_str(&mut header, &inb.client_id);
        }
        if born_ts != 0 {
            let _ = write!(header, r#","born_ts":{born_ts}"#);
        }
        header.push('}');
        body.extend_from_slice(&inb.payload);
    }
    header.push_str("]}");
    (header.into_bytes(), body)
}

/// Where the store put one message: (phys, store_ts, rsize, [(queue, offset)]).
pub type Placed = (u64, u64, u64, Vec<(String, u64)>);

/// The store's `results` for a stored PUBLISH, one (phys, store_ts, rsize, queues) per
/// message, or None when the answer does not say (a protocol error). A frame sent again
/// whose messages the store holds from before the appends it remembers comes back with
/// phys -1 and no queues: stored, its place not said (read as 0, and no queue).
pub fn results_of(frame: &Frame) -> Option<Vec<Placed>> {
    // Read typed, borrowing (no map per message); a read that fails is no answer.
    #[derive(serde::Deserialize)]
    struct Results<'a> {
        #[serde(borrow)]
        results: Vec<Result<'a>>,
    }
    #[derive(serde::Deserialize)]
    struct Result<'a> {
        #[serde(borrow)]
        queues: Vec<(std::borrow::Cow<'a, str>, u64)>,
        phys: i64,
        store_ts: u64,
        rsize: u64,
    }
    let h: Results<'_> = serde_json::from_slice(&frame.header).ok()?;
    Some(
        h.results
            .into_iter()
            .map(|r| {
                let queues = r
                    .queues
                    .into_iter()
                    .map(|(q, o)| (q.into_owned(), o))
                    .collect();
                (r.phys.max(0) as u64, r.store_ts, r.rsize, queues)
            })
            .collect(),
    )
}

/// The frames in flight, and the publishes waiting for one.
#[derive(Default)]
struct Flow {
    in_flight: usize,
    staged: Vec<Inbound>,
    staged_bytes: usize,
}

pub struct RemoteSink {
    client: Client,
    flow: Mutex<Flow>,
    /// `Flow::staged_bytes`, read without the lock.
    staged_bytes: AtomicUsize,
    handle: OnceLock<Handle>,
    reports: Mutex<Vec<Report>>,
    wake: UnixStream,
    topic_limits: (AtomicUsize, AtomicUsize),
    not_stored: RwLock<NotStored>,
    latency: Latency,
    /// Queues Python reads on this node: their messages are kept for it (`Stored`).
    stored_queues: RwLock<HashSet<String>>,
    stored_any: AtomicUsize,
    stored: Mutex<Vec<Stored>>,
    /// Frames the store refused (the first few reasons, and how many in all), for
    /// Python's log.
    refused: Mutex<(Vec<String>, u64)>,
    /// The subscribers carried here, and their positions (`readers`). Deliveries are
    /// handed to the reactors under its lock, so each reader's go in the order given.
    readers: Mutex<Readers>,
    /// Whether any is carried (read without the lock on every answer).
    reading: AtomicUsize,
    /// Pulls of queues answered, and the records they delivered (for the metrics).
    pulls: AtomicU64,
    pulled_records: AtomicU64,
}

impl RemoteSink {
    fn wake_owner(&self) {
        let _ = (&self.wake).write(&[1]);
    }

    /// A pass's publishes to the store: one frame, or with those waiting for one when
    /// `FRAMES_IN_FLIGHT` are out; each QoS 1 publisher's PUBACK when its answer comes.
    /// What waits goes before what comes after it: one connection's order is kept.
    fn send(self: &Arc<Self>, batch: Vec<Inbound>) {
        if batch.is_empty() {
            return;
        }
        let bytes: usize = batch.iter().map(|i| i.payload.len() + i.topic.len()).sum();
        let Ok(mut flow) = self.flow.lock() else {
            return;
        };
        let busy = !flow.staged.is_empty() || flow.in_flight >= FRAMES_IN_FLIGHT;
        if busy && flow.staged_bytes + bytes <= STAGED_MAX {
            flow.staged.extend(batch);
            flow.staged_bytes += bytes;
            self.staged_bytes
                .store(flow.staged_bytes, Ordering::Relaxed);
            return;
        }
        let batch = if flow.staged.is_empty() {
            batch
        } else {
            let mut all = std::mem::take(&mut flow.staged);
            all.extend(batch);
            all
        };
        let failed = self.submit(&mut flow, batch);
        drop(flow);
        if let Some((done, why)) = failed {
            done(Err(why));
        }
    }

    /// One frame out (under the flow's lock, so frames go in the order taken); a frame
    /// that cannot go is handed back, to be failed once the lock is let go.
    fn submit(
        self: &Arc<Self>,
        flow: &mut Flow,
        batch: Vec<Inbound>,
    ) -> Option<(client::Done, String)> {
        flow.in_flight += 1;
        flow.staged_bytes = 0;
        self.staged_bytes.store(0, Ordering::Relaxed);
        let born = now_ms();
        let (header, body) = publish_request(&batch, born);
        let batch_len = batch.len();
        let started = Instant::now();
        let me = Arc::clone(self);
        let done: client::Done =
            Box::new(move |answer: Answer| me.answered(batch, born, started, answer));
        let count = batch_len;
        self.client
            .try_submit_once(PUBLISH, header, body, count, done)
            .err()
    }

    /// A frame answered: the next one out, with what waits.
    fn next_frame(self: &Arc<Self>) {
        let Ok(mut flow) = self.flow.lock() else {
            return;
        };
        flow.in_flight = flow.in_flight.saturating_sub(1);
        if flow.staged.is_empty() || flow.in_flight >= FRAMES_IN_FLIGHT {
            return;
        }
        let batch = std::mem::take(&mut flow.staged);
        let failed = self.submit(&mut flow, batch);
        drop(flow);
        if let Some((done, why)) = failed {
            done(Err(why));
        }
    }

    fn answered(
        self: &Arc<Self>,
        batch: Vec<Inbound>,
        born: u64,
        started: Instant,
        answer: Answer,
    ) {
        self.acknowledge(batch, born, started, answer);
        self.next_frame();
    }

    fn acknowledge(
        self: &Arc<Self>,
        batch: Vec<Inbound>,
        born: u64,
        started: Instant,
        answer: Answer,
    ) {
        let Some(handle) = self.handle.get() else {
            return;
        };
        let words = self
            .not_stored
            .read()
            .map(|w| w.clone())
            .unwrap_or_default();
        let mut placed = None;
        let (code, reason): (u8, Option<Arc<str>>) = match &answer {
            Ok(f) if f.kind == Kind::Response => match results_of(f) {
                Some(r) if r.len() == batch.len() => {
                    self.latency.observe(started.elapsed());
                    self.keep_stored(&batch, born, &r);
                    placed = Some(r);
                    (0, None)
                }
                _ => self.refuse(&words, "the store's answer does not say where".into(), true),
            },
            Ok(f) => {
                let (status, message) = client::error_of(f);
                if status == DISK_FULL {
                    self.note(format!("{status}: {message}"));
                    (0x97, Some(words.disk_full.clone()))
                } else {
                    self.refuse(&words, message, true)
                }
            }
            // No store connection: said once by the client's state, not per publish
            // (as Python's gateway logs its StoreUnavailable at debug).
            Err(why) => self.refuse(&words, why.clone(), false),
        };
        let acks: Vec<Command> = batch
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
            .collect();
        match placed {
            Some(placed) if self.reading.load(Ordering::Relaxed) > 0 => {
                self.deliver_own(handle, acks, &batch, &placed)
            }
            _ if !acks.is_empty() => {
                handle.send_many(acks);
            }
            _ => {}
        }
    }

    /// The stored messages of this gateway's publishers to the readers carried here,
    /// after the publishers' acks (a client subscribed to what it publishes gets its
    /// PUBACK first, as from Python); the queues where a reader found a gap are pulled.
    fn deliver_own(
        self: &Arc<Self>,
        handle: &Handle,
        acks: Vec<Command>,
        batch: &[Inbound],
        placed: &[Placed],
    ) {
        let mut commands = acks;
        let mut short = Vec::new();
        if let Ok(mut readers) = self.readers.lock() {
            for (inb, (phys, _, _, queues)) in batch.iter().zip(placed) {
                let m = readers::Stored {
                    topic: &inb.topic,
                    body: &inb.payload,
                    qos: inb.qos,
                    properties: b"",
                    phys: *phys,
                    queues,
                };
                readers.offer(&m, &mut commands, &mut short);
            }
            if !commands.is_empty() {
                handle.send_many(commands);
            }
        } else if !commands.is_empty() {
            handle.send_many(commands);
        }
        self.pull_all(short);
    }

    fn pull_all(self: &Arc<Self>, mut queues: Vec<Arc<str>>) {
        queues.sort_unstable();
        queues.dedup();
        for q in queues {
            self.pull(&q);
        }
    }

    /// Pull `queue` from its readers' lowest position (unless a pull of it is under
    /// way: it pulls again once answered), as raw records.
    fn pull(self: &Arc<Self>, queue: &str) {
        let asked = match self.readers.lock() {
            Ok(mut r) => r.ask(queue),
            Err(_) => None,
        };
        let Some((queue, from)) = asked else {
            return;
        };
        let header = serde_json::json!({
            "queue": &*queue,
            "offset": from,
            "max": readers::PULL_RECORDS,
            "raw": true,
        });
        let header = serde_json::to_vec(&header).unwrap_or_default();
        let me = Arc::clone(self);
        self.client.submit(
            PULL,
            header,
            Vec::new(),
            Box::new(move |answer: Answer| me.pulled(&queue, from, answer)),
        );
    }

    /// A pull's answer: its records to the readers, in order; then the queue pulled
    /// again if more may wait.
    fn pulled(self: &Arc<Self>, queue: &str, from: u64, answer: Answer) {
        let Some(handle) = self.handle.get() else {
            return;
        };
        let (raw, body) = match &answer {
            Ok(f) if f.kind == Kind::Response => (raw_records(f), &f.body[..]),
            _ => (None, &[][..]),
        };
        let mut commands = Vec::new();
        let mut short = Vec::new();
        let again = {
            let Ok(mut readers) = self.readers.lock() else {
                return;
            };
            let answered = raw.as_ref().map(|(records, next_offset, more)| {
                let mut first = None;
                for rec in records {
                    let Ok((r, _)) = record::decode(&body[rec.1.clone()]) else {
                        continue;
                    };
                    if first.is_none() {
                        first = r.queues.iter().find(|(q, _)| *q == queue).map(|(_, o)| *o);
                    }
                    let m = readers::Stored {
                        topic: r.topic,
                        body: r.body,
                        qos: r.qos,
                        properties: r.properties,
                        phys: rec.0,
                        queues: &r.queues,
                    };
                    readers.offer(&m, &mut commands, &mut short);
                }
                Answered {
                    first,
                    next_offset: *next_offset,
                    more: *more,
                }
            });
            let delivered = commands
                .iter()
                .any(|c| matches!(c, Command::Deliver { .. }));
            let again = readers.pulled(queue, from, answered, delivered, &mut commands);
            if !commands.is_empty() {
                handle.send_many(commands);
            }
            again
        };
        if let Some((records, _, _)) = &raw {
            self.pulls.fetch_add(1, Ordering::Relaxed);
            self.pulled_records
                .fetch_add(records.len() as u64, Ordering::Relaxed);
        }
        short.retain(|q| &**q != queue);
        if again {
            short.push(Arc::from(queue));
        }
        self.pull_all(short);
    }

    fn note(&self, why: String) {
        if let Ok(mut r) = self.refused.lock() {
            if r.0.len() < 8 {
                r.0.push(why);
            }
            r.1 += 1;
        }
    }

    fn refuse(&self, words: &NotStored, why: String, note: bool) -> (u8, Option<Arc<str>>) {
        let reason: Arc<str> = format!("{}{why}", words.prefix).into();
        if note {
            self.note(why);
        }
        (0x80, Some(reason))
    }

    fn keep_stored(&self, batch: &[Inbound], born: u64, results: &[Placed]) {
        if self.stored_any.load(Ordering::Relaxed) == 0 {
            return;
        }
        let Ok(wanted) = self.stored_queues.read() else {
            return;
        };
        let mut kept = Vec::new();
        for (inb, (phys, store_ts, rsize, queues)) in batch.iter().zip(results) {
            if queues.iter().any(|(q, _)| wanted.contains(q)) {
                kept.push(Stored {
                    topic: inb.topic.clone(),
                    payload: inb.payload.clone(),
                    qos: inb.qos,
                    client_id: Arc::clone(&inb.client_id),
                    born_ts: born,
                    phys: *phys,
                    store_ts: *store_ts,
                    rsize: *rsize,
                    queues: queues.clone(),
                });
            }
        }
        drop(wanted);
        if kept.is_empty() {
            return;
        }
        if let Ok(mut s) = self.stored.lock() {
            let room = STORED_MAX.saturating_sub(s.len());
            kept.truncate(room);
            s.extend(kept);
        }
        self.wake_owner();
    }
}

impl RemoteSink {
    fn forget(&self, conn: u64) {
        if let Ok(mut r) = self.readers.lock() {
            r.forget(conn);
            self.reading
                .store(usize::from(!r.is_empty()), Ordering::Relaxed);
        }
    }
}

/// A round of a reader that fell behind: its queues' pulls, as they are answered.
struct Round {
    conn: u64,
    round: u64,
    plan: RoundPlan,
    answers: Vec<Option<Answer>>,
    left: usize,
}

impl RemoteSink {
    /// Round `round` of `conn`, which fell behind: its queues pulled from `positions`
    /// (or where it was promoted), their records made into one batch once all are
    /// answered; none (every queue at its end): live again. A round that cannot be
    /// made hands it back: Python delivers from its positions.
    fn round(self: &Arc<Self>, conn: u64, round: u64, positions: &[(Arc<str>, u64)]) {
        let Some(handle) = self.handle.get() else {
            return;
        };
        let plan = self
            .readers
            .lock()
            .ok()
            .and_then(|r| r.round_plan(conn, positions));
        let Some(plan) = plan.filter(|p| !p.queues.is_empty()) else {
            handle.send(Command::Release { conn });
            return;
        };
        handle
            .counters()
            .rounds_from_store
            .fetch_add(1, Ordering::Relaxed);
        let n = plan.queues.len();
        let asks: Vec<(Arc<str>, u64)> = plan
            .queues
            .iter()
            .map(|(q, at, _)| (Arc::clone(q), *at))
            .collect();
        let state = Arc::new(Mutex::new(Round {
            conn,
            round,
            plan,
            answers: (0..n).map(|_| None).collect(),
            left: n,
        }));
        for (i, (queue, at)) in asks.into_iter().enumerate() {
            let header = serde_json::json!({
                "queue": &*queue,
                "offset": at,
                "max": crate::backlog::BATCH_MESSAGES,
                "raw": true,
            });
            let header = serde_json::to_vec(&header).unwrap_or_default();
            let (me, state) = (Arc::clone(self), Arc::clone(&state));
            self.client.submit(
                PULL,
                header,
                Vec::new(),
                Box::new(move |answer: Answer| me.round_answered(&state, i, answer)),
            );
        }
    }

    fn round_answered(self: &Arc<Self>, state: &Mutex<Round>, i: usize, answer: Answer) {
        let Some(handle) = self.handle.get() else {
            return;
        };
        let Ok(mut st) = state.lock() else {
            return;
        };
        st.answers[i] = Some(answer);
        st.left -= 1;
        if st.left > 0 {
            return;
        }
        let conn = st.conn;
        let frames: Option<Vec<&Frame>> = st
            .answers
            .iter()
            .map(|a| match a {
                Some(Ok(f)) if f.kind == Kind::Response => Some(f),
                _ => None,
            })
            .collect();
        let pulls: Option<Vec<QueuePull<'_>>> = frames.and_then(|frames| {
            frames
                .into_iter()
                .map(|f| {
                    let (records, next_offset, _) = raw_records(f)?;
                    let full = records.len() >= crate::backlog::BATCH_MESSAGES;
                    let records = records
                        .into_iter()
                        .map(|(phys, at)| Some((phys, record::decode(&f.body[at]).ok()?.0)))
                        .collect::<Option<Vec<_>>>()?;
                    Some(QueuePull {
                        records,
                        next_offset,
                        full,
                    })
                })
                .collect()
        });
        let Some(pulls) = pulls else {
            // (the store away, or an answer that does not say: Python reads on)
            handle.send(Command::Release { conn });
            return;
        };
        self.pulls.fetch_add(pulls.len() as u64, Ordering::Relaxed);
        self.pulled_records.fetch_add(
            pulls.iter().map(|p| p.records.len() as u64).sum(),
            Ordering::Relaxed,
        );
        let made = readers::round_batch(
            &st.plan,
            &pulls,
            crate::backlog::BATCH_MESSAGES,
            crate::backlog::BATCH_BYTES,
        );
        if let Some(batch) = made {
            handle.send(Command::Catch {
                conn,
                round: st.round,
                batch: Box::new(batch),
            });
            return;
        }
        let live = match self.readers.lock() {
            Ok(mut r) => {
                let live = r.resume(conn, &st.plan);
                if live {
                    // Under the lock: the deliveries that follow go after it.
                    handle.send(Command::Live { conn });
                }
                live
            }
            Err(_) => false,
        };
        if live {
            let queues = st
                .plan
                .queues
                .iter()
                .map(|(q, _, _)| Arc::clone(q))
                .collect();
            drop(st);
            self.pull_all(queues);
        }
    }
}

/// A raw PULL answer's records, each with its place in the log, where the next pull
/// starts, and whether more may follow: None if the answer does not say.
/// (Each record's log position and its bytes' range in the answer's body.)
type RawRecords = (Vec<(u64, std::ops::Range<usize>)>, u64, bool);

fn raw_records(frame: &Frame) -> Option<RawRecords> {
    let h = client::header_of(frame);
    let next_offset = h.get("next_offset")?.as_u64()?;
    let max_offset = h.get("max_offset").and_then(|v| v.as_u64()).unwrap_or(0);
    let mut records = Vec::new();
    let mut pos = 0usize;
    for run in h.get("runs")?.as_array()? {
        let phys = run.get(0)?.as_u64()?;
        let bytes = run.get(1)?.as_u64()? as usize;
        let count = run.get(3)?.as_u64()?;
        let data = frame.body.get(pos..pos + bytes)?;
        let mut at = 0usize;
        for _ in 0..count {
            let (_, size) = record::decode(data.get(at..)?).ok()?;
            records.push((phys + at as u64, pos + at..pos + at + size));
            at += size;
        }
        pos += bytes;
    }
    Some((records, next_offset, next_offset < max_offset))
}

/// The sink the reactors see: `RemoteSink` behind an `Arc` (its answers hold one).
struct SinkRef(Arc<RemoteSink>);

impl Sink for SinkRef {
    fn report(&self, report: Report) {
        match report {
            Report::Published(batch) => self.0.send(batch),
            Report::Behind {
                conn,
                round,
                positions,
            } => self.0.round(conn, round, &positions),
            // Clean sessions only: an ack frees the window, which the reactor did, and
            // none keeps sends.
            Report::Acked { .. } | Report::Keep { .. } | Report::Progress { .. } => {}
            Report::Link(e) => self.link_events(vec![e]),
            Report::Demoted(d) => {
                // Its subscriptions go first: nothing is delivered to it after the
                // positions it hands back.
                self.0.forget(d.conn);
                if let Ok(mut r) = self.0.reports.lock() {
                    r.push(Report::Demoted(d));
                }
                self.0.wake_owner();
            }
        }
    }

    fn publish(&self, batch: Vec<Inbound>) -> Vec<(u64, Lean)> {
        self.0.send(batch);
        Vec::new()
    }

    fn topic_limits(&self) -> TopicLimits {
        TopicLimits {
            max_length: self.0.topic_limits.0.load(Ordering::Relaxed),
            max_levels: self.0.topic_limits.1.load(Ordering::Relaxed),
        }
    }

    fn behind(&self) -> bool {
        self.0.client.backlog() + self.0.staged_bytes.load(Ordering::Relaxed) > BEHIND_BYTES
    }

    fn catches_up(&self) -> bool {
        true
    }

    fn fell_behind(&self, conn: u64) {
        if let Ok(mut r) = self.0.readers.lock() {
            r.fall_behind(conn);
        }
    }

    fn partial_freed(&self) {
        self.0.wake_owner();
    }

    fn link_events(&self, events: Vec<LinkEvent>) {
        if let Ok(mut r) = self.0.reports.lock() {
            r.extend(events.into_iter().map(Report::Link));
        }
        self.0.wake_owner();
    }
}

/// The reactors and their remote sink: what `lightgate gateway` carries natively.
pub struct RemoteEngine {
    sink: Arc<RemoteSink>,
    reactor: Reactor,
    woken: UnixStream,
}

impl RemoteEngine {
    pub fn start(options: Options, io_threads: usize) -> io::Result<RemoteEngine> {
        let client = Client::start(options)?;
        let (wake, woken) = UnixStream::pair()?;
        wake.set_nonblocking(true)?;
        woken.set_nonblocking(true)?;
        let sink = Arc::new(RemoteSink {
            client,
            flow: Mutex::new(Flow::default()),
            staged_bytes: AtomicUsize::new(0),
            handle: OnceLock::new(),
            reports: Mutex::new(Vec::new()),
            wake,
            topic_limits: (AtomicUsize::new(usize::MAX), AtomicUsize::new(usize::MAX)),
            not_stored: RwLock::new(NotStored::default()),
            latency: Latency::default(),
            stored_queues: RwLock::new(HashSet::new()),
            stored_any: AtomicUsize::new(0),
            stored: Mutex::new(Vec::new()),
            refused: Mutex::new((Vec::new(), 0)),
            readers: Mutex::new(Readers::default()),
            reading: AtomicUsize::new(0),
            pulls: AtomicU64::new(0),
            pulled_records: AtomicU64::new(0),
        });
        let reactor = Reactor::start(io_threads, Arc::new(SinkRef(Arc::clone(&sink))))?;
        let _ = sink.handle.set(reactor.handle());
        Ok(RemoteEngine {
            sink,
            reactor,
            woken,
        })
    }

    /// Whether the store's master is connected now, and (its address, why not).
    pub fn store_status(&self) -> (bool, String, String) {
        let c = &self.sink.client;
        let (master, why) = c.status();
        (c.connected(), master, why)
    }

    /// Fail the frames held to be sent again (the gateway gives up on the master: its
    /// clients go to another gateway), and the publishes waiting behind them.
    pub fn give_up_held(&self) {
        self.sink.client.give_up();
    }

    /// The queues Python reads on this node: the acknowledged messages of these are
    /// handed to it (`take_stored`).
    pub fn set_stored_queues(&self, names: HashSet<String>) {
        if let Ok(mut w) = self.sink.stored_queues.write() {
            self.sink.stored_any.store(names.len(), Ordering::Relaxed);
            *w = names;
        }
    }

    /// One more queue Python reads (its first reader here came).
    pub fn add_stored_queue(&self, name: &str) {
        if let Ok(mut w) = self.sink.stored_queues.write() {
            w.insert(name.to_string());
            self.sink.stored_any.store(w.len(), Ordering::Relaxed);
        }
    }

    pub fn take_stored(&self) -> Vec<Stored> {
        self.sink
            .stored
            .lock()
            .map(|mut s| std::mem::take(&mut *s))
            .unwrap_or_default()
    }

    /// The store's notify says these queues grew: those read here are pulled from
    /// their readers' positions (what this gateway published is there already, and
    /// skipped). `*` (notify lost events): every queue read here.
    pub fn grew(&self, names: &[String]) {
        self.grew_to(names, &HashMap::new());
    }

    /// `grew`, where the notify said some queues' ends: such a queue is not pulled
    /// while every reader of it here is at that end already (this gateway's own
    /// publishes, delivered from the store's answers, as most are).
    pub fn grew_to(&self, names: &[String], ends: &HashMap<String, u64>) {
        if self.sink.reading.load(Ordering::Relaxed) == 0 {
            return;
        }
        let queues: Vec<Arc<str>> = match self.sink.readers.lock() {
            Ok(r) if names.iter().any(|n| n == "*") => r.queues(),
            Ok(r) => names
                .iter()
                .filter(|n| r.reads(n) && !ends.get(*n).is_some_and(|e| r.at_end(n, *e)))
                .map(|n| Arc::from(n.as_str()))
                .collect(),
            Err(_) => return,
        };
        self.sink.pull_all(queues);
    }

    /// Pull again the queues whose last pull failed or left a reader short.
    pub fn recheck(&self) {
        let queues = match self.sink.readers.lock() {
            Ok(mut r) => r.take_retry(),
            Err(_) => return,
        };
        self.sink.pull_all(queues);
    }

    /// (pulls answered, records they brought) of the queues read here.
    pub fn pulls(&self) -> (u64, u64) {
        (
            self.sink.pulls.load(Ordering::Relaxed),
            self.sink.pulled_records.load(Ordering::Relaxed),
        )
    }

    pub fn take_refused(&self) -> (Vec<String>, u64) {
        self.sink
            .refused
            .lock()
            .map(|mut r| std::mem::take(&mut *r))
            .unwrap_or_default()
    }

    /// Stop the reactors (their connections close), then the store client (what it
    /// waits for fails).
    pub fn stop(self) {
        let RemoteEngine { sink, reactor, .. } = self;
        reactor.stop();
        sink.client.stop();
    }
}

/// What Python's handover uses of an engine, the local one's or the remote one's.
pub trait Carrier: Send + Sync {
    fn send(&self, command: Command);
    fn handle(&self) -> Handle;
    fn wake_fd(&self) -> RawFd;
    fn clear_wake(&self);
    fn take_reports(&self) -> Vec<Report>;
    fn counters(&self) -> &Counters;
    fn partial_budget(&self) -> &PartialBudget;
    fn append_latency(&self) -> (Vec<u64>, u64, f64);
    fn set_topic_limits(&self, limits: TopicLimits);
    fn set_not_stored(&self, words: NotStored);
    fn io_threads(&self) -> usize;
    /// As `Engine::promote`; a remote engine carries no subscriptions (false: Python
    /// keeps a connection that has some).
    fn promote(
        &self,
        conn: u64,
        version: u8,
        subscriptions: &[(String, u8, u64)],
        adopt: Box<dyn FnOnce() -> Command + '_>,
    ) -> Result<bool, FilterError>;
    /// As `Engine::promote_kept` (a persistent session's); a remote engine carries none.
    fn promote_kept(
        &self,
        _conn: u64,
        _version: u8,
        _subscriptions: &[(String, u8, u64)],
        _adopt: Box<dyn FnOnce(bool) -> Command + '_>,
    ) -> Result<bool, FilterError> {
        Ok(false)
    }
    /// `promote`, or `promote_kept` for a persistent session's connection (`kept`):
    /// `make` is told whether it starts behind its queues' ends.
    fn promote_any(
        &self,
        conn: u64,
        version: u8,
        subscriptions: &[(String, u8, u64)],
        kept: bool,
        make: Box<dyn FnOnce(bool) -> Command + '_>,
    ) -> Result<bool, FilterError> {
        if kept {
            self.promote_kept(conn, version, subscriptions, make)
        } else {
            self.promote(conn, version, subscriptions, Box::new(move || make(false)))
        }
    }
}

impl Carrier for Engine {
    fn send(&self, command: Command) {
        Engine::send(self, command)
    }
    fn handle(&self) -> Handle {
        Engine::handle(self)
    }
    fn wake_fd(&self) -> RawFd {
        Engine::wake_fd(self)
    }
    fn clear_wake(&self) {
        Engine::clear_wake(self)
    }
    fn take_reports(&self) -> Vec<Report> {
        Engine::take_reports(self)
    }
    fn counters(&self) -> &Counters {
        Engine::counters(self)
    }
    fn partial_budget(&self) -> &PartialBudget {
        Engine::partial_budget(self)
    }
    fn append_latency(&self) -> (Vec<u64>, u64, f64) {
        Engine::append_latency(self)
    }
    fn set_topic_limits(&self, limits: TopicLimits) {
        Engine::set_topic_limits(self, limits)
    }
    fn set_not_stored(&self, words: NotStored) {
        Engine::set_not_stored(self, words)
    }
    fn io_threads(&self) -> usize {
        Engine::io_threads(self)
    }
    fn promote(
        &self,
        conn: u64,
        version: u8,
        subscriptions: &[(String, u8, u64)],
        adopt: Box<dyn FnOnce() -> Command + '_>,
    ) -> Result<bool, FilterError> {
        Engine::promote(self, conn, version, subscriptions, adopt)
    }
    fn promote_kept(
        &self,
        conn: u64,
        version: u8,
        subscriptions: &[(String, u8, u64)],
        adopt: Box<dyn FnOnce(bool) -> Command + '_>,
    ) -> Result<bool, FilterError> {
        Engine::promote_kept(self, conn, version, subscriptions, adopt)
    }
}

impl Carrier for RemoteEngine {
    fn send(&self, command: Command) {
        self.reactor.send(command)
    }
    fn handle(&self) -> Handle {
        self.reactor.handle()
    }
    fn wake_fd(&self) -> RawFd {
        self.woken.as_raw_fd()
    }
    fn clear_wake(&self) {
        let mut buf = [0u8; 256];
        while matches!(io::Read::read(&mut &self.woken, &mut buf), Ok(n) if n > 0) {}
    }
    fn take_reports(&self) -> Vec<Report> {
        self.sink
            .reports
            .lock()
            .map(|mut r| std::mem::take(&mut *r))
            .unwrap_or_default()
    }
    fn counters(&self) -> &Counters {
        self.reactor.handle_ref().counters()
    }
    fn partial_budget(&self) -> &PartialBudget {
        self.reactor.handle_ref().partial()
    }
    fn append_latency(&self) -> (Vec<u64>, u64, f64) {
        self.sink.latency.snapshot()
    }
    fn set_topic_limits(&self, limits: TopicLimits) {
        let (length, levels) = &self.sink.topic_limits;
        length.store(limits.max_length, Ordering::Relaxed);
        levels.store(limits.max_levels, Ordering::Relaxed);
    }
    fn set_not_stored(&self, words: NotStored) {
        if let Ok(mut w) = self.sink.not_stored.write() {
            *w = words;
        }
    }
    fn io_threads(&self) -> usize {
        self.reactor.threads()
    }
    /// Its subscriptions are carried from their positions (`readers`), wherever the
    /// queues end: each is pulled once from there.
    fn promote(
        &self,
        conn: u64,
        version: u8,
        subscriptions: &[(String, u8, u64)],
        adopt: Box<dyn FnOnce() -> Command + '_>,
    ) -> Result<bool, FilterError> {
        if subscriptions.is_empty() {
            self.reactor.send(adopt());
            return Ok(true);
        }
        for (filter, _, _) in subscriptions {
            crate::router::validate_filter(filter)?;
        }
        let queues = {
            let Ok(mut readers) = self.sink.readers.lock() else {
                return Ok(false);
            };
            // The adoption first, under the lock: no delivery to it goes before it.
            self.reactor.send(adopt());
            let queues = readers.promote(conn, version, subscriptions)?;
            self.sink.reading.store(1, Ordering::Relaxed);
            queues
        };
        self.sink.pull_all(queues);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inbound(topic: &str, payload: &[u8], qos: u8) -> Inbound {
        Inbound {
            conn: 1,
            client_id: Arc::from("dev-1"),
            topic: topic.into(),
            payload: payload.to_vec(),
            qos,
            packet_id: (qos > 0).then_some(7),
            ticket: (qos > 0).then_some(1),
        }
    }

    /// `pack_messages([Message("dev/1/t", b"hi", 1, client_id="dev-1", born_ts=1700000000000),
    /// Message("dev/1/u", b"", 0, client_id="dev-1", born_ts=1700000000000)])`, its
    /// metas as `encode_frame` writes the header (`dumps_json`: orjson, compact, keys in
    /// insertion order): made with store/protocol.py.
    const PY_HEADER: &str = concat!(
        r#"{"messages":[{"topic":"dev/1/t","size":2,"qos":1,"client_id":"dev-1","#,
        r#""born_ts":1700000000000},{"topic":"dev/1/u","size":0,"client_id":"dev-1","#,
        r#""born_ts":1700000000000}]}"#
    );

    #[test]
    fn a_pass_is_one_publish_laid_out_as_python_packs_it() {
        let batch = [inbound("dev/1/t", b"hi", 1), inbound("dev/1/u", b"", 0)];
        let (header, body) = publish_request(&batch, 1_700_000_000_000);
        assert_eq!(String::from_utf8(header).unwrap(), PY_HEADER);
        assert_eq!(body, b"hi");
    }

    #[test]
    fn reads_the_stores_results() {
        let f = Frame {
            kind: Kind::Response,
            code: PUBLISH,
            request_id: 3,
            header: br#"{"results":[{"phys":0,"store_ts":5,"rsize":90,"queues":[["dev/1/t",4]]}]}"#
                .to_vec(),
            body: Vec::new(),
        };
        assert_eq!(
            results_of(&f).unwrap(),
            vec![(0, 5, 90, vec![("dev/1/t".to_string(), 4)])]
        );
        let bad = Frame {
            header: br#"{"results":[{"phys":0}]}"#.to_vec(),
            ..f
        };
        assert_eq!(results_of(&bad), None);
        // The store's whole answer (msg_id too), a place not said, an escaped name.
        let again = Frame {
            header: br#"{"results":[{"msg_id":"-000000000000001","queues":[],"store_ts":5,"phys":-1,"rsize":90},{"msg_id":"000000000000002A","queues":[["a\"b\u00e9",1],["c",2]],"store_ts":6,"phys":42,"rsize":7}]}"#
                .to_vec(),
            ..bad
        };
        assert_eq!(
            results_of(&again).unwrap(),
            vec![
                (0, 5, 90, vec![]),
                (42, 6, 7, vec![("a\"b\u{e9}".to_string(), 1), ("c".to_string(), 2)])
            ]
        );
    }
}
