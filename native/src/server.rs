//! The store's native protocol server for the connections Python hands over
//! (`store/server.py`): Python accepts a connection and answers its HELLO (who it is);
//! one whose rights cover every request (authentication off, a node user, a super
//! user: what gateways use) is carried here from then on. Its PUBLISH frames are
//! validated, routed and appended through the engine (`engine::Appender`) and answered
//! here, in frame order, once written (and synced, under `--flush sync`); every other
//! request goes up to Python (`Up::Frame`) with its request id, and Python's answer is
//! written here (`Server::answer`).
//!
//! An append that goes up (a SEND, a PUBLISH with properties or anything this side does
//! not decide) holds the connection's next frames until it is answered: one
//! connection's messages are stored in the order they were sent, as in Python.
//!
//! Idempotent producers (`store/producers.py`): the sequence of a producer's publishes
//! (`PUBLISHES`) is checked here while a carried connection holds it. A connection's
//! first stamped PUBLISH asks Python (`Up::Claim`): Python checks the id is the
//! connection's user's and hands over what its table holds of the sequence
//! (`Server::claimed`). The sequence goes back to Python (`take_released`) when no
//! connection holding it is left, or when one of its frames must go up; Python's
//! snapshots of the table include what is held here (`producer_entries`). The records
//! carry the stamps (MARK_FIRST, `lg_producer`), so recovery rebuilds it all from the
//! log after a crash.
//!
//! A store group's master (`Server::hold`): an append made here is answered only once
//! Python says the in-sync set holds it (`Server::acked`, the group's acknowledged
//! offset), in append order, or failed after the ack timeout; while Python refuses
//! writes (`Server::refuse_writes`: no lease, no in-sync quorum, a full disk) PUBLISH
//! is refused here with Python's status and words; a master stepping down fails what
//! is held (`Server::fail_held`), as `Replication._fail_pending` fails Python's.
//!
//! Its replicas' REPL_FETCH (`fetch`): the steady case is answered here while Python
//! says this node is master (`Server::fetching`) and the replica's metadata is current
//! (`Server::meta`); a fetch at the log's end waits here (the long poll, with Python's
//! lazy/eager rule). Each fetch says how far its replica holds the log: with the rule
//! Python keeps (`Server::insync`: the replicas an acknowledgement waits for, whether
//! there are enough, the lease), the acknowledged offset is computed here the moment a
//! fetch arrives and the held answers go out at once; Python hears of the replicas'
//! positions in batches (`Up::Fetched`) and keeps its own count, pushing `acked` as
//! before (the larger of the two holds).

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token, Waker};
use serde_json::Value;

use crate::codec::wire::topic_name_problem;
use crate::engine::{AppendError, Appender, Dispatched, Message};
use crate::fetch::{self, Fetching, REPL_FETCH};
use crate::frame::{self, Decoder, Frame, Kind};

pub const HELLO: u16 = 1;
pub const SEND: u16 = 10;
pub const PUBLISH: u16 = 11;
/// The sequence of a producer's MQTT publishes (`store/producers.py` PUBLISHES).
pub const PUBLISHES: &str = "/";
/// Appends remembered per producer (`KEEP`): a duplicate of one gets its places.
pub const KEEP: usize = 5;
/// Places kept per remembered append for its duplicates' answers: a larger append's
/// duplicates are answered as stored, their places not said (phys -1), as Python does
/// for appends older than the ones it remembers.
pub const PLACES_KEPT: usize = 1024;
const MARK_FIRST: u8 = 0x02;
const MARK_MORE: u8 = 0x04;
const PRODUCER_PROP: &str = "lg_producer";
/// Requests of one connection with Python at once (`MAX_INFLIGHT_REQUESTS`): past it
/// the connection's next frames wait, and past `MAX_PARKED` of those it is not read.
pub const MAX_UP: usize = 64;
pub const MAX_PARKED: usize = 64;
/// Bytes of answers waiting for a connection's socket past which it is not read.
pub const MAX_UNSENT: usize = 8 << 20;
/// Bytes a connection's parked frames may hold past which it is not read.
pub const MAX_PARKED_BYTES: usize = 64 << 20;
const WAKER: Token = Token(usize::MAX);
const READ_CHUNK: usize = 64 * 1024;
/// A connection held back this long by the node's budget for partial frames is closed
/// (`NATIVE_PARTIAL_TIMEOUT_S`).
pub const PARTIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// Fetches waiting here at once; past it they go to Python.
pub const MAX_PARKED_FETCHES: usize = 1024;
/// How long the replicas' positions wait for other news to go up with.
pub const REPORT_EVERY: Duration = Duration::from_millis(2);

/// What goes up to Python.
#[derive(Debug, PartialEq, Eq)]
pub enum Up {
    /// A request Python answers (`Server::answer`).
    Frame {
        conn: u64,
        code: u16,
        request_id: u32,
        header: Vec<u8>,
        body: Vec<u8>,
    },
    /// May `conn` stamp its publishes with `producer`? (`Server::claimed` or `refuse`.)
    Claim {
        conn: u64,
        request_id: u32,
        producer: String,
    },
    /// The connection ended.
    Closed { conn: u64 },
    /// Appends were made here since the last time (held answers only: a store group's
    /// master, whose replicas' long polls Python wakes).
    Appended,
    /// Fetches answered here: each replica's last one.
    Fetched(Vec<FetchReport>),
}

/// A replica's fetch answered here, as `Replication._report` takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchReport {
    pub node: String,
    pub addr: String,
    pub offset: u64,
    pub meta_inc: String,
    pub meta_seq: u64,
}

/// Python's in-sync rule (`Server::insync`) and how far each replica holds the log (its
/// last fetch's offset), under one lock: the offset Python reads when a rule takes
/// effect is one no later release passes without the rule.
#[derive(Default)]
struct Replicas {
    rule: Option<Rule>,
    offsets: HashMap<String, u64>,
}

struct Rule {
    /// The replicas an acknowledgement waits for (the committed set's and the proposed).
    required: Vec<String>,
    /// The committed set has `min_insync` nodes.
    enough: bool,
    /// Until when the lease lasts (None: no controller, no end).
    lease_until: Option<std::time::Instant>,
}

/// A fetch waiting at the log's end.
struct ParkedFetch {
    conn: u64,
    ask: fetch::Ask,
    deadline: std::time::Instant,
    frame: Frame,
}

/// One remembered append of a producer: (epoch, first sequence, last, log offset of its
/// first record, of its end), as `store/producers.py`'s Batch.
pub type Batch = (u64, u64, u64, u64, u64);

/// Where one message went: (phys, store_ts, rsize, queues); phys -1: not said.
type Place = (i64, u64, u64, Vec<(String, u64)>);

/// A producer's sequence of publishes: its newest record's store time and its newest
/// appends, with their places while small enough (`PLACES_KEPT`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Entry {
    pub seen: u64,
    pub batches: Vec<Batch>,
    places: Vec<Option<Arc<Vec<Place>>>>,
}

impl Entry {
    pub fn new(seen: u64, batches: Vec<Batch>) -> Entry {
        let places = vec![None; batches.len()];
        Entry {
            seen,
            batches,
            places,
        }
    }

    fn push(&mut self, batch: Batch, seen: u64, places: Option<Arc<Vec<Place>>>) {
        self.batches.push(batch);
        self.places.push(places);
        if self.batches.len() > KEEP {
            let cut = self.batches.len() - KEEP;
            self.batches.drain(..cut);
            self.places.drain(..cut);
        }
        self.seen = self.seen.max(seen);
    }
}

/// A request's stamp: (producer, epoch, first sequence).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stamp {
    pub producer: String,
    pub epoch: u64,
    pub seq: u64,
}

/// How a request fits its producer's sequence: its first `skip` messages are stored
/// already (their places, if remembered); the rest is appended.
#[derive(Debug, PartialEq)]
pub struct Plan {
    pub skip: usize,
    places: Option<Vec<Place>>,
}

/// `ProducerTable.plan` for the publishes' sequence: a refusal is (409, why).
pub fn plan(entry: Option<&Entry>, st: &Stamp, count: usize) -> Result<Plan, (u16, String)> {
    let topic = "'/'";
    let Some(entry) = entry.filter(|e| !e.batches.is_empty()) else {
        if st.seq != 0 {
            return Err((
                409,
                format!(
                    "sequence gap: producer {} has sent nothing to {topic} that the store \
                     remembers, so its first sequence is 0, not {}",
                    st.producer, st.seq
                ),
            ));
        }
        return Ok(Plan {
            skip: 0,
            places: Some(Vec::new()),
        });
    };
    let (epoch, _, last, _, _) = entry.batches[entry.batches.len() - 1];
    if st.epoch < epoch {
        return Err((
            409,
            format!(
                "producer {} sends to {topic} under epoch {}, older than its epoch {epoch} \
                 there: a replaced writer is refused",
                st.producer, st.epoch
            ),
        ));
    }
    if st.epoch > epoch || st.seq == last + 1 {
        if st.epoch > epoch && st.seq != 0 {
            return Err((
                409,
                format!(
                    "sequence gap: a new epoch {} of producer {} on {topic} starts at \
                     sequence 0, not {}",
                    st.epoch, st.producer, st.seq
                ),
            ));
        }
        return Ok(Plan {
            skip: 0,
            places: Some(Vec::new()),
        });
    }
    if st.seq > last + 1 {
        return Err((
            409,
            format!(
                "sequence gap: producer {} on {topic} (epoch {epoch}) stored up to sequence \
                 {last}; {} would skip {}",
                st.producer,
                st.seq,
                st.seq - last - 1
            ),
        ));
    }
    let skip = (count as u64).min(last - st.seq + 1) as usize;
    Ok(Plan {
        skip,
        places: places_of(entry, st.epoch, st.seq, st.seq + skip as u64 - 1),
    })
}

/// The places of sequences [lo, hi] of `epoch`, if every one is remembered.
fn places_of(entry: &Entry, epoch: u64, lo: u64, hi: u64) -> Option<Vec<Place>> {
    let mut out = Vec::new();
    let mut next = lo;
    for (batch, places) in entry.batches.iter().zip(&entry.places) {
        let (b_epoch, first, last, _, _) = *batch;
        if b_epoch != epoch || last < next || first > hi {
            continue;
        }
        if first > next {
            return None;
        }
        let places = places.as_ref()?;
        let take = last.min(hi) - next + 1;
        let from = (next - first) as usize;
        out.extend_from_slice(places.get(from..from + take as usize)?);
        next += take;
        if next > hi {
            return Some(out);
        }
    }
    None
}

/// The producers' sequences held here, and those given back that Python has not taken.
#[derive(Default)]
struct Held {
    /// producer -> (its sequence, the connections that claimed it).
    table: HashMap<String, (Entry, Vec<u64>)>,
    released: Vec<(String, Entry)>,
    dirty: bool,
}

impl Held {
    fn holds(&self, producer: &str, conn: u64) -> bool {
        self.table
            .get(producer)
            .is_some_and(|(_, conns)| conns.contains(&conn))
    }

    /// Give `producer`'s sequence back to Python (every connection claims it again).
    fn release(&mut self, producer: &str) {
        if let Some((entry, _)) = self.table.remove(producer) {
            self.released.retain(|(p, _)| p != producer);
            self.released.push((producer.to_string(), entry));
            self.dirty = true;
        }
    }

    /// `conn` ended: the sequences nobody else holds go back.
    fn drop_conn(&mut self, conn: u64) {
        let mut gone = Vec::new();
        for (producer, (_, conns)) in self.table.iter_mut() {
            conns.retain(|c| *c != conn);
            if conns.is_empty() {
                gone.push(producer.clone());
            }
        }
        for producer in gone {
            self.release(&producer);
        }
    }
}

/// A PUBLISH this side appends: its messages and its stamp. None: it goes to Python
/// (anything this side does not decide: properties, odd types, a bad topic, ...).
pub fn native_publish(header: &Value, body: &[u8]) -> Option<(Vec<Message>, Option<Stamp>)> {
    let h = header.as_object()?;
    let metas = h.get("messages")?.as_array()?;
    if metas.is_empty() {
        return None;
    }
    let stamp = match h.get("producer") {
        None => None,
        Some(p) => Some(Stamp {
            producer: p.as_str()?.to_string(),
            epoch: match h.get("epoch") {
                None => 0,
                Some(e) => e.as_u64()?,
            },
            seq: h.get("seq")?.as_u64()?,
        }),
    };
    let mut msgs = Vec::with_capacity(metas.len());
    let mut pos = 0usize;
    for meta in metas {
        let m = meta.as_object()?;
        let topic = m.get("topic")?.as_str()?;
        if topic_name_problem(topic).is_some() {
            return None; // (Python says why)
        }
        let size = m.get("size")?.as_u64()? as usize;
        let end = pos.checked_add(size).filter(|e| *e <= body.len())?;
        let qos = match m.get("qos") {
            None => 0,
            Some(q) => q.as_u64().filter(|q| *q <= 2)? as u8,
        };
        let retain = match m.get("retain") {
            None => false,
            Some(r) => r.as_bool()?,
        };
        match m.get("props") {
            None | Some(Value::Null) => {}
            Some(Value::Object(o)) if o.is_empty() => {}
            Some(_) => return None,
        }
        let text = |name: &str| -> Option<String> {
            match m.get(name) {
                None => Some(String::new()),
                Some(v) => Some(v.as_str()?.to_string()),
            }
        };
        let born_ts = match m.get("born_ts") {
            None => 0,
            Some(b) => b.as_u64()?,
        };
        msgs.push(Message {
            born_ts,
            qos,
            retain,
            marks: 0,
            client_id: text("client_id")?,
            topic: topic.to_string(),
            key: text("key")?,
            properties: Vec::new(),
            body: body[pos..end].to_vec(),
            queues: Vec::new(),
        });
        pos = end;
    }
    if pos != body.len() {
        return None;
    }
    Some((msgs, stamp))
}

/// A PUBLISH header read typed, borrowing its strings (no map per message): what
/// `native_publish` reads, each field absent or of its type (null is not a value here).
#[derive(serde::Deserialize)]
struct PublishHeader<'a> {
    #[serde(borrow)]
    messages: Vec<PublishMeta<'a>>,
    #[serde(default, deserialize_with = "present", borrow)]
    producer: Option<Cow<'a, str>>,
    #[serde(default, deserialize_with = "present")]
    epoch: Option<u64>,
    #[serde(default, deserialize_with = "present")]
    seq: Option<u64>,
}

#[derive(serde::Deserialize)]
struct PublishMeta<'a> {
    #[serde(borrow)]
    topic: Cow<'a, str>,
    size: u64,
    #[serde(default, deserialize_with = "present")]
    qos: Option<u64>,
    #[serde(default, deserialize_with = "present")]
    retain: Option<bool>,
    #[serde(default)]
    props: Option<Value>,
    #[serde(default, deserialize_with = "present", borrow)]
    client_id: Option<Cow<'a, str>>,
    #[serde(default, deserialize_with = "present", borrow)]
    key: Option<Cow<'a, str>>,
    #[serde(default, deserialize_with = "present")]
    born_ts: Option<u64>,
}

/// A field that is there: its value, never null (`native_publish` refuses a null).
fn present<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de>,
{
    T::deserialize(d).map(Some)
}

/// `native_publish` from the header's bytes, read typed: None when that read fails or
/// the PUBLISH is not one this side appends (the caller then reads it as a map, which
/// decides, and says why). Some only where `native_publish` gives the same.
fn native_publish_fast(header: &[u8], body: &[u8]) -> Option<(Vec<Message>, Option<Stamp>)> {
    let h: PublishHeader<'_> = serde_json::from_slice(header).ok()?;
    if h.messages.is_empty() {
        return None;
    }
    let stamp = match h.producer {
        None => None,
        Some(p) => Some(Stamp {
            producer: p.into_owned(),
            epoch: h.epoch.unwrap_or(0),
            seq: h.seq?,
        }),
    };
    let mut msgs = Vec::with_capacity(h.messages.len());
    let mut pos = 0usize;
    for m in h.messages {
        if topic_name_problem(&m.topic).is_some() {
            return None;
        }
        let end = pos
            .checked_add(m.size as usize)
            .filter(|e| *e <= body.len())?;
        let qos = m.qos.unwrap_or(0);
        if qos > 2 {
            return None;
        }
        match &m.props {
            None | Some(Value::Null) => {}
            Some(Value::Object(o)) if o.is_empty() => {}
            Some(_) => return None,
        }
        msgs.push(Message {
            born_ts: m.born_ts.unwrap_or(0),
            qos: qos as u8,
            retain: m.retain.unwrap_or(false),
            marks: 0,
            client_id: m.client_id.map(Cow::into_owned).unwrap_or_default(),
            topic: m.topic.into_owned(),
            key: m.key.map(Cow::into_owned).unwrap_or_default(),
            properties: Vec::new(),
            body: body[pos..end].to_vec(),
            queues: Vec::new(),
        });
        pos = end;
    }
    if pos != body.len() {
        return None;
    }
    Some((msgs, stamp))
}

/// The producer a PUBLISH header names, if any (a frame that goes up gives it back).
fn producer_of(header: &Value) -> Option<&str> {
    header.get("producer")?.as_str()
}

/// The answer of a stored append (`_append_answer`): its `results`, JSON as orjson
/// writes it.
pub fn results_answer(code: u16, request_id: u32, places: &[Place]) -> Vec<u8> {
    let mut h = String::with_capacity(16 + places.len() * 112);
    h.push_str(r#"{"results":["#);
    for (i, (phys, store_ts, rsize, queues)) in places.iter().enumerate() {
        if i > 0 {
            h.push(',');
        }
        h.push_str(r#"{"msg_id":""#);
        push_msg_id(&mut h, *phys);
        h.push_str(r#"","queues":["#);
        for (j, (q, o)) in queues.iter().enumerate() {
            if j > 0 {
                h.push(',');
            }
            h.push('[');
            frame::push_json_str(&mut h, q);
            let _ = write!(h, ",{o}]");
        }
        let _ = write!(
            h,
            r#"],"store_ts":{store_ts},"phys":{phys},"rsize":{rsize}}}"#
        );
    }
    h.push_str("]}");
    encoded(Kind::Response, code, request_id, h.into_bytes())
}

/// `format_msg_id` into `out`: 16 hex digits (Python's format of -1 for a place not
/// said).
fn push_msg_id(out: &mut String, phys: i64) {
    let _ = if phys < 0 {
        write!(out, "-{:015X}", -phys)
    } else {
        write!(out, "{phys:016X}")
    };
}


/// An ERROR frame (`_error`).
pub fn error_answer(code: u16, request_id: u32, status: u16, message: &str) -> Vec<u8> {
    let text = serde_json::to_string(message).unwrap_or_else(|_| "\"\"".into());
    let header = format!(r#"{{"status":{status},"error":{text}}}"#);
    encoded(Kind::Error, code, request_id, header.into_bytes())
}

fn encoded(kind: Kind, code: u16, request_id: u32, header: Vec<u8>) -> Vec<u8> {
    let f = Frame {
        kind,
        code,
        request_id,
        header,
        body: Vec::new(),
    };
    frame::encode(&f).unwrap_or_default()
}

/// What a connection waits for before its next frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// The answer of an append Python makes.
    Answer(u32),
    /// Python's word on a producer claim; the frame waits in `claiming`.
    Claim(u32),
}

struct Conn {
    stream: TcpStream,
    decoder: Decoder,
    /// Answers not written yet, and how far the first is written.
    out: VecDeque<Vec<u8>>,
    out_pos: usize,
    unsent: usize,
    /// Requests with Python.
    up: usize,
    /// Bytes of this connection's answers held for the group's acknowledgement.
    held: usize,
    parked: VecDeque<Frame>,
    parked_bytes: usize,
    wait: Option<Wait>,
    claiming: Option<Frame>,
    readable: bool,
    /// The poll said the peer closed (or the socket failed): read to the end.
    hangup: bool,
    /// Answer what is queued, then close (a protocol error).
    closing: bool,
    /// The peer closed or the socket failed: end once nothing is left to do.
    ended: bool,
    /// Bytes of a partial frame counted in the node's budget, and since when the budget
    /// holds the connection back.
    partial: usize,
    held_back: Option<std::time::Instant>,
    /// Python allows it REPL_FETCH (a store node): answered here; else Python's.
    may_fetch: bool,
}

impl Conn {
    fn queue(&mut self, bytes: Vec<u8>) {
        if !bytes.is_empty() {
            self.unsent += bytes.len();
            self.out.push_back(bytes);
        }
    }

    fn may_read(&self) -> bool {
        !self.closing
            && !self.ended
            && self.unsent + self.held < MAX_UNSENT
            && self.parked.len() < MAX_PARKED
            && self.parked_bytes < MAX_PARKED_BYTES
    }
}

/// From Python to the server thread.
enum Down {
    Adopt {
        conn: u64,
        fd: OwnedFd,
        first: Vec<u8>,
        unread: Vec<u8>,
        may_fetch: bool,
    },
    Answer {
        conn: u64,
        bytes: Vec<u8>,
    },
    Claimed {
        conn: u64,
        producer: String,
        entry: Option<Entry>,
    },
    Refuse {
        conn: u64,
        bytes: Vec<u8>,
    },
    Close {
        conn: u64,
    },
    MayFetch {
        conn: u64,
        may: bool,
    },
    Hold(Duration),
    Acked(u64),
    RefuseWrites(Option<(u16, String)>),
    FailHeld(String),
    Fetching(Option<Arc<Fetching>>),
    Meta(String, u64),
    MetaOps(u64, Vec<Vec<u8>>),
}

/// An append's answer held until the group acknowledges `end` (or `deadline` passes).
struct HeldAnswer {
    end: u64,
    conn: u64,
    code: u16,
    request_id: u32,
    bytes: Vec<u8>,
    deadline: std::time::Instant,
}

/// The group's word on this master's appends (`Server::hold`).
#[derive(Default)]
struct Group {
    /// How long an answer is held at most (None: not a group's master, none held).
    timeout: Option<Duration>,
    acked: u64,
    refusal: Option<(u16, String)>,
    held: VecDeque<HeldAnswer>,
    /// A group's master replicating asynchronously: Python hears of appends
    /// (`Up::Appended`: they count as acknowledged at once). In sync mode it hears of the
    /// replicas' positions instead (`Up::Fetched`, every `REPORT_EVERY` at most): a wake
    /// of the interpreter per turn cost the master more than its native work.
    report: bool,
    /// An append was made since the last turn.
    appended: bool,
}

struct Shared {
    down: Mutex<Vec<Down>>,
    up: Mutex<Vec<Up>>,
    held: Mutex<Held>,
    /// A byte written here wakes Python: `Up` items wait.
    wake: UnixStream,
    stopping: AtomicBool,
    /// Python's in-sync rule, the replicas' offsets, and the acknowledged offset (raised
    /// under their lock).
    replicas: Mutex<Replicas>,
    acked: AtomicU64,
    /// Fetches answered here.
    fetches: AtomicU64,
}

impl Shared {
    fn send_up(&self, items: Vec<Up>) {
        if items.is_empty() {
            return;
        }
        if let Ok(mut up) = self.up.lock() {
            up.extend(items);
        }
        let _ = (&self.wake).write(&[1]);
    }
}

/// The server: its thread and Python's handles on it.
pub struct Server {
    shared: Arc<Shared>,
    waker: Arc<Waker>,
    /// Taken by `stop` (from `&self`: other threads go on calling while it joins).
    thread: Mutex<Option<JoinHandle<()>>>,
    woken: UnixStream,
    next_conn: Mutex<u64>,
}

impl Server {
    pub fn start(appender: Appender) -> io::Result<Server> {
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let (wake, woken) = UnixStream::pair()?;
        wake.set_nonblocking(true)?;
        woken.set_nonblocking(true)?;
        let shared = Arc::new(Shared {
            down: Mutex::new(Vec::new()),
            up: Mutex::new(Vec::new()),
            held: Mutex::new(Held::default()),
            wake,
            stopping: AtomicBool::new(false),
            replicas: Mutex::new(Replicas::default()),
            acked: AtomicU64::new(0),
            fetches: AtomicU64::new(0),
        });
        let mut looped = Loop {
            poll,
            shared: Arc::clone(&shared),
            appender,
            conns: HashMap::new(),
            group: Group::default(),
            up: Vec::new(),
            buf: vec![0u8; READ_CHUNK],
            fetching: None,
            meta: fetch::MetaOps::default(),
            parked_fetches: Vec::new(),
            reports: Vec::new(),
            reports_since: None,
            segment: fetch::Segment::default(),
            dirty: false,
        };
        let thread = std::thread::Builder::new()
            .name("store-native".into())
            .spawn(move || looped.run())?;
        Ok(Server {
            shared,
            waker,
            thread: Mutex::new(Some(thread)),
            woken,
            next_conn: Mutex::new(1),
        })
    }

    fn down(&self, item: Down) {
        if let Ok(mut d) = self.shared.down.lock() {
            d.push(item);
        }
        let _ = self.waker.wake();
    }

    /// Carry a connection Python authenticated: `first`, what it is sent first (the
    /// HELLO's answer); `unread`, what Python read of it past the HELLO. Its id. Its
    /// REPL_FETCH goes to Python (`adopt_fetching`: a store node's, answered here).
    pub fn adopt(&self, fd: OwnedFd, first: Vec<u8>, unread: Vec<u8>) -> u64 {
        self.adopt_fetching(fd, first, unread, false)
    }

    /// `adopt`; `may_fetch`: Python allows it REPL_FETCH (a store node of the group).
    pub fn adopt_fetching(
        &self,
        fd: OwnedFd,
        first: Vec<u8>,
        unread: Vec<u8>,
        may_fetch: bool,
    ) -> u64 {
        let conn = match self.next_conn.lock() {
            Ok(mut n) => {
                *n += 1;
                *n - 1
            }
            Err(_) => 0,
        };
        self.down(Down::Adopt {
            conn,
            fd,
            first,
            unread,
            may_fetch,
        });
        conn
    }

    /// Python's answer of a request that went up (a whole frame).
    pub fn answer(&self, conn: u64, bytes: Vec<u8>) {
        self.down(Down::Answer { conn, bytes });
    }

    /// `conn` may stamp with `producer`: what Python's table holds of its sequence.
    pub fn claimed(&self, conn: u64, producer: String, entry: Option<Entry>) {
        self.down(Down::Claimed {
            conn,
            producer,
            entry,
        });
    }

    /// The claim's frame is refused with this answer (an ERROR frame).
    /// (Python's refusal of a producer id: the frame is not appended.)
    pub fn refuse(&self, conn: u64, bytes: Vec<u8>) {
        self.down(Down::Refuse { conn, bytes });
    }

    /// Whether Python allows `conn` REPL_FETCH from its next frame on (a HELLO proved
    /// the group secret since it was adopted).
    pub fn may_fetch(&self, conn: u64, may: bool) {
        self.down(Down::MayFetch { conn, may });
    }

    /// Close `conn` once what is queued for it is written.
    pub fn close(&self, conn: u64) {
        self.down(Down::Close { conn });
    }

    /// A store group's master: each append's answer waits for `acked` to reach its
    /// end, or fails after `timeout` (zero: answered at once, asynchronous replication,
    /// and Python hears of appends: `Up::Appended`).
    pub fn hold(&self, timeout: Duration) {
        self.down(Down::Hold(timeout));
    }

    /// The group holds the log up to `offset`: the answers held to there go out.
    pub fn acked(&self, offset: u64) {
        self.down(Down::Acked(offset));
    }

    /// PUBLISH is refused with (status, message) from now on (None: taken again).
    pub fn refuse_writes(&self, refusal: Option<(u16, String)>) {
        self.down(Down::RefuseWrites(refusal));
    }

    /// Every held answer fails (503, `why`): this node stopped being master.
    pub fn fail_held(&self, why: String) {
        self.down(Down::FailHeld(why));
    }

    /// This node is master (`Some`): the steady fetches are answered here; None: every
    /// fetch goes to Python, the waiting ones too.
    pub fn fetching(&self, fetching: Option<Fetching>) {
        self.down(Down::Fetching(fetching.map(Arc::new)));
    }

    /// The metadata change log's incarnation and sequence: a fetch at a position not
    /// kept here goes to Python (it has the ops); the waiting ones it moves are answered.
    pub fn meta(&self, incarnation: String, seq: u64) {
        self.down(Down::Meta(incarnation, seq));
    }

    /// Metadata ops recorded from sequence `first` on, each as Python's JSON of it.
    pub fn meta_ops(&self, first: u64, ops: Vec<Vec<u8>>) {
        self.down(Down::MetaOps(first, ops));
    }

    /// Python's in-sync rule from now on (`lease`: how long the lease lasts, None: no
    /// end; zero: none). The acknowledged offset when it took effect (every offset
    /// acknowledged after it waits for `required`), and how far each of `required`
    /// holds the log as its fetches said here.
    pub fn insync(
        &self,
        required: Vec<String>,
        enough: bool,
        lease: Option<Duration>,
    ) -> (u64, Vec<(String, u64)>) {
        let lease_until = lease.map(|d| std::time::Instant::now() + d);
        let out = match self.shared.replicas.lock() {
            Ok(mut r) => {
                let held = required
                    .iter()
                    .filter_map(|n| r.offsets.get(n).map(|o| (n.clone(), *o)))
                    .collect();
                r.rule = Some(Rule {
                    required,
                    enough,
                    lease_until,
                });
                (self.shared.acked.load(Ordering::Acquire), held)
            }
            Err(_) => (u64::MAX, Vec::new()),
        };
        let _ = self.waker.wake(); // (the rule may release what is held)
        out
    }

    /// The acknowledged offset, as far as this side knows.
    pub fn acked_offset(&self) -> u64 {
        self.shared.acked.load(Ordering::Acquire)
    }

    /// Fetches answered here since the start.
    pub fn fetches(&self) -> u64 {
        self.shared.fetches.load(Ordering::Relaxed)
    }

    /// Readable while `take_up` has something.
    pub fn wake_fd(&self) -> RawFd {
        self.woken.as_raw_fd()
    }

    pub fn clear_wake(&self) {
        let mut buf = [0u8; 256];
        while matches!(Read::read(&mut &self.woken, &mut buf), Ok(n) if n > 0) {}
    }

    pub fn take_up(&self) -> Vec<Up> {
        self.shared
            .up
            .lock()
            .map(|mut u| std::mem::take(&mut *u))
            .unwrap_or_default()
    }

    /// The sequences given back since the last call (Python's table takes them).
    pub fn take_released(&self) -> Vec<(String, Entry)> {
        self.shared
            .held
            .lock()
            .map(|mut h| std::mem::take(&mut h.released))
            .unwrap_or_default()
    }

    /// Every sequence held here or given back and not taken, and whether any changed
    /// since the last call: Python's snapshot of its table adds them. Taken under the
    /// lock the appends hold from their check to their table's update, so every
    /// append written before the call is in it.
    pub fn producer_entries(&self) -> (bool, Vec<(String, Entry)>) {
        let Ok(mut h) = self.shared.held.lock() else {
            return (false, Vec::new());
        };
        let dirty = std::mem::take(&mut h.dirty);
        let mut out: Vec<(String, Entry)> = h.released.clone();
        out.extend(h.table.iter().map(|(p, (e, _))| (p.clone(), e.clone())));
        (dirty, out)
    }

    /// Stop the thread; the connections close.
    pub fn stop(&self) {
        self.shared.stopping.store(true, Ordering::Release);
        let _ = self.waker.wake();
        let thread = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Loop {
    poll: Poll,
    shared: Arc<Shared>,
    appender: Appender,
    conns: HashMap<u64, Conn>,
    group: Group,
    /// What goes up at the end of this turn (one wake-up for all of it).
    up: Vec<Up>,
    /// Every read's buffer (one, not one zeroed per read).
    buf: Vec<u8>,
    /// The master's side of replication, as Python says it (None: fetches go up).
    fetching: Option<Arc<Fetching>>,
    /// The metadata change log's position and newest ops.
    meta: fetch::MetaOps,
    parked_fetches: Vec<ParkedFetch>,
    /// The replicas' fetches answered here, for Python (the last of each), and since
    /// when the first waits.
    reports: Vec<FetchReport>,
    reports_since: Option<std::time::Instant>,
    segment: fetch::Segment,
    /// A fetch, an append or Python's word may release answers or wake fetches.
    dirty: bool,
}

impl Loop {
    fn run(&mut self) {
        let mut events = Events::with_capacity(256);
        let mut paced = false;
        while !self.shared.stopping.load(Ordering::Acquire) {
            let mut timeout = paced.then(|| Duration::from_millis(1));
            let now = std::time::Instant::now();
            let deadlines = self
                .group
                .held
                .front()
                .map(|h| h.deadline)
                .into_iter()
                .chain(self.parked_fetches.iter().map(|p| p.deadline))
                .chain(self.reports_since.map(|t| t + REPORT_EVERY));
            for deadline in deadlines {
                let left = deadline.saturating_duration_since(now);
                timeout = Some(timeout.map_or(left, |t| t.min(left)));
            }
            if self.dirty {
                timeout = Some(Duration::ZERO);
            }
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                break;
            }
            let mut touched: Vec<u64> = Vec::new();
            for ev in events.iter() {
                if ev.token() == WAKER {
                    continue;
                }
                let id = ev.token().0 as u64;
                if let Some(c) = self.conns.get_mut(&id) {
                    if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                        c.readable = true;
                    }
                    c.hangup |= ev.is_read_closed() || ev.is_error();
                    touched.push(id);
                }
            }
            touched.extend(self.commands());
            touched.extend(self.expire_held());
            // Every connection that may have work: readable ones, ones an answer or a
            // claim resumed, and those paced to the dispatch last turn.
            if paced {
                touched.extend(self.conns.keys().copied());
            }
            touched.sort_unstable();
            touched.dedup();
            paced = false;
            for id in touched {
                paced |= self.turn(id);
            }
            // Releases and fetch answers once every connection is back in the map (a
            // turn holds its own out of it); their connections' answers written.
            self.dirty |= self.group.appended;
            for _ in 0..3 {
                if !self.dirty && self.parked_fetches.is_empty() {
                    break;
                }
                let ids = self.settle();
                if ids.is_empty() {
                    break;
                }
                for id in ids {
                    paced |= self.turn(id);
                }
            }
            let appended = std::mem::take(&mut self.group.appended);
            if appended && self.group.report {
                self.up.push(Up::Appended);
            }
            self.report_up();
            let up = std::mem::take(&mut self.up);
            self.shared.send_up(up);
        }
        let ids: Vec<u64> = self.conns.keys().copied().collect();
        for id in ids {
            self.end(id);
        }
        let up = std::mem::take(&mut self.up);
        self.shared.send_up(up);
    }

    /// Python's commands; the connections they concern.
    fn commands(&mut self) -> Vec<u64> {
        let items = self
            .shared
            .down
            .lock()
            .map(|mut d| std::mem::take(&mut *d))
            .unwrap_or_default();
        let mut ids = Vec::with_capacity(items.len());
        for item in items {
            match item {
                Down::Adopt {
                    conn,
                    fd,
                    first,
                    unread,
                    may_fetch,
                } => {
                    if self.adopt(conn, fd, first, unread, may_fetch).is_err() {
                        self.up.push(Up::Closed { conn });
                        continue;
                    }
                    ids.push(conn);
                }
                Down::Answer { conn, bytes } => {
                    let Some(c) = self.conns.get_mut(&conn) else {
                        continue;
                    };
                    let rid = answer_id(&bytes);
                    c.up = c.up.saturating_sub(1);
                    if c.wait == Some(Wait::Answer(rid)) {
                        c.wait = None;
                    }
                    c.queue(bytes);
                    ids.push(conn);
                }
                Down::Claimed {
                    conn,
                    producer,
                    entry,
                } => {
                    if let Some(c) = self.conns.get_mut(&conn) {
                        c.up = c.up.saturating_sub(1);
                        if let Ok(mut held) = self.shared.held.lock() {
                            // What is held here is newer than Python's word, and so is
                            // what was given back since Python took the last of it.
                            let given_back = held
                                .released
                                .iter()
                                .position(|(p, _)| *p == producer)
                                .map(|i| held.released.remove(i).1);
                            let slot = held.table.entry(producer).or_insert_with(|| {
                                (given_back.or(entry).unwrap_or_default(), Vec::new())
                            });
                            if !slot.1.contains(&conn) {
                                slot.1.push(conn);
                            }
                        }
                        c.wait = None;
                        if let Some(f) = c.claiming.take() {
                            c.parked.push_front(f);
                        }
                        ids.push(conn);
                    }
                }
                Down::Refuse { conn, bytes } => {
                    if let Some(c) = self.conns.get_mut(&conn) {
                        c.up = c.up.saturating_sub(1);
                        c.wait = None;
                        c.claiming = None;
                        c.queue(bytes);
                        ids.push(conn);
                    }
                }
                Down::MayFetch { conn, may } => {
                    if let Some(c) = self.conns.get_mut(&conn) {
                        c.may_fetch = may;
                    }
                }
                Down::Close { conn } => {
                    if let Some(c) = self.conns.get_mut(&conn) {
                        c.closing = true; // (what is queued goes first)
                        ids.push(conn);
                    }
                }
                Down::Hold(timeout) => {
                    self.group.report = timeout.is_zero();
                    self.group.timeout = (!timeout.is_zero()).then_some(timeout);
                }
                Down::Acked(offset) => {
                    if offset > self.group.acked {
                        self.group.acked = offset;
                        self.shared.acked.fetch_max(offset, Ordering::AcqRel);
                        self.dirty = true;
                    }
                    ids.extend(self.release_held());
                }
                Down::Fetching(f) => {
                    self.fetching = f;
                    self.dirty = true;
                }
                Down::Meta(inc, seq) => {
                    self.meta.position(inc, seq);
                    self.dirty = true;
                }
                Down::MetaOps(first, ops) => {
                    self.meta.record(first, ops);
                    self.dirty = true;
                }
                Down::RefuseWrites(refusal) => self.group.refusal = refusal,
                Down::FailHeld(why) => ids.extend(self.fail_held(503, &why)),
            }
        }
        ids
    }

    fn adopt(
        &mut self,
        conn: u64,
        fd: OwnedFd,
        first: Vec<u8>,
        unread: Vec<u8>,
        may_fetch: bool,
    ) -> io::Result<()> {
        let std_stream = std::net::TcpStream::from(fd);
        std_stream.set_nonblocking(true)?;
        let _ = std_stream.set_nodelay(true);
        let mut stream = TcpStream::from_std(std_stream);
        self.poll.registry().register(
            &mut stream,
            Token(conn as usize),
            Interest::READABLE | Interest::WRITABLE,
        )?;
        let mut c = Conn {
            stream,
            decoder: Decoder::new(frame::MAX_FRAME),
            out: VecDeque::new(),
            out_pos: 0,
            unsent: 0,
            up: 0,
            held: 0,
            parked: VecDeque::new(),
            parked_bytes: 0,
            wait: None,
            claiming: None,
            readable: true,
            hangup: false,
            closing: false,
            ended: false,
            partial: 0,
            held_back: None,
            may_fetch,
        };
        c.queue(first);
        match c.decoder.feed(&unread) {
            Ok(frames) => {
                for f in frames {
                    c.parked_bytes += f.header.len() + f.body.len();
                    c.parked.push_back(f);
                }
            }
            Err(e) => protocol_error(&mut c, &e.to_string()),
        }
        self.conns.insert(conn, c);
        Ok(())
    }

    /// One connection's work: parked frames, reads, writes. Whether it waits for the
    /// dispatch (appends paced to it).
    fn turn(&mut self, id: u64) -> bool {
        let Some(mut c) = self.conns.remove(&id) else {
            return false;
        };
        let paced = loop {
            let paced = self.run_parked(id, &mut c);
            // Answers out before the next read: their room is what lets it read again
            // (edge-triggered, a socket left unread gives no second readiness).
            if flush(&mut c).is_err() {
                c.ended = true;
                c.out.clear();
            }
            if paced || !c.readable || !c.may_read() {
                break paced;
            }
            let size = match self.appender.partial() {
                Some(budget) if budget.must_wait(c.partial) => {
                    let since = *c.held_back.get_or_insert_with(std::time::Instant::now);
                    if since.elapsed() >= PARTIAL_TIMEOUT {
                        protocol_error(
                            &mut c,
                            "a partial frame held while the store's read budget was \
                             exhausted (--native-max-partial-bytes)",
                        );
                        continue;
                    }
                    break true; // (looked at again in a moment)
                }
                Some(budget) => budget.read_size(c.partial, READ_CHUNK),
                None => READ_CHUNK,
            };
            c.held_back = None;
            let buf = &mut self.buf[..size.min(READ_CHUNK)];
            let asked = buf.len();
            match c.stream.read(buf) {
                Ok(0) => {
                    c.ended = true;
                    c.readable = false;
                }
                Ok(n) => {
                    // A short read drained the socket: what comes next is a new edge
                    // (not read again to hear it say so: a syscall a frame, and at a
                    // fleet's pace a frame a wake-up). Unless the peer closed: its
                    // end is read, whatever is short.
                    if n < asked && !c.hangup {
                        c.readable = false;
                    }
                    match c.decoder.feed(&buf[..n]) {
                        Ok(frames) => {
                            for f in frames {
                                c.parked_bytes += f.header.len() + f.body.len();
                                c.parked.push_back(f);
                            }
                        }
                        Err(e) => protocol_error(&mut c, &e.to_string()),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => c.readable = false,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    c.ended = true;
                    c.readable = false;
                    c.out.clear();
                }
            }
        };
        self.count_partial(&mut c);
        if flush(&mut c).is_err() {
            c.ended = true;
            c.out.clear();
        }
        let done = (c.closing && c.out.is_empty()) || c.ended;
        self.conns.insert(id, c);
        if done {
            self.end(id);
        }
        paced
    }

    /// Handle the frames that wait, in order, until one makes the connection wait.
    /// Whether the appends are paced to the dispatch.
    fn run_parked(&mut self, id: u64, c: &mut Conn) -> bool {
        while c.wait.is_none() && !c.closing {
            let Some(f) = c.parked.front() else {
                return false;
            };
            if f.kind == Kind::Request && f.code == PUBLISH && self.appender.behind() {
                return true;
            }
            if c.up >= MAX_UP && !(f.kind == Kind::Request && f.code == PUBLISH) {
                return false; // (an answer resumes it)
            }
            let Some(f) = c.parked.pop_front() else {
                return false;
            };
            c.parked_bytes = c.parked_bytes.saturating_sub(f.header.len() + f.body.len());
            self.on_frame(id, c, f);
        }
        false
    }

    fn on_frame(&mut self, id: u64, c: &mut Conn, f: Frame) {
        if f.kind != Kind::Request {
            return; // (Python ignores them too)
        }
        // The usual PUBLISH, read typed; anything else (or a doubt) is read as a map.
        let f = match (f.code == PUBLISH)
            .then(|| native_publish_fast(&f.header, &f.body))
            .flatten()
        {
            Some((msgs, stamp)) => {
                let producer = stamp.as_ref().map(|s| s.producer.clone());
                let Some(f) = self.publish(id, c, f, msgs, stamp) else {
                    return;
                };
                // (its producer given back: Python answers it, from a whole table)
                if let Some(p) = producer {
                    if let Ok(mut held) = self.shared.held.lock() {
                        held.release(&p);
                    }
                }
                return self.up_frame(id, c, f);
            }
            None => f,
        };
        let header: Value = if f.header.is_empty() {
            Value::Object(Default::default())
        } else {
            match serde_json::from_slice(&f.header) {
                Ok(v @ Value::Object(_)) => v,
                Ok(_) => return protocol_error(c, "header must be a JSON object"),
                Err(e) => return protocol_error(c, &format!("bad header JSON: {e}")),
            }
        };
        let f = if f.code == REPL_FETCH && c.may_fetch {
            match self.fetch(id, c, &header, f) {
                None => return,
                Some(f) => f,
            }
        } else if f.code == PUBLISH {
            let f = match native_publish(&header, &f.body) {
                Some((msgs, stamp)) => match self.publish(id, c, f, msgs, stamp) {
                    None => return,
                    Some(f) => f, // (its producer given back: Python answers it)
                },
                None => f,
            };
            if let Some(p) = producer_of(&header) {
                if let Ok(mut held) = self.shared.held.lock() {
                    held.release(p); // Python checks this one: its table must be whole
                }
            }
            f
        } else {
            f
        };
        self.up_frame(id, c, f);
    }

    /// A request up to Python; an append holds the connection's next frames.
    fn up_frame(&mut self, id: u64, c: &mut Conn, f: Frame) {
        let append = f.code == PUBLISH || f.code == SEND || f.code == HELLO;
        if append {
            c.wait = Some(Wait::Answer(f.request_id));
        }
        c.up += 1;
        self.up.push(Up::Frame {
            conn: id,
            code: f.code,
            request_id: f.request_id,
            header: f.header,
            body: f.body,
        });
    }

    /// A PUBLISH appended here; the frame back if Python must answer it (a duplicate
    /// whose places are not remembered here: Python reads them from the log).
    fn publish(
        &mut self,
        id: u64,
        c: &mut Conn,
        f: Frame,
        msgs: Vec<Message>,
        stamp: Option<Stamp>,
    ) -> Option<Frame> {
        if let Some((status, why)) = &self.group.refusal {
            c.queue(error_answer(f.code, f.request_id, *status, why));
            return None;
        }
        let Some(st) = stamp else {
            match self.appender.publish(&msgs) {
                Ok(rows) => {
                    let out = places(rows);
                    self.group.appended = true;
                    let answer = results_answer(f.code, f.request_id, &out);
                    self.answer_append(c, id, &f, end_of_places(&out), answer);
                }
                Err(e) => c.queue(append_error(f.code, f.request_id, &e)),
            }
            return None;
        };
        let Ok(mut held) = self.shared.held.lock() else {
            c.queue(error_answer(f.code, f.request_id, 500, "internal error"));
            return None;
        };
        if !held.holds(&st.producer, id) {
            drop(held);
            c.wait = Some(Wait::Claim(f.request_id));
            c.up += 1;
            self.up.push(Up::Claim {
                conn: id,
                request_id: f.request_id,
                producer: st.producer.clone(),
            });
            c.claiming = Some(f);
            return None;
        }
        // From the check to the table's update under `held`: Python's snapshot of the
        // table (`producer_entries`) sees every append written before it.
        let entry = held.table.get(&st.producer).map(|(e, _)| e);
        let plan = match plan(entry, &st, msgs.len()) {
            Ok(p) => p,
            Err((status, why)) => {
                c.queue(error_answer(f.code, f.request_id, status, &why));
                return None;
            }
        };
        let Some(mut out) = plan.places else {
            held.release(&st.producer);
            return Some(f);
        };
        let mut fresh = msgs;
        fresh.drain(..plan.skip);
        mark(&mut fresh, &st, plan.skip as u64);
        if !fresh.is_empty() {
            match self.appender.publish(&fresh) {
                Ok(rows) => {
                    let (first, last) = (&rows[0], &rows[rows.len() - 1]);
                    let seq = st.seq + plan.skip as u64;
                    let batch = (
                        st.epoch,
                        seq,
                        seq + rows.len() as u64 - 1,
                        first.phys_offset,
                        last.phys_offset + u64::from(last.size),
                    );
                    let store_ts = first.store_ts;
                    let new = places(rows);
                    let kept = (new.len() <= PLACES_KEPT).then(|| Arc::new(new.clone()));
                    if let Some((e, _)) = held.table.get_mut(&st.producer) {
                        e.push(batch, store_ts, kept);
                    }
                    held.dirty = true;
                    self.group.appended = true;
                    out.extend(new);
                }
                Err(e) => {
                    c.queue(append_error(f.code, f.request_id, &e));
                    return None;
                }
            }
        }
        drop(held);
        let answer = results_answer(f.code, f.request_id, &out);
        self.answer_append(c, id, &f, end_of_places(&out), answer);
        None
    }

    /// A replica's REPL_FETCH: answered here, waiting here, or back (Python's).
    fn fetch(&mut self, id: u64, c: &mut Conn, header: &Value, f: Frame) -> Option<Frame> {
        let Some(conf) = self.fetching.clone() else {
            return Some(f);
        };
        let Some(ask) = fetch::ask(header) else {
            return Some(f);
        };
        if ask.epoch > conf.epoch {
            return Some(f);
        }
        let end = self.appender.write_pos();
        if let Ok(mut r) = self.shared.replicas.lock() {
            if ask.first || ask.offset > end {
                // Where it forked is Python's to say: its offset counts once it fetches on.
                r.offsets.remove(&ask.node);
                return Some(f);
            }
            // It holds the log to here (checked against this log by its connection's
            // first fetch): acknowledgements may move.
            r.offsets.insert(ask.node.clone(), ask.offset);
        }
        // Its answer carries the read limit this fetch moved (as Python's reports it
        // first); the held answers go out once every connection is back (`settle`).
        self.raise_acked();
        self.dirty = true;
        if !ask.steady
            || ask.max_bytes > fetch::FETCH_MAX_BYTES
            || !self.meta_covered(&ask)
            || ask.offset < self.appender.active_base()
        {
            return Some(f);
        }
        let limit = conf.sync.then_some(self.group.acked);
        if ask.offset >= end
            && ask.wait_ms > 0
            && self.meta_current(&ask)
            && (limit.is_none() || ask.lazy || ask.confirmed == limit)
            && self.parked_fetches.len() < MAX_PARKED_FETCHES
        {
            self.report(&ask);
            let deadline = std::time::Instant::now() + Duration::from_millis(ask.wait_ms);
            self.parked_fetches.push(ParkedFetch {
                conn: id,
                ask,
                deadline,
                frame: f,
            });
            return None;
        }
        match self.fetch_answer(&conf, &ask, f.request_id) {
            Some(bytes) => {
                self.report(&ask);
                c.queue(bytes);
                None
            }
            None => Some(f),
        }
    }

    /// Whether its metadata is current (it may wait), or behind by ops kept here.
    fn meta_current(&self, ask: &fetch::Ask) -> bool {
        ask.meta_inc == self.meta.inc && ask.meta_seq == self.meta.seq()
    }

    fn meta_covered(&self, ask: &fetch::Ask) -> bool {
        self.meta.covers(&ask.meta_inc, ask.meta_seq)
    }

    /// Python hears of this fetch (the replica's last one counts).
    fn report(&mut self, ask: &fetch::Ask) {
        let r = FetchReport {
            node: ask.node.clone(),
            addr: ask.addr.clone(),
            offset: ask.offset,
            meta_inc: ask.meta_inc.clone(),
            meta_seq: ask.meta_seq,
        };
        match self.reports.iter_mut().find(|x| x.node == r.node) {
            Some(x) => *x = r,
            None => self.reports.push(r),
        }
        self.reports_since
            .get_or_insert_with(std::time::Instant::now);
    }

    /// The replicas' positions go up with other news, or once `REPORT_EVERY` passed.
    fn report_up(&mut self) {
        let Some(since) = self.reports_since else {
            return;
        };
        if self.up.is_empty() && since.elapsed() < REPORT_EVERY {
            return;
        }
        self.reports_since = None;
        self.up.push(Up::Fetched(std::mem::take(&mut self.reports)));
    }

    /// The answer of a fetch (None: Python's to answer).
    fn fetch_answer(&mut self, conf: &Fetching, ask: &fetch::Ask, rid: u32) -> Option<Vec<u8>> {
        let end = self.appender.write_pos();
        let base = self.appender.active_base();
        let (data, base) =
            self.segment
                .read_raw(&conf.dir, base, end, ask.offset, ask.max_bytes)?;
        let limit = conf.sync.then_some(self.group.acked);
        let meta = self.meta.since(ask.meta_seq);
        let header = fetch::header(end, base, conf, limit, &meta);
        let bytes = frame::encode(&Frame {
            kind: Kind::Response,
            code: REPL_FETCH,
            request_id: rid,
            header,
            body: data,
        })
        .ok()?;
        self.shared.fetches.fetch_add(1, Ordering::Relaxed);
        Some(bytes)
    }

    /// The acknowledged offset by Python's rule and the replicas' fetches (raised
    /// only: the answers held to it go out in `settle`).
    fn raise_acked(&mut self) {
        let end = self.appender.write_pos();
        let Ok(reps) = self.shared.replicas.lock() else {
            return;
        };
        let Some(r) = reps.rule.as_ref() else {
            return;
        };
        if !r.enough
            || r.lease_until
                .is_some_and(|t| std::time::Instant::now() >= t)
        {
            return;
        }
        let ack = r
            .required
            .iter()
            .fold(end, |a, n| a.min(reps.offsets.get(n).copied().unwrap_or(0)));
        if ack > self.group.acked {
            self.group.acked = ack;
            self.shared.acked.fetch_max(ack, Ordering::AcqRel);
        }
    }

    /// Releases by the replicas' positions, and the waiting fetches that may be
    /// answered now (new bytes; a new read limit unless lazy; metadata moved; this node
    /// no longer master: up to Python; their time is up). The connections touched.
    fn settle(&mut self) -> Vec<u64> {
        self.dirty = false;
        self.raise_acked();
        let mut ids = self.release_held();
        if self.parked_fetches.is_empty() {
            return ids;
        }
        let now = std::time::Instant::now();
        let end = self.appender.write_pos();
        let acked = self.group.acked;
        let parked = std::mem::take(&mut self.parked_fetches);
        for p in parked {
            if !self.conns.contains_key(&p.conn) {
                continue;
            }
            let conf = match &self.fetching {
                Some(conf) if self.meta_covered(&p.ask) => Arc::clone(conf),
                _ => {
                    // Not master any more, or its metadata moved past what is kept
                    // here: Python answers it.
                    self.fetch_up(p.conn, p.frame);
                    continue;
                }
            };
            let new_limit = conf.sync && !p.ask.lazy && p.ask.confirmed != Some(acked);
            if end <= p.ask.offset && !new_limit && self.meta_current(&p.ask) && now < p.deadline {
                self.parked_fetches.push(p);
                continue;
            }
            match self.fetch_answer(&conf, &p.ask, p.frame.request_id) {
                Some(bytes) => {
                    if let Some(c) = self.conns.get_mut(&p.conn) {
                        c.queue(bytes);
                    }
                }
                None => self.fetch_up(p.conn, p.frame),
            }
            ids.push(p.conn);
        }
        ids
    }

    /// A parked fetch goes up to Python after all (a fetch holds no later frames of its
    /// connection, unlike an append: `up_frame`).
    fn fetch_up(&mut self, conn: u64, f: Frame) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.up += 1;
        }
        self.up.push(Up::Frame {
            conn,
            code: f.code,
            request_id: f.request_id,
            header: f.header,
            body: f.body,
        });
    }

    /// An append's answer: out now, or held until the group acknowledges `end`.
    fn answer_append(&mut self, c: &mut Conn, id: u64, f: &Frame, end: u64, bytes: Vec<u8>) {
        let g = &mut self.group;
        match g.timeout {
            Some(timeout) if end > g.acked => {
                c.held += bytes.len();
                g.held.push_back(HeldAnswer {
                    end,
                    conn: id,
                    code: f.code,
                    request_id: f.request_id,
                    bytes,
                    deadline: std::time::Instant::now() + timeout,
                });
            }
            _ => c.queue(bytes),
        }
    }

    /// The held answers the group acknowledged, out in order; their connections.
    fn release_held(&mut self) -> Vec<u64> {
        let mut ids = Vec::new();
        while self
            .group
            .held
            .front()
            .is_some_and(|h| h.end <= self.group.acked)
        {
            let Some(h) = self.group.held.pop_front() else {
                break;
            };
            if let Some(c) = self.conns.get_mut(&h.conn) {
                c.held = c.held.saturating_sub(h.bytes.len());
                c.queue(h.bytes);
                ids.push(h.conn);
            }
        }
        ids
    }

    /// Every held answer fails with (status, why); their connections.
    fn fail_held(&mut self, status: u16, why: &str) -> Vec<u64> {
        let mut ids = Vec::new();
        for h in std::mem::take(&mut self.group.held) {
            if let Some(c) = self.conns.get_mut(&h.conn) {
                c.held = c.held.saturating_sub(h.bytes.len());
                c.queue(error_answer(h.code, h.request_id, status, why));
                ids.push(h.conn);
            }
        }
        ids
    }

    /// Past the first held answer's deadline, every one fails (acks stay in order, as
    /// `InSync.expired` has them).
    fn expire_held(&mut self) -> Vec<u64> {
        let now = std::time::Instant::now();
        match (self.group.held.front(), self.group.timeout) {
            (Some(h), Some(timeout)) if h.deadline <= now => {
                let why = format!(
                    "not replicated to the in-sync set within {} s",
                    fmt_secs(timeout)
                );
                self.fail_held(503, &why)
            }
            _ => Vec::new(),
        }
    }

    /// What the connection's decoder holds, in the node's budget.
    fn count_partial(&self, c: &mut Conn) {
        let now = if c.closing || c.ended {
            0
        } else {
            c.decoder.buffered()
        };
        if now != c.partial {
            if let Some(budget) = self.appender.partial() {
                budget.update(c.partial, now);
            }
            c.partial = now;
        }
    }

    /// A connection ends: its sequences go back, Python hears of it.
    fn end(&mut self, id: u64) {
        if let Some(mut c) = self.conns.remove(&id) {
            c.ended = true;
            self.count_partial(&mut c);
            let _ = self.poll.registry().deregister(&mut c.stream);
            if let Ok(mut held) = self.shared.held.lock() {
                held.drop_conn(id);
            }
            self.up.push(Up::Closed { conn: id });
        }
    }
}

/// The request id of an answer frame (bytes 8..12).
fn answer_id(bytes: &[u8]) -> u32 {
    bytes
        .get(8..12)
        .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
        .unwrap_or(0)
}

/// Write what the socket takes.
fn flush(c: &mut Conn) -> io::Result<()> {
    while let Some(first) = c.out.front() {
        match c.stream.write(&first[c.out_pos..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                c.out_pos += n;
                if c.out_pos == first.len() {
                    c.unsent -= first.len();
                    c.out_pos = 0;
                    c.out.pop_front();
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A protocol error: an ERROR frame, then the connection closes (as Python does).
fn protocol_error(c: &mut Conn, why: &str) {
    c.parked.clear();
    c.parked_bytes = 0;
    let text = format!("protocol error: {why}");
    c.queue(error_answer(0, 0, 400, &text));
    c.closing = true;
}

/// A refused append, answered as Python answers it (507 a full disk, 503 else).
fn append_error(code: u16, request_id: u32, e: &AppendError) -> Vec<u8> {
    match e {
        AppendError::Io(io) if io.raw_os_error() == Some(28) => {
            error_answer(code, request_id, 507, "no space left on the store's disk")
        }
        AppendError::Invalid(_, why) => error_answer(code, request_id, 400, &why.to_string()),
        _ => error_answer(code, request_id, 503, &e.to_string()),
    }
}

/// Where the last of these places ends (0: none said).
fn end_of_places(places: &[Place]) -> u64 {
    places
        .iter()
        .filter(|p| p.0 >= 0)
        .map(|p| p.0 as u64 + p.2)
        .max()
        .unwrap_or(0)
}

/// Seconds as Python's `:g` writes them (5 -> "5", 0.5 -> "0.5").
fn fmt_secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{}", s as u64)
    } else {
        format!("{s}")
    }
}

fn places(rows: Vec<Dispatched>) -> Vec<Place> {
    rows.into_iter()
        .map(|d| (d.phys_offset as i64, d.store_ts, u64::from(d.size), d.queues))
        .collect()
}

/// A producer's records (`commitlog._mark`): the first carries the stamp of its first
/// sequence, the others follow it.
fn mark(msgs: &mut [Message], st: &Stamp, skip: u64) {
    for m in msgs.iter_mut() {
        m.marks = MARK_MORE;
    }
    if let Some(first) = msgs.first_mut() {
        first.marks = MARK_FIRST;
        let id = serde_json::to_string(&st.producer).unwrap_or_else(|_| "\"\"".into());
        first.properties = format!(
            r#"{{"{PRODUCER_PROP}":[{id},{},{},"{PUBLISHES}"]}}"#,
            st.epoch,
            st.seq + skip
        )
        .into_bytes();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Config, Engine};
    use proptest::prelude::*;
    use std::net::{TcpListener, TcpStream as StdStream};
    use std::path::PathBuf;
    use std::time::Instant;

    fn tmp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "lg-server-{name}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn engine(name: &str) -> Engine {
        let config = Config {
            segment_size: 1 << 20,
            active_base: 0,
            write_pos: 0,
            default_partitions: 1,
            sync: false,
            io_threads: 1,
        };
        std::fs::File::create(tmp(name).join("00000000000000000000")).unwrap();
        Engine::start(&tmp_keep(name), config, Box::new(|_| 0)).unwrap()
    }

    fn tmp_keep(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!(
            "lg-server-{name}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ))
    }

    /// A carried connection: the server's end adopted, the client's end returned.
    fn connect(server: &Server) -> (u64, StdStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = StdStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let conn = server.adopt(OwnedFd::from(accepted), b"".to_vec(), Vec::new());
        (conn, client)
    }

    fn request(code: u16, rid: u32, header: &str, body: &[u8]) -> Vec<u8> {
        frame::encode(&Frame {
            kind: Kind::Request,
            code,
            request_id: rid,
            header: header.as_bytes().to_vec(),
            body: body.to_vec(),
        })
        .unwrap()
    }

    fn publish(rid: u32, topics: &[&str], stamp: &str) -> Vec<u8> {
        let metas: Vec<String> = topics
            .iter()
            .map(|t| format!(r#"{{"topic":"{t}","size":{},"qos":1}}"#, t.len()))
            .collect();
        let header = format!(r#"{{"messages":[{}]{stamp}}}"#, metas.join(","));
        request(PUBLISH, rid, &header, topics.concat().as_bytes())
    }

    /// A client's decoder and the frames it decoded, not yet looked at.
    struct Pending(Decoder, VecDeque<Frame>);

    impl Pending {
        fn new() -> Pending {
            Pending(Decoder::new(frame::MAX_FRAME), VecDeque::new())
        }
    }

    fn recv(client: &mut StdStream, pending: &mut Pending) -> Frame {
        let mut buf = [0u8; 65536];
        loop {
            if let Some(f) = pending.1.pop_front() {
                return f;
            }
            let n = client.read(&mut buf).expect("an answer");
            assert!(n > 0, "closed");
            pending.1.extend(pending.0.feed(&buf[..n]).unwrap());
        }
    }

    fn header(f: &Frame) -> Value {
        serde_json::from_slice(&f.header).unwrap()
    }

    /// Whether nothing comes on `s` for `wait` (its read timeout is 5 s again after).
    fn silent_for(s: &StdStream, wait: Duration) -> bool {
        s.set_read_timeout(Some(wait)).unwrap();
        let silent = s.peek(&mut [0u8; 1]).is_err();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        silent
    }

    fn wait_up(server: &Server) -> Vec<Up> {
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            let up = server.take_up();
            if !up.is_empty() || Instant::now() > until {
                return up;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Whether `cond` came true within 5 s.
    fn wait_for(cond: impl Fn() -> bool) -> bool {
        let until = Instant::now() + Duration::from_secs(5);
        while !cond() {
            if Instant::now() > until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        true
    }

    fn stamp(producer: &str, epoch: u64, seq: u64) -> Stamp {
        Stamp {
            producer: producer.into(),
            epoch,
            seq,
        }
    }

    #[test]
    fn plan_follows_the_producers_table() {
        let st = |e, s| stamp("p", e, s);
        assert_eq!(plan(None, &st(0, 0), 2).unwrap().skip, 0);
        assert_eq!(plan(None, &st(0, 3), 2).unwrap_err().0, 409);
        let mut e = Entry::default();
        let places: Vec<Place> = (0..3).map(|i| (i * 10, 1, 10, Vec::new())).collect();
        e.push((0, 0, 2, 0, 30), 1, Some(Arc::new(places)));
        // Next in sequence, a new epoch from 0: appended.
        assert_eq!(plan(Some(&e), &st(0, 3), 1).unwrap().skip, 0);
        assert_eq!(plan(Some(&e), &st(1, 0), 1).unwrap().skip, 0);
        // A duplicate, in part: its places, as remembered.
        let dup = plan(Some(&e), &st(0, 1), 4).unwrap();
        assert_eq!(dup.skip, 2);
        assert_eq!(
            dup.places.unwrap().iter().map(|p| p.0).collect::<Vec<_>>(),
            vec![10, 20]
        );
        // A gap, an older epoch, a new epoch not from 0: refused.
        let gap = plan(Some(&e), &st(0, 5), 1).unwrap_err();
        assert!(gap.1.contains("would skip 2"), "{}", gap.1);
        assert_eq!(plan(Some(&e), &st(1, 2), 1).unwrap_err().0, 409);
        e.push((2, 0, 0, 30, 40), 2, None);
        assert!(plan(Some(&e), &st(1, 0), 1)
            .unwrap_err()
            .1
            .contains("older than its epoch 2"));
        // Places not remembered (a large append, or handed over from Python): None.
        assert_eq!(plan(Some(&e), &st(2, 0), 1).unwrap().places, None);
        // Only the newest KEEP appends are remembered.
        for i in 1..=KEEP as u64 {
            e.push((2, i, i, 40 + i, 41 + i), 3, None);
        }
        assert_eq!(e.batches.len(), KEEP);
        assert_eq!(plan(Some(&e), &st(2, 0), 1).unwrap().places, None);
    }

    #[test]
    fn only_what_python_would_store_unchanged_is_appended_here() {
        let body = b"hiyo";
        // Read as a map and read typed (the usual path): the same, or typed says None.
        let ok = |h: &str| {
            let slow = native_publish(&serde_json::from_str(h).unwrap(), body);
            let fast = native_publish_fast(h.as_bytes(), body);
            if fast.is_some() {
                assert_eq!(format!("{fast:?}"), format!("{slow:?}"), "{h}");
            }
            slow
        };
        let (msgs, st) = ok(
            r#"{"messages":[{"topic":"a/b","size":2,"qos":1,"client_id":"c",
            "born_ts":5},{"topic":"c","size":2,"retain":true,"key":"k","props":{}}],
            "producer":"p1","epoch":3,"seq":7}"#,
        )
        .unwrap();
        assert_eq!(st, Some(stamp("p1", 3, 7)));
        assert_eq!(
            (msgs[0].qos, msgs[0].born_ts, &*msgs[0].client_id),
            (1, 5, "c")
        );
        assert_eq!(
            (&msgs[1].body[..], msgs[1].retain, &*msgs[1].key),
            (&b"yo"[..], true, "k")
        );
        // Escaped strings, unknown fields, a key twice (the map keeps the last one).
        for h in [
            r#"{"messages":[{"topic":"a\/b\u00e9","size":4,"client_id":"c\"1","x":[1]}]}"#,
            r#"{"messages":[{"topic":"a","size":4,"props":null}],"producer":"p","seq":0}"#,
            r#"{"messages":[{"topic":"a","size":4,"qos":1,"qos":2}]}"#,
        ] {
            assert!(ok(h).is_some(), "{h}");
        }
        for bad in [
            r#"{"messages":[]}"#,
            r#"{"messages":[{"topic":"a/+","size":4}]}"#,
            r#"{"messages":[{"topic":"a#","size":4}]}"#,
            r#"{"messages":[{"topic":"","size":4}]}"#,
            r#"{"messages":[{"topic":"a\u0000","size":4}]}"#,
            r#"{"messages":[{"topic":"a","size":3}]}"#,
            r#"{"messages":[{"topic":"a","size":5}]}"#,
            r#"{"messages":[{"topic":"a","size":4,"qos":3}]}"#,
            r#"{"messages":[{"topic":"a","size":4,"qos":true}]}"#,
            r#"{"messages":[{"topic":"a","size":4,"qos":1.0}]}"#,
            r#"{"messages":[{"topic":"a","size":4,"retain":1}]}"#,
            r#"{"messages":[{"topic":"a","size":4,"props":{"content_type":"x"}}]}"#,
            r#"{"messages":[{"topic":"a","size":"4"}]}"#,
            r#"{"messages":[{"topic":"a","size":4}],"producer":"p","seq":-1}"#,
            r#"{"messages":[{"topic":"a","size":4}],"producer":"p"}"#,
            r#"{"messages":[{"topic":"a","size":4}],"producer":7,"seq":0}"#,
            r#"{"messages":[{"topic":"a","size":4,"qos":null}]}"#,
            r#"{"messages":[{"topic":"a","size":4,"client_id":null}]}"#,
            r#"{"messages":[{"topic":"a","size":4}],"producer":"p","epoch":null,"seq":0}"#,
            r#"{"messages":[{"topic":"a","size":4,"props":[]}]}"#,
            r#"{"messages":{"topic":"a","size":4}}"#,
            r#"[{"topic":"a","size":4}]"#,
        ] {
            assert!(ok(bad).is_none(), "{bad}");
            assert!(native_publish_fast(bad.as_bytes(), body).is_none(), "{bad}");
        }
    }

    #[test]
    fn answers_are_byte_for_byte_pythons() {
        // encode_frame(Frame(RESPONSE, PUBLISH, 7, {"results": [{"msg_id":
        // "000000000000002A", "queues": [["a/b", 3], ["a#1", 0]], "store_ts": 5, "phys": 42,
        // "rsize": 90}]}))
        let results = results_answer(
            PUBLISH,
            7,
            &[(42, 5, 90, vec![("a/b".into(), 3), ("a#1".into(), 0)])],
        );
        let mut want = vec![0, 0, 0, 120, 1, 1, 0, 11, 0, 0, 0, 7, 0, 0, 0, 108];
        want.extend_from_slice(
            br#"{"results":[{"msg_id":"000000000000002A","queues":[["a/b",3],["a#1",0]],"store_ts":5,"phys":42,"rsize":90}]}"#,
        );
        assert_eq!(results, want);
        let error = error_answer(PUBLISH, 7, 409, "gap \"x\" é");
        let mut want = vec![0, 0, 0, 49, 1, 2, 0, 11, 0, 0, 0, 7, 0, 0, 0, 37];
        want.extend_from_slice("{\"status\":409,\"error\":\"gap \\\"x\\\" é\"}".as_bytes());
        assert_eq!(error, want);
        let id = |phys| {
            let mut s = String::new();
            push_msg_id(&mut s, phys);
            s
        };
        assert_eq!(id(-1), "-000000000000001");
        assert_eq!(id(255), "00000000000000FF");
    }

    #[test]
    fn a_peer_that_sends_and_closes_is_answered_and_its_end_read() {
        // Its frame and its end in one readiness: the short read of the frame must not
        // be taken for "drained, wait for the next edge" (there is none after an end).
        let engine = engine("sends-and-closes");
        let server = Server::start(engine.appender()).unwrap();
        let (conn, mut client) = connect(&server);
        let (busy_conn, mut busy) = connect(&server);
        std::thread::sleep(Duration::from_millis(100)); // adopted, read, waiting
        // Another connection's burst keeps the server's thread busy meanwhile: the
        // frame and the end arrive while it is, and are one readiness.
        let burst: Vec<u8> = (0..4000).flat_map(|i| publish(i, &["busy"], "")).collect();
        let writer = std::thread::spawn(move || {
            busy.write_all(&burst).unwrap();
            busy
        });
        std::thread::sleep(Duration::from_millis(5));
        client.write_all(&publish(1, &["a/b"], "")).unwrap();
        client.shutdown(std::net::Shutdown::Write).unwrap();
        let mut dec = Pending::new();
        let answer = recv(&mut client, &mut dec);
        assert_eq!((answer.kind, answer.request_id), (Kind::Response, 1));
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).expect("the server closes its side");
        assert!(rest.is_empty());
        assert!(wait_up(&server).contains(&Up::Closed { conn }));
        drop(writer.join().unwrap());
        let _ = busy_conn;
        server.stop();
        let _ = engine.stop_and_take();
    }

    #[test]
    fn a_carried_connection_appends_forwards_and_keeps_a_producer_once() {
        let engine = engine("carried");
        let server = Server::start(engine.appender()).unwrap();
        let (conn, mut client) = connect(&server);
        let mut dec = Pending::new();
        // Two PUBLISH frames and a PULL between them, pipelined.
        let mut out = publish(1, &["a/b", "c"], "");
        out.extend(request(20, 2, r#"{"queue":"c"}"#, b""));
        out.extend(publish(3, &["a/b"], ""));
        client.write_all(&out).unwrap();
        let first = recv(&mut client, &mut dec);
        assert_eq!((first.kind, first.request_id), (Kind::Response, 1));
        let results = header(&first)["results"].clone();
        assert_eq!(results[0]["phys"], 0);
        assert_eq!(results[1]["queues"][0], serde_json::json!(["c", 0]));
        let third = recv(&mut client, &mut dec);
        assert_eq!(third.request_id, 3);
        assert_eq!(header(&third)["results"][0]["queues"][0][1], 1);
        // The PULL went up with its request id; Python's answer is written.
        let up = wait_up(&server);
        assert!(
            matches!(&up[..], [Up::Frame { conn: c, code: 20, request_id: 2, .. }] if *c == conn),
            "{up:?}"
        );
        server.answer(conn, encoded(Kind::Response, 20, 2, b"{}".to_vec()));
        assert_eq!(recv(&mut client, &mut dec).request_id, 2);
        // A producer's first stamped PUBLISH asks Python; then it is checked here.
        let stamped = |rid, seq| publish(rid, &["d"], &format!(r#","producer":"p1","seq":{seq}"#));
        client.write_all(&stamped(4, 0)).unwrap();
        let up = wait_up(&server);
        assert!(matches!(&up[..], [Up::Claim { request_id: 4, producer, .. }] if producer == "p1"));
        server.claimed(conn, "p1".into(), None);
        let stored = header(&recv(&mut client, &mut dec))["results"].clone();
        client.write_all(&stamped(5, 0)).unwrap(); // sent again: its places, no append
        assert_eq!(header(&recv(&mut client, &mut dec))["results"], stored);
        client.write_all(&stamped(6, 3)).unwrap();
        let gap = recv(&mut client, &mut dec);
        assert_eq!(
            (gap.kind, header(&gap)["status"].as_u64()),
            (Kind::Error, Some(409))
        );
        let (dirty, held) = server.producer_entries();
        assert!(dirty);
        assert_eq!(
            held[0].1.batches,
            vec![(0, 0, 0, stored_phys(&stored), end_of(&stored))]
        );
        // The connection ends: Python hears of it and takes the sequence back.
        drop(client);
        let up = wait_up(&server);
        assert_eq!(up, vec![Up::Closed { conn }]);
        let released = server.take_released();
        assert_eq!(released.len(), 1);
        assert_eq!(released[0].0, "p1");
        assert!(server.take_released().is_empty());
        server.stop();
        let (_, pending) = engine.stop_and_take();
        assert_eq!(pending.rows.len(), 4);
        assert!(pending.rows.iter().all(|d| !d.own));
    }

    fn stored_phys(results: &Value) -> u64 {
        results[0]["phys"].as_u64().unwrap()
    }

    fn end_of(results: &Value) -> u64 {
        stored_phys(results) + results[0]["rsize"].as_u64().unwrap()
    }

    #[test]
    fn a_group_masters_answers_wait_for_the_acknowledged_offset() {
        let engine = engine("held");
        let server = Server::start(engine.appender()).unwrap();
        server.hold(Duration::from_secs(30));
        let (_, mut client) = connect(&server);
        let mut dec = Pending::new();
        let mut out = publish(1, &["a"], "");
        out.extend(publish(2, &["b"], ""));
        client.write_all(&out).unwrap();
        let stored = wait_for(|| engine.write_pos() > 0);
        assert!(stored, "not appended");
        assert!(
            silent_for(&client, Duration::from_millis(300)),
            "answered before acknowledged"
        );
        // Sync replication: Python hears of the replicas' positions, not of appends.
        assert!(server.take_up().is_empty());
        server.acked(1); // (inside the first record: nothing yet)
        server.acked(1 << 20); // both
        let (a, b) = (recv(&mut client, &mut dec), recv(&mut client, &mut dec));
        assert_eq!((a.kind, a.request_id, b.request_id), (Kind::Response, 1, 2));
        // Held, then failed by a step-down; refused while Python refuses writes.
        server.stop();
        let server = Server::start(engine.appender()).unwrap();
        server.hold(Duration::from_secs(30));
        server.acked(end_of(&header(&b)["results"]));
        let (_, mut client) = connect(&server);
        client.write_all(&publish(3, &["c"], "")).unwrap();
        let end = engine.write_pos();
        assert!(wait_for(|| engine.write_pos() > end), "not appended");
        server.fail_held("this node stopped being master".into());
        let failed = recv(&mut client, &mut dec);
        assert_eq!(
            (
                failed.kind,
                failed.request_id,
                header(&failed)["status"].as_u64()
            ),
            (Kind::Error, 3, Some(503))
        );
        // (Commands reach the server's thread a moment later: a read already under way
        // may take the next frame first, as Python's word may come after a frame.)
        let settle = || std::thread::sleep(Duration::from_millis(100));
        server.refuse_writes(Some((507, "no space".into())));
        settle();
        client.write_all(&publish(4, &["d"], "")).unwrap();
        let refused = recv(&mut client, &mut dec);
        assert_eq!(header(&refused)["status"].as_u64(), Some(507));
        // Past the timeout, what is held fails.
        server.refuse_writes(None);
        server.hold(Duration::from_millis(200));
        settle();
        client.write_all(&publish(5, &["e"], "")).unwrap();
        let expired = recv(&mut client, &mut dec);
        assert_eq!(header(&expired)["status"].as_u64(), Some(503));
        assert!(header(&expired)["error"]
            .as_str()
            .unwrap()
            .contains("within 0.2 s"));
        server.stop();
    }

    #[test]
    fn an_asynchronous_masters_appends_are_answered_at_once_and_told_to_python() {
        let engine = engine("async");
        let server = Server::start(engine.appender()).unwrap();
        server.hold(Duration::ZERO);
        let (_, mut client) = connect(&server);
        let mut dec = Pending::new();
        client.write_all(&publish(1, &["a"], "")).unwrap();
        let answer = recv(&mut client, &mut dec);
        assert_eq!((answer.kind, answer.request_id), (Kind::Response, 1));
        assert!(matches!(&wait_up(&server)[..], [Up::Appended]));
        server.stop();
    }

    #[test]
    fn a_replicas_fetches_are_answered_here_and_release_held_appends() {
        let engine = engine("fetch");
        let server = Server::start(engine.appender()).unwrap();
        server.hold(Duration::from_secs(30));
        server.fetching(Some(Fetching {
            epoch: 1,
            epochs: "[[1,0]]".into(),
            dir: tmp_keep("fetch"),
            sync: true,
        }));
        server.meta("inc".into(), 0);
        let (acked, held) = server.insync(vec!["r1".into()], true, None);
        assert_eq!((acked, held), (0, vec![]));
        let (_, mut gateway) = connect(&server);
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut replica = StdStream::connect(listener.local_addr().unwrap()).unwrap();
        replica
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let accepted = OwnedFd::from(listener.accept().unwrap().0);
        server.adopt_fetching(accepted, Vec::new(), Vec::new(), true);
        let (mut gdec, mut rdec) = (Pending::new(), Pending::new());
        let fetch = |rid: u32, offset: u64, extra: &str| {
            let h = format!(
                r#"{{"node":"r1","addr":"h:1","offset":{offset},"epoch":1,"meta_inc":"inc",
                "meta_seq":0,"confirmed":0,"lazy":true,"wait_ms":5000,"max_bytes":4194304{extra}}}"#
            );
            request(REPL_FETCH, rid, &h, b"")
        };
        // A connection Python does not allow REPL_FETCH (a gateway's): Python says so.
        gateway.write_all(&fetch(9, 0, "")).unwrap();
        assert!(matches!(
            &wait_up(&server)[..],
            [Up::Frame {
                code: REPL_FETCH,
                request_id: 9,
                ..
            }]
        ));
        // The first fetch of a connection (its epoch history) is Python's.
        replica
            .write_all(&fetch(1, 0, r#","epochs":[[1,0]]"#))
            .unwrap();
        assert!(matches!(
            &wait_up(&server)[..],
            [Up::Frame {
                code: REPL_FETCH,
                request_id: 1,
                ..
            }]
        ));
        // At the end: it waits here, until an append.
        replica.write_all(&fetch(2, 0, "")).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        gateway.write_all(&publish(7, &["a/b", "c"], "")).unwrap();
        let answer = recv(&mut replica, &mut rdec);
        assert_eq!((answer.kind, answer.request_id), (Kind::Response, 2));
        let h = header(&answer);
        let end = engine.write_pos();
        assert_eq!(answer.body.len() as u64, end);
        assert_eq!(
            (
                h["end"].as_u64(),
                h["base"].as_u64(),
                h["confirmed"].as_u64()
            ),
            (Some(end), Some(0), Some(0))
        );
        assert_eq!(
            h["meta"],
            serde_json::json!({"inc": "inc", "seq": 0, "ops": []})
        );
        assert_eq!(h["epochs"], serde_json::json!([[1, 0]]));
        // Not answered until the replica says it holds the append: then at once.
        assert!(
            silent_for(&gateway, Duration::from_millis(200)),
            "answered before replicated"
        );
        server.meta_ops(1, vec![br#"["put","sessions","k",1]"#.to_vec()]);
        replica.write_all(&fetch(3, end, "")).unwrap();
        let stored = recv(&mut gateway, &mut gdec);
        assert_eq!((stored.kind, stored.request_id), (Kind::Response, 7));
        assert_eq!(server.acked_offset(), end);
        // Its metadata is a change behind: answered at once with the op.
        let answer = recv(&mut replica, &mut rdec);
        let h = header(&answer);
        assert_eq!(
            h["meta"]["ops"],
            serde_json::json!([["put", "sessions", "k", 1]])
        );
        assert_eq!(h["confirmed"].as_u64(), Some(end));
        assert!(answer.body.is_empty());
        assert_eq!(server.fetches(), 2);
        // Python hears of the replica's position.
        let until = Instant::now() + Duration::from_secs(5);
        let mut heard = None;
        while heard != Some(end) && Instant::now() < until {
            for up in server.take_up() {
                if let Up::Fetched(r) = up {
                    assert!(r.iter().all(|r| r.node == "r1" && r.addr == "h:1"));
                    heard = r.last().map(|r| r.offset);
                }
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(heard, Some(end));
        // Not master any more: what waits goes to Python.
        replica
            .write_all(&fetch(4, end, r#","meta_seq":1"#))
            .unwrap();
        std::thread::sleep(Duration::from_millis(100));
        server.fetching(None);
        let until = Instant::now() + Duration::from_secs(5);
        let mut up = false;
        while !up && Instant::now() < until {
            up = server
                .take_up()
                .iter()
                .any(|u| matches!(u, Up::Frame { request_id: 4, .. }));
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(up, "the waiting fetch went to Python");
        server.stop();
    }

    #[test]
    fn an_append_python_makes_holds_the_frames_after_it() {
        let engine = engine("held");
        let server = Server::start(engine.appender()).unwrap();
        let (conn, mut client) = connect(&server);
        let mut dec = Pending::new();
        let props = request(
            PUBLISH,
            1,
            r#"{"messages":[{"topic":"a","size":1,"props":{"content_type":"x"}}]}"#,
            b"x",
        );
        let mut out = props;
        out.extend(publish(2, &["b"], ""));
        client.write_all(&out).unwrap();
        let up = wait_up(&server);
        assert!(
            matches!(&up[..], [Up::Frame { request_id: 1, .. }]),
            "{up:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            engine.write_pos(),
            0,
            "the next PUBLISH waits for Python's append"
        );
        server.answer(conn, encoded(Kind::Response, PUBLISH, 1, b"{}".to_vec()));
        assert_eq!(recv(&mut client, &mut dec).request_id, 1);
        assert_eq!(recv(&mut client, &mut dec).request_id, 2);
        assert!(engine.write_pos() > 0);
        server.stop();
        drop(engine);
    }

    #[test]
    fn a_client_that_reads_its_answers_late_is_read_again_once_they_are_out() {
        // More answers than MAX_UNSENT while the client writes before it reads: the
        // server stops reading it, writes, and reads it again as the answers go.
        let engine = engine("late");
        let server = Server::start(engine.appender()).unwrap();
        let (_, client) = connect(&server);
        client
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let topic = format!("t/{}", "x".repeat(400));
        let frames = 16_000u32;
        let mut writer = client.try_clone().unwrap();
        let wrote = std::thread::spawn(move || {
            for rid in 0..frames {
                writer.write_all(&publish(rid, &[&topic], "")).unwrap();
            }
        });
        let mut reader = client;
        let mut pending = Pending::new();
        for rid in 0..frames {
            assert_eq!(recv(&mut reader, &mut pending).request_id, rid);
        }
        wrote.join().unwrap();
        server.stop();
        drop(engine);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Hostile bytes after the HELLO: every one answered or the connection closed
        /// after an ERROR frame; nothing panics, the server serves the next connection.
        #[test]
        fn hostile_bytes_never_break_the_server(
            noise in proptest::collection::vec(any::<u8>(), 0..300),
            head in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            let engine = engine("fuzz");
            let server = Server::start(engine.appender()).unwrap();
            let (_, mut client) = connect(&server);
            client.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
            let mut bytes = head.clone();
            // A valid head announcing a JSON header of noise, then the noise.
            let len = (12 + noise.len()) as u32;
            bytes.extend_from_slice(&len.to_be_bytes());
            bytes.extend_from_slice(&[1, 0, 0, 11, 0, 0, 0, 9]);
            bytes.extend_from_slice(&(noise.len() as u32).to_be_bytes());
            bytes.extend_from_slice(&noise);
            let _ = client.write_all(&bytes);
            let mut buf = [0u8; 4096];
            let _ = client.read(&mut buf);
            let _ = server.take_up();
            let (_, mut next) = connect(&server);
            next.write_all(&publish(1, &["z"], "")).unwrap();
            let mut dec = Pending::new();
            prop_assert_eq!(recv(&mut next, &mut dec).kind, Kind::Response);
            server.stop();
            drop(engine);
        }
    }
}
