//! A client of the store's native protocol (`store/client.py`'s `NativeClient`), for
//! the reactors' appends on a gateway node: one connection to the store (of a group:
//! to its master, found by asking every node's HELLO), requests pipelined on it and
//! their answers matched by request id. One thread owns the socket; the reactor
//! threads hand it requests (`submit`) and are called back with each answer.
//!
//! While no master is found, and when the connection is lost, requests fail at once
//! (their callbacks say why), as Python's client's do; but an idempotent request
//! (`try_submit_once`: the gateway's PUBLISH frames) is stamped with the producer id
//! this connection asked for (PRODUCER_INIT), its epoch and the sequence of its first
//! message, and one whose answer was lost is sent again, stamped the same, on the next
//! master's connection, until `DELIVERY_TIMEOUT` after it was submitted, as the SDK's
//! Producer does (`store/sdk.py`): the store keeps it once (`store/producers.py`).
//! Meanwhile, idempotent requests submitted wait behind it rather than fail.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream as StdStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token, Waker};
use serde_json::{json, Value};

use crate::frame::{self, Decoder, Frame, Kind};

thread_local! {
    /// The client (its `Shared`, as an address) whose answers this thread is calling
    /// back: a request they submit is written once they are done, with no wake-up.
    static ANSWERING: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The HELLO request's code (`store/protocol.py`).
pub const HELLO: u16 = 1;
/// Dialing a node and its HELLO answer (`HELLO_TIMEOUT_S`): a stopped process's kernel
/// still accepts connections, so only an answer proves a node alive.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(2);
/// Between rounds of the master search: from, doubling up to (`SEARCH_PAUSE_S`).
/// A search waits this long for other nodes' answers once one says it is master
/// (`MASTER_GRACE_S`), and this long for the nodes that stopped answering lately once
/// the others answered (`SUSPECT_GRACE_S`).
const MASTER_GRACE: Duration = Duration::from_millis(200);
const SUSPECT_GRACE: Duration = Duration::from_millis(300);
/// How a HELLO that timed out is told.
const NO_ANSWER: &str = "no answer within";
const SEARCH_PAUSE: (Duration, Duration) = (Duration::from_millis(100), Duration::from_millis(500));
/// An answer this long overdue, with nothing heard from the node meanwhile, makes the
/// client ask the node, on a connection of its own, whether it is alive and still
/// master (`PROBE_AFTER_S`): if not, the connection ends (its requests fail) and the
/// master is looked for again. A node that answers is waited for.
pub const PROBE_AFTER: Duration = Duration::from_secs(1);
/// A refusal that says the node may no longer be master ("a replica", "stepped
/// down"): in a group, the client asks it at once.
const NOT_MASTER: u16 = 503;
/// An id the store never issued or forgot (`store/producer_ids.py`: idle for
/// `--producer-idle-s`): a frame it refused is stamped again under a new id.
const UNKNOWN_PRODUCER: u16 = 410;
/// The PRODUCER_INIT request's code (`store/protocol.py`).
pub const PRODUCER_INIT: u16 = 12;
/// An idempotent request is sent again while its answer is lost, until this long after
/// it was submitted (`store/sdk.py`'s `DELIVERY_TIMEOUT`); then it fails.
pub const DELIVERY_TIMEOUT: Duration = Duration::from_secs(120);
/// An idempotent request unanswered this long leaves its connection even when the node
/// answers the probe (a connection can stay open and carry nothing back: a NAT or
/// firewall that lost the flow), and goes again on a new one (`store/client.py`'s
/// `DEFAULT_TIMEOUT`, one attempt of the SDK's Producer).
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes of requests queued or sent and not answered yet, at most: past it a request
/// fails at once (`submit`), as Python's client refuses past its send queue, rather
/// than grow memory while the store does not read or answer.
pub const MAX_QUEUED: usize = 16 << 20;
const READ_SIZE: usize = 64 * 1024;
const WAKER: Token = Token(0);
const SOCKET: Token = Token(1);

/// What a request's callback is told: the answer frame (a RESPONSE or an ERROR), or
/// why none will come (not connected, the connection lost: the store may have carried
/// it out in the second case).
pub type Answer = Result<Frame, String>;
pub type Done = Box<dyn FnOnce(Answer) + Send>;

/// How the client finds and greets the store.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// "host:port", or a group's "a:1,b:2,c:3".
    pub addrs: String,
    /// A user's name and password for HELLO (a node user, for a gateway), or none.
    pub credentials: Option<(String, String)>,
    /// `ATTEMPT_TIMEOUT` and `DELIVERY_TIMEOUT` when zero (tests shorten them).
    pub attempt_timeout: Duration,
    pub delivery_timeout: Duration,
}

struct Request {
    code: u16,
    header: Vec<u8>,
    body: Vec<u8>,
    done: Done,
    /// Bytes counted for it (`request_cost` as submitted, before a stamp).
    cost: usize,
    once: Option<Once>,
}

/// An idempotent request's state.
struct Once {
    /// Messages in it: the sequence moves on by these.
    count: u64,
    /// When it fails if not answered by then.
    deadline: Instant,
    /// Its stamp once stamped (producer, epoch), and where in the header it starts:
    /// sent again as it is.
    stamp: Option<(Arc<str>, u64, usize)>,
    /// Times sent: once sent, the store may hold it.
    sent: u32,
}

impl Once {
    /// The header with the stamp taken off (to be stamped under a new id).
    fn unstamp(&mut self, header: &mut Vec<u8>) {
        if let Some((_, _, at)) = self.stamp.take() {
            header.truncate(at);
            header.push(b'}');
        }
    }
}

/// The producer id this connection asked for, its epoch and the next sequence.
struct Producer {
    id: Arc<str>,
    epoch: u64,
    next: u64,
}

/// `header` (a JSON object) stamped with `producer`, `epoch` and `seq`; where the
/// stamp starts. None when it is not an object.
fn stamped(header: &mut Vec<u8>, id: &str, epoch: u64, seq: u64) -> Option<usize> {
    while header.last().is_some_and(u8::is_ascii_whitespace) {
        header.pop();
    }
    if header.last() != Some(&b'}') {
        return None;
    }
    header.pop();
    let at = header.len();
    let empty = header.iter().rev().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    let id = serde_json::to_string(id).ok()?;
    let sep = if empty { "" } else { "," };
    header.extend_from_slice(
        format!(r#"{sep}"producer":{id},"epoch":{epoch},"seq":{seq}}}"#).as_bytes(),
    );
    Some(at)
}

/// A request sent and not answered yet.
struct Sent {
    request: Request,
    at: Instant,
}

#[derive(Default)]
struct Queue {
    requests: VecDeque<Request>,
    /// Bytes of the requests queued or sent and not answered yet.
    bytes: usize,
}

struct Shared {
    queue: Mutex<Queue>,
    connected: AtomicBool,
    stopping: AtomicBool,
    /// Bytes queued or unanswered (`Queue::bytes`), read without the lock.
    backlog: AtomicUsize,
    /// Requests sent and not answered yet.
    in_flight: AtomicUsize,
    /// The master it talks to, and why the last search found none.
    status: Mutex<(String, String)>,
    /// Whether idempotent requests wait for a master rather than fail at once: a lost
    /// connection left requests to send again, and what comes after waits behind them.
    holding: AtomicBool,
    /// The owner gave up on the master (a gateway cut off from it): what is held to
    /// send again fails at the next search round.
    give_up: AtomicBool,
}

/// The client: `submit` from any thread; the connection's thread does the rest.
pub struct Client {
    shared: Arc<Shared>,
    delivery_timeout: Duration,
    waker: Arc<Waker>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

fn request_cost(header: &[u8], body: &[u8]) -> usize {
    frame::HEAD + header.len() + body.len()
}

impl Client {
    pub fn start(options: Options) -> io::Result<Client> {
        let addrs: Vec<String> = options
            .addrs
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(str::to_string)
            .collect();
        if addrs.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "no store address",
            ));
        }
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            connected: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            backlog: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            status: Mutex::new((String::new(), String::new())),
            holding: AtomicBool::new(false),
            give_up: AtomicBool::new(false),
        });
        let or = |d: Duration, default| if d.is_zero() { default } else { d };
        let delivery_timeout = or(options.delivery_timeout, DELIVERY_TIMEOUT);
        let mut conn = Connection {
            poll,
            shared: Arc::clone(&shared),
            addrs,
            credentials: options.credentials,
            next_id: 1,
            suspects: HashSet::new(),
            attempt_timeout: or(options.attempt_timeout, ATTEMPT_TIMEOUT),
            delivery_timeout,
            producer: None,
            resend: VecDeque::new(),
        };
        let thread = std::thread::Builder::new()
            .name("lightgate-store-client".into())
            .spawn(move || conn.run())?;
        Ok(Client {
            shared,
            delivery_timeout,
            waker,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Send a request; `done` is called (on the client's thread, or here at once when
    /// it cannot go) with its answer.
    pub fn submit(&self, code: u16, header: Vec<u8>, body: Vec<u8>, done: Done) {
        if let Err((done, why)) = self.try_submit(code, header, body, done) {
            done(Err(why));
        }
    }

    /// `submit`, but a request that cannot go is handed back with why, its callback not
    /// called (the caller may hold a lock the callback takes).
    pub fn try_submit(
        &self,
        code: u16,
        header: Vec<u8>,
        body: Vec<u8>,
        done: Done,
    ) -> Result<(), (Done, String)> {
        self.enqueue(code, header, body, done, None)
    }

    /// `try_submit` of an idempotent request of `count` messages (its header a JSON
    /// object the stamp is added to): sent again with the same stamp while its answer
    /// is lost, until the delivery timeout; it waits for a master meanwhile.
    pub fn try_submit_once(
        &self,
        code: u16,
        header: Vec<u8>,
        body: Vec<u8>,
        count: usize,
        done: Done,
    ) -> Result<(), (Done, String)> {
        let once = Once {
            count: count as u64,
            deadline: Instant::now() + self.delivery_timeout,
            stamp: None,
            sent: 0,
        };
        self.enqueue(code, header, body, done, Some(once))
    }

    fn recovering(&self) -> bool {
        self.shared.holding.load(Ordering::Acquire)
    }

    fn enqueue(
        &self,
        code: u16,
        header: Vec<u8>,
        body: Vec<u8>,
        done: Done,
        once: Option<Once>,
    ) -> Result<(), (Done, String)> {
        // (an idempotent one waits for the next master after a connection was lost)
        let waits = once.is_some() && self.recovering();
        if !(self.shared.connected.load(Ordering::Acquire) || waits) {
            let (_, why) = self.status();
            let why = if why.is_empty() {
                "looking for its master".into()
            } else {
                why
            };
            return Err((done, format!("not connected to the store ({why})")));
        }
        let cost = request_cost(&header, &body);
        let Ok(mut q) = self.shared.queue.lock() else {
            return Err((done, "the store client stopped".into()));
        };
        if q.bytes + cost > MAX_QUEUED {
            drop(q);
            let why = format!(
                "the connection to the store is not taking requests ({MAX_QUEUED} bytes wait)"
            );
            return Err((done, why));
        }
        q.bytes += cost;
        self.shared.backlog.store(q.bytes, Ordering::Relaxed);
        q.requests.push_back(Request {
            code,
            header,
            body,
            done,
            cost,
            once,
        });
        drop(q);
        // (from its answers' callbacks: the connection's thread sends it next)
        if ANSWERING.with(|a| a.get()) != Arc::as_ptr(&self.shared) as usize {
            let _ = self.waker.wake();
        }
        Ok(())
    }

    /// Fail what is held to be sent again, and what waits behind it, when the client
    /// next finds no master or loses its connection: the owner gave up on the master (a
    /// gateway sending its clients to another gateway).
    pub fn give_up(&self) {
        self.shared.give_up.store(true, Ordering::Release);
        let _ = self.waker.wake();
    }

    pub fn connected(&self) -> bool {
        self.shared.connected.load(Ordering::Acquire)
    }

    /// Bytes of requests not answered yet.
    pub fn backlog(&self) -> usize {
        self.shared.backlog.load(Ordering::Relaxed)
    }

    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::Relaxed)
    }

    /// (the master it talks to, or ""; why the last search found none, or "").
    pub fn status(&self) -> (String, String) {
        self.shared
            .status
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default()
    }

    /// Stop: what waits fails ("stopped"), the connection closes.
    pub fn stop(&self) {
        self.shared.stopping.store(true, Ordering::Release);
        let _ = self.waker.wake();
        let thread = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A node's HELLO answer, on the connection it came on.
struct Hello {
    addr: String,
    stream: StdStream,
    decoder: Decoder,
    role: String,
    epoch: i64,
}

/// A frame's JSON header as an object (empty bytes: `{}`).
pub fn header_of(frame: &Frame) -> Value {
    if frame.header.is_empty() {
        return Value::Object(Default::default());
    }
    serde_json::from_slice(&frame.header).unwrap_or(Value::Null)
}

/// An ERROR frame's (status, message), as `_raise_for` reads them.
pub fn error_of(frame: &Frame) -> (u16, String) {
    let h = header_of(frame);
    let status = h.get("status").and_then(Value::as_u64).unwrap_or(500) as u16;
    let message = h
        .get("error")
        .and_then(Value::as_str)
        .unwrap_or("error")
        .to_string();
    (status, message)
}

struct Connection {
    poll: Poll,
    shared: Arc<Shared>,
    addrs: Vec<String>,
    credentials: Option<(String, String)>,
    next_id: u32,
    /// Nodes whose HELLO went unanswered lately: not waited for in a search.
    suspects: HashSet<String>,
    attempt_timeout: Duration,
    delivery_timeout: Duration,
    /// This connection's producer id (None: the store issues none, or none yet).
    producer: Option<Producer>,
    /// Idempotent requests a lost connection left unanswered, in the order sent: the
    /// next master's connection sends them first (their bytes still counted).
    resend: VecDeque<Request>,
}

impl Connection {
    fn run(&mut self) {
        let mut pause = SEARCH_PAUSE.0;
        while !self.shared.stopping.load(Ordering::Acquire) {
            match self.find_master() {
                Some(hello) => {
                    pause = SEARCH_PAUSE.0;
                    let name = hello.addr.clone();
                    if let Ok(mut s) = self.shared.status.lock() {
                        *s = (name.clone(), String::new());
                    }
                    let why = self.session(hello);
                    let why = format!("connection to {name} lost: {why}");
                    if let Ok(mut s) = self.shared.status.lock() {
                        *s = (String::new(), why.clone());
                    }
                    self.expire(&why);
                }
                None => {
                    let (_, why) = self.status();
                    self.expire(&why);
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(SEARCH_PAUSE.1);
                }
            }
        }
        let why = "the store client stopped";
        for r in std::mem::take(&mut self.resend) {
            self.unqueue(r.cost);
            (r.done)(Err(why.into()));
        }
        self.fail_queued(why, true);
    }

    fn status(&self) -> (String, String) {
        self.shared
            .status
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default()
    }

    /// One round: every node asked at once; the one that says it is master (the latest
    /// epoch if two do; a single store in no group is master whatever it says). The
    /// round ends `MASTER_GRACE` after a master answered (another may answer with a
    /// later epoch), or once every node was heard; nodes that stopped answering lately
    /// (`suspects`) get `SUSPECT_GRACE` after the others, not a whole HELLO timeout a
    /// round while the group elects another master (`_settle`).
    fn find_master(&mut self) -> Option<Hello> {
        let group = self.addrs.len() > 1;
        let (tx, rx) = std::sync::mpsc::channel();
        for addr in &self.addrs {
            let rid = self.next_id;
            self.next_id = self.next_id.wrapping_add(1).max(1);
            let (tx, addr, creds) = (tx.clone(), addr.clone(), self.credentials.clone());
            // Detached: one left behind answers into a closed channel, its socket closed.
            let _ = std::thread::Builder::new()
                .name("lightgate-store-hello".into())
                .spawn(move || {
                    let answer = hello(&addr, rid, creds.as_ref());
                    let _ = tx.send((addr, answer));
                });
        }
        drop(tx);
        let mut notes = Vec::new();
        let mut best: Option<Hello> = None;
        let mut heard: HashSet<String> = HashSet::new();
        let mut deadline = Instant::now() + HELLO_TIMEOUT + Duration::from_secs(1);
        while heard.len() < self.addrs.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok((addr, answer)) = rx.recv_timeout(left) else {
                break;
            };
            heard.insert(addr.clone());
            match answer {
                Ok(h) => {
                    self.suspects.remove(&addr);
                    if !group || h.role == "master" {
                        if best.as_ref().is_none_or(|b| h.epoch > b.epoch) {
                            best = Some(h);
                        }
                    } else {
                        notes.push(format!("{} is a {}", h.addr, h.role));
                    }
                }
                Err(why) => {
                    if why.contains(NO_ANSWER) {
                        self.suspects.insert(addr);
                    }
                    notes.push(why);
                }
            }
            let now = Instant::now();
            if best.is_some() {
                deadline = deadline.min(now + MASTER_GRACE);
            } else if self
                .addrs
                .iter()
                .all(|a| heard.contains(a) || self.suspects.contains(a))
            {
                deadline = deadline.min(now + SUSPECT_GRACE);
            }
        }
        for a in &self.addrs {
            if !heard.contains(a) {
                notes.push(format!("{a}: {NO_ANSWER} (left for this round)"));
            }
        }
        if best.is_none() {
            if let Ok(mut s) = self.shared.status.lock() {
                s.1 = notes.join("; ");
            }
        }
        best
    }

    /// Carry requests on the master's connection until it is lost; why it was.
    fn session(&mut self, hello: Hello) -> String {
        let Hello {
            mut stream,
            mut decoder,
            addr,
            ..
        } = hello;
        let group = self.addrs.len() > 1;
        // This connection's producer id, for the idempotent requests it stamps (a store
        // that issues none: they go unstamped, at least once, as before).
        match self.producer_init(&addr, &mut stream, &mut decoder) {
            Ok(id) => {
                self.producer = id.map(|id| Producer {
                    id,
                    epoch: 0,
                    next: 0,
                })
            }
            Err(why) => return why,
        }
        let mut recheck = false;
        if let Err(e) = stream.set_nonblocking(true) {
            return e.to_string();
        }
        let _ = stream.set_nodelay(true);
        let mut stream = TcpStream::from_std(stream);
        if let Err(e) = self.poll.registry().register(
            &mut stream,
            SOCKET,
            Interest::READABLE | Interest::WRITABLE,
        ) {
            return e.to_string();
        }
        let mut waiting: HashMap<u32, Sent> = HashMap::new();
        let mut due: VecDeque<u32> = VecDeque::new(); // sent, in the order sent
        let mut out: Vec<u8> = Vec::new();
        let mut written = 0usize; // of `out`

        // What a lost connection left: sent again first, in the order first sent.
        for r in std::mem::take(&mut self.resend) {
            self.frame_out(r, &mut out, &mut waiting, &mut due);
        }
        self.shared.connected.store(true, Ordering::Release);
        self.shared.holding.store(false, Ordering::Release);
        let mut last_heard = Instant::now();
        let mut forgotten: Option<Arc<str>> = None; // a producer id the store forgot
        let mut events = Events::with_capacity(64);
        let mut buf = vec![0u8; READ_SIZE];
        let why = loop {
            if self.shared.stopping.load(Ordering::Acquire) {
                break "stopping".to_string();
            }
            if let Err(e) = self
                .poll
                .poll(&mut events, Some(Duration::from_millis(250)))
            {
                if e.kind() != io::ErrorKind::Interrupted {
                    break e.to_string();
                }
            }
            if let Err(why) =
                self.send_queued(&mut stream, &mut out, &mut written, &mut waiting, &mut due)
            {
                break why;
            }
            // Read the answers, when the socket said it has some (edge-triggered: data
            // that comes later says so again). Not after a wake-up for new requests
            // alone: at a fleet's pace, each request's wake-up cost a read that found
            // nothing.
            let mut lost = None;
            let readable = events.iter().any(|e| {
                e.token() == SOCKET && (e.is_readable() || e.is_read_closed() || e.is_error())
            });
            // The store closed: read to its end, whatever is short (no edge comes after).
            let hangup = events
                .iter()
                .any(|e| e.token() == SOCKET && (e.is_read_closed() || e.is_error()));
            ANSWERING.with(|a| a.set(Arc::as_ptr(&self.shared) as usize));
            'read: loop {
                if !readable {
                    break;
                }
                match stream.read(&mut buf) {
                    Ok(0) => {
                        lost = Some("the store closed the connection".to_string());
                        break;
                    }
                    Ok(n) => {
                        last_heard = Instant::now();
                        let frames = match decoder.feed(&buf[..n]) {
                            Ok(frames) => frames,
                            Err(e) => {
                                lost = Some(e.to_string());
                                break;
                            }
                        };
                        for f in frames {
                            let status = (f.kind == Kind::Error).then(|| error_of(&f).0);
                            if group {
                                recheck |= status == Some(NOT_MASTER);
                            }
                            let Some(sent) = waiting.remove(&f.request_id) else {
                                continue;
                            };
                            if let Some(why) = self.keep_for_resend(&sent, status, group) {
                                // Refused for now, or under an id the store forgot:
                                // this connection ends, the request goes again.
                                if why.1 {
                                    forgotten = sent
                                        .request
                                        .once
                                        .as_ref()
                                        .and_then(|o| o.stamp.as_ref())
                                        .map(|s| Arc::clone(&s.0));
                                }
                                // (the answers read with it are taken still)
                                waiting.insert(f.request_id, sent);
                                lost.get_or_insert(why.0);
                                continue;
                            }
                            self.answered(sent.request, f);
                        }
                        if lost.is_some() {
                            break 'read;
                        }
                        if n < buf.len() && !hangup {
                            // The socket was drained (what comes next says so again):
                            // no read that only finds nothing.
                            break 'read;
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        lost = Some(e.to_string());
                        break;
                    }
                }
            }
            ANSWERING.with(|a| a.set(0));
            self.shared
                .in_flight
                .store(waiting.len(), Ordering::Relaxed);
            if let Some(why) = lost {
                break why;
            }
            // What the answers' callbacks submitted (they woke nobody): out now.
            if let Err(why) =
                self.send_queued(&mut stream, &mut out, &mut written, &mut waiting, &mut due)
            {
                break why;
            }
            while due.front().is_some_and(|rid| !waiting.contains_key(rid)) {
                due.pop_front();
            }
            let oldest = due.front().and_then(|rid| waiting.get(rid));
            if let Some(s) =
                oldest.filter(|s| s.request.once.as_ref().is_some_and(|o| o.stamp.is_some()))
            {
                if s.at.elapsed() >= self.attempt_timeout {
                    break format!(
                        "a request went unanswered for {:.1} s",
                        self.attempt_timeout.as_secs_f64()
                    );
                }
            }
            let overdue = oldest
                .map(|s| s.at.max(last_heard).elapsed())
                .filter(|late| *late >= PROBE_AFTER);
            if overdue.is_some() || recheck {
                recheck = false;
                let late = overdue.unwrap_or_default();
                if let Some(why) = self.probe(&addr, group, late) {
                    break why;
                }
                last_heard = Instant::now(); // it answers: alive
            }
        };
        self.shared.connected.store(false, Ordering::Release);
        let _ = self.poll.registry().deregister(&mut stream);
        drop(stream);
        let lost = format!("connection to the store lost: {why}");
        let stopping = self.shared.stopping.load(Ordering::Acquire);
        let mut kept = 0;
        for rid in due {
            let Some(Sent { mut request, .. }) = waiting.remove(&rid) else {
                continue;
            };
            let again = !stopping
                && request.once.as_mut().is_some_and(|o| {
                    let mine = o.stamp.as_ref().map(|s| Arc::clone(&s.0));
                    if o.sent == 1 && mine.is_some() && mine == forgotten {
                        // Under the id the store forgot and sent nowhere else: never
                        // stored, so stamped anew under the next id.
                        o.unstamp(&mut request.header);
                        return true;
                    }
                    o.stamp.is_some()
                });
            if again {
                self.resend.push_back(request);
                kept += 1;
            } else {
                self.unqueue(request.cost);
                (request.done)(Err(lost.clone()));
            }
        }
        self.shared.in_flight.store(0, Ordering::Relaxed);
        // Idempotent requests wait behind those to send again (each until its delivery
        // timeout); with none, they fail at once, as while no master is found.
        self.shared.holding.store(kept > 0, Ordering::Release);
        self.fail_queued(&lost, kept == 0);
        if kept > 0 {
            return format!("{why} ({kept} requests to send again)");
        }
        why
    }

    /// The requests submitted since the last time framed into `out`, in the order they
    /// came, and what waits in `out` written (as far as the socket takes it: its
    /// writable edge brings the rest). Err: the connection is lost, why.
    fn send_queued(
        &mut self,
        stream: &mut TcpStream,
        out: &mut Vec<u8>,
        written: &mut usize,
        waiting: &mut HashMap<u32, Sent>,
        due: &mut VecDeque<u32>,
    ) -> Result<(), String> {
        let taken = match self.shared.queue.lock() {
            Ok(mut q) => std::mem::take(&mut q.requests),
            Err(_) => return Err("poisoned".into()),
        };
        for r in taken {
            self.frame_out(r, out, waiting, due);
        }
        self.shared
            .in_flight
            .store(waiting.len(), Ordering::Relaxed);
        let mut lost = None;
        while *written < out.len() {
            match stream.write(&out[*written..]) {
                Ok(0) => {
                    lost = Some("the store closed the connection".to_string());
                    break;
                }
                Ok(n) => *written += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    lost = Some(e.to_string());
                    break;
                }
            }
        }
        if *written == out.len() {
            out.clear();
            *written = 0;
        }
        lost.map_or(Ok(()), Err)
    }

    /// Ask the store for this connection's producer id: None if it issues none (an
    /// older store, or one that refuses this user: its requests go unstamped).
    fn producer_init(
        &mut self,
        addr: &str,
        stream: &mut StdStream,
        decoder: &mut Decoder,
    ) -> Result<Option<Arc<str>>, String> {
        let rid = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        let f = call(addr, stream, decoder, rid, PRODUCER_INIT, &json!({}))?;
        if f.kind == Kind::Error {
            return Ok(None);
        }
        let h = header_of(&f);
        Ok(h.get("producer").and_then(Value::as_str).map(Arc::from))
    }

    /// A request into `out` (stamped first when it is idempotent and not yet), and
    /// into `waiting`.
    fn frame_out(
        &mut self,
        mut r: Request,
        out: &mut Vec<u8>,
        waiting: &mut HashMap<u32, Sent>,
        due: &mut VecDeque<u32>,
    ) {
        if let (Some(o), Some(p)) = (r.once.as_mut(), self.producer.as_mut()) {
            if o.stamp.is_none() {
                if let Some(at) = stamped(&mut r.header, &p.id, p.epoch, p.next) {
                    o.stamp = Some((Arc::clone(&p.id), p.epoch, at));
                    p.next += o.count;
                }
            }
        }
        let rid = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        let f = Frame {
            kind: Kind::Request,
            code: r.code,
            request_id: rid,
            header: std::mem::take(&mut r.header),
            body: std::mem::take(&mut r.body),
        };
        let encoded = frame::encode_into(&f, out);
        (r.header, r.body) = (f.header, f.body);
        if let Err(e) = encoded {
            self.unqueue(r.cost);
            (r.done)(Err(e.to_string()));
            return;
        }
        if let Some(o) = r.once.as_mut() {
            o.sent += 1;
        }
        waiting.insert(
            rid,
            Sent {
                request: r,
                at: Instant::now(),
            },
        );
        due.push_back(rid);
    }

    /// Whether an answer leaves a stamped request to be sent again on the next master's
    /// connection: a refusal for now in a group (503: a replica, a lease lost, the in-sync
    /// set not reached; the store may hold it), or an id the store forgot. (why, forgot)
    fn keep_for_resend(
        &self,
        sent: &Sent,
        status: Option<u16>,
        group: bool,
    ) -> Option<(String, bool)> {
        let once = sent.request.once.as_ref()?;
        once.stamp.as_ref()?;
        match status? {
            NOT_MASTER if group => Some(("it refused a request for now (503)".into(), false)),
            // (sent before: it may be stored under that id; refused, at least once)
            UNKNOWN_PRODUCER if once.sent == 1 => {
                Some(("it forgot this client's producer id (410)".into(), true))
            }
            _ => None,
        }
    }

    /// An answer to its request's callback. A refusal of a stamped request (nothing of
    /// it stored) leaves a gap in the sequence: what is stamped next starts a new epoch.
    fn answered(&mut self, r: Request, f: Frame) {
        if f.kind == Kind::Error {
            if let (Some((id, epoch, _)), Some(p)) = (
                r.once.as_ref().and_then(|o| o.stamp.as_ref()),
                self.producer.as_mut(),
            ) {
                if *id == p.id && *epoch == p.epoch {
                    p.epoch += 1;
                    p.next = 0;
                }
            }
        }
        self.unqueue(r.cost);
        (r.done)(Ok(f));
    }

    /// Ask the node on a new connection (blocking this thread `HELLO_TIMEOUT` at
    /// most: its connection is suspect already); why to leave it, or None to stay.
    fn probe(&mut self, addr: &str, group: bool, late: Duration) -> Option<String> {
        let rid = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        match hello(addr, rid, self.credentials.as_ref()) {
            Ok(h) if group && h.role != "master" => {
                Some(format!("it is no longer master (now {})", h.role))
            }
            Ok(_) => None,
            Err(why) if why.contains("refused our credentials") => None, // alive
            Err(why) => Some(format!(
                "a request {:.1} s overdue, then a HELLO on a new connection: {why}",
                late.as_secs_f64()
            )),
        }
    }

    fn unqueue(&self, n: usize) {
        if let Ok(mut q) = self.shared.queue.lock() {
            q.bytes = q.bytes.saturating_sub(n);
            self.shared.backlog.store(q.bytes, Ordering::Relaxed);
        }
    }

    /// Fail what waits to be sent (submitted, not framed yet): all of it, or what is
    /// not idempotent (idempotent requests wait for the next master).
    fn fail_queued(&self, why: &str, all: bool) {
        let taken = match self.shared.queue.lock() {
            Ok(mut q) => {
                let (fail, keep): (VecDeque<Request>, VecDeque<Request>) =
                    std::mem::take(&mut q.requests)
                        .into_iter()
                        .partition(|r| all || r.once.is_none());
                q.requests = keep;
                for r in &fail {
                    q.bytes = q.bytes.saturating_sub(r.cost);
                }
                self.shared.backlog.store(q.bytes, Ordering::Relaxed);
                fail
            }
            Err(_) => return,
        };
        for r in taken {
            (r.done)(Err(why.to_string()));
        }
    }

    /// While no master is found: the idempotent requests past their delivery timeout
    /// fail, and once none is left to send again, everything waiting does.
    fn expire(&mut self, why: &str) {
        let now = Instant::now();
        let given_up = self.shared.give_up.swap(false, Ordering::AcqRel);
        let late = |r: &Request| given_up || r.once.as_ref().is_none_or(|o| now >= o.deadline);
        let timed_out = format!(
            "not delivered within {} s: {why}",
            self.delivery_timeout.as_secs_f64()
        );
        let (fail, keep): (VecDeque<Request>, VecDeque<Request>) =
            std::mem::take(&mut self.resend).into_iter().partition(late);
        self.resend = keep;
        let over = self.resend.is_empty();
        if over {
            self.shared.holding.store(false, Ordering::Release);
        }
        let late = |r: &Request| over || late(r);
        for r in fail {
            self.unqueue(r.cost);
            (r.done)(Err(timed_out.clone()));
        }
        let taken = match self.shared.queue.lock() {
            Ok(mut q) => {
                let (fail, keep): (VecDeque<Request>, VecDeque<Request>) =
                    std::mem::take(&mut q.requests).into_iter().partition(late);
                q.requests = keep;
                for r in &fail {
                    q.bytes = q.bytes.saturating_sub(r.cost);
                }
                self.shared.backlog.store(q.bytes, Ordering::Relaxed);
                fail
            }
            Err(_) => return,
        };
        for r in taken {
            (r.done)(Err(timed_out.clone()));
        }
    }
}

/// Dial `addr` and greet it, within `HELLO_TIMEOUT`.
fn hello(addr: &str, rid: u32, creds: Option<&(String, String)>) -> Result<Hello, String> {
    let fail = |why: String| format!("{addr} unreachable ({why})");
    let sockaddr: SocketAddr = addr
        .to_socket_addrs()
        .map_err(|e| fail(e.to_string()))?
        .next()
        .ok_or_else(|| fail("no address".into()))?;
    let mut stream =
        StdStream::connect_timeout(&sockaddr, HELLO_TIMEOUT).map_err(|e| fail(e.to_string()))?;
    let mut header = json!({"sdk": "lightgate-native"});
    if let Some((user, password)) = creds {
        header["username"] = json!(user);
        header["password"] = json!(password);
    }
    let mut decoder = Decoder::new(frame::MAX_FRAME);
    let f = call(addr, &mut stream, &mut decoder, rid, HELLO, &header)?;
    if f.kind == Kind::Error {
        let (status, message) = error_of(&f);
        return Err(format!(
            "{addr} refused our credentials: {status}: {message}"
        ));
    }
    let h = header_of(&f);
    let role = h
        .get("role")
        .and_then(Value::as_str)
        .filter(|r| !r.is_empty())
        .unwrap_or("master")
        .to_string();
    let epoch = h.get("epoch").and_then(Value::as_i64).unwrap_or(0);
    Ok(Hello {
        addr: addr.to_string(),
        stream,
        decoder,
        role,
        epoch,
    })
}

/// One request on a blocking connection and its answer (a RESPONSE or an ERROR),
/// within `HELLO_TIMEOUT`.
fn call(
    addr: &str,
    stream: &mut StdStream,
    decoder: &mut Decoder,
    rid: u32,
    code: u16,
    header: &Value,
) -> Result<Frame, String> {
    let fail = |why: String| format!("{addr} unreachable ({why})");
    let deadline = Instant::now() + HELLO_TIMEOUT;
    let request = Frame {
        kind: Kind::Request,
        code,
        request_id: rid,
        header: serde_json::to_vec(header).map_err(|e| fail(e.to_string()))?,
        body: Vec::new(),
    };
    let bytes = frame::encode(&request).map_err(|e| fail(e.to_string()))?;
    stream.write_all(&bytes).map_err(|e| fail(e.to_string()))?;
    let mut buf = vec![0u8; 4096];
    let silent = || format!("{addr}: {NO_ANSWER} {} s", HELLO_TIMEOUT.as_secs());
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(silent());
        }
        stream
            .set_read_timeout(Some(left))
            .map_err(|e| fail(e.to_string()))?;
        let n = match stream.read(&mut buf) {
            Ok(0) => return Err(fail("the store closed the connection".into())),
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(silent())
            }
            Err(e) => return Err(fail(e.to_string())),
        };
        for f in decoder.feed(&buf[..n]).map_err(|e| fail(e.to_string()))? {
            if f.request_id == rid {
                let _ = stream.set_read_timeout(None);
                return Ok(f);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::sync::mpsc;

    /// A store that answers HELLO with `hello` and each other request with what
    /// `answer` makes of it (None: no answer; the connection closes when it says so).
    fn server(
        hello: Value,
        answer: impl Fn(&Frame) -> Option<Frame> + Send + Sync + 'static,
        close_after: Option<usize>,
    ) -> (String, mpsc::Receiver<Frame>) {
        scripted(hello, move |_, seen, f| match answer(f) {
            _ if close_after.is_some_and(|c| seen + 1 >= c) => Act::Close,
            Some(r) => Act::Reply(r),
            None => Act::Silent,
        })
    }

    enum Act {
        Reply(Frame),
        Silent,
        /// The connection closes, the request unanswered.
        Close,
    }

    /// A store that answers HELLO with `hello`, PRODUCER_INIT with the id "p<n>" (its
    /// n-th connection), and each other request as `act` says of it (given the
    /// requests seen before it, on every connection and on this one). A thread per
    /// connection: a silent one stays open.
    fn scripted(
        hello: Value,
        act: impl Fn(usize, usize, &Frame) -> Act + Send + Sync + 'static,
    ) -> (String, mpsc::Receiver<Frame>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, rx) = mpsc::channel();
        let act = Arc::new(act);
        let all = Arc::new(AtomicUsize::new(0));
        std::thread::spawn(move || {
            for (conn, s) in listener.incoming().enumerate() {
                let Ok(mut s) = s else { return };
                let (tx, act, all, hello) = (
                    tx.clone(),
                    Arc::clone(&act),
                    Arc::clone(&all),
                    hello.clone(),
                );
                std::thread::spawn(move || {
                    let mut d = Decoder::new(frame::MAX_FRAME);
                    let mut buf = [0u8; 4096];
                    let mut seen = 0;
                    loop {
                        let n = match s.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        for f in d.feed(&buf[..n]).unwrap() {
                            let reply = |header: Value| Frame {
                                kind: Kind::Response,
                                code: f.code,
                                request_id: f.request_id,
                                header: serde_json::to_vec(&header).unwrap(),
                                body: Vec::new(),
                            };
                            let r = match f.code {
                                HELLO => reply(hello.clone()),
                                PRODUCER_INIT => reply(json!({"producer": format!("p{conn}")})),
                                _ => {
                                    let _ = tx.send(f.clone());
                                    let a = act(all.fetch_add(1, Ordering::SeqCst), seen, &f);
                                    seen += 1;
                                    match a {
                                        Act::Reply(r) => r,
                                        Act::Silent => continue,
                                        Act::Close => return,
                                    }
                                }
                            };
                            if s.write_all(&frame::encode(&r).unwrap()).is_err() {
                                return;
                            }
                        }
                    }
                });
            }
        });
        (addr, rx)
    }

    fn answered(client: &Client, code: u16, header: &str, body: &[u8]) -> Answer {
        let (tx, rx) = mpsc::channel();
        client.submit(
            code,
            header.as_bytes().to_vec(),
            body.to_vec(),
            Box::new(move |a| {
                let _ = tx.send(a);
            }),
        );
        rx.recv_timeout(Duration::from_secs(10)).unwrap()
    }

    fn wait_connected(client: &Client) {
        let until = Instant::now() + Duration::from_secs(10);
        while !client.connected() {
            assert!(
                Instant::now() < until,
                "not connected: {:?}",
                client.status()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn echo(f: &Frame) -> Option<Frame> {
        Some(Frame {
            kind: Kind::Response,
            code: f.code,
            request_id: f.request_id,
            header: f.header.clone(),
            body: f.body.clone(),
        })
    }

    #[test]
    fn pipelines_requests_and_matches_answers_by_id() {
        let (addr, rx) = server(json!({"role": "master"}), echo, None);
        let client = Client::start(Options {
            addrs: addr,
            credentials: Some(("gw".into(), "pw".into())),
            ..Default::default()
        })
        .unwrap();
        wait_connected(&client);
        let (tx, answers) = mpsc::channel();
        for i in 0..50u32 {
            let tx = tx.clone();
            client.submit(
                11,
                format!("{{\"n\":{i}}}").into_bytes(),
                vec![i as u8],
                Box::new(move |a| {
                    let _ = tx.send((i, a));
                }),
            );
        }
        for _ in 0..50 {
            let (i, a) = answers.recv_timeout(Duration::from_secs(10)).unwrap();
            let f = a.unwrap();
            assert_eq!(f.header, format!("{{\"n\":{i}}}").into_bytes());
            assert_eq!(f.body, vec![i as u8]);
        }
        assert_eq!(
            client.backlog(),
            0,
            "what was answered is no longer counted"
        );
        // Sent in the order submitted.
        let seen: Vec<u8> = (0..50).map(|_| rx.recv().unwrap().body[0]).collect();
        assert_eq!(seen, (0..50).collect::<Vec<u8>>());
    }

    #[test]
    fn errors_come_back_as_frames() {
        let (addr, _rx) = server(
            json!({}),
            |f| {
                Some(Frame {
                    kind: Kind::Error,
                    code: f.code,
                    request_id: f.request_id,
                    header: br#"{"status":507,"error":"no space left"}"#.to_vec(),
                    body: Vec::new(),
                })
            },
            None,
        );
        let client = Client::start(Options {
            addrs: addr,
            credentials: None,
            ..Default::default()
        })
        .unwrap();
        wait_connected(&client);
        let f = answered(&client, 11, "{}", b"").unwrap();
        assert_eq!(f.kind, Kind::Error);
        assert_eq!(error_of(&f), (507, "no space left".to_string()));
    }

    #[test]
    fn a_lost_connection_fails_what_waits_and_the_client_comes_back() {
        // No answers, and the connection closes after the second request.
        let (addr, _rx) = server(json!({"role": "master"}), |_| None, Some(2));
        let client = Client::start(Options {
            addrs: addr,
            credentials: None,
            ..Default::default()
        })
        .unwrap();
        wait_connected(&client);
        let (tx, rx) = mpsc::channel();
        for _ in 0..2 {
            let tx = tx.clone();
            client.submit(
                11,
                b"{}".to_vec(),
                Vec::new(),
                Box::new(move |a| {
                    let _ = tx.send(a);
                }),
            );
        }
        for _ in 0..2 {
            let a = rx.recv_timeout(Duration::from_secs(10)).unwrap();
            assert!(a.unwrap_err().contains("lost"));
        }
        wait_connected(&client); // found again
        assert_eq!(client.backlog(), 0);
    }

    #[test]
    fn a_group_goes_to_its_master() {
        let (replica, replica_seen) = server(json!({"role": "replica", "epoch": 3}), echo, None);
        let (stale, _) = server(json!({"role": "master", "epoch": 2}), echo, None);
        let (master, master_seen) = server(json!({"role": "master", "epoch": 3}), echo, None);
        let client = Client::start(Options {
            addrs: format!("{replica},{stale},{master}"),
            credentials: None,
            ..Default::default()
        })
        .unwrap();
        wait_connected(&client);
        answered(&client, 11, "{}", b"x").unwrap();
        assert_eq!(
            master_seen
                .recv_timeout(Duration::from_secs(5))
                .unwrap()
                .body,
            b"x"
        );
        assert!(replica_seen.try_recv().is_err());
        assert_eq!(client.status().0, master);
    }

    /// A node that answers HELLO once (and PRODUCER_INIT), then nothing on any
    /// connection (SIGSTOP's view).
    fn hung_after_hello() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for (n, s) in listener.incoming().enumerate() {
                let Ok(mut s) = s else { return };
                if n == 0 {
                    // HELLO, then PRODUCER_INIT (no id: the store issues none).
                    let mut d = Decoder::new(frame::MAX_FRAME);
                    let mut buf = [0u8; 4096];
                    let mut answered = 0;
                    while answered < 2 {
                        let k = s.read(&mut buf).unwrap();
                        for f in d.feed(&buf[..k]).unwrap() {
                            let answer = Frame {
                                kind: Kind::Response,
                                code: f.code,
                                request_id: f.request_id,
                                header: Vec::new(),
                                body: Vec::new(),
                            };
                            s.write_all(&frame::encode(&answer).unwrap()).unwrap();
                            answered += 1;
                        }
                    }
                }
                held.push(s); // open, silent
            }
        });
        addr
    }

    #[test]
    fn a_hung_node_is_asked_and_left() {
        let client = Client::start(Options {
            addrs: hung_after_hello(),
            credentials: None,
            ..Default::default()
        })
        .unwrap();
        wait_connected(&client);
        let started = Instant::now();
        let err = answered(&client, 11, "{}", b"").unwrap_err();
        assert!(err.contains("overdue"), "{err}");
        let took = started.elapsed();
        assert!(
            took >= PROBE_AFTER && took < PROBE_AFTER + HELLO_TIMEOUT * 3,
            "{took:?}"
        );
    }

    #[test]
    fn without_a_store_requests_fail_at_once() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        drop(listener);
        let client = Client::start(Options {
            addrs: addr,
            credentials: None,
            ..Default::default()
        })
        .unwrap();
        let err = answered(&client, 11, "{}", b"").unwrap_err();
        assert!(err.starts_with("not connected to the store"), "{err}");
    }

    /// Each idempotent request's (producer, epoch, seq).
    fn stamp_of(f: &Frame) -> (String, u64, u64) {
        let h = header_of(f);
        (
            h["producer"].as_str().unwrap().to_string(),
            h["epoch"].as_u64().unwrap(),
            h["seq"].as_u64().unwrap(),
        )
    }

    fn submit_once(client: &Client, body: &[u8], count: usize) -> mpsc::Receiver<Answer> {
        let (tx, rx) = mpsc::channel();
        client
            .try_submit_once(
                11,
                br#"{"messages":[]}"#.to_vec(),
                body.to_vec(),
                count,
                Box::new(move |a| {
                    let _ = tx.send(a);
                }),
            )
            .map_err(|(_, why)| why)
            .unwrap();
        rx
    }

    fn refused(f: &Frame, status: u16) -> Frame {
        Frame {
            kind: Kind::Error,
            code: f.code,
            request_id: f.request_id,
            header: format!(r#"{{"status":{status},"error":"no"}}"#).into_bytes(),
            body: Vec::new(),
        }
    }

    #[test]
    fn idempotent_requests_are_stamped_one_sequence_a_refusal_a_new_epoch() {
        let (addr, seen) = scripted(json!({"role": "master"}), |_, _, f| {
            Act::Reply(if f.body == b"full" {
                refused(f, 507)
            } else {
                echo(f).unwrap()
            })
        });
        let client = Client::start(Options {
            addrs: addr,
            ..Default::default()
        })
        .unwrap();
        wait_connected(&client);
        for (body, count) in [
            (&b"a"[..], 2),
            (b"b", 1),
            (b"full", 3),
            (b"c", 1),
            (b"d", 4),
        ] {
            submit_once(&client, body, count)
                .recv_timeout(Duration::from_secs(10))
                .unwrap()
                .unwrap();
        }
        let stamps: Vec<_> = (0..5).map(|_| stamp_of(&seen.recv().unwrap())).collect();
        let p = |e, s| ("p0".to_string(), e, s);
        // 0-1, 2, (3-5 refused: a gap), then epoch 1 from 0.
        assert_eq!(stamps, vec![p(0, 0), p(0, 2), p(0, 3), p(1, 0), p(1, 1)]);
        // Plain requests go unstamped.
        let f = answered(&client, 11, "{}", b"");
        assert_eq!(f.unwrap().header, b"{}");
        assert_eq!(client.backlog(), 0);
    }

    #[test]
    fn stamps_are_added_to_the_header_object() {
        let mut h = br#"{"messages":[1]} "#.to_vec();
        let at = stamped(&mut h, "ab\"c", 2, 7).unwrap();
        assert_eq!(
            String::from_utf8(h.clone()).unwrap(),
            r#"{"messages":[1],"producer":"ab\"c","epoch":2,"seq":7}"#
        );
        let mut once = Once {
            count: 1,
            deadline: Instant::now(),
            stamp: Some(("ab".into(), 2, at)),
            sent: 1,
        };
        once.unstamp(&mut h);
        assert_eq!(h, br#"{"messages":[1]}"#);
        let mut empty = b"{}".to_vec();
        stamped(&mut empty, "p", 0, 0).unwrap();
        assert_eq!(empty, br#"{"producer":"p","epoch":0,"seq":0}"#);
        assert_eq!(stamped(&mut b"[1]".to_vec(), "p", 0, 0), None);
    }

    #[test]
    fn a_lost_connection_sends_idempotent_requests_again_stamped_the_same() {
        // The first connection takes three requests, answers none and closes; then all
        // is answered.
        let (addr, seen) = scripted(json!({"role": "master"}), |all, _, f| match all {
            0 | 1 => Act::Silent,
            2 => Act::Close,
            _ => Act::Reply(echo(f).unwrap()),
        });
        let client = Client::start(Options {
            addrs: addr,
            ..Default::default()
        })
        .unwrap();
        wait_connected(&client);
        let a = submit_once(&client, b"a", 2);
        let b = submit_once(&client, b"b", 1);
        let plain = {
            let (tx, rx) = mpsc::channel();
            client.submit(
                11,
                b"{}".to_vec(),
                b"plain".to_vec(),
                Box::new(move |a| {
                    let _ = tx.send(a);
                }),
            );
            rx
        };
        let lost = plain.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(lost.unwrap_err().contains("lost"), "a plain request fails");
        assert_eq!(
            a.recv_timeout(Duration::from_secs(10))
                .unwrap()
                .unwrap()
                .body,
            b"a"
        );
        assert_eq!(
            b.recv_timeout(Duration::from_secs(10))
                .unwrap()
                .unwrap()
                .body,
            b"b"
        );
        let c = submit_once(&client, b"c", 1); // the new connection's own id
        c.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
        let frames: Vec<Frame> = seen.try_iter().collect();
        let bodies: Vec<&[u8]> = frames.iter().map(|f| &f.body[..]).collect();
        assert_eq!(bodies, [&b"a"[..], b"b", b"plain", b"a", b"b", b"c"]);
        let stamps: Vec<_> = frames
            .iter()
            .filter(|f| f.body != b"plain")
            .map(stamp_of)
            .collect();
        let first = stamps[0].0.clone();
        let p = |id: &str, s| (id.to_string(), 0, s);
        let second = stamps[4].0.clone();
        assert_ne!(first, second, "a producer id per connection");
        assert_eq!(
            stamps,
            vec![
                p(&first, 0),
                p(&first, 2),
                p(&first, 0),
                p(&first, 2),
                p(&second, 0)
            ]
        );
        assert_eq!(client.backlog(), 0);
    }

    #[test]
    fn a_silent_connection_is_left_and_the_request_goes_again() {
        let (addr, seen) = scripted(json!({"role": "master"}), |all, _, f| match all {
            0 => Act::Silent, // the connection stays open and says nothing
            _ => Act::Reply(echo(f).unwrap()),
        });
        let client = Client::start(Options {
            addrs: addr,
            attempt_timeout: Duration::from_millis(300),
            ..Default::default()
        })
        .unwrap();
        wait_connected(&client);
        let a = submit_once(&client, b"a", 1);
        assert_eq!(
            a.recv_timeout(Duration::from_secs(10))
                .unwrap()
                .unwrap()
                .body,
            b"a"
        );
        let stamps: Vec<_> = seen.try_iter().map(|f| stamp_of(&f)).collect();
        assert_eq!(stamps.len(), 2);
        assert_eq!(stamps[0], stamps[1], "sent again stamped the same");
    }

    #[test]
    fn a_request_never_answered_fails_after_the_delivery_timeout() {
        let (addr, _seen) = scripted(json!({"role": "master"}), |_, _, _| Act::Close);
        let client = Client::start(Options {
            addrs: addr,
            delivery_timeout: Duration::from_millis(700),
            ..Default::default()
        })
        .unwrap();
        wait_connected(&client);
        let started = Instant::now();
        let a = submit_once(&client, b"a", 1);
        let err = a
            .recv_timeout(Duration::from_secs(10))
            .unwrap()
            .unwrap_err();
        assert!(err.contains("not delivered within"), "{err}");
        assert!(started.elapsed() >= Duration::from_millis(700));
        assert_eq!(client.backlog(), 0);
    }

    #[test]
    fn a_forgotten_producer_id_is_asked_again_and_the_request_stamped_anew() {
        let (addr, seen) = scripted(json!({"role": "master"}), |all, _, f| match all {
            0 => Act::Reply(refused(f, UNKNOWN_PRODUCER)),
            _ => Act::Reply(echo(f).unwrap()),
        });
        let client = Client::start(Options {
            addrs: addr,
            ..Default::default()
        })
        .unwrap();
        wait_connected(&client);
        let a = submit_once(&client, b"a", 1);
        assert_eq!(
            a.recv_timeout(Duration::from_secs(10))
                .unwrap()
                .unwrap()
                .kind,
            Kind::Response
        );
        let stamps: Vec<_> = seen.try_iter().map(|f| stamp_of(&f)).collect();
        assert_eq!(stamps.len(), 2);
        assert_ne!(stamps[0].0, stamps[1].0);
        assert_eq!(stamps[1].2, 0);
    }

    #[test]
    fn a_refusal_for_now_in_a_group_sends_the_request_again() {
        let (master, seen) = scripted(
            json!({"role": "master", "epoch": 2}),
            |all, _, f| match all {
                0 => Act::Reply(refused(f, NOT_MASTER)),
                _ => Act::Reply(echo(f).unwrap()),
            },
        );
        let (replica, _) = scripted(json!({"role": "replica", "epoch": 2}), |_, _, _| Act::Close);
        let client = Client::start(Options {
            addrs: format!("{replica},{master}"),
            ..Default::default()
        })
        .unwrap();
        wait_connected(&client);
        let a = submit_once(&client, b"a", 1);
        let f = a.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
        assert_eq!(f.kind, Kind::Response);
        let stamps: Vec<_> = seen.try_iter().map(|f| stamp_of(&f)).collect();
        assert_eq!(stamps.len(), 2);
        assert_eq!(stamps[0], stamps[1], "sent again stamped the same");
    }

    #[test]
    fn what_is_held_fails_when_the_owner_gives_up() {
        let (addr, _seen) = scripted(json!({"role": "master"}), |_, _, _| Act::Close);
        let client = Client::start(Options {
            addrs: addr,
            ..Default::default()
        })
        .unwrap();
        wait_connected(&client);
        let a = submit_once(&client, b"a", 1);
        assert!(
            a.recv_timeout(Duration::from_millis(500)).is_err(),
            "held, not failed"
        );
        client.give_up();
        let err = a
            .recv_timeout(Duration::from_secs(10))
            .unwrap()
            .unwrap_err();
        assert!(err.contains("not delivered"), "{err}");
        assert_eq!(client.backlog(), 0);
    }
}
