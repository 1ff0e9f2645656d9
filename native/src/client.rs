//! A client of the store's native protocol (`store/client.py`'s `NativeClient`), for
//! the reactors' appends on a gateway node: one connection to the store (of a group:
//! to its master, found by asking every node's HELLO), requests pipelined on it and
//! their answers matched by request id. One thread owns the socket; the reactor
//! threads hand it requests (`submit`) and are called back with each answer.
//!
//! While no master is found, and when the connection is lost, requests fail at once
//! (their callbacks say why): a write is never sent again here, the caller decides
//! (a device resends a QoS 1 publish it saw no PUBACK for), as Python's client does.

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
}

struct Request {
    code: u16,
    header: Vec<u8>,
    body: Vec<u8>,
    done: Done,
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
}

/// The client: `submit` from any thread; the connection's thread does the rest.
pub struct Client {
    shared: Arc<Shared>,
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
        });
        let mut conn = Connection {
            poll,
            shared: Arc::clone(&shared),
            addrs,
            credentials: options.credentials,
            next_id: 1,
            suspects: HashSet::new(),
        };
        let thread = std::thread::Builder::new()
            .name("lightgate-store-client".into())
            .spawn(move || conn.run())?;
        Ok(Client {
            shared,
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
        if !self.shared.connected.load(Ordering::Acquire) {
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
        });
        drop(q);
        let _ = self.waker.wake();
        Ok(())
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
                    if let Ok(mut s) = self.shared.status.lock() {
                        *s = (String::new(), format!("connection to {name} lost: {why}"));
                    }
                }
                None => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(SEARCH_PAUSE.1);
                }
            }
        }
        self.fail_queued("the store client stopped");
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
            stream,
            mut decoder,
            addr,
            ..
        } = hello;
        let group = self.addrs.len() > 1;
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
        self.shared.connected.store(true, Ordering::Release);
        let mut waiting: HashMap<u32, (Done, usize)> = HashMap::new();
        let mut due: VecDeque<(u32, Instant)> = VecDeque::new();
        let mut out: Vec<u8> = Vec::new();
        let mut written = 0usize; // of `out`
        let mut last_heard = Instant::now();
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
            // New requests: framed into `out`, in the order they came.
            let taken = match self.shared.queue.lock() {
                Ok(mut q) => std::mem::take(&mut q.requests),
                Err(_) => break "poisoned".into(),
            };
            let now = Instant::now();
            for r in taken {
                let rid = self.next_id;
                self.next_id = self.next_id.wrapping_add(1).max(1);
                let f = Frame {
                    kind: Kind::Request,
                    code: r.code,
                    request_id: rid,
                    header: r.header,
                    body: r.body,
                };
                let cost = request_cost(&f.header, &f.body);
                if let Err(e) = frame::encode_into(&f, &mut out) {
                    self.unqueue(cost);
                    (r.done)(Err(e.to_string()));
                    continue;
                }
                waiting.insert(rid, (r.done, cost));
                due.push_back((rid, now));
            }
            self.shared
                .in_flight
                .store(waiting.len(), Ordering::Relaxed);
            // Write what waits.
            let mut lost = None;
            while written < out.len() {
                match stream.write(&out[written..]) {
                    Ok(0) => {
                        lost = Some("the store closed the connection".to_string());
                        break;
                    }
                    Ok(n) => written += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        lost = Some(e.to_string());
                        break;
                    }
                }
            }
            if written == out.len() {
                out.clear();
                written = 0;
            }
            if let Some(why) = lost {
                break why;
            }
            // Read the answers.
            let mut lost = None;
            loop {
                match stream.read(&mut buf) {
                    Ok(0) => {
                        lost = Some("the store closed the connection".to_string());
                        break;
                    }
                    Ok(n) => {
                        last_heard = Instant::now();
                        match decoder.feed(&buf[..n]) {
                            Ok(frames) => {
                                for f in frames {
                                    if group && f.kind == Kind::Error {
                                        recheck |= error_of(&f).0 == NOT_MASTER;
                                    }
                                    if let Some((done, cost)) = waiting.remove(&f.request_id) {
                                        self.unqueue(cost);
                                        done(Ok(f));
                                    }
                                }
                            }
                            Err(e) => {
                                lost = Some(e.to_string());
                                break;
                            }
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
            self.shared
                .in_flight
                .store(waiting.len(), Ordering::Relaxed);
            if let Some(why) = lost {
                break why;
            }
            while due
                .front()
                .is_some_and(|(rid, _)| !waiting.contains_key(rid))
            {
                due.pop_front();
            }
            let overdue = due
                .front()
                .map(|(_, sent)| (*sent).max(last_heard).elapsed())
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
        for (_, (done, cost)) in waiting.drain() {
            self.unqueue(cost);
            done(Err(lost.clone()));
        }
        self.shared.in_flight.store(0, Ordering::Relaxed);
        self.fail_queued(&lost);
        why
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

    /// Fail what waits to be sent (submitted while connected, not framed yet).
    fn fail_queued(&self, why: &str) {
        let taken = match self.shared.queue.lock() {
            Ok(mut q) => {
                let t = std::mem::take(&mut q.requests);
                for r in &t {
                    q.bytes = q.bytes.saturating_sub(request_cost(&r.header, &r.body));
                }
                self.shared.backlog.store(q.bytes, Ordering::Relaxed);
                t
            }
            Err(_) => return,
        };
        for r in taken {
            (r.done)(Err(why.to_string()));
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
    let deadline = Instant::now() + HELLO_TIMEOUT;
    let mut stream =
        StdStream::connect_timeout(&sockaddr, HELLO_TIMEOUT).map_err(|e| fail(e.to_string()))?;
    let mut header = json!({"sdk": "lightgate-native"});
    if let Some((user, password)) = creds {
        header["username"] = json!(user);
        header["password"] = json!(password);
    }
    let request = Frame {
        kind: Kind::Request,
        code: HELLO,
        request_id: rid,
        header: serde_json::to_vec(&header).map_err(|e| fail(e.to_string()))?,
        body: Vec::new(),
    };
    let bytes = frame::encode(&request).map_err(|e| fail(e.to_string()))?;
    stream.write_all(&bytes).map_err(|e| fail(e.to_string()))?;
    let mut decoder = Decoder::new(frame::MAX_FRAME);
    let mut buf = vec![0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "{addr}: no answer within {} s",
                HELLO_TIMEOUT.as_secs()
            ));
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
                return Err(format!(
                    "{addr}: no answer within {} s",
                    HELLO_TIMEOUT.as_secs()
                ))
            }
            Err(e) => return Err(fail(e.to_string())),
        };
        for f in decoder.feed(&buf[..n]).map_err(|e| fail(e.to_string()))? {
            if f.request_id != rid {
                continue;
            }
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
            let _ = stream.set_read_timeout(None);
            return Ok(Hello {
                addr: addr.to_string(),
                stream,
                decoder,
                role,
                epoch,
            });
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
        answer: impl Fn(&Frame) -> Option<Frame> + Send + 'static,
        close_after: Option<usize>,
    ) -> (String, mpsc::Receiver<Frame>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for s in listener.incoming() {
                let Ok(mut s) = s else { return };
                let mut d = Decoder::new(frame::MAX_FRAME);
                let mut buf = [0u8; 4096];
                let mut seen = 0;
                'conn: loop {
                    let n = match s.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    for f in d.feed(&buf[..n]).unwrap() {
                        let reply = if f.code == HELLO {
                            Some(Frame {
                                kind: Kind::Response,
                                code: HELLO,
                                request_id: f.request_id,
                                header: serde_json::to_vec(&hello).unwrap(),
                                body: Vec::new(),
                            })
                        } else {
                            seen += 1;
                            let _ = tx.send(f.clone());
                            answer(&f)
                        };
                        if let Some(r) = reply {
                            s.write_all(&frame::encode(&r).unwrap()).unwrap();
                        }
                        if close_after.is_some_and(|c| seen >= c) {
                            break 'conn;
                        }
                    }
                }
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

    /// A node that answers HELLO once, then nothing on any connection (SIGSTOP's view).
    fn hung_after_hello() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for (n, s) in listener.incoming().enumerate() {
                let Ok(mut s) = s else { return };
                if n == 0 {
                    let mut d = Decoder::new(frame::MAX_FRAME);
                    let mut buf = [0u8; 4096];
                    let k = s.read(&mut buf).unwrap();
                    let f = d.feed(&buf[..k]).unwrap().remove(0);
                    let answer = Frame {
                        kind: Kind::Response,
                        code: HELLO,
                        request_id: f.request_id,
                        header: Vec::new(),
                        body: Vec::new(),
                    };
                    s.write_all(&frame::encode(&answer).unwrap()).unwrap();
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
        })
        .unwrap();
        let err = answered(&client, 11, "{}", b"").unwrap_err();
        assert!(err.starts_with("not connected to the store"), "{err}");
    }
}
