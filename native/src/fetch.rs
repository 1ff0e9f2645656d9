//! A store group master's steady-state REPL_FETCH, answered by the native server
//! (`server`) as `Replication.handle_fetch` (store/replication/node.py) answers it:
//! the log's raw bytes from the replica's offset, whole records of one segment, and the
//! header Python writes. Only the plain case is decided here (`Ask::steady`): a
//! connection's first fetch (its epoch history: the fork point), a metadata snapshot,
//! a start-over, a replica that cannot write or lacks metadata, or anything odd goes to
//! Python as before. The metadata change log's newest ops come here as Python records
//! them (`MetaOps`), encoded as Python encodes them, so that a replica a few changes
//! behind is answered here too.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::commitlog::segment_name;

pub const REPL_FETCH: u16 = 120;
/// The longest a fetch waits at the log's end (`MAX_WAIT_MS`).
pub const MAX_WAIT_MS: u64 = 5000;
/// A fetch asking for more bytes than this goes to Python (the replicas ask 4 MiB).
pub const FETCH_MAX_BYTES: u64 = 16 << 20;
/// A record's frame: magic u32, total length u32, crc u32 (`record.FRAME`).
const RECORD_FRAME: usize = 12;
/// Metadata ops kept here for replicas a few changes behind (a count, encoded bytes);
/// one further behind goes to Python. Far under what Python's `MetaLog.since` puts in
/// one answer (10,000 ops, 8 MiB), so that an answer here holds what Python's would.
pub const META_OPS_KEPT: usize = 1024;
pub const META_BYTES_KEPT: usize = 1 << 20;

/// The metadata change log's position and its newest ops, each as Python's JSON.
#[derive(Debug, Default)]
pub struct MetaOps {
    pub inc: String,
    /// The sequence before the first op kept.
    start: u64,
    ops: VecDeque<Vec<u8>>,
    bytes: usize,
}

impl MetaOps {
    /// The sequence of the newest change.
    pub fn seq(&self) -> u64 {
        self.start + self.ops.len() as u64
    }

    /// Python's word on the position (`MetaLog.incarnation`, `seq`): another
    /// incarnation, or a sequence past the ops known, starts over from it.
    pub fn position(&mut self, inc: String, seq: u64) {
        if inc != self.inc || seq > self.seq() {
            self.inc = inc;
            self.start = seq;
            self.ops.clear();
            self.bytes = 0;
        }
    }

    /// Ops recorded from sequence `first` on.
    pub fn record(&mut self, first: u64, ops: Vec<Vec<u8>>) {
        if first != self.seq() + 1 {
            self.start = first.saturating_sub(1);
            self.ops.clear();
            self.bytes = 0;
        }
        for op in ops {
            self.bytes += op.len();
            self.ops.push_back(op);
        }
        while self.ops.len() > META_OPS_KEPT || self.bytes > META_BYTES_KEPT {
            if let Some(op) = self.ops.pop_front() {
                self.bytes -= op.len();
                self.start += 1;
            }
        }
    }

    /// Whether a replica at (`inc`, `seq`) is answered from here.
    pub fn covers(&self, inc: &str, seq: u64) -> bool {
        inc == self.inc && self.start <= seq && seq <= self.seq()
    }

    /// The answer's `meta` for a replica at `seq` (`covers` said yes): the ops after it.
    pub fn since(&self, seq: u64) -> Vec<u8> {
        let inc = serde_json::to_string(&self.inc).unwrap_or_else(|_| "\"\"".into());
        let mut out = format!(r#"{{"inc":{inc},"seq":{},"ops":["#, self.seq()).into_bytes();
        let skip = seq.saturating_sub(self.start) as usize;
        for (i, op) in self.ops.iter().skip(skip).enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(op);
        }
        out.extend_from_slice(b"]}");
        out
    }
}

/// What the master's side of replication is, as Python says it (`Server::fetching`).
#[derive(Debug, Clone)]
pub struct Fetching {
    /// The epoch this node is master of.
    pub epoch: u64,
    /// Its epoch history as the answer's JSON (`[[epoch, start], ...]`).
    pub epochs: String,
    /// The log's directory (its segment files).
    pub dir: PathBuf,
    /// Sync mode: answers carry the read limit (`confirmed`); else null.
    pub sync: bool,
}

/// A REPL_FETCH's header, as far as this side reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ask {
    pub node: String,
    pub addr: String,
    pub offset: u64,
    pub epoch: u64,
    /// It carries the replica's epoch history (a connection's first fetch).
    pub first: bool,
    /// Nothing but the log's bytes is asked: no snapshot, start-over, write error, or
    /// metadata incomplete.
    pub steady: bool,
    pub lazy: bool,
    /// The read limit the replica has (None: none, or not a number).
    pub confirmed: Option<u64>,
    pub wait_ms: u64,
    pub max_bytes: u64,
    pub meta_inc: String,
    pub meta_seq: u64,
}

fn absent_or_null(h: &serde_json::Map<String, Value>, key: &str) -> bool {
    h.get(key).is_none_or(Value::is_null)
}

fn falsy(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => true,
        Some(Value::String(s)) => s.is_empty(),
        _ => false,
    }
}

/// A whole number as Python's `int()` of it takes it (non-negative here); None: odd.
fn uint(v: Option<&Value>, default: u64) -> Option<u64> {
    match v {
        None | Some(Value::Null) => Some(default),
        Some(v) => v.as_u64(),
    }
}

/// The fetch's header; None if anything in it is not what a replica sends (Python says
/// what is wrong).
pub fn ask(header: &Value) -> Option<Ask> {
    let h = header.as_object()?;
    let node = h.get("node")?.as_str()?.to_string();
    let addr = match h.get("addr") {
        None => String::new(),
        Some(a) => a.as_str()?.to_string(),
    };
    let meta_inc = match h.get("meta_inc") {
        None => String::new(),
        Some(a) => a.as_str()?.to_string(),
    };
    let steady = absent_or_null(h, "snap")
        && absent_or_null(h, "restart")
        && falsy(h.get("write_error"))
        && h.get("meta_complete")
            .is_none_or(|v| v == &Value::Bool(true));
    Some(Ask {
        node,
        addr,
        offset: h.get("offset")?.as_u64()?,
        epoch: uint(h.get("epoch"), 0)?,
        first: !absent_or_null(h, "epochs"),
        steady,
        lazy: h.get("lazy").is_some_and(|v| v == &Value::Bool(true)),
        confirmed: h.get("confirmed").and_then(Value::as_u64),
        wait_ms: uint(h.get("wait_ms"), 0)?.min(MAX_WAIT_MS),
        max_bytes: uint(h.get("max_bytes"), 1 << 20)?.max(1),
        meta_inc,
        meta_seq: uint(h.get("meta_seq"), 0)?,
    })
}

/// The answer's header, byte for byte as Python's `handle_fetch` (orjson) writes it;
/// `meta`: its metadata part (`MetaOps::since`).
pub fn header(end: u64, base: u64, f: &Fetching, confirmed: Option<u64>, meta: &[u8]) -> Vec<u8> {
    let confirmed = confirmed.map_or_else(|| "null".to_string(), |c| c.to_string());
    let mut out = format!(
        r#"{{"end":{end},"base":{base},"epoch":{},"confirmed":{confirmed},"epochs":{},"meta":"#,
        f.epoch, f.epochs
    )
    .into_bytes();
    out.extend_from_slice(meta);
    out.push(b'}');
    out
}

/// Whole records from the start of `data` (`CommitLog.read_raw`'s walk): how many bytes.
pub fn whole_records(data: &[u8]) -> usize {
    let mut pos = 0usize;
    while data.len() - pos >= RECORD_FRAME {
        let size = u32::from_be_bytes([data[pos + 4], data[pos + 5], data[pos + 6], data[pos + 7]])
            as usize;
        if size < RECORD_FRAME || pos + size > data.len() {
            break;
        }
        pos += size;
    }
    pos
}

/// The segment file being read (the active one: a steady replica is near the end).
#[derive(Default)]
pub struct Segment {
    open: Option<(PathBuf, u64, File)>,
}

impl Segment {
    /// `CommitLog.read_raw` for an offset in the active segment (`base`), the log
    /// written to `end`: (bytes, their segment's base). None: not decided here (a
    /// record larger than `max_bytes`, a segment rolled meanwhile, a read error).
    pub fn read_raw(
        &mut self,
        dir: &Path,
        base: u64,
        end: u64,
        offset: u64,
        max_bytes: u64,
    ) -> Option<(Vec<u8>, u64)> {
        if offset >= end {
            return Some((Vec::new(), offset));
        }
        if offset < base {
            return None;
        }
        let want = (end - offset).min(max_bytes) as usize;
        let file = self.file(dir, base).ok()?;
        let mut data = vec![0u8; want];
        let mut got = 0usize;
        while got < want {
            match file.read_at(&mut data[got..], offset - base + got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return None,
            }
        }
        data.truncate(got);
        let whole = whole_records(&data);
        if whole == 0 {
            return None; // (a record larger than asked, or the segment rolled: Python's)
        }
        data.truncate(whole);
        Some((data, base))
    }

    fn file(&mut self, dir: &Path, base: u64) -> io::Result<&File> {
        let fresh = !matches!(&self.open, Some((d, b, _)) if *b == base && d == dir);
        if fresh {
            let f = File::open(dir.join(segment_name(base)))?;
            self.open = Some((dir.to_path_buf(), base, f));
        }
        match &self.open {
            Some((_, _, f)) => Ok(f),
            None => Err(io::ErrorKind::NotFound.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_steady_fetch_is_told_from_the_rest() {
        let parse = |s: &str| ask(&serde_json::from_str(s).unwrap());
        let a = parse(
            r#"{"node":"n1","addr":"h:1","offset":120,"epoch":3,"epochs":null,
            "meta_inc":"ab","meta_seq":7,"meta_complete":true,"snap":null,"restart":null,
            "confirmed":100,"write_error":null,"lazy":true,"wait_ms":9000,"max_bytes":4194304}"#,
        )
        .unwrap();
        assert!(a.steady && !a.first && a.lazy);
        assert_eq!(
            (a.offset, a.epoch, a.confirmed, a.wait_ms, a.meta_seq),
            (120, 3, Some(100), MAX_WAIT_MS, 7)
        );
        let b = parse(r#"{"node":"n","offset":0}"#).unwrap();
        assert!(b.steady && !b.lazy);
        assert_eq!((b.max_bytes, b.confirmed, b.wait_ms), (1 << 20, None, 0));
        for not_steady in [
            r#"{"node":"n","offset":0,"snap":["a",1,"c","k"]}"#,
            r#"{"node":"n","offset":0,"restart":[0,"q"]}"#,
            r#"{"node":"n","offset":0,"write_error":"no space"}"#,
            r#"{"node":"n","offset":0,"meta_complete":false}"#,
        ] {
            assert!(!parse(not_steady).unwrap().steady, "{not_steady}");
        }
        assert!(
            parse(r#"{"node":"n","offset":0,"epochs":[[1,0]]}"#)
                .unwrap()
                .first
        );
        for odd in [
            r#"{"offset":0}"#,
            r#"{"node":1,"offset":0}"#,
            r#"{"node":"n","offset":-1}"#,
            r#"{"node":"n","offset":"0"}"#,
            r#"{"node":"n","offset":0,"epoch":1.5}"#,
        ] {
            assert!(parse(odd).is_none(), "{odd}");
        }
    }

    #[test]
    fn the_header_is_byte_for_byte_pythons() {
        // orjson.dumps({"end": 500, "base": 0, "epoch": 2, "confirmed": 480,
        // "epochs": [[1, 0], [2, 300]], "meta": {"inc": "ab", "seq": 4, "ops": []}})
        let f = Fetching {
            epoch: 2,
            epochs: "[[1,0],[2,300]]".into(),
            dir: PathBuf::new(),
            sync: true,
        };
        let mut meta = MetaOps::default();
        meta.position("ab".into(), 4);
        assert_eq!(
            header(500, 0, &f, Some(480), &meta.since(4)),
            br#"{"end":500,"base":0,"epoch":2,"confirmed":480,"epochs":[[1,0],[2,300]],"meta":{"inc":"ab","seq":4,"ops":[]}}"#.to_vec()
        );
        assert!(String::from_utf8(header(1, 1, &f, None, b"{}"))
            .unwrap()
            .contains(r#""confirmed":null"#));
        // orjson.dumps({"inc": "ab", "seq": 6, "ops": [["put", "sessions", "c1", {"a": 1}],
        // ["delete", "inflight", "k", None]]})
        meta.record(
            5,
            vec![
                br#"["put","sessions","c1",{"a":1}]"#.to_vec(),
                br#"["delete","inflight","k",null]"#.to_vec(),
            ],
        );
        assert!(meta.covers("ab", 4) && meta.covers("ab", 6) && !meta.covers("ab", 7));
        assert!(!meta.covers("cd", 6) && !meta.covers("ab", 3));
        assert_eq!(
            meta.since(4),
            br#"{"inc":"ab","seq":6,"ops":[["put","sessions","c1",{"a":1}],["delete","inflight","k",null]]}"#.to_vec()
        );
        assert_eq!(
            meta.since(5),
            br#"{"inc":"ab","seq":6,"ops":[["delete","inflight","k",null]]}"#.to_vec()
        );
    }

    #[test]
    fn metadata_ops_are_kept_bounded_and_gaps_start_over() {
        let mut meta = MetaOps::default();
        meta.position("i".into(), 10);
        meta.record(20, vec![b"[1]".to_vec()]); // (a gap: 11..19 unknown here)
        assert!(!meta.covers("i", 10) && meta.covers("i", 19) && meta.seq() == 20);
        for n in 0..(META_OPS_KEPT as u64 + 10) {
            meta.record(21 + n, vec![b"[2]".to_vec()]);
        }
        assert_eq!(meta.ops.len(), META_OPS_KEPT);
        assert!(!meta.covers("i", 19) && meta.covers("i", meta.seq() - 5));
        meta.position("i".into(), 5); // (behind what is known: nothing changes)
        assert!(meta.covers("i", meta.seq()));
        meta.position("j".into(), 0);
        assert!(meta.covers("j", 0) && meta.seq() == 0);
    }

    #[test]
    fn reads_stop_at_whole_records() {
        let rec = |n: u32| {
            let mut r = vec![0u8; n as usize];
            r[4..8].copy_from_slice(&n.to_be_bytes());
            r
        };
        let mut log = rec(20);
        log.extend(rec(30));
        log.extend(rec(16));
        assert_eq!(whole_records(&log), 66);
        assert_eq!(whole_records(&log[..60]), 50);
        assert_eq!(whole_records(&log[..10]), 0);
        let dir = std::env::temp_dir().join(format!("lg-fetch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(segment_name(100)), &log).unwrap();
        let mut seg = Segment::default();
        assert_eq!(
            seg.read_raw(&dir, 100, 166, 120, 40),
            Some((log[20..50].to_vec(), 100))
        );
        assert_eq!(seg.read_raw(&dir, 100, 166, 166, 40), Some((vec![], 166)));
        assert_eq!(
            seg.read_raw(&dir, 100, 166, 100, 10),
            None,
            "larger than asked"
        );
        assert_eq!(
            seg.read_raw(&dir, 100, 166, 90, 10),
            None,
            "before the segment"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
