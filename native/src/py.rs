//! The crossing: the one place where Python calls in. Nothing here decides anything; it
//! converts Python values to the Rust modules' types and back.

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyList, PyTuple};

use crate::codec::properties::{self as props, Kind};
use crate::codec::{self, Packet, Property, Value};
use crate::commitlog;
use crate::engine;
use crate::index;
use crate::protocol;
use crate::reactor::{Command as ReactorCommand, DrainRule, Report, Restore};
use crate::record::{self, Record};
use crate::remote::Carrier;
use crate::router;
use crate::tls;

/// One CommitLog record, byte for byte as `store.record.encode` makes it.
#[pyfunction]
#[pyo3(signature = (store_ts, born_ts, qos, retain, client_id, topic, key, properties, body, queues, marks=0))]
#[allow(clippy::too_many_arguments)] // the record's fields, in the order they are stored
fn encode_record<'py>(
    py: Python<'py>,
    store_ts: u64,
    born_ts: u64,
    qos: u8,
    retain: bool,
    client_id: &str,
    topic: &str,
    key: &str,
    properties: &[u8],
    body: &[u8],
    queues: Vec<(String, u64)>,
    marks: u8,
) -> PyResult<Bound<'py, PyBytes>> {
    let rec = Record {
        store_ts,
        born_ts,
        qos,
        retain,
        marks,
        client_id,
        topic,
        key,
        properties,
        body,
        queues: queues.iter().map(|(n, o)| (n.as_str(), *o)).collect(),
    };
    let mut out = Vec::new();
    record::encode_into(&rec, &mut out).map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(PyBytes::new(py, &out))
}

/// The native topic-filter trie, with integer values (subscription handles): what the
/// differential tests hold to `lightqueue.trie.TopicTrie`.
#[pyclass(name = "TopicTrie", module = "lightgate_native")]
#[derive(Default)]
struct PyTopicTrie {
    inner: router::TopicTrie<u64>,
}

#[pymethods]
impl PyTopicTrie {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    fn add(&mut self, topic_filter: &str, value: u64) -> PyResult<bool> {
        self.inner
            .add(topic_filter, value)
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    fn remove(&mut self, topic_filter: &str, value: u64) -> bool {
        self.inner.remove(topic_filter, value)
    }

    fn matching(&self, topic: &str) -> Vec<u64> {
        self.inner.matching(topic)
    }

    fn matching_filters(&self, topic: &str) -> Vec<String> {
        self.inner.matching_filters(topic)
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }
}

/// The CommitLog's tail writer; the interpreter lock is released while it writes and
/// syncs, so the event loop goes on meanwhile.
#[pyclass(name = "LogWriter", module = "lightgate_native")]
struct PyLogWriter {
    inner: commitlog::LogWriter,
}

fn os_error(e: std::io::Error) -> PyErr {
    match e.raw_os_error() {
        Some(code) => PyOSError::new_err((code, e.to_string())),
        None => PyOSError::new_err(e.to_string()),
    }
}

/// The engine's `Marks` from Python's (store.highwater.HighWater): `mark(name)` and
/// `raise_for(pairs)`, each called with the interpreter (the caller holds the log lock,
/// as for `queue_end`). A Python error comes back as an io::Error with its errno.
fn py_marks(marks: PyObject) -> engine::Marks {
    let source = std::sync::Arc::new(marks);
    let asked = std::sync::Arc::clone(&source);
    engine::Marks {
        mark: Box::new(move |name: &str| {
            Python::with_gil(|py| {
                asked
                    .call_method1(py, "mark", (name,))
                    .and_then(|v| v.extract::<u64>(py))
                    .unwrap_or(0)
            })
        }),
        raise: Box::new(move |wanted: &[(String, u64)]| {
            Python::with_gil(|py| {
                source
                    .call_method1(py, "raise_for", (wanted.to_vec(),))
                    .and_then(|v| v.extract::<Vec<u64>>(py))
                    .map_err(|e| {
                        let errno = e
                            .value(py)
                            .getattr("errno")
                            .and_then(|n| n.extract::<i32>())
                            .ok();
                        match errno {
                            Some(code) => std::io::Error::from_raw_os_error(code),
                            None => std::io::Error::other(e.to_string()),
                        }
                    })
            })
        }),
    }
}

#[pymethods]
impl PyLogWriter {
    #[new]
    fn new(
        directory: std::path::PathBuf,
        segment_size: u64,
        active_base: u64,
        write_pos: u64,
    ) -> PyResult<Self> {
        let inner = commitlog::LogWriter::open(&directory, segment_size, active_base, write_pos)
            .map_err(os_error)?;
        Ok(PyLogWriter { inner })
    }

    /// Append encoded records: (their positions, the bases of the segments begun).
    fn append(&mut self, py: Python<'_>, records: Vec<Vec<u8>>) -> PyResult<(Vec<u64>, Vec<u64>)> {
        let inner = &mut self.inner;
        let done = py
            .allow_threads(|| {
                let refs: Vec<&[u8]> = records.iter().map(Vec::as_slice).collect();
                inner.append(&refs)
            })
            .map_err(os_error)?;
        Ok((done.positions, done.new_segments))
    }

    fn sync(&mut self, py: Python<'_>) -> PyResult<u64> {
        let inner = &mut self.inner;
        py.allow_threads(|| inner.sync()).map_err(os_error)
    }

    #[getter]
    fn write_pos(&self) -> u64 {
        self.inner.write_pos()
    }

    #[getter]
    fn flushed(&self) -> u64 {
        self.inner.flushed()
    }

    #[getter]
    fn active_base(&self) -> u64 {
        self.inner.active_base()
    }
}

/// One connection's steady state (`protocol::Connection`): what the differential tests
/// drive beside the Python core.
#[pyclass(name = "Connection", module = "lightgate_native")]
struct PyConnection {
    inner: protocol::Connection,
    /// Topics the ACL cache allows; None: every topic.
    allowed: Option<std::collections::BTreeSet<String>>,
}

#[pymethods]
impl PyConnection {
    #[new]
    #[pyo3(signature = (version, keepalive, max_packet, max_qos, topic_alias_maximum, receive_maximum, client_receive_maximum, max_inflight, client_max_packet, now, allowed=None, problem_info=true))]
    #[allow(clippy::too_many_arguments)] // what CONNECT negotiated, one value each
    fn new(
        version: u8,
        keepalive: u16,
        max_packet: usize,
        max_qos: u8,
        topic_alias_maximum: u16,
        receive_maximum: u32,
        client_receive_maximum: u32,
        max_inflight: u32,
        client_max_packet: usize,
        now: f64,
        allowed: Option<std::collections::BTreeSet<String>>,
        problem_info: bool,
    ) -> Self {
        let settings = protocol::Settings {
            version,
            keepalive,
            max_packet,
            max_qos,
            topic_alias_maximum,
            receive_maximum,
            client_receive_maximum,
            max_inflight,
            client_max_packet,
            problem_info,
        };
        PyConnection {
            inner: protocol::Connection::new(settings, now),
            allowed,
        }
    }

    /// Feed bytes: a list of ("publish", topic, payload, qos, packet_id, ticket),
    /// ("acked", packet_id) and ("demote",).
    fn receive<'py>(
        &mut self,
        py: Python<'py>,
        data: &[u8],
        now: f64,
    ) -> PyResult<Bound<'py, PyList>> {
        let mut events = Vec::new();
        let allowed = &self.allowed;
        self.inner.receive(
            data,
            now,
            |topic| protocol::Acl::from_cache(allowed, topic, protocol::TopicLimits::NONE),
            &mut events,
        );
        let out = PyList::empty(py);
        for ev in events {
            let item = match ev {
                protocol::Event::Publish {
                    topic,
                    payload,
                    qos,
                    packet_id,
                    ticket,
                } => (
                    "publish",
                    topic,
                    PyBytes::new(py, &payload),
                    qos,
                    packet_id,
                    ticket,
                )
                    .into_pyobject(py)?
                    .into_any(),
                protocol::Event::Acked { packet_id, .. } => {
                    ("acked", packet_id).into_pyobject(py)?.into_any()
                }
                protocol::Event::Demote => ("demote",).into_pyobject(py)?.into_any(),
            };
            out.append(item)?;
        }
        Ok(out)
    }

    #[pyo3(signature = (ticket, packet_id, code, reason=None))]
    fn publish_done(&mut self, ticket: u64, packet_id: u16, code: u8, reason: Option<&str>) {
        self.inner.publish_done(ticket, packet_id, code, reason);
    }

    fn take_output<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.take_output())
    }

    fn unread<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.inner.unread())
    }

    /// The packet id taken (QoS 1), None (QoS 0); ValueError when dropped.
    fn deliver(
        &mut self,
        topic: &str,
        payload: &[u8],
        qos: u8,
        retain: bool,
    ) -> PyResult<Option<u16>> {
        self.inner
            .deliver(topic, payload, qos, retain, (0, 0))
            .map_err(|_| PyValueError::new_err("dropped: larger than the client takes"))
    }

    #[getter]
    fn window(&self) -> usize {
        self.inner.window()
    }

    #[getter]
    fn deadline(&self) -> f64 {
        self.inner.deadline()
    }
}

/// Message routing (`router::Routes`), held to `lightqueue.routing.Router` by tests.
#[pyclass(name = "Routes", module = "lightgate_native")]
struct PyRoutes {
    inner: router::Routes,
}

#[pymethods]
impl PyRoutes {
    #[new]
    fn new(default_partitions: u32) -> Self {
        PyRoutes {
            inner: router::Routes::new(default_partitions),
        }
    }

    fn register_wildcard(&mut self, topic_filter: &str) -> PyResult<bool> {
        self.inner
            .register_wildcard(topic_filter)
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    fn unregister_wildcard(&mut self, topic_filter: &str) -> bool {
        self.inner.unregister_wildcard(topic_filter)
    }

    fn set_partitions(&mut self, first_level: &str, partitions: u32) {
        self.inner.set_partitions(first_level, partitions);
    }

    fn route(&self, topic: &str) -> Vec<String> {
        self.inner.route(topic)
    }
}

/// An appended message for the index: (phys_offset, size, store_ts, queues).
type DispatchedRow = (u64, u32, u64, Vec<(String, u64)>);
/// A message Python appends: (born_ts, qos, retain, client_id, topic, key, properties,
/// body, queues, marks), the fields of `encode_record` but the store time and offsets.
/// (The bytes as PyBytes: a Vec<u8> would be taken from them one item at a time.)
type MessageRow<'py> = (
    u64,
    u8,
    bool,
    String,
    String,
    String,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Vec<String>,
    u8,
);

/// ([(phys_offset, size)] of what was appended, [base of each segment begun]).
fn row(d: engine::Dispatched) -> DispatchedRow {
    (d.phys_offset, d.size, d.store_ts, d.queues)
}

/// One dispatch's worth of the engine's appends (`PyEngine::take_batch`), held natively:
/// what Python does with it costs a call per run, queue or message it reads, none per
/// message it does not.
#[pyclass(name = "DispatchBatch", module = "lightgate_native", frozen)]
struct PyDispatchBatch {
    taken: usize,
    end: Option<u64>,
    new_segments: Vec<u64>,
    runs: Vec<index::Run>,
    keys: Vec<(String, u64)>,
    /// The last `grown` runs are each grown queue's last (`index::Rows::ends`).
    grown: usize,
    /// (phys offset, record) of the rows the owner wants: its own (no record: it holds
    /// the message) and those kept for its readers, in log order.
    bodies: Vec<(u64, Option<std::sync::Arc<[u8]>>)>,
}

#[pymethods]
impl PyDispatchBatch {
    /// Rows taken.
    #[getter]
    fn taken(&self) -> usize {
        self.taken
    }

    /// The end of the last record taken, or None when none was.
    #[getter]
    fn end(&self) -> Option<u64> {
        self.end
    }

    /// The bases of the segments begun meanwhile, oldest first.
    #[getter]
    fn new_segments(&self) -> Vec<u64> {
        self.new_segments.clone()
    }

    /// Runs in the batch (one index value each).
    #[getter]
    fn runs(&self) -> usize {
        self.runs.len()
    }

    /// Each of the batch's index entries to `put(key, value)`, with the index's keys
    /// (`lightqueue/index.py`): a value per run of a queue's consecutive offsets, an
    /// empty one per key reference. How many puts.
    fn put_index(&self, py: Python<'_>, put: &Bound<'_, PyAny>) -> PyResult<usize> {
        for run in &self.runs {
            put.call1((
                PyBytes::new(py, &index::queue_key(&run.queue, run.first)),
                PyBytes::new(py, &run.entries),
            ))?;
        }
        for (key, phys) in &self.keys {
            put.call1((
                PyBytes::new(py, &index::key_ref(key, *phys)),
                PyBytes::new(py, b""),
            ))?;
        }
        Ok(self.runs.len() + self.keys.len())
    }

    /// {queue: its end after the batch} for every queue that grew.
    fn grown<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for run in &self.runs[self.runs.len() - self.grown..] {
            out.set_item(&run.queue, run.first + run.len() as u64)?;
        }
        Ok(out)
    }

    /// The messages the owner has or reads, in log order, without a line of Python each:
    /// its own appends taken out of `own` ({phys offset: message}; one a drain took
    /// before `own` knew of it is left out), and the records kept for its readers made
    /// into `cls` (store.record.Message) with every field `store.record.decode` sets,
    /// properties through `decode_properties` (JSON) when a record has any.
    fn messages<'py>(
        &self,
        py: Python<'py>,
        cls: &Bound<'py, pyo3::types::PyType>,
        own: &Bound<'py, PyDict>,
        decode_properties: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for (phys, kept) in &self.bodies {
            match kept {
                None => {
                    if let Some(m) = own.get_item(phys)? {
                        own.del_item(phys)?;
                        out.append(m)?;
                    }
                }
                Some(bytes) => out.append(message(py, cls, bytes, *phys, decode_properties)?)?,
            }
        }
        Ok(out)
    }
}

/// `store.record.decode(bytes, 0, phys)` without the interpreter: a Message made with
/// `__new__` and its fields set one by one (`tests/plane/test_dispatch_cost.py` holds
/// it to `decode`'s, field for field).
fn message<'py>(
    py: Python<'py>,
    cls: &Bound<'py, pyo3::types::PyType>,
    bytes: &[u8],
    phys: u64,
    decode_properties: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    use pyo3::intern;
    let (rec, size) = record::decode(bytes).map_err(value_error)?;
    let properties = if rec.properties.is_empty() {
        PyDict::new(py).into_any()
    } else {
        decode_properties.call1((PyBytes::new(py, rec.properties),))?
    };
    // An idempotent producer's first record carries its sequence in its properties.
    let producer = if rec.marks & record::MARK_FIRST != 0 {
        properties.call_method1(intern!(py, "pop"), (intern!(py, "lg_producer"), py.None()))?
    } else {
        py.None().into_bound(py)
    };
    let queues = PyList::empty(py);
    for (name, offset) in &rec.queues {
        queues.append((*name, *offset))?;
    }
    let m = cls.call_method1(intern!(py, "__new__"), (cls,))?;
    m.setattr(intern!(py, "topic"), rec.topic)?;
    m.setattr(intern!(py, "body"), PyBytes::new(py, rec.body))?;
    m.setattr(intern!(py, "qos"), rec.qos)?;
    m.setattr(intern!(py, "retain"), rec.retain)?;
    m.setattr(intern!(py, "client_id"), rec.client_id)?;
    m.setattr(intern!(py, "properties"), properties)?;
    m.setattr(intern!(py, "born_ts"), rec.born_ts)?;
    m.setattr(intern!(py, "key"), rec.key)?;
    m.setattr(intern!(py, "store_ts"), rec.store_ts)?;
    m.setattr(intern!(py, "phys_offset"), phys)?;
    m.setattr(intern!(py, "size"), size)?;
    m.setattr(intern!(py, "queues"), queues)?;
    m.setattr(intern!(py, "mark"), rec.marks & record::MARKS)?;
    m.setattr(intern!(py, "producer"), producer)?;
    Ok(m)
}

/// The native per-message path (`engine::Engine`): reactors, the log's tail, routing,
/// acks and deliveries. Python hands it sockets after their CONNACK and takes back
/// what only Python decides.
#[pyclass(name = "Engine", module = "lightgate_native")]
pub(crate) struct PyEngine {
    inner: Option<engine::Engine>,
    /// A gateway node's engine (`Engine.start_remote`): reactors whose publishes go to
    /// a store elsewhere; `inner` is None then.
    remote: Option<crate::remote::RemoteEngine>,
    /// What was left for dispatch when it stopped: `take_batch` hands it over once.
    left: std::sync::Mutex<Option<engine::Pending>>,
}

impl PyEngine {
    /// What the engine appended since the last call; once stopped, what was left.
    fn pending(&self, limit: usize) -> engine::Pending {
        match &self.inner {
            Some(engine) => engine.take_pending_upto(limit),
            None => self
                .left
                .lock()
                .ok()
                .and_then(|mut left| left.take())
                .unwrap_or_default(),
        }
    }

    pub(crate) fn engine(&self) -> PyResult<&engine::Engine> {
        self.inner
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("the engine is stopped"))
    }

    /// The reactors' side, the local engine's or the remote one's.
    fn carrier(&self) -> PyResult<&dyn Carrier> {
        match (&self.inner, &self.remote) {
            (Some(e), _) => Ok(e),
            (None, Some(r)) => Ok(r),
            (None, None) => Err(PyValueError::new_err("the engine is stopped")),
        }
    }

    fn remote(&self) -> PyResult<&crate::remote::RemoteEngine> {
        self.remote
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("not a remote engine, or stopped"))
    }
}

/// A demotion as Python takes it (`PyEngine::take_demoted`).
fn demoted_row<'py>(py: Python<'py>, d: crate::reactor::Demoted) -> PyResult<Bound<'py, PyDict>> {
    use std::os::fd::IntoRawFd;
    let row = PyDict::new(py);
    row.set_item("conn", d.conn)?;
    row.set_item("why", d.why.name())?;
    let detail = match &d.why {
        crate::reactor::Why::Lost(text) => text.as_str(),
        _ => "",
    };
    row.set_item("detail", detail)?;
    row.set_item("unread", PyBytes::new(py, &d.unread))?;
    row.set_item("unsent", PyBytes::new(py, &d.unsent))?;
    row.set_item("next_packet_id", d.next_packet_id)?;
    let outgoing = PyList::empty(py);
    for (pid, o) in &d.outgoing {
        outgoing.append((*pid, PyBytes::new(py, &o.data), o.source.1))?;
    }
    row.set_item("outgoing", outgoing)?;
    let sends = PyDict::new(py);
    for (pid, queue, offset) in &d.sends {
        sends.set_item(*pid, (&**queue, *offset))?;
    }
    row.set_item("sends", sends)?;
    let positions = PyDict::new(py);
    for (queue, next) in &d.positions {
        positions.set_item(&**queue, *next)?;
    }
    row.set_item("positions", positions)?;
    row.set_item("idle_for", d.idle_for)?;
    row.set_item("partial", d.partial)?;
    row.set_item("aliases_in", d.aliases_in.clone())?;
    row.set_item("inbound_unacked", d.inbound_unacked)?;
    row.set_item("fd", d.socket.map(IntoRawFd::into_raw_fd))?;
    Ok(row)
}

/// A connection the engine accepted and relays to Python (`take_events`' "opened"):
/// Python's end of it. Its bytes go out with `send`; `consumed` says how much of what
/// was relayed Python has taken (the engine relays at most a window ahead of it).
#[pyclass(name = "Link", module = "lightgate_native")]
struct PyLink {
    id: u64,
    share: std::sync::Arc<crate::link::LinkShare>,
    handle: crate::reactor::Handle,
}

#[pymethods]
impl PyLink {
    #[getter]
    fn id(&self) -> u64 {
        self.id
    }

    /// Bytes for the client, in order: True when the caller should wait for "room"
    /// before it sends more (what waits for the link is past the mark).
    /// BrokenPipeError once the link is closed.
    fn send(&self, data: Vec<u8>) -> PyResult<bool> {
        if self.share.gone.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(pyo3::exceptions::PyBrokenPipeError::new_err(
                "connection closed",
            ));
        }
        let wait = self.share.sent(data.len());
        self.handle.send(ReactorCommand::Send {
            conn: self.id,
            data,
        });
        Ok(wait)
    }

    /// Python has consumed `total` bytes of what was relayed, over the link's life:
    /// what still waits for it counts in the node's budget for partial packets. True
    /// when that took the node back within the budget (the caller's `ReadBudget` should
    /// `refresh`).
    fn consumed(&self, total: u64) -> bool {
        if self.share.consumed(total) {
            self.handle.send(ReactorCommand::Resume { conn: self.id });
        }
        self.share.recount(self.handle.partial())
    }

    /// Bytes Python sent that the link has not taken yet.
    #[getter]
    fn queued(&self) -> usize {
        self.share.queued.load(std::sync::atomic::Ordering::SeqCst)
    }

    #[getter]
    fn gone(&self) -> bool {
        self.share.gone.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Close it: what was sent goes out first (a moment at most), then the
    /// close_notify (a WebSocket's close frame, and a moment for the client's).
    fn close(&self) {
        self.handle.send(ReactorCommand::Close { conn: self.id });
    }

    /// Accept a WebSocket's upgrade ("opened" with its request) with `subprotocol`,
    /// one it offered: the 101 goes out, then every `send` is a binary message. A
    /// message that begins from here may hold `limit` bytes, as `setting` says.
    #[pyo3(signature = (subprotocol, limit, setting))]
    fn upgrade(&self, subprotocol: Option<String>, limit: usize, setting: &str) {
        self.share.set_message_limit(limit, setting);
        self.handle.send(ReactorCommand::Upgrade {
            conn: self.id,
            subprotocol,
        });
    }

    /// Refuse a WebSocket's upgrade: HTTP `status` with `body` (text/plain), as
    /// `transports.reject_upgrade` answers, then the connection closes.
    fn refuse(&self, status: u16, body: Vec<u8>) {
        self.handle.send(ReactorCommand::Refuse {
            conn: self.id,
            status,
            body,
        });
    }

    /// A WebSocket message that begins from now on may hold `limit` bytes, as
    /// `setting` says (the engine closes one past it with 1009 and says so).
    fn set_message_limit(&self, limit: usize, setting: &str) {
        self.share.set_message_limit(limit, setting);
    }
}

/// What `adopt` and `carry` hand the reactor: a connection's negotiated settings and
/// the Python core's state to go on from, from their arguments as Python passes them
/// (`behind` is the engine's to say).
fn adoption(
    settings: protocol::Settings,
    (unread, idle_for, acl): (Vec<u8>, f64, Option<std::collections::HashSet<String>>),
    (aliases_in, next_packet_id, client_id, inbound_unacked): (
        std::collections::HashMap<u16, String>,
        u16,
        &str,
        u32,
    ),
    (max_unsent, min_drain, write_timeout): (usize, usize, f64),
    keep: Option<f64>,
) -> crate::reactor::Adoption {
    crate::reactor::Adoption {
        settings,
        unread,
        idle_for,
        acl,
        restore: Restore {
            aliases_in,
            next_packet_id,
            client_id: client_id.into(),
            inbound_unacked,
        },
        max_unsent,
        drain: DrainRule {
            min_bytes: min_drain,
            timeout: write_timeout,
        },
        keep,
        behind: false,
    }
}

/// A socket Python gives up (`socket.detach()`): from here on Rust owns and closes it.
#[allow(unsafe_code)]
pub(crate) fn adopt_fd(fd: Fd) -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    // SAFETY: the caller detached `fd` from its Python socket, so nothing else owns or
    // closes it; it is owned exactly once from here.
    unsafe { std::os::fd::OwnedFd::from_raw_fd(fd.0) }
}

/// A descriptor number checked not to be negative.
#[derive(Clone, Copy)]
pub(crate) struct Fd(i32);

impl Fd {
    pub(crate) fn checked(fd: i32) -> PyResult<Fd> {
        if fd < 0 {
            return Err(PyValueError::new_err("not a socket"));
        }
        Ok(Fd(fd))
    }
}

#[pymethods]
impl PyEngine {
    /// `queue_end(name) -> int`: where a queue the engine has not appended to ends (the
    /// index's answer), asked once per queue. `marks`: the queues' high-water marks
    /// (store.highwater.HighWater: `mark(name) -> int`, `raise_for([(name, offset)]) ->
    /// [int]`), or None to keep none.
    #[new]
    #[pyo3(signature = (directory, segment_size, active_base, write_pos, default_partitions, sync, io_threads, queue_end, marks=None))]
    #[allow(clippy::too_many_arguments)] // the log's tail and the engine's settings
    fn new(
        directory: std::path::PathBuf,
        segment_size: u64,
        active_base: u64,
        write_pos: u64,
        default_partitions: u32,
        sync: bool,
        io_threads: usize,
        queue_end: PyObject,
        marks: Option<PyObject>,
    ) -> PyResult<Self> {
        let config = engine::Config {
            segment_size,
            active_base,
            write_pos,
            default_partitions,
            sync,
            io_threads,
        };
        let ends: engine::QueueEnd = Box::new(move |name: &str| {
            Python::with_gil(|py| {
                queue_end
                    .call1(py, (name,))
                    .and_then(|v| v.extract::<u64>(py))
                    .unwrap_or(0)
            })
        });
        let marks = marks.map(py_marks);
        let inner =
            engine::Engine::start_marked(&directory, config, ends, marks).map_err(os_error)?;
        Ok(PyEngine {
            inner: Some(inner),
            remote: None,
            left: std::sync::Mutex::new(None),
        })
    }

    /// A gateway node's engine (`lightgate gateway`): `io_threads` reactors whose
    /// publishes go to the store at `addrs` ("host:port", or a group's
    /// "a:1,b:2,c:3": its master, looked for as store/client.py does) as PUBLISH
    /// frames, each publisher acknowledged once the store's answer says stored. It
    /// keeps no log; it carries clean sessions' subscribers (`grew`, `recheck`).
    #[staticmethod]
    #[pyo3(signature = (addrs, io_threads, username=None, password=None))]
    fn start_remote(
        addrs: String,
        io_threads: usize,
        username: Option<String>,
        password: Option<String>,
    ) -> PyResult<Self> {
        let options = crate::client::Options {
            addrs,
            credentials: username.map(|u| (u, password.unwrap_or_default())),
            ..Default::default()
        };
        let remote = crate::remote::RemoteEngine::start(options, io_threads).map_err(os_error)?;
        Ok(PyEngine {
            inner: None,
            remote: Some(remote),
            left: std::sync::Mutex::new(None),
        })
    }

    /// Whether this is a gateway node's engine (`start_remote`): its store is elsewhere.
    #[getter(remote)]
    fn is_remote(&self) -> bool {
        self.remote.is_some()
    }

    /// The store's notify says these queues grew: a remote engine pulls those its
    /// carried subscribers read from their positions ("*": every one).
    /// `ends`: the queues' ends the notify said (a queue whose readers here are all at
    /// its end is not pulled).
    #[pyo3(signature = (names, ends=None))]
    fn grew(
        &self,
        py: Python<'_>,
        names: Vec<String>,
        ends: Option<std::collections::HashMap<String, u64>>,
    ) -> PyResult<()> {
        let remote = self.remote()?;
        let ends = ends.unwrap_or_default();
        py.allow_threads(|| remote.grew_to(&names, &ends));
        Ok(())
    }

    /// A remote engine pulls again the queues whose last pull failed or left one of
    /// its subscribers short.
    fn recheck(&self, py: Python<'_>) -> PyResult<()> {
        let remote = self.remote()?;
        py.allow_threads(|| remote.recheck());
        Ok(())
    }

    /// A remote engine's pulls for its subscribers: (answered, records they brought).
    fn pulls(&self) -> PyResult<(u64, u64)> {
        Ok(self.remote()?.pulls())
    }

    /// A remote engine's store connection: (connected, the master's address, why
    /// none was found or the last was lost).
    fn store_status(&self) -> PyResult<(bool, String, String)> {
        Ok(self.remote()?.store_status())
    }

    /// A remote engine's frames held to be sent again to the store's master fail, and
    /// the publishes behind them: the gateway gave up on that master.
    fn give_up_held(&self) -> PyResult<()> {
        self.remote()?.give_up_held();
        Ok(())
    }

    /// The queues Python reads on this node: a remote engine hands it the messages of
    /// these its publishers stored (`take_events`' "stored").
    fn set_stored_queues(&self, names: std::collections::HashSet<String>) -> PyResult<()> {
        self.remote()?.set_stored_queues(names);
        Ok(())
    }

    /// One more queue for `set_stored_queues`' set (its first reader came).
    fn add_stored_queue(&self, name: &str) -> PyResult<()> {
        self.remote()?.add_stored_queue(name);
        Ok(())
    }

    /// Take a connection over after its CONNACK: True, and `fd` is the engine's (the
    /// caller detached it); False, and nothing changed, when a subscription's position
    /// is not at its queue's end (the caller delivers the rest, and tries again).
    /// `subscriptions`: (filter, QoS, next offset of its queue), registered with it;
    /// `aliases_in` and `next_packet_id`: the Python core's state to go on from;
    /// `max_unsent`: bytes waiting for the client past which it comes back (0: 2 MiB);
    /// `inbound_unacked`: QoS 1 publishes not acknowledged when `unread` was read;
    /// `problem_info`: the client's Request Problem Information.
    /// `min_drain` bytes of them it must take per `write_timeout` seconds, or it comes
    /// back "stuck" (0 s: no such rule).
    /// `keep`: a persistent session's, seconds between its progress reports: its QoS 1
    /// sends wait for their records (("keep", ...), `kept`), and it may be promoted
    /// behind its queues' ends (served from the store from its positions).
    #[pyo3(signature = (conn, fd, version, keepalive, max_packet, max_qos, topic_alias_maximum, receive_maximum, client_receive_maximum, max_inflight, client_max_packet, unread=Vec::new(), idle_for=0.0, acl=None, subscriptions=Vec::new(), aliases_in=std::collections::HashMap::new(), next_packet_id=1, max_unsent=0, client_id=String::new(), inbound_unacked=0, problem_info=true, min_drain=0, write_timeout=0.0, keep=None))]
    #[allow(clippy::too_many_arguments)] // what CONNECT negotiated, one value each
    fn adopt(
        &self,
        py: Python<'_>,
        conn: u64,
        fd: i32,
        version: u8,
        keepalive: u16,
        max_packet: usize,
        max_qos: u8,
        topic_alias_maximum: u16,
        receive_maximum: u32,
        client_receive_maximum: u32,
        max_inflight: u32,
        client_max_packet: usize,
        unread: Vec<u8>,
        idle_for: f64,
        acl: Option<std::collections::HashSet<String>>,
        subscriptions: Vec<(String, u8, u64)>,
        aliases_in: std::collections::HashMap<u16, String>,
        next_packet_id: u16,
        max_unsent: usize,
        client_id: String,
        inbound_unacked: u32,
        problem_info: bool,
        min_drain: usize,
        write_timeout: f64,
        keep: Option<f64>,
    ) -> PyResult<bool> {
        let fd = Fd::checked(fd)?;
        let engine = self.carrier()?;
        let adoption = adoption(
            protocol::Settings {
                version,
                keepalive,
                max_packet,
                max_qos,
                topic_alias_maximum,
                receive_maximum,
                client_receive_maximum,
                max_inflight,
                client_max_packet,
                problem_info,
            },
            (unread, idle_for, acl),
            (aliases_in, next_packet_id, &client_id, inbound_unacked),
            (max_unsent, min_drain, write_timeout),
            keep,
        );
        // The log's lock is taken inside: the interpreter is let go first (a reactor
        // holding it may be asking Python where a queue ends).
        let taken = py.allow_threads(|| {
            let make = move |behind: bool| ReactorCommand::Adopt {
                conn,
                socket: adopt_fd(fd),
                adoption: Box::new(crate::reactor::Adoption { behind, ..adoption }),
            };
            engine.promote_any(
                conn,
                version,
                &subscriptions,
                keep.is_some(),
                Box::new(make),
            )
        });
        taken.map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// The record of batch `batch` of ("keep", conn, batch, sends) is in the store: its
    /// sends may go out.
    fn kept(&self, conn: u64, batch: u64) -> PyResult<()> {
        self.carrier()?.send(ReactorCommand::Kept { conn, batch });
        Ok(())
    }

    /// Hand connection `conn` back (a takeover, a kick, changed credentials, a
    /// shutdown): its demotion follows, as any other, with why "released".
    fn release(&self, conn: u64) -> PyResult<()> {
        self.carrier()?.send(ReactorCommand::Release { conn });
        Ok(())
    }

    /// Readable while demotions wait: the owner's event loop waits on it, then calls
    /// `take_demoted` (which reads it empty).
    #[getter]
    fn wake_fd(&self) -> PyResult<i32> {
        Ok(self.carrier()?.wake_fd())
    }

    /// What the reactors did: messages and bytes in and out, drops, adoptions,
    /// demotions, connections held now.
    /// How long native publishes took to append: (bucket bounds in seconds, cumulative
    /// count per bound, count, sum in seconds), as a Prometheus histogram takes them.
    fn append_latency(&self) -> PyResult<(Vec<f64>, Vec<u64>, u64, f64)> {
        let (buckets, count, sum) = self.carrier()?.append_latency();
        Ok((engine::APPEND_BUCKETS.to_vec(), buckets, count, sum))
    }

    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for (name, value) in self.carrier()?.counters().snapshot() {
            out.set_item(name, value)?;
        }
        if let Some(remote) = &self.remote {
            // A gateway node's pulls of its subscribers' queues, and what they brought.
            let (pulls, records) = remote.pulls();
            out.set_item("store_pulls", pulls)?;
            out.set_item("store_pulled_records", records)?;
        }
        Ok(out)
    }

    fn subscribe(&self, conn: u64, topic_filter: &str, qos: u8) -> PyResult<()> {
        self.engine()?
            .subscribe(conn, topic_filter, qos)
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    fn unsubscribe(&self, conn: u64, topic_filter: &str) -> PyResult<bool> {
        Ok(self.engine()?.unsubscribe(conn, topic_filter))
    }

    // The calls that take the engine's log lock let go of the interpreter first: a
    // reactor thread may hold that lock while it asks Python where a new queue ends.
    fn register_wildcard(&self, py: Python<'_>, topic_filter: &str) -> PyResult<bool> {
        let engine = self.engine()?;
        py.allow_threads(|| engine.register_wildcard(topic_filter))
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    fn set_partitions(&self, py: Python<'_>, first_level: &str, partitions: u32) -> PyResult<()> {
        let engine = self.engine()?;
        py.allow_threads(|| engine.set_partitions(first_level, partitions));
        Ok(())
    }

    /// What was appended since the last call: (phys_offset, size, store_ts, queues).
    fn take_dispatched(&self) -> PyResult<Vec<DispatchedRow>> {
        Ok(self
            .engine()?
            .take_dispatched()
            .into_iter()
            .map(row)
            .collect())
    }

    /// What was appended since the last call (the oldest `limit` rows at most), as one
    /// `DispatchBatch`: the index's entries, the queues that grew, the records the
    /// owner reads. Once stopped, what was left when it stopped (then nothing).
    #[pyo3(signature = (run_max, limit=usize::MAX))]
    fn take_batch(&self, py: Python<'_>, run_max: usize, limit: usize) -> PyDispatchBatch {
        py.allow_threads(|| {
            let mut p = self.pending(limit);
            let made = index::runs(&p.rows, run_max);
            let bodies = p
                .rows
                .iter_mut()
                .filter(|d| d.own || d.record.is_some())
                .map(|d| (d.phys_offset, d.record.take()))
                .collect();
            let batch = PyDispatchBatch {
                taken: p.rows.len(),
                end: p.rows.last().map(|d| d.phys_offset + u64::from(d.size)),
                new_segments: p.new_segments,
                runs: made.runs,
                keys: made.keys,
                grown: made.grown,
                bodies,
            };
            if let Some(engine) = &self.inner {
                engine.recycle(p.rows); // freed by a reactor thread, not this one
            }
            batch
        })
    }

    /// The owner reads the new messages of these queues for the next `seconds` (0: no
    /// longer): the dispatch hands their records over (`DispatchBatch.messages`).
    /// Nothing once stopped. The interpreter goes first: an append may hold the engine's
    /// lock on them while it asks Python where a new queue ends.
    fn want_queues(&self, py: Python<'_>, names: Vec<String>, seconds: f64) {
        if let Some(engine) = &self.inner {
            let for_ = std::time::Duration::from_secs_f64(seconds.clamp(0.0, 3600.0));
            py.allow_threads(|| engine.want_queues(&names, for_));
        }
    }

    /// Append Python's messages (`MessageRow`s) through the log's one writer: each
    /// queue's next offset, the record, the write (and fsync in sync mode), the rows
    /// left for dispatch in log order with the native publishes', deliveries to native
    /// subscribers. Returns each message's (phys_offset, size, store_ts, queues).
    /// ValueError((index, why)) when a message cannot be a record, OSError (with the
    /// errno: ENOSPC for a full disk) when the write failed; either way nothing of the
    /// batch is in the log and no offset was used.
    #[pyo3(signature = (batch, store_ts=None))]
    fn append_messages<'py>(
        &self,
        py: Python<'py>,
        batch: Vec<MessageRow<'py>>,
        store_ts: Option<u64>,
    ) -> PyResult<Vec<DispatchedRow>> {
        let engine = self.engine()?;
        let messages: Vec<engine::Message> = batch
            .into_iter()
            .map(
                |(born_ts, qos, retain, client_id, topic, key, properties, body, queues, marks)| {
                    engine::Message {
                        born_ts,
                        qos,
                        retain,
                        marks,
                        client_id,
                        topic,
                        key,
                        properties: properties.as_bytes().to_vec(),
                        body: body.as_bytes().to_vec(),
                        queues,
                    }
                },
            )
            .collect();
        // The interpreter goes first: a reactor thread may hold the log lock while it
        // asks Python where a new queue ends.
        match py.allow_threads(|| engine.append(&messages, store_ts)) {
            Ok(rows) => Ok(rows.into_iter().map(row).collect()),
            Err(engine::AppendError::Invalid(i, e)) => {
                Err(PyValueError::new_err((i, e.to_string())))
            }
            Err(engine::AppendError::Io(e)) => Err(os_error(e)),
            Err(e @ engine::AppendError::Failed(_)) => Err(PyOSError::new_err(e.to_string())),
        }
    }

    /// Wait (the interpreter let go) until something is left for dispatch, `timeout`
    /// seconds at most, or `wake`: true if something is.
    fn wait_dispatched(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let engine = self.engine()?;
        let timeout = std::time::Duration::from_secs_f64(timeout.clamp(0.0, 3600.0));
        Ok(py.allow_threads(|| engine.wait_dispatched(timeout)))
    }

    /// The dispatch's pause: `timeout` seconds at most (the interpreter let go), less
    /// when `hurry` was called or the reactors wait for the dispatch. Whether hurried.
    fn wait_hurry(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let engine = self.engine()?;
        let timeout = std::time::Duration::from_secs_f64(timeout.clamp(0.0, 3600.0));
        Ok(py.allow_threads(|| engine.wait_hurry(timeout)))
    }

    /// Serve a carried connection that falls behind its budget from the store instead
    /// of handing it back: the engine says ("behind", conn, round, {queue: next}) when
    /// it has room for a batch, and the owner answers with `feed_runs`.
    fn set_catch_up(&self, on: bool) -> PyResult<()> {
        self.engine()?.set_catch_up(on);
        Ok(())
    }

    /// The answer to ("behind", conn, round, positions): for each of its queues
    /// (queue, start, [(first offset, entries)], full) as the index holds them from its
    /// position (`start`: the position, moved past what retention took; `full`: the
    /// read stopped at its count), and the log position the index covers. The engine
    /// reads the records and sends the connection its next batch, on a thread of its
    /// own: this returns at once (a log it cannot read hands the connection back).
    /// False: it is not served from the store (any more).
    #[allow(clippy::type_complexity)] // the runs as the index hands them
    fn feed_runs(
        &self,
        py: Python<'_>,
        conn: u64,
        round: u64,
        queues: Vec<(String, u64, Vec<(u64, Vec<u8>)>, bool)>,
        horizon: u64,
    ) -> PyResult<bool> {
        let engine = self.engine()?;
        let queues: Vec<crate::backlog::QueueRuns> = queues
            .into_iter()
            .map(|(queue, start, runs, full)| crate::backlog::QueueRuns {
                queue: std::sync::Arc::from(queue),
                start,
                runs,
                full,
            })
            .collect();
        Ok(py.allow_threads(|| engine.feed_runs(conn, round, &queues, horizon)))
    }

    /// What a topic is held to on a connection adopted with `acl=None` (it may publish
    /// anywhere): longer than `max_length` characters, or with `max_levels` separators,
    /// its publish comes back to Python, as does one to a `$` topic.
    fn set_topic_limits(&self, max_length: usize, max_levels: usize) -> PyResult<()> {
        self.carrier()?.set_topic_limits(protocol::TopicLimits {
            max_length,
            max_levels,
        });
        Ok(())
    }

    /// How a native publish the store refused is explained to its client (a v5
    /// PUBACK's Reason String, if it asked for problem information): `disk_full` on a
    /// full disk, else `prefix` followed by the error. The owner's words: until this
    /// is called, no Reason String.
    fn set_not_stored(&self, disk_full: &str, prefix: &str) -> PyResult<()> {
        self.carrier()?.set_not_stored(engine::NotStored {
            disk_full: disk_full.into(),
            prefix: prefix.into(),
        });
        Ok(())
    }

    /// The node's budget for partly received packets (--max-partial-bytes; 0: none),
    /// which the engine's connections and, through `partial_update`, Python's count in.
    fn set_partial_limit(&self, limit: usize) -> PyResult<()> {
        self.carrier()?.partial_budget().set_limit(limit);
        Ok(())
    }

    /// One of Python's connections went from holding `before` bytes of a partial packet
    /// to `after` (0, 0: only a look): the node's count after it, (held, holders, peak).
    /// The wake-up descriptor is written when the engine's connections free the budget.
    fn partial_update(&self, before: usize, after: usize) -> PyResult<(usize, usize, usize)> {
        let count = self.carrier()?.partial_budget().update(before, after);
        Ok((count.held, count.holders, count.peak))
    }

    /// Cut the dispatch's pause short (a reader came); nothing once stopped (a reader
    /// may come while another thread stops the engine).
    fn hurry(&self) {
        if let Some(engine) = &self.inner {
            engine.hurry();
        }
    }

    /// End every `wait_dispatched`, now and from here on: the dispatcher stops.
    fn wake(&self) -> PyResult<()> {
        self.engine()?.wake();
        Ok(())
    }

    /// fdatasync the tail (the interpreter let go): the durable end. After a failure
    /// the log takes no more writes (`failed` says why).
    fn flush(&self, py: Python<'_>) -> PyResult<u64> {
        let engine = self.engine()?;
        py.allow_threads(|| engine.sync()).map_err(os_error)
    }

    fn unregister_wildcard(&self, py: Python<'_>, topic_filter: &str) -> PyResult<bool> {
        let engine = self.engine()?;
        Ok(py.allow_threads(|| engine.unregister_wildcard(topic_filter)))
    }

    #[getter]
    fn flushed(&self) -> PyResult<u64> {
        Ok(self.engine()?.flushed())
    }

    #[getter]
    fn active_base(&self) -> PyResult<u64> {
        Ok(self.engine()?.active_base())
    }

    /// Why native publishes were refused since the last call (the first few), and how
    /// many of their batches were: for the log (their publishers were answered).
    fn take_refused(&self) -> PyResult<(Vec<String>, u64)> {
        if let Some(r) = &self.remote {
            return Ok(r.take_refused());
        }
        Ok(self.engine()?.take_refused())
    }

    /// Why the log stopped taking writes, or None.
    #[getter]
    fn failed(&self) -> PyResult<Option<String>> {
        Ok(self.engine()?.failed())
    }

    /// Connections handed back, each a dict: conn, fd (now the caller's), why
    /// ("packet", "timeout", "lost", "backlog", "stuck", "partial", "released"), detail
    /// (a loss's text), unread (the packet that needs Python first, or the start of one
    /// it holds back for the node's budget), unsent (to write before anything
    /// else), next_packet_id, outgoing ([(packet_id, encoded PUBLISH, phys_offset)], in
    /// flight at QoS 1), positions ({queue: next offset}, for the queues delivered
    /// from), idle_for (seconds since the client sent anything), aliases_in,
    /// inbound_unacked (QoS 1 publishes not acknowledged yet when `unread` was read),
    /// partial (bytes of unread counted in the partial-packet budget, the caller's
    /// to count).
    fn take_demoted<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let engine = self.carrier()?;
        engine.clear_wake();
        let out = PyList::empty(py);
        for report in engine.take_reports() {
            if let Report::Demoted(d) = report {
                out.append(demoted_row(py, *d)?)?;
            }
        }
        Ok(out)
    }

    /// Everything the reactors have to say since the last call, in order: each
    /// demotion as `take_demoted` gives it (fd None for a TLS connection, which the
    /// engine keeps and relays), and the news of the connections the native listeners
    /// accepted, as tuples:
    /// ("opened", Link, listener, peer, identity | None, upgrade | None): its handshake
    /// is done (a WebSocket's upgrade: (target, [subprotocols]), for `Link.upgrade` or
    /// `Link.refuse`);
    /// ("data", conn, bytes): plaintext from the client;
    /// ("ended", conn, eof, why): the client ended it (eof) or it broke;
    /// ("room", conn): what Python sent is down to the mark;
    /// ("log", what, text, count): "handshake", "reloaded", "reload_failed",
    /// "accept_failed", "refused" (count connections of the listener named by text),
    /// "ws_handshake" (an upgrade that failed), "ws_limit" (a message past its limit).
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        use crate::reactor::{LinkEvent, LogTarget};
        let engine = self.carrier()?;
        engine.clear_wake();
        let handle = engine.handle();
        let out = PyList::empty(py);
        let mut logs = 0;
        for report in engine.take_reports() {
            let item = match report {
                Report::Demoted(d) => demoted_row(py, *d)?.into_any(),
                Report::Link(LinkEvent::Opened {
                    conn,
                    listener,
                    share,
                    peer,
                    identity,
                    upgrade,
                }) => {
                    let link = PyLink {
                        id: conn,
                        share,
                        handle: handle.clone(),
                    };
                    ("opened", link, listener, peer, identity, upgrade)
                        .into_pyobject(py)?
                        .into_any()
                }
                Report::Link(LinkEvent::Data { conn, data }) => {
                    ("data", conn, PyBytes::new(py, &data))
                        .into_pyobject(py)?
                        .into_any()
                }
                Report::Link(LinkEvent::Ended { conn, eof, why }) => {
                    ("ended", conn, eof, why).into_pyobject(py)?.into_any()
                }
                Report::Link(LinkEvent::Room { conn }) => {
                    ("room", conn).into_pyobject(py)?.into_any()
                }
                Report::Link(LinkEvent::Log { target, text }) => {
                    logs += 1;
                    let (what, count) = match target {
                        LogTarget::Handshake => ("handshake", 1),
                        LogTarget::Reloaded => ("reloaded", 1),
                        LogTarget::ReloadFailed => ("reload_failed", 1),
                        LogTarget::AcceptFailed => ("accept_failed", 1),
                        LogTarget::Refused { count } => ("refused", count),
                        LogTarget::Upgrade => ("ws_handshake", 1),
                        LogTarget::MessageLimit => ("ws_limit", 1),
                    };
                    ("log", what, text, count).into_pyobject(py)?.into_any()
                }
                Report::Behind {
                    conn,
                    round,
                    positions,
                } => {
                    let at = PyDict::new(py);
                    for (queue, next) in positions {
                        at.set_item(&*queue, next)?;
                    }
                    ("behind", conn, round, at).into_pyobject(py)?.into_any()
                }
                Report::Keep { conn, batch, sends } => {
                    let sends: Vec<(u16, &str, u64, u32)> = sends
                        .iter()
                        .map(|(p, q, o, n)| (*p, &**q, *o, *n))
                        .collect();
                    ("keep", conn, batch, sends).into_pyobject(py)?.into_any()
                }
                Report::Progress {
                    conn,
                    positions,
                    done,
                } => {
                    let at = PyDict::new(py);
                    for (queue, acked, next) in positions {
                        at.set_item(&*queue, (acked, next))?;
                    }
                    ("progress", conn, at, done).into_pyobject(py)?.into_any()
                }
                Report::Published(_) | Report::Acked { .. } => continue,
            };
            out.append(item)?;
        }
        handle
            .links()
            .logs
            .fetch_sub(logs, std::sync::atomic::Ordering::Relaxed);
        if let Some(r) = &self.remote {
            let stored = r.take_stored();
            if !stored.is_empty() {
                let rows = PyList::empty(py);
                for m in stored {
                    let row = (
                        m.topic,
                        PyBytes::new(py, &m.payload),
                        m.qos,
                        &*m.client_id,
                        m.born_ts,
                        m.phys,
                        m.store_ts,
                        m.rsize,
                        m.queues,
                    );
                    rows.append(row.into_pyobject(py)?)?;
                }
                out.append(("stored", rows).into_pyobject(py)?)?;
            }
        }
        Ok(out)
    }

    /// Accept MQTT over TLS on the listening socket `fd` (bound by the caller, which
    /// gives it up: `socket.detach()`), with the TLS files and choices given (loaded
    /// now: ValueError when they do not make a configuration; reloaded when they
    /// change). `index` names the listener in "opened" events, `name` in the log; a
    /// connection on a descriptor at `fd_ceiling` or above is refused; a handshake may
    /// take `handshake_timeout` seconds; at most `max_handshakes` run at once (the
    /// engine's, for all its listeners). `websocket`: MQTT over WebSocket (over TLS
    /// when `cert` is given), its upgrade within `upgrade_timeout` seconds.
    #[pyo3(signature = (fd, index, name, cert, key, ca=None, client_auth="none", username_from="none", fd_ceiling=usize::MAX, handshake_timeout=10.0, max_handshakes=usize::MAX, websocket=false, upgrade_timeout=10.0))]
    #[allow(clippy::too_many_arguments)] // the listener's settings, one value each
    fn listen(
        &self,
        fd: i32,
        index: u32,
        name: String,
        cert: Option<&str>,
        key: Option<&str>,
        ca: Option<&str>,
        client_auth: &str,
        username_from: &str,
        fd_ceiling: usize,
        handshake_timeout: f64,
        max_handshakes: usize,
        websocket: bool,
        upgrade_timeout: f64,
    ) -> PyResult<()> {
        let engine = self.carrier()?;
        let files = match (cert, key) {
            (Some(cert), Some(key)) => {
                let settings = tls_settings(cert, key, ca, client_auth, username_from)?;
                let files = tls::TlsFiles::load(settings).map_err(value_error)?;
                Some(std::sync::Arc::new(std::sync::Mutex::new(files)))
            }
            (None, None) if websocket => None,
            _ => {
                return Err(value_error(
                    "a TLS listener needs a certificate and its key",
                ))
            }
        };
        let fd = Fd::checked(fd)?;
        let socket = std::net::TcpListener::from(adopt_fd(fd));
        let listener = if websocket {
            crate::reactor::Listener::websocket(
                index,
                name,
                socket,
                files,
                fd_ceiling,
                handshake_timeout,
                upgrade_timeout,
            )
        } else {
            let files = files.expect("checked above");
            crate::reactor::Listener::new(index, name, socket, files, fd_ceiling, handshake_timeout)
        }
        .map_err(os_error)?;
        engine
            .handle()
            .links()
            .max_handshakes
            .store(max_handshakes.max(1), std::sync::atomic::Ordering::Relaxed);
        engine.send(ReactorCommand::Listen(Box::new(listener)));
        Ok(())
    }

    /// Carry a connection the engine relays (`link`) from here on, as `adopt` does a
    /// plain one: True; False, and nothing changed, when more bytes than `relayed` (the
    /// total Python took of it) are on their way to Python, or a subscription's
    /// position is not at its queue's end (a persistent session's, `keep`, may be
    /// behind them, as for `adopt`). `unread`: what Python took and did not parse (the
    /// engine reads it first); the rest as for `adopt`.
    #[pyo3(signature = (link, relayed, version, keepalive, max_packet, max_qos, topic_alias_maximum, receive_maximum, client_receive_maximum, max_inflight, client_max_packet, unread=Vec::new(), idle_for=0.0, acl=None, subscriptions=Vec::new(), aliases_in=std::collections::HashMap::new(), next_packet_id=1, max_unsent=0, client_id=String::new(), inbound_unacked=0, problem_info=true, min_drain=0, write_timeout=0.0, keep=None))]
    #[allow(clippy::too_many_arguments)] // what CONNECT negotiated, one value each
    fn carry(
        &self,
        py: Python<'_>,
        link: PyRef<'_, PyLink>,
        relayed: u64,
        version: u8,
        keepalive: u16,
        max_packet: usize,
        max_qos: u8,
        topic_alias_maximum: u16,
        receive_maximum: u32,
        client_receive_maximum: u32,
        max_inflight: u32,
        client_max_packet: usize,
        unread: Vec<u8>,
        idle_for: f64,
        acl: Option<std::collections::HashSet<String>>,
        subscriptions: Vec<(String, u8, u64)>,
        aliases_in: std::collections::HashMap<u16, String>,
        next_packet_id: u16,
        max_unsent: usize,
        client_id: String,
        inbound_unacked: u32,
        problem_info: bool,
        min_drain: usize,
        write_timeout: f64,
        keep: Option<f64>,
    ) -> PyResult<bool> {
        let engine = self.carrier()?;
        let conn = link.id;
        if link.share.gone.load(std::sync::atomic::Ordering::SeqCst)
            || !link.share.begin_carry(relayed)
        {
            return Ok(false);
        }
        let adoption = adoption(
            protocol::Settings {
                version,
                keepalive,
                max_packet,
                max_qos,
                topic_alias_maximum,
                receive_maximum,
                client_receive_maximum,
                max_inflight,
                client_max_packet,
                problem_info,
            },
            (unread, idle_for, acl),
            (aliases_in, next_packet_id, &client_id, inbound_unacked),
            (max_unsent, min_drain, write_timeout),
            keep,
        );
        let taken = py.allow_threads(|| {
            let make = move |behind: bool| ReactorCommand::Carry {
                conn,
                adoption: Box::new(crate::reactor::Adoption { behind, ..adoption }),
            };
            engine.promote_any(
                conn,
                version,
                &subscriptions,
                keep.is_some(),
                Box::new(make),
            )
        });
        if !matches!(taken, Ok(true)) {
            // Not taken: relayed on, from what was held back for it.
            link.share.end_carry();
            engine.send(ReactorCommand::Resume { conn });
        }
        taken.map_err(|e| PyValueError::new_err(e.to_string()))
    }

    #[getter]
    fn write_pos(&self) -> PyResult<u64> {
        Ok(self.engine()?.write_pos())
    }

    /// The reactor threads (connection `conn` starts on thread `conn % io_threads`).
    #[getter]
    fn io_threads(&self) -> PyResult<usize> {
        Ok(self.carrier()?.io_threads())
    }

    /// Stop the reactors (their sockets close) and make the log durable: its end.
    /// What was appended and not taken yet stays for `take_batch`.
    /// The engine is taken out under a borrow that ends before the wait: a `&mut self`
    /// held over `allow_threads` would make every other thread's call (the event loop's
    /// `take_batch` while a worker thread stops the engine) raise "Already mutably
    /// borrowed". Meanwhile `take_batch` finds nothing, and then what was left.
    fn stop(slf: &Bound<'_, Self>) -> PyResult<u64> {
        let py = slf.py();
        let (remote, inner) = {
            // (Another thread inside a call that waits without the GIL: RuntimeError
            // "Already borrowed", and the caller tries again.)
            let mut me = slf.try_borrow_mut()?;
            (me.remote.take(), me.inner.take())
        };
        if let Some(r) = remote {
            py.allow_threads(|| r.stop());
            return Ok(0);
        }
        match inner {
            Some(e) => {
                let (synced, left) = py.allow_threads(|| e.stop_and_take());
                if let Ok(mut slot) = slf.try_borrow()?.left.lock() {
                    *slot = Some(left);
                }
                synced.map_err(os_error)
            }
            None => Err(PyValueError::new_err("the engine is stopped")),
        }
    }
}

/// `--tls-cert`/`--tls-key`/`--tls-ca` as the native listeners read them: the
/// settings, checked (ValueError: the files do not make a configuration, and why).
fn tls_settings(
    cert: &str,
    key: &str,
    ca: Option<&str>,
    client_auth: &str,
    username_from: &str,
) -> PyResult<tls::TlsSettings> {
    Ok(tls::TlsSettings {
        cert: cert.into(),
        key: key.into(),
        ca: ca.map(Into::into),
        client_auth: tls::ClientAuth::parse(client_auth).map_err(value_error)?,
        username_from: tls::UsernameFrom::parse(username_from).map_err(value_error)?,
    })
}

/// Whether the TLS files load as the native listeners load them: None, or ValueError
/// with the reason.
#[pyfunction]
#[pyo3(signature = (cert, key, ca=None, client_auth="none", username_from="none"))]
fn tls_check(
    cert: &str,
    key: &str,
    ca: Option<&str>,
    client_auth: &str,
    username_from: &str,
) -> PyResult<()> {
    let settings = tls_settings(cert, key, ca, client_auth, username_from)?;
    tls::build(&settings).map(|_| ()).map_err(value_error)
}

/// The identity a verified client certificate (DER) stands for, as the native
/// listeners read it (`gateway.transports.cert_identity`'s rule).
#[pyfunction]
fn tls_identity(der: &[u8], source: &str) -> PyResult<Option<String>> {
    let from = tls::UsernameFrom::parse(source).map_err(value_error)?;
    Ok(tls::identity(der, from))
}

#[pymodule]
fn lightgate_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(encode_record, m)?)?;
    m.add_class::<PyTopicTrie>()?;
    m.add_class::<PyLogWriter>()?;
    m.add_class::<PyConnection>()?;
    m.add_class::<PyRoutes>()?;
    m.add_class::<PyEngine>()?;
    m.add_class::<crate::py_server::PyStoreServer>()?;
    m.add_class::<crate::py_replica::PyReplicaCopy>()?;
    m.add_class::<PyDispatchBatch>()?;
    m.add_class::<PyLink>()?;
    m.add("MqttError", m.py().get_type::<MqttError>())?;
    m.add_class::<MqttDecoder>()?;
    m.add_function(wrap_pyfunction!(decode_frames, m)?)?;
    m.add_function(wrap_pyfunction!(encode_publish, m)?)?;
    m.add_function(wrap_pyfunction!(encode_puback, m)?)?;
    m.add_function(wrap_pyfunction!(encode_pingresp, m)?)?;
    m.add_function(wrap_pyfunction!(tls_check, m)?)?;
    m.add_function(wrap_pyfunction!(tls_identity, m)?)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The MQTT codec. Decoded packets cross as plain tuples, the packet type first:
//   (3, topic, payload, qos, retain, dup, packet_id | None, properties)   PUBLISH
//   (4..7, packet_id, reason_code, properties)                           PUBACK..PUBCOMP
//   (12,)                                                                PINGREQ
//   (14, reason_code, properties)                                        DISCONNECT
//   (0, packet_type, flags, body)                    any other packet, for Python to decode
// `properties` is a dict as gateway.mqtt.properties decodes it (lists for the repeatable).
// ---------------------------------------------------------------------------------------

pyo3::create_exception!(
    lightgate_native,
    MqttError,
    PyValueError,
    "The peer broke the protocol: args are (reason_code, message, packets decoded before)."
);

fn value_error(err: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(err.to_string())
}

fn props_dict<'py>(py: Python<'py>, list: &[Property<'_>]) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    for prop in list {
        let Some(spec) = props::by_id(prop.id) else {
            continue;
        };
        let value = match prop.value {
            Value::Int(v) => v.into_pyobject(py)?.into_any(),
            Value::Str(s) => s.into_pyobject(py)?.into_any(),
            Value::Bin(b) => PyBytes::new(py, b).into_any(),
            Value::Pair(k, v) => (k, v).into_pyobject(py)?.into_any(),
        };
        if spec.repeatable() {
            match dict.get_item(spec.name)? {
                Some(items) => items.downcast::<PyList>()?.append(value)?,
                None => dict.set_item(spec.name, PyList::new(py, [value])?)?,
            }
        } else {
            dict.set_item(spec.name, value)?;
        }
    }
    Ok(dict)
}

fn packet_tuple<'py>(py: Python<'py>, packet: &Packet<'_>) -> PyResult<Bound<'py, PyAny>> {
    Ok(match packet {
        Packet::Publish(p) => (
            codec::PUBLISH,
            p.topic,
            PyBytes::new(py, p.payload),
            p.qos,
            p.retain,
            p.dup,
            p.packet_id,
            props_dict(py, &p.properties)?,
        )
            .into_pyobject(py)?
            .into_any(),
        Packet::Ack(a) => (
            a.ptype,
            a.packet_id,
            a.reason_code,
            props_dict(py, &a.properties)?,
        )
            .into_pyobject(py)?
            .into_any(),
        Packet::Pingreq => PyTuple::new(py, [codec::PINGREQ])?.into_any(),
        Packet::Disconnect {
            reason_code,
            properties,
        } => (codec::DISCONNECT, *reason_code, props_dict(py, properties)?)
            .into_pyobject(py)?
            .into_any(),
        Packet::Other(f) => (0u8, f.ptype, f.flags, PyBytes::new(py, f.body))
            .into_pyobject(py)?
            .into_any(),
    })
}

/// Feed `data` to `decoder`: the packets as tuples, or MqttError with the reason code.
fn feed<'py>(
    py: Python<'py>,
    decoder: &mut codec::Decoder,
    data: &[u8],
) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    let mut failed: Option<PyErr> = None;
    let result = decoder.feed(data, |packet| {
        if failed.is_none() {
            if let Err(e) = packet_tuple(py, &packet).and_then(|t| out.append(t)) {
                failed = Some(e);
            }
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    match result {
        Ok(()) => Ok(out),
        Err(e) => Err(MqttError::new_err((
            e.reason_code(),
            e.to_string(),
            out.unbind(),
        ))),
    }
}

/// The decoder of what one client sends after its CONNACK (`gateway.mqtt.Decoder` with
/// the version known): `feed(bytes) -> list[tuple]`, MqttError on a violation.
#[pyclass(module = "lightgate_native")]
struct MqttDecoder {
    inner: codec::Decoder,
}

#[pymethods]
impl MqttDecoder {
    #[new]
    #[pyo3(signature = (version, max_packet_size = codec::MAX_PACKET_SIZE))]
    fn new(version: u8, max_packet_size: usize) -> PyResult<Self> {
        Ok(MqttDecoder {
            inner: codec::Decoder::new(version, max_packet_size).map_err(value_error)?,
        })
    }

    fn feed<'py>(&mut self, py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyList>> {
        feed(py, &mut self.inner, data)
    }

    /// Bytes of an incomplete packet held until the rest arrives.
    #[getter]
    fn buffered(&self) -> usize {
        self.inner.buffered()
    }
}

/// Decode `data` on its own: (the packets as tuples, bytes of an incomplete packet left).
#[pyfunction]
#[pyo3(signature = (data, version, max_packet = codec::MAX_PACKET_SIZE))]
fn decode_frames<'py>(
    py: Python<'py>,
    data: &[u8],
    version: u8,
    max_packet: usize,
) -> PyResult<(Bound<'py, PyList>, usize)> {
    let mut decoder = codec::Decoder::new(version, max_packet).map_err(value_error)?;
    let packets = feed(py, &mut decoder, data)?;
    Ok((packets, decoder.buffered()))
}

/// A property value taken out of Python, owned until it is encoded.
enum Owned {
    Int(u32),
    Str(String),
    Bin(Vec<u8>),
    Pair(String, String),
}

fn owned_value(spec: &props::Spec, value: &Bound<'_, PyAny>) -> PyResult<Owned> {
    let bad = |what: &str| value_error(format!("property {} must be {what}", spec.name));
    Ok(match spec.kind {
        Kind::Byte | Kind::U16 | Kind::U32 | Kind::Varint => {
            // As Python's codec: a bool is an int only for the 0/1 properties.
            if value.is_instance_of::<PyBool>() && !spec.boolean() {
                return Err(bad("an int"));
            }
            let v: i64 = value.extract().map_err(|_| bad("an int"))?;
            Owned::Int(u32::try_from(v).map_err(|_| bad("in range"))?)
        }
        Kind::Str => Owned::Str(value.extract().map_err(|_| bad("a str"))?),
        Kind::Bin => Owned::Bin(value.extract().map_err(|_| bad("bytes"))?),
        Kind::Pair => {
            let (k, v): (String, String) =
                value.extract().map_err(|_| bad("(key, value) pairs"))?;
            Owned::Pair(k, v)
        }
    })
}

/// A properties dict (as gateway.mqtt.properties encodes it) as (id, value) in dict order.
fn owned_props(dict: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<(u8, Owned)>> {
    let mut out = Vec::new();
    let Some(dict) = dict else { return Ok(out) };
    for (name, value) in dict.iter() {
        let name: String = name.extract().map_err(value_error)?;
        let spec = props::by_name(&name)
            .ok_or_else(|| value_error(format!("unknown property {name:?}")))?;
        if spec.repeatable() && !value.is_instance_of::<pyo3::types::PyInt>() {
            for item in value.try_iter().map_err(value_error)? {
                out.push((spec.id, owned_value(spec, &item?)?));
            }
        } else {
            out.push((spec.id, owned_value(spec, &value)?));
        }
    }
    Ok(out)
}

fn borrowed(list: &[(u8, Owned)]) -> Vec<Property<'_>> {
    list.iter()
        .map(|(id, v)| Property {
            id: *id,
            value: match v {
                Owned::Int(i) => Value::Int(*i),
                Owned::Str(s) => Value::Str(s),
                Owned::Bin(b) => Value::Bin(b),
                Owned::Pair(k, v) => Value::Pair(k, v),
            },
        })
        .collect()
}

/// A PUBLISH, byte for byte as `gateway.mqtt.encode_publish` makes it (ValueError where
/// it raises one).
#[pyfunction]
#[pyo3(signature = (topic, payload, qos = 0, retain = false, dup = false, packet_id = None, version = 4, properties = None))]
#[allow(clippy::too_many_arguments)] // encode_publish's parameters, in its order
fn encode_publish<'py>(
    py: Python<'py>,
    topic: &Bound<'py, PyAny>,
    payload: &[u8],
    qos: i64,
    retain: bool,
    dup: bool,
    packet_id: Option<i64>,
    version: u8,
    properties: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let topic: String = topic
        .extract()
        .map_err(|_| value_error("topic must be a str"))?;
    let qos =
        u8::try_from(qos).map_err(|_| value_error(format!("QoS must be 0, 1 or 2, got {qos}")))?;
    let packet_id = packet_id
        .map(|id| {
            u16::try_from(id)
                .map_err(|_| value_error(format!("packet id must be 1..65535, got {id}")))
        })
        .transpose()?;
    let owned = owned_props(properties)?;
    let p = codec::Publish {
        topic: &topic,
        payload,
        qos,
        retain,
        dup,
        packet_id,
        properties: borrowed(&owned),
    };
    let mut out = Vec::new();
    codec::encode_publish(&p, version, &mut out).map_err(value_error)?;
    Ok(PyBytes::new(py, &out))
}

/// A PUBACK as `gateway.mqtt.encode(Puback(...), version)` makes it.
#[pyfunction]
#[pyo3(signature = (packet_id, reason_code = 0, version = 4, properties = None))]
fn encode_puback<'py>(
    py: Python<'py>,
    packet_id: u16,
    reason_code: u8,
    version: u8,
    properties: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let owned = owned_props(properties)?;
    let mut out = Vec::new();
    codec::encode_ack(packet_id, reason_code, &borrowed(&owned), version, &mut out)
        .map_err(value_error)?;
    Ok(PyBytes::new(py, &out))
}

#[pyfunction]
fn encode_pingresp(py: Python<'_>) -> Bound<'_, PyBytes> {
    let mut out = Vec::new();
    codec::encode_pingresp(&mut out);
    PyBytes::new(py, &out)
}
