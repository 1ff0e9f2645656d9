//! The store's native server (`server`) as Python holds it (`store/server.py`).

use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::fetch::Fetching;
use crate::py::{adopt_fd, Fd, PyEngine};
use crate::server::{Entry, Server, Up};

/// A producer's sequence as Python's table holds it: (store time of its newest record,
/// [(epoch, first, last, start, end)]).
type PyEntry = (u64, Vec<(u64, u64, u64, u64, u64)>);

#[pyclass(name = "StoreServer", module = "lightgate_native")]
pub(crate) struct PyStoreServer {
    server: Option<Server>,
}
// (`server` stays after `stop`: what its connections held is taken after it.)

impl PyStoreServer {
    fn server(&self) -> PyResult<&Server> {
        self.server
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("the native server is stopped"))
    }
}

fn entries_out(py: Python<'_>, entries: Vec<(String, Entry)>) -> PyResult<Bound<'_, PyList>> {
    let out = PyList::empty(py);
    for (producer, e) in entries {
        out.append((producer, e.seen, e.batches))?;
    }
    Ok(out)
}

#[pymethods]
impl PyStoreServer {
    /// A server thread appending through `engine` (the log's writer).
    #[new]
    fn new(engine: PyRef<'_, PyEngine>) -> PyResult<Self> {
        let appender = engine.engine()?.appender();
        let server = Server::start(appender).map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(PyStoreServer {
            server: Some(server),
        })
    }

    /// Carry a connection Python authenticated (the caller detached `fd`): `first`,
    /// what it is sent first (the HELLO's answer); `unread`, what Python read of it
    /// past the HELLO. Its id.
    /// `may_fetch`: Python allows it REPL_FETCH (a store node): answered natively.
    #[pyo3(signature = (fd, first, unread, may_fetch=false))]
    fn adopt(&self, fd: i32, first: &[u8], unread: &[u8], may_fetch: bool) -> PyResult<u64> {
        let server = self.server()?;
        let fd = adopt_fd(Fd::checked(fd)?);
        Ok(server.adopt_fetching(fd, first.to_vec(), unread.to_vec(), may_fetch))
    }

    /// Readable while `take_up` has something.
    #[getter]
    fn wake_fd(&self) -> PyResult<i32> {
        Ok(self.server()?.wake_fd())
    }

    fn clear_wake(&self) -> PyResult<()> {
        self.server()?.clear_wake();
        Ok(())
    }

    /// What Python answers: ("frame", conn, code, request id, header, body),
    /// ("claim", conn, request id, producer), ("closed", conn), ("appended", 0),
    /// ("fetched", 0, [(node, addr, offset, meta_inc, meta_seq)]).
    fn take_up<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for item in self.server()?.take_up() {
            let row = match item {
                Up::Frame {
                    conn,
                    code,
                    request_id,
                    header,
                    body,
                } => PyTuple::new(
                    py,
                    [
                        "frame".into_pyobject(py)?.into_any(),
                        conn.into_pyobject(py)?.into_any(),
                        code.into_pyobject(py)?.into_any(),
                        request_id.into_pyobject(py)?.into_any(),
                        PyBytes::new(py, &header).into_any(),
                        PyBytes::new(py, &body).into_any(),
                    ],
                )?,
                Up::Claim {
                    conn,
                    request_id,
                    producer,
                } => PyTuple::new(
                    py,
                    [
                        "claim".into_pyobject(py)?.into_any(),
                        conn.into_pyobject(py)?.into_any(),
                        request_id.into_pyobject(py)?.into_any(),
                        producer.into_pyobject(py)?.into_any(),
                    ],
                )?,
                Up::Appended => PyTuple::new(
                    py,
                    [
                        "appended".into_pyobject(py)?.into_any(),
                        0u64.into_pyobject(py)?.into_any(),
                    ],
                )?,
                Up::Fetched(reports) => {
                    let rows = PyList::empty(py);
                    for r in reports {
                        rows.append((r.node, r.addr, r.offset, r.meta_inc, r.meta_seq))?;
                    }
                    PyTuple::new(
                        py,
                        [
                            "fetched".into_pyobject(py)?.into_any(),
                            0u64.into_pyobject(py)?.into_any(),
                            rows.into_any(),
                        ],
                    )?
                }
                Up::Closed { conn } => PyTuple::new(
                    py,
                    [
                        "closed".into_pyobject(py)?.into_any(),
                        conn.into_pyobject(py)?.into_any(),
                    ],
                )?,
            };
            out.append(row)?;
        }
        Ok(out)
    }

    /// Python's answer (a whole frame) of a request of `conn`'s.
    fn answer(&self, conn: u64, data: &[u8]) -> PyResult<()> {
        self.server()?.answer(conn, data.to_vec());
        Ok(())
    }

    /// `conn` may stamp with `producer`; `entry`: what Python's table holds of its
    /// publishes' sequence.
    #[pyo3(signature = (conn, producer, entry=None))]
    fn claimed(&self, conn: u64, producer: String, entry: Option<PyEntry>) -> PyResult<()> {
        let entry = entry.map(|(seen, batches)| Entry::new(seen, batches));
        self.server()?.claimed(conn, producer, entry);
        Ok(())
    }

    /// The claim's frame is answered with `data` (an ERROR frame).
    fn refuse(&self, conn: u64, data: &[u8]) -> PyResult<()> {
        self.server()?.refuse(conn, data.to_vec());
        Ok(())
    }

    /// A store group's master: each append's answer waits for `acked` to reach its
    /// end, or fails after `timeout_s`.
    fn hold(&self, timeout_s: f64) -> PyResult<()> {
        let timeout = Duration::try_from_secs_f64(timeout_s)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        self.server()?.hold(timeout);
        Ok(())
    }

    /// The group holds the log up to `offset` (`Replication.confirmed`).
    fn acked(&self, offset: u64) -> PyResult<()> {
        self.server()?.acked(offset);
        Ok(())
    }

    /// PUBLISH is refused with `status` and `message` from now on; status 0: taken.
    fn refuse_writes(&self, status: u16, message: String) -> PyResult<()> {
        self.server()?
            .refuse_writes((status != 0).then_some((status, message)));
        Ok(())
    }

    /// This node is master of `epoch` (history `epochs`, JSON; log in `log_dir`; sync
    /// mode or not): its replicas' steady fetches are answered natively. `stop_fetching`
    /// sends them all to Python again.
    fn fetching(&self, epoch: u64, epochs: String, log_dir: String, sync: bool) -> PyResult<()> {
        self.server()?.fetching(Some(Fetching {
            epoch,
            epochs,
            dir: log_dir.into(),
            sync,
        }));
        Ok(())
    }

    fn stop_fetching(&self) -> PyResult<()> {
        self.server()?.fetching(None);
        Ok(())
    }

    /// The metadata change log's position (`MetaLog.incarnation`, `seq`).
    fn meta(&self, incarnation: String, seq: u64) -> PyResult<()> {
        self.server()?.meta(incarnation, seq);
        Ok(())
    }

    /// Metadata ops recorded from sequence `first` on, each as `dumps_json` of it.
    fn meta_ops(&self, first: u64, ops: Vec<Bound<'_, PyBytes>>) -> PyResult<()> {
        let ops = ops.iter().map(|b| b.as_bytes().to_vec()).collect();
        self.server()?.meta_ops(first, ops);
        Ok(())
    }

    /// The in-sync rule: the replicas an acknowledgement waits for, whether the set is
    /// large enough, the lease's seconds left (inf: no end; 0: none). Returns the
    /// acknowledged offset when it took effect, and {node: offset} of the required
    /// replicas as their fetches said natively.
    fn insync(
        &self,
        py: Python<'_>,
        required: Vec<String>,
        enough: bool,
        lease_s: f64,
    ) -> PyResult<(u64, std::collections::HashMap<String, u64>)> {
        let lease = if lease_s.is_finite() {
            Some(Duration::from_secs_f64(lease_s.max(0.0)))
        } else {
            None
        };
        let server = self.server()?;
        let (acked, held) = py.allow_threads(|| server.insync(required, enough, lease));
        Ok((acked, held.into_iter().collect()))
    }

    /// The acknowledged offset as the native side knows it.
    fn acked_offset(&self) -> PyResult<u64> {
        Ok(self.server()?.acked_offset())
    }

    /// Fetches answered natively.
    #[getter]
    fn fetches(&self) -> PyResult<u64> {
        Ok(self.server()?.fetches())
    }

    /// Every held answer fails (503, `why`).
    fn fail_held(&self, why: String) -> PyResult<()> {
        self.server()?.fail_held(why);
        Ok(())
    }

    /// Whether `conn`'s REPL_FETCH is answered natively from its next frame on.
    fn may_fetch(&self, conn: u64, may: bool) -> PyResult<()> {
        self.server()?.may_fetch(conn, may);
        Ok(())
    }

    fn close(&self, conn: u64) -> PyResult<()> {
        self.server()?.close(conn);
        Ok(())
    }

    /// The sequences given back: [(producer, seen, batches)].
    fn take_released<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let server = self.server()?;
        // Without the GIL: the server's appends hold the table's lock, and an append
        // may call into Python (a queue's end, a mark).
        let released = py.allow_threads(|| server.take_released());
        entries_out(py, released)
    }

    /// (changed since the last call, [(producer, seen, batches)]): every sequence held
    /// here or given back and not taken.
    fn producer_entries<'py>(&self, py: Python<'py>) -> PyResult<(bool, Bound<'py, PyList>)> {
        let server = self.server()?;
        let (dirty, entries) = py.allow_threads(|| server.producer_entries()); // (as above)
        Ok((dirty, entries_out(py, entries)?))
    }

    /// Stop the thread (its connections close; what they held is then in
    /// `take_released`).
    /// (`&self`: a `&mut self` held over `allow_threads` would make the event loop's
    /// calls meanwhile raise "Already mutably borrowed".)
    fn stop(&self, py: Python<'_>) {
        if let Some(s) = self.server.as_ref() {
            py.allow_threads(move || s.stop());
        }
    }
}
