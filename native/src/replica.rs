//! A store group's replica copying its master's log natively: the steady state of
//! `store/replication/follower.py` (`follow`, `_take`) on a thread of its own. It asks
//! REPL_FETCH from its log's end, writes each answer's bytes at the master's offset
//! through the engine (`Appender::copy_raw`: the record format as it is, rolled where the
//! master rolled, the rows left for the dispatch into the index), and fetches again at
//! once, with no interpreter on the way.
//!
//! Python keeps everything rare, and this loop hands it over (`Event`): an answer only
//! Python takes (a cut, a start-over page, a metadata snapshot page, an older epoch: the
//! loop stops, the answer goes up whole), metadata changes (applied by Python; the loop
//! fetches again only once Python says they are, so the master never hears of a change
//! sequence this node has not applied), the master's epoch history when it changed or
//! the log reached an epoch's start, the read limit reaching what Python waits for
//! (`watch`), and every failure (the loop stops: a write that failed, with its errno; a
//! connection lost). `halt` stops it from any thread and returns once nothing more will
//! be written.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::client::{error_of, header_of, HELLO, HELLO_TIMEOUT};
use crate::engine::Appender;
use crate::frame::{self, Decoder, Frame, Kind};

/// The REPL_FETCH request's code (`store/protocol.py`).
pub const REPL_FETCH: u16 = 120;
/// How often a fetch waiting for its answer looks at what the owner asked (a halt, a
/// reader that cuts a lazy fetch short).
const TICK: Duration = Duration::from_millis(10);
/// Beyond the master's wait, how long an answer may take (`follower.py`'s timeout).
const ANSWER_GRACE: Duration = Duration::from_secs(10);
const READ_SIZE: usize = 256 * 1024;
/// Why the loop stopped when `halt` stopped it (Python's copy loop knows the word).
const HALTED: &str = "stopped";

/// Where the copy starts and what its fetches say (`follower.follow`'s request).
#[derive(Debug, Clone, Default)]
pub struct Params {
    /// The master's native address.
    pub master: String,
    /// This node's name and the native address it advertises.
    pub node: String,
    pub addr: String,
    /// The epoch of the master it follows.
    pub epoch: u64,
    /// The group secret (the node proof) or, without one, a user's credentials.
    pub secret: Option<Vec<u8>>,
    pub credentials: Option<(String, String)>,
    /// This node's epoch history ([[epoch, start], ...]): sent with the connection's
    /// first fetch (the fork check), as Python's first fetch does.
    pub epochs: Value,
    pub meta_inc: String,
    pub meta_seq: u64,
    pub meta_complete: bool,
    /// The master's read limit as this node knows it (None: none).
    pub confirmed: Option<u64>,
    pub wait_ms: u64,
    pub max_bytes: u64,
}

/// What the copy hands to Python.
#[derive(Debug, PartialEq, Eq)]
pub enum Event {
    /// An answer's header with metadata changes (`meta.ops`): applied by Python, which
    /// then says so (`Copier::meta_applied`); no fetch goes before.
    Ops(Vec<u8>),
    /// The read limit reached what `Copier::watch` asked for.
    Confirmed,
    /// An answer's header whose epoch history is to be adopted as far as the log goes.
    Epochs(Vec<u8>),
    /// An answer only Python takes, to the fetch at `offset`: the copy stopped.
    Handover {
        offset: u64,
        header: Vec<u8>,
        body: Vec<u8>,
    },
    /// The copy stopped: why; `write` when writing failed (`errno` when known), else
    /// the connection, the master or the log's bytes.
    Stopped {
        why: String,
        write: bool,
        errno: Option<i32>,
    },
}

struct State {
    events: VecDeque<Event>,
    meta_inc: String,
    meta_seq: u64,
    /// Metadata changes handed up and not applied yet: the next fetch waits.
    ops_pending: bool,
    watch: Option<u64>,
    /// Whether a reader waits on this node (its fetches are eager then).
    readers: bool,
    /// A reader started waiting: a lazy fetch out is sent again, eager.
    cut_lazy: bool,
    /// The thread ended (its last event is queued).
    done: bool,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    stop: AtomicBool,
    /// The master's read limit as this node keeps it (-1: none).
    confirmed: AtomicI64,
    master_end: AtomicU64,
    answers: AtomicU64,
    bytes: AtomicU64,
    /// Held over each write: `halt` takes it, so nothing is written once it returns.
    writing: Mutex<()>,
}

impl Shared {
    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}

/// The copy loop: started on its connection's thread, stopped by `halt` or a failure.
pub struct Copier {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Copier {
    pub fn start(appender: Appender, params: Params) -> io::Result<Copier> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                events: VecDeque::new(),
                meta_inc: params.meta_inc.clone(),
                meta_seq: params.meta_seq,
                ops_pending: false,
                watch: None,
                readers: false,
                cut_lazy: false,
                done: false,
            }),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            confirmed: AtomicI64::new(limit_word(params.confirmed)),
            master_end: AtomicU64::new(0),
            answers: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            writing: Mutex::new(()),
        });
        let inner = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("lightgate-replica-copy".into())
            .spawn(move || {
                let last = copy(&inner, &appender, &params);
                if let Ok(mut st) = inner.state.lock() {
                    st.events.push_back(last);
                    st.done = true;
                }
                inner.changed.notify_all();
            })?;
        Ok(Copier {
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The next event, waiting up to `timeout`; None if none came (or the loop ended
    /// and every event was taken).
    pub fn next_event(&self, timeout: Duration) -> Option<Event> {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.state.lock().ok()?;
        loop {
            if let Some(e) = st.events.pop_front() {
                return Some(e);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if st.done || left.is_zero() {
                return None;
            }
            st = self.shared.changed.wait_timeout(st, left).ok()?.0;
        }
    }

    /// Python applied the metadata changes up to (`inc`, `seq`): the copy goes on.
    pub fn meta_applied(&self, inc: &str, seq: u64) {
        if let Ok(mut st) = self.shared.state.lock() {
            st.meta_inc = inc.to_string();
            st.meta_seq = seq;
            st.ops_pending = false;
        }
        self.shared.changed.notify_all();
    }

    /// Say `Confirmed` once the read limit reaches `upto` (None: say nothing).
    pub fn watch(&self, upto: Option<u64>) {
        let now = self.confirmed();
        let reached = upto.is_some_and(|u| now.is_none_or(|c| c >= u));
        if let Ok(mut st) = self.shared.state.lock() {
            if reached {
                st.watch = None;
                st.events.push_back(Event::Confirmed);
            } else {
                st.watch = upto;
            }
        }
        if reached {
            self.shared.changed.notify_all();
        }
    }

    /// Whether readers wait on this node (fetches are eager while they do).
    pub fn set_readers(&self, readers: bool) {
        if let Ok(mut st) = self.shared.state.lock() {
            st.readers = readers;
        }
    }

    /// A reader starts waiting: a lazy fetch out is cut short, sent again eager.
    pub fn reader_waits(&self) {
        if let Ok(mut st) = self.shared.state.lock() {
            st.readers = true;
            st.cut_lazy = true;
        }
    }

    /// The master's read limit (None: none).
    pub fn confirmed(&self) -> Option<u64> {
        let word = self.shared.confirmed.load(Ordering::Acquire);
        u64::try_from(word).ok()
    }

    pub fn master_end(&self) -> u64 {
        self.shared.master_end.load(Ordering::Relaxed)
    }

    /// (answers whose bytes were written here, bytes written).
    pub fn copied(&self) -> (u64, u64) {
        (
            self.shared.answers.load(Ordering::Relaxed),
            self.shared.bytes.load(Ordering::Relaxed),
        )
    }

    /// Stop: returns once nothing more will be written (a write under way ends first)
    /// and the thread is gone.
    pub fn halt(&self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.changed.notify_all();
        drop(self.shared.writing.lock());
        let thread = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl Drop for Copier {
    fn drop(&mut self) {
        self.halt();
    }
}

fn limit_word(limit: Option<u64>) -> i64 {
    limit.map_or(-1, |c| c as i64)
}

fn stopped(why: impl Into<String>) -> Event {
    Event::Stopped {
        why: why.into(),
        write: false,
        errno: None,
    }
}

/// A connection to the master, greeted.
struct Conn {
    stream: TcpStream,
    decoder: Decoder,
    buf: Vec<u8>,
    next_id: u32,
}

impl Conn {
    fn send(&mut self, code: u16, header: &Value) -> io::Result<u32> {
        let rid = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        let request = Frame {
            kind: Kind::Request,
            code,
            request_id: rid,
            header: serde_json::to_vec(header).map_err(io::Error::other)?,
            body: Vec::new(),
        };
        let bytes = frame::encode(&request).map_err(|e| io::Error::other(e.to_string()))?;
        self.stream.write_all(&bytes)?;
        Ok(rid)
    }

    /// The answer to `rid` (others are dropped: a lazy fetch sent again leaves one), or
    /// None after a `TICK` without it.
    fn answer(&mut self, rid: u32, pending: &mut VecDeque<Frame>) -> io::Result<Option<Frame>> {
        while let Some(f) = pending.pop_front() {
            if f.request_id == rid {
                return Ok(Some(f));
            }
        }
        match self.stream.read(&mut self.buf) {
            Ok(0) => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the master closed the connection",
            )),
            Ok(n) => {
                let frames = self
                    .decoder
                    .feed(&self.buf[..n])
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
                pending.extend(frames);
                while let Some(f) = pending.pop_front() {
                    if f.request_id == rid {
                        return Ok(Some(f));
                    }
                }
                Ok(None)
            }
            Err(e)
                if matches!(
                    e.kind(),
                    // (a signal, SIGSTOP then SIGCONT, interrupts a read: it goes on)
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// One request and its answer within `HELLO_TIMEOUT` (the greeting), given up at
    /// once when halted.
    fn call(&mut self, shared: &Shared, code: u16, header: &Value) -> Result<Frame, String> {
        let rid = self.send(code, header).map_err(|e| e.to_string())?;
        let deadline = Instant::now() + HELLO_TIMEOUT;
        let mut pending = VecDeque::new();
        while Instant::now() < deadline && !shared.stopping() {
            if let Some(f) = self.answer(rid, &mut pending).map_err(|e| e.to_string())? {
                return Ok(f);
            }
        }
        if shared.stopping() {
            return Err(HALTED.into());
        }
        Err(format!("no answer within {} s", HELLO_TIMEOUT.as_secs()))
    }
}

/// The node's proof of the group secret (`store/protocol.py` `node_proof`).
pub fn node_proof(secret: &[u8], challenge: &str, node: &str) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    let mut msg = b"lightgate store node\0".to_vec();
    msg.extend_from_slice(challenge.as_bytes());
    msg.push(0);
    msg.extend_from_slice(node.as_bytes());
    ring::hmac::sign(&key, &msg)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Dial `addr` within `HELLO_TIMEOUT`, given up at once when halted: `halt` joins this
/// thread from the node's event loop (a new master stopping its copy), which a dial to
/// a master cut off by the network would otherwise hold for the whole timeout.
fn dial(shared: &Shared, addr: SocketAddr) -> io::Result<TcpStream> {
    use mio::{Events, Interest, Poll, Token};
    let mut poll = Poll::new()?;
    let mut stream = mio::net::TcpStream::connect(addr)?;
    poll.registry()
        .register(&mut stream, Token(0), Interest::WRITABLE)?;
    let mut events = Events::with_capacity(1);
    let deadline = Instant::now() + HELLO_TIMEOUT;
    loop {
        if shared.stopping() {
            return Err(io::Error::new(io::ErrorKind::Interrupted, HALTED));
        }
        if Instant::now() >= deadline {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out"));
        }
        poll.poll(&mut events, Some(TICK))?;
        if events.is_empty() {
            continue;
        }
        if let Some(e) = stream.take_error()? {
            return Err(e);
        }
        match stream.peer_addr() {
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::NotConnected => {} // (not yet: poll again)
            Err(e) => return Err(e),
        }
    }
    poll.registry().deregister(&mut stream)?;
    let stream = TcpStream::from(std::os::fd::OwnedFd::from(stream));
    stream.set_nonblocking(false)?;
    Ok(stream)
}

/// Dial the master and greet it as `store/client.py` does: the node proof (a second
/// HELLO answering the first's challenge), or a user's credentials.
fn connect(shared: &Shared, p: &Params) -> Result<Conn, String> {
    let sockaddr: SocketAddr = p
        .master
        .to_socket_addrs()
        .map_err(|e| e.to_string())?
        .next()
        .ok_or("no address")?;
    let stream = dial(shared, sockaddr).map_err(|e| e.to_string())?;
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(TICK))
        .map_err(|e| e.to_string())?;
    stream
        .set_write_timeout(Some(ANSWER_GRACE))
        .map_err(|e| e.to_string())?;
    let mut conn = Conn {
        stream,
        decoder: Decoder::new(frame::MAX_FRAME),
        buf: vec![0u8; READ_SIZE],
        next_id: 1,
    };
    let mut hello = json!({"sdk": "lightgate-native"});
    if p.secret.is_some() {
        hello["node"] = json!(p.node);
    } else if let Some((user, password)) = &p.credentials {
        hello["username"] = json!(user);
        hello["password"] = json!(password);
    }
    let mut answer = conn.call(shared, HELLO, &hello)?;
    if let (Some(secret), Kind::Response) = (&p.secret, answer.kind) {
        let challenge = header_of(&answer)
            .get("challenge")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let proof = node_proof(secret, &challenge, &p.node);
        answer = conn.call(shared, HELLO, &json!({"node": p.node, "node_proof": proof}))?;
    }
    if answer.kind == Kind::Error {
        let (status, message) = error_of(&answer);
        return Err(format!("HELLO refused: {status}: {message}"));
    }
    Ok(conn)
}

/// Epoch starts in a history ([[epoch, start], ...]).
fn starts(history: &Value) -> Vec<u64> {
    history
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|e| e.get(1).and_then(Value::as_u64))
                .collect()
        })
        .unwrap_or_default()
}

/// The loop; its last event (why it stopped).
fn copy(shared: &Shared, appender: &Appender, p: &Params) -> Event {
    let mut conn = match connect(shared, p) {
        Ok(c) => c,
        Err(_) if shared.stopping() => return stopped(HALTED),
        Err(why) => return stopped(format!("{} unreachable ({why})", p.master)),
    };
    let mut first = true;
    let mut marked = false;
    let mut confirmed = p.confirmed;
    let mut history: Option<Value> = None;
    let mut adopted_end = appender.write_pos();
    let mut pending = VecDeque::new();
    let timeout = Duration::from_millis(p.wait_ms) + ANSWER_GRACE;
    loop {
        // Metadata handed up is applied before the next fetch reports its sequence.
        let (inc, seq, readers) = {
            let Ok(mut st) = shared.state.lock() else {
                return stopped("lock poisoned");
            };
            while st.ops_pending && !shared.stopping() {
                st = match shared.changed.wait_timeout(st, TICK) {
                    Ok((s, _)) => s,
                    Err(_) => return stopped("lock poisoned"),
                };
            }
            st.cut_lazy = false;
            (st.meta_inc.clone(), st.meta_seq, st.readers)
        };
        if shared.stopping() {
            return stopped(HALTED);
        }
        if appender.behind() {
            std::thread::sleep(Duration::from_millis(1)); // the dispatch catches up first
            continue;
        }
        let offset = appender.write_pos();
        let mut lazy = !readers;
        let fetch = |lazy: bool, first: bool, confirmed: Option<u64>| {
            json!({
                "node": p.node, "addr": p.addr, "offset": offset, "epoch": p.epoch,
                "epochs": if first { p.epochs.clone() } else { Value::Null },
                "meta_inc": inc, "meta_seq": seq, "meta_complete": p.meta_complete,
                "snap": Value::Null, "restart": Value::Null, "confirmed": confirmed,
                "write_error": false, "lazy": lazy, "wait_ms": p.wait_ms,
                "max_bytes": p.max_bytes,
            })
        };
        let mut rid = match conn.send(REPL_FETCH, &fetch(lazy, first, confirmed)) {
            Ok(r) => r,
            Err(e) => return stopped(format!("replication from {}: {e}", p.master)),
        };
        let mut deadline = Instant::now() + timeout;
        let answer = loop {
            match conn.answer(rid, &mut pending) {
                Ok(Some(f)) => break f,
                Ok(None) => {}
                Err(e) => return stopped(format!("replication from {}: {e}", p.master)),
            }
            if shared.stopping() {
                return stopped(HALTED);
            }
            // A reader started waiting while the fetch is lazy and this node holds bytes
            // its readers may not see yet: the same fetch again, eager.
            let cut = lazy
                && shared
                    .state
                    .lock()
                    .map(|mut st| std::mem::take(&mut st.cut_lazy))
                    .unwrap_or(false)
                && confirmed.is_some_and(|c| c < appender.write_pos());
            if cut {
                lazy = false;
                rid = match conn.send(REPL_FETCH, &fetch(false, first, confirmed)) {
                    Ok(r) => r,
                    Err(e) => return stopped(format!("replication from {}: {e}", p.master)),
                };
                deadline = Instant::now() + timeout;
            } else if Instant::now() > deadline {
                return stopped(format!(
                    "{}: no answer within {} s",
                    p.master,
                    timeout.as_secs()
                ));
            }
        };
        if answer.kind == Kind::Error {
            let (status, message) = error_of(&answer);
            return stopped(format!("{}: {status}: {message}", p.master));
        }
        let h = header_of(&answer);
        let meta = h
            .get("meta")
            .filter(|m| m.as_object().is_some_and(|o| !o.is_empty()));
        if h.get("truncate_to").is_some()
            || h.get("restart_at").is_some()
            || h.get("epoch").and_then(Value::as_u64).unwrap_or(0) < p.epoch
            || meta.is_some_and(|m| m.get("page").is_some())
        {
            return Event::Handover {
                offset,
                header: answer.header,
                body: answer.body,
            };
        }
        first = false;
        let end = h.get("end").and_then(Value::as_u64).unwrap_or(0);
        shared.master_end.store(end, Ordering::Relaxed);
        if !answer.body.is_empty() {
            let base = h.get("base").and_then(Value::as_u64).unwrap_or(u64::MAX);
            let Ok(_writing) = shared.writing.lock() else {
                return stopped("lock poisoned");
            };
            if shared.stopping() {
                return stopped(HALTED); // halted: nothing written after it
            }
            if let Err(e) = appender.copy_raw(offset, &answer.body, base, &mut marked) {
                let write = e.kind() != io::ErrorKind::InvalidData;
                return Event::Stopped {
                    why: e.to_string(),
                    write,
                    errno: e.raw_os_error(),
                };
            }
            shared.answers.fetch_add(1, Ordering::Relaxed);
            shared
                .bytes
                .fetch_add(answer.body.len() as u64, Ordering::Relaxed);
        }
        // The master's read limit, as `Replication.confirm` keeps it: never past this
        // log's end, never back.
        let mut events = Vec::new();
        match h.get("confirmed").and_then(Value::as_u64) {
            None => confirmed = None,
            Some(c) => {
                let c = c.min(appender.write_pos());
                if confirmed.is_none_or(|old| c > old) {
                    confirmed = Some(c);
                }
            }
        }
        shared
            .confirmed
            .store(limit_word(confirmed), Ordering::Release);
        let now_end = appender.write_pos();
        let epochs = h.get("epochs").cloned().unwrap_or(Value::Null);
        let reached = starts(&epochs)
            .iter()
            .any(|s| *s > adopted_end && *s <= now_end);
        if history.as_ref() != Some(&epochs) || reached {
            events.push(Event::Epochs(answer.header.clone()));
            history = Some(epochs);
            adopted_end = now_end;
        }
        let ops = meta.and_then(|m| m.get("ops")).and_then(Value::as_array);
        let Ok(mut st) = shared.state.lock() else {
            return stopped("lock poisoned");
        };
        if st.watch.is_some_and(|w| confirmed.is_none_or(|c| c >= w)) {
            st.watch = None;
            st.events.push_back(Event::Confirmed);
        }
        if ops.is_some_and(|o| !o.is_empty()) {
            st.ops_pending = true;
            st.events.push_back(Event::Ops(answer.header));
        } else if let Some(m) = meta {
            if let (Some(i), Some(s)) = (
                m.get("inc").and_then(Value::as_str),
                m.get("seq").and_then(Value::as_u64),
            ) {
                st.meta_inc = i.to_string();
                st.meta_seq = s;
            }
        }
        let told = !events.is_empty() || !st.events.is_empty();
        st.events.extend(events);
        drop(st);
        if told {
            shared.changed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Config, Engine};
    use crate::record::{self, Record};
    use std::net::TcpListener;
    use std::path::PathBuf;

    fn engine(name: &str) -> (Engine, PathBuf) {
        let dir = std::env::temp_dir().join(format!("lg-replica-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::File::create(dir.join("00000000000000000000")).unwrap();
        let config = Config {
            segment_size: 1 << 20,
            active_base: 0,
            write_pos: 0,
            default_partitions: 1,
            sync: false,
            io_threads: 1,
        };
        (Engine::start(&dir, config, Box::new(|_| 0)).unwrap(), dir)
    }

    fn rec(topic: &str, offset: u64, marks: u8) -> Vec<u8> {
        let mut out = Vec::new();
        let r = Record {
            store_ts: 5,
            born_ts: 4,
            qos: 1,
            retain: false,
            marks,
            client_id: "c",
            topic,
            key: "",
            properties: b"",
            body: b"payload",
            queues: vec![(topic, offset)],
        };
        record::encode_into(&r, &mut out).unwrap();
        out
    }

    /// A master that greets with a challenge, checks the proof, then answers each
    /// fetch with the next of `answers` (header, body), recording the fetches.
    fn master(answers: Vec<(Value, Vec<u8>)>) -> (String, std::sync::mpsc::Receiver<Value>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut dec = Decoder::new(frame::MAX_FRAME);
            let mut answers = answers.into_iter();
            let mut buf = vec![0u8; 65536];
            loop {
                let n = match s.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                for f in dec.feed(&buf[..n]).unwrap() {
                    let h = header_of(&f);
                    let (header, body) = if f.code == HELLO {
                        if let Some(proof) = h.get("node_proof").and_then(Value::as_str) {
                            assert_eq!(proof, node_proof(b"s3cret", "xyz", "r1"));
                            (json!({"role": "master"}), Vec::new())
                        } else {
                            (json!({"challenge": "xyz"}), Vec::new())
                        }
                    } else {
                        tx.send(h).unwrap();
                        match answers.next() {
                            Some(a) => a,
                            None => return,
                        }
                    };
                    let out = Frame {
                        kind: Kind::Response,
                        code: f.code,
                        request_id: f.request_id,
                        header: serde_json::to_vec(&header).unwrap(),
                        body,
                    };
                    s.write_all(&frame::encode(&out).unwrap()).unwrap();
                }
            }
        });
        (addr, rx)
    }

    fn params(master: String) -> Params {
        Params {
            master,
            node: "r1".into(),
            addr: "r1:1".into(),
            epoch: 2,
            secret: Some(b"s3cret".to_vec()),
            epochs: json!([[1, 0]]),
            meta_inc: "i".into(),
            wait_ms: 1000,
            max_bytes: 1 << 20,
            confirmed: Some(0),
            ..Params::default()
        }
    }

    #[test]
    fn copies_the_masters_bytes_and_hands_the_rare_answers_up() {
        let (engine, dir) = engine("copy");
        let (a, b) = (rec("t/a", 0, 0), rec("t/b", 0, record::MARK_FIRST));
        let both: Vec<u8> = [a.clone(), b.clone()].concat();
        let end = both.len() as u64;
        let history = json!([[1, 0], [2, end]]);
        let answers = vec![
            (
                json!({"end": end, "base": 0, "epoch": 2, "confirmed": 0, "epochs": history,
                       "meta": {"inc": "i", "seq": 0, "ops": []}}),
                both.clone(),
            ),
            (
                json!({"end": end, "base": 0, "epoch": 2, "confirmed": end, "epochs": history,
                       "meta": {"inc": "i", "seq": 3, "ops": [["put", "k", "v"]]}}),
                Vec::new(),
            ),
            (json!({"truncate_to": 0}), Vec::new()),
        ];
        let (addr, fetches) = master(answers);
        let copier = Copier::start(engine.appender(), params(addr)).unwrap();
        let wait = Duration::from_secs(5);
        let first = fetches.recv_timeout(wait).unwrap();
        assert_eq!(first["offset"], 0);
        assert_eq!(
            first["epochs"],
            json!([[1, 0]]),
            "the fork check on the first fetch"
        );
        assert_eq!(first["lazy"], true, "no reader waits");
        // The master's history reaches the log's end: adopted (the epoch began at it).
        assert!(matches!(copier.next_event(wait), Some(Event::Epochs(_))));
        let second = fetches.recv_timeout(wait).unwrap();
        assert_eq!(second["offset"], end);
        assert_eq!(second["epochs"], Value::Null);
        assert_eq!(copier.copied(), (1, end));
        let Some(Event::Ops(h)) = copier.next_event(wait) else {
            panic!("ops expected")
        };
        assert_eq!(
            serde_json::from_slice::<Value>(&h).unwrap()["meta"]["seq"],
            3
        );
        assert_eq!(copier.confirmed(), Some(end));
        assert!(
            fetches.recv_timeout(Duration::from_millis(100)).is_err(),
            "no fetch before the ops are applied"
        );
        copier.meta_applied("i", 3);
        let third = fetches.recv_timeout(wait).unwrap();
        assert_eq!(third["meta_seq"], 3);
        assert_eq!(third["confirmed"], end);
        match copier.next_event(wait) {
            Some(Event::Handover { offset, header, .. }) => {
                assert_eq!(offset, end);
                assert_eq!(
                    serde_json::from_slice::<Value>(&header).unwrap()["truncate_to"],
                    0
                );
            }
            other => panic!("handover expected, got {other:?}"),
        }
        assert_eq!(copier.next_event(Duration::from_millis(50)), None);
        copier.halt();
        // The bytes as the master sent them; the rows for the dispatch, the marked
        // record's and the one after it kept.
        assert_eq!(
            std::fs::read(dir.join("00000000000000000000")).unwrap(),
            both
        );
        let pending = engine.take_pending_upto(10);
        let rows: Vec<(u64, bool)> = pending
            .rows
            .iter()
            .map(|r| (r.phys_offset, r.record.is_some()))
            .collect();
        assert_eq!(rows, vec![(0, false), (a.len() as u64, true)]);
        assert_eq!(pending.rows[1].queues, vec![("t/b".to_string(), 0)]);
        let _ = engine.stop();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_copy_that_does_not_continue_the_log_stops_and_writes_nothing() {
        let (engine, dir) = engine("gap");
        let r = rec("t/a", 0, 0);
        let answers = vec![(
            json!({"end": 99, "base": 0, "epoch": 2, "confirmed": 0, "epochs": [[1, 0]],
                   "meta": {}}),
            r[..r.len() - 1].to_vec(),
        )];
        let (addr, _fetches) = master(answers);
        let copier = Copier::start(engine.appender(), params(addr)).unwrap();
        match copier.next_event(Duration::from_secs(5)) {
            Some(Event::Stopped { write, .. }) => assert!(!write, "the bytes, not the disk"),
            other => panic!("stopped expected, got {other:?}"),
        }
        assert_eq!(engine.write_pos(), 0);
        let _ = engine.stop();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn halt_returns_at_once_while_the_master_does_not_answer_the_greeting() {
        // Accepted by the kernel, never answered: the copy waits in its greeting.
        let silent = TcpListener::bind("127.0.0.1:0").unwrap();
        let (engine, dir) = engine("silent");
        let copier = Copier::start(
            engine.appender(),
            params(silent.local_addr().unwrap().to_string()),
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let took = Instant::now();
        copier.halt();
        assert!(took.elapsed() < HELLO_TIMEOUT / 4, "{:?}", took.elapsed());
        match copier.next_event(Duration::from_secs(1)) {
            Some(Event::Stopped { why, write, .. }) => assert!(why == HALTED && !write),
            other => panic!("stopped expected, got {other:?}"),
        }
        let _ = engine.stop();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
