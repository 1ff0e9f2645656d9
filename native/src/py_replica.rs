//! A store group's replica copy loop (`replica`) as Python holds it
//! (`store/replication/native_copy.py`).

use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::py::PyEngine;
use crate::replica::{Copier, Event, Params};

#[pyclass(name = "ReplicaCopy", module = "lightgate_native")]
pub(crate) struct PyReplicaCopy {
    copier: Copier,
}

#[pymethods]
impl PyReplicaCopy {
    /// Start copying from `master` into the log `engine` writes (`replica::Params`;
    /// `epochs` is this node's history as JSON).
    #[new]
    #[pyo3(signature = (engine, master, node, addr, epoch, secret, credentials, epochs,
                        meta_inc, meta_seq, meta_complete, confirmed, wait_ms, max_bytes))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        engine: PyRef<'_, PyEngine>,
        master: String,
        node: String,
        addr: String,
        epoch: u64,
        secret: Option<Vec<u8>>,
        credentials: Option<(String, String)>,
        epochs: &str,
        meta_inc: String,
        meta_seq: u64,
        meta_complete: bool,
        confirmed: Option<u64>,
        wait_ms: u64,
        max_bytes: u64,
    ) -> PyResult<Self> {
        let appender = engine.engine()?.appender();
        let epochs =
            serde_json::from_str(epochs).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let params = Params {
            master,
            node,
            addr,
            epoch,
            secret,
            credentials,
            epochs,
            meta_inc,
            meta_seq,
            meta_complete,
            confirmed,
            wait_ms,
            max_bytes,
        };
        let copier =
            Copier::start(appender, params).map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(PyReplicaCopy { copier })
    }

    /// The next event within `timeout` seconds, or None: ("ops", header),
    /// ("confirmed",), ("epochs", header), ("handover", offset, header, body),
    /// ("stopped", why, write, errno).
    fn next_event<'py>(
        &self,
        py: Python<'py>,
        timeout: f64,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let wait = Duration::from_secs_f64(timeout.max(0.0));
        let Some(event) = py.allow_threads(|| self.copier.next_event(wait)) else {
            return Ok(None);
        };
        let t = match event {
            Event::Ops(h) => PyTuple::new(
                py,
                [
                    "ops".into_pyobject(py)?.into_any(),
                    PyBytes::new(py, &h).into_any(),
                ],
            )?,
            Event::Confirmed => PyTuple::new(py, ["confirmed"])?,
            Event::Epochs(h) => PyTuple::new(
                py,
                [
                    "epochs".into_pyobject(py)?.into_any(),
                    PyBytes::new(py, &h).into_any(),
                ],
            )?,
            Event::Handover {
                offset,
                header,
                body,
            } => PyTuple::new(
                py,
                [
                    "handover".into_pyobject(py)?.into_any(),
                    offset.into_pyobject(py)?.into_any(),
                    PyBytes::new(py, &header).into_any(),
                    PyBytes::new(py, &body).into_any(),
                ],
            )?,
            Event::Stopped { why, write, errno } => PyTuple::new(
                py,
                [
                    "stopped".into_pyobject(py)?.into_any(),
                    why.into_pyobject(py)?.into_any(),
                    pyo3::types::PyBool::new(py, write).to_owned().into_any(),
                    errno.into_pyobject(py)?.into_any(),
                ],
            )?,
        };
        Ok(Some(t))
    }

    /// Python applied the metadata changes up to (`inc`, `seq`).
    fn meta_applied(&self, inc: &str, seq: u64) {
        self.copier.meta_applied(inc, seq);
    }

    /// Say "confirmed" once the read limit reaches `upto` (None: nothing to say).
    #[pyo3(signature = (upto))]
    fn watch(&self, upto: Option<u64>) {
        self.copier.watch(upto);
    }

    fn set_readers(&self, readers: bool) {
        self.copier.set_readers(readers);
    }

    fn reader_waits(&self) {
        self.copier.reader_waits();
    }

    /// The master's read limit (None: none).
    #[getter]
    fn confirmed(&self) -> Option<u64> {
        self.copier.confirmed()
    }

    #[getter]
    fn master_end(&self) -> u64 {
        self.copier.master_end()
    }

    /// (answers whose bytes the loop wrote, bytes written).
    #[getter]
    fn copied(&self) -> (u64, u64) {
        self.copier.copied()
    }

    /// Stop; returns once nothing more will be written.
    fn halt(&self, py: Python<'_>) {
        py.allow_threads(|| self.copier.halt());
    }
}
