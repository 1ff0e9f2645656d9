//! The crossing: the one place where Python calls in. Nothing here decides anything; it
//! converts Python values to the Rust modules' types and back.

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::commitlog;
use crate::record::{self, Record};
use crate::router;

/// One CommitLog record, byte for byte as `store.record.encode` makes it.
#[pyfunction]
#[pyo3(signature = (store_ts, born_ts, qos, retain, client_id, topic, key, properties, body, queues))]
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
) -> PyResult<Bound<'py, PyBytes>> {
    let rec = Record {
        store_ts,
        born_ts,
        qos,
        retain,
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
        self.inner.add(topic_filter, value).map_err(|e| PyValueError::new_err(e.to_string()))
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

#[pymethods]
impl PyLogWriter {
    #[new]
    fn new(directory: std::path::PathBuf, segment_size: u64, active_base: u64, write_pos: u64) -> PyResult<Self> {
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

#[pymodule]
fn lightgate_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(encode_record, m)?)?;
    m.add_class::<PyTopicTrie>()?;
    m.add_class::<PyLogWriter>()?;
    Ok(())
}
