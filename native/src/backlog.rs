//! A subscriber that fell behind, served from the store (`gateway/delivery.py` pulls
//! do it in Python): past its budget a carried connection stops taking live
//! deliveries, and each round the owner hands over what the light-queue index holds of
//! its queues from its positions (runs of 20-byte entries, as `index.rs` packs them,
//! and the log's end the index is known to cover); this module merges them in log
//! order across the queues, a record in several of them once, reads the records from
//! the segment files and makes one bounded batch of deliveries of them.
//!
//! Nothing is kept between rounds: a batch starts at the positions the connection
//! reports, so a round cut short (a record that needs Python, one that is gone) loses
//! nothing and the next round starts where it ended.
//!
//! The batches are made on a thread of their own (`Rounds`, "lightgate-backlog"): a
//! read the page cache does not hold waits for the disk, which must stall neither a
//! reactor thread nor the owner's.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::commitlog::segment_name;
use crate::index::ENTRY_SIZE;
use crate::reactor::{Command, Delivery};
use crate::record;

/// Messages and bytes (their cost as held) of one batch, at most (one at least).
pub const BATCH_MESSAGES: usize = 256;
pub const BATCH_BYTES: usize = 256 * 1024;
/// Segment files kept open between reads.
const OPEN_FILES: usize = 4;

/// What the index holds of one of the connection's queues from its position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueRuns {
    pub queue: Arc<str>,
    /// Where the reader is (clamped by the owner to what the queue still holds: a
    /// position below it was taken by retention).
    pub start: u64,
    /// (first offset, entries) in offset order.
    pub runs: Vec<(u64, Vec<u8>)>,
    /// The read stopped at its count: more entries may follow the last one given.
    pub full: bool,
}

/// One record to deliver, where it is in the log and its offset in each of the
/// connection's queues it is in (their indexes in the round's `QueueRuns`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    pub phys: u64,
    pub size: u32,
    pub positions: Vec<(usize, u64)>,
}

fn entries(q: &QueueRuns) -> impl Iterator<Item = (u64, u32, u64)> + '_ {
    q.runs.iter().flat_map(move |(first, bytes)| {
        bytes
            .chunks_exact(ENTRY_SIZE)
            .enumerate()
            .map(move |(i, e)| {
                let phys = u64::from_be_bytes(e[0..8].try_into().expect("8 bytes"));
                let size = u32::from_be_bytes(e[8..12].try_into().expect("4 bytes"));
                (phys, size, first + i as u64)
            })
            .filter(move |(_, _, offset)| *offset >= q.start)
    })
}

/// The records of `queues` below what every one of them is known to hold (`horizon`,
/// the log position the index covers; for a read cut at its count, its last entry),
/// in log order, each once with its offset in each queue it is in.
pub fn merge(queues: &[QueueRuns], horizon: u64) -> Vec<Planned> {
    let mut bound = horizon;
    for q in queues.iter().filter(|q| q.full) {
        if let Some((phys, _, _)) = entries(q).last() {
            bound = bound.min(phys + 1);
        }
    }
    let mut by_phys: HashMap<u64, Planned> = HashMap::new();
    for (i, q) in queues.iter().enumerate() {
        for (phys, size, offset) in entries(q).take_while(|(phys, _, _)| *phys < bound) {
            by_phys
                .entry(phys)
                .or_insert_with(|| Planned {
                    phys,
                    size,
                    positions: Vec::new(),
                })
                .positions
                .push((i, offset));
        }
    }
    let mut out: Vec<Planned> = by_phys.into_values().collect();
    out.sort_unstable_by_key(|p| p.phys);
    out
}

/// Reads records from the segment files of `dir` (`{base:020}`), a few kept open.
pub struct Segments {
    dir: PathBuf,
    bases: Vec<u64>,
    open: Vec<(u64, File)>,
}

impl Segments {
    pub fn new(dir: &Path) -> Self {
        Segments {
            dir: dir.to_path_buf(),
            bases: Vec::new(),
            open: Vec::new(),
        }
    }

    fn list(&mut self) {
        let mut bases: Vec<u64> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name();
                let name = name.to_str()?;
                (name.len() == 20).then(|| name.parse().ok())?
            })
            .collect();
        bases.sort_unstable();
        self.bases = bases;
        self.open
            .retain(|(b, _)| self.bases.binary_search(b).is_ok());
    }

    fn file(&mut self, base: u64) -> io::Result<&File> {
        if let Some(i) = self.open.iter().position(|(b, _)| *b == base) {
            let f = self.open.remove(i);
            self.open.push(f);
        } else {
            let f = File::open(self.dir.join(segment_name(base)))?;
            if self.open.len() >= OPEN_FILES {
                self.open.remove(0);
            }
            self.open.push((base, f));
        }
        Ok(&self.open.last().expect("just pushed").1)
    }

    fn try_read(&mut self, phys: u64, size: u32) -> io::Result<Option<Vec<u8>>> {
        let i = self.bases.partition_point(|b| *b <= phys);
        if i == 0 {
            return Ok(None);
        }
        let base = self.bases[i - 1];
        let mut buf = vec![0; size as usize];
        match self
            .file(base)
            .and_then(|f| f.read_exact_at(&mut buf, phys - base))
        {
            Ok(()) => Ok(Some(buf)),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::NotFound | io::ErrorKind::UnexpectedEof
                ) =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// The record at `phys`; None when its segment is gone (retention) or does not
    /// hold it.
    pub fn read(&mut self, phys: u64, size: u32) -> io::Result<Option<Vec<u8>>> {
        if let Some(buf) = self.try_read(phys, size)? {
            return Ok(Some(buf));
        }
        self.list(); // a segment begun or removed since the last look
        self.try_read(phys, size)
    }
}

/// What a connection subscribed to a queue with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reader {
    pub version: u8,
    /// queue -> the subscription's QoS.
    pub qos: HashMap<Arc<str>, u8>,
}

/// One round's work for a connection.
#[derive(Debug, Default)]
pub struct Batch {
    /// Positions to move to first: where the owner found the queue starts now (past
    /// what retention took), and past records that are gone or damaged.
    pub jumps: Vec<(Arc<str>, u64)>,
    pub deliveries: Vec<Delivery>,
    /// The next record needs Python (QoS 2, properties a v5 client must get): the
    /// connection goes back at it, once the batch is out.
    pub release: bool,
    /// Records skipped as gone or damaged.
    pub dropped: u64,
}

/// Whether a record's properties (JSON, as `store/record.py` keeps them) are none.
pub fn no_properties(properties: &[u8]) -> bool {
    properties.is_empty() || properties == b"{}"
}

/// The next batch for `reader` from the round's runs: records in log order from the
/// positions, each once, at most `max_messages` and `max_bytes` (one message at
/// least). A record that cannot be read ends the batch before it (the next round
/// starts there and skips it).
pub fn batch(
    reader: &Reader,
    queues: &[QueueRuns],
    horizon: u64,
    segments: &mut Segments,
    max_messages: usize,
    max_bytes: usize,
) -> io::Result<Batch> {
    let mut out = Batch::default();
    // The segments as they are now: a file retention removed is let go (an open one
    // would keep its disk space), one begun since is known.
    segments.list();
    let mut next: Vec<u64> = queues.iter().map(|q| q.start).collect();
    for q in queues {
        out.jumps.push((Arc::clone(&q.queue), q.start));
    }
    let mut bytes = 0;
    let plan = merge(queues, horizon);
    let mut ahead = ReadAhead::default();
    for (k, p) in plan.iter().enumerate() {
        if out.deliveries.len() >= max_messages || bytes >= max_bytes {
            break;
        }
        let Some(buf) = ahead.record(segments, &plan, k)? else {
            if !out.deliveries.is_empty() {
                break;
            }
            skip(&mut out, queues, &mut next, p);
            continue;
        };
        let Ok((rec, _)) = record::decode(buf) else {
            if !out.deliveries.is_empty() {
                break;
            }
            skip(&mut out, queues, &mut next, p);
            continue;
        };
        let sub_qos = p
            .positions
            .iter()
            .filter_map(|(i, _)| reader.qos.get(&queues[*i].queue))
            .max()
            .copied()
            .unwrap_or(0);
        let qos = rec.qos.min(sub_qos);
        if qos > 1 || (reader.version == 5 && !no_properties(rec.properties)) {
            out.release = out.deliveries.is_empty();
            break;
        }
        let d = Delivery {
            topic: Arc::from(rec.topic),
            payload: Arc::from(rec.body),
            qos,
            retain: false,
            source: (0, p.phys),
            positions: p
                .positions
                .iter()
                .map(|(i, o)| (Arc::clone(&queues[*i].queue), *o))
                .collect(),
            from_lane: None,
        };
        for (i, o) in &p.positions {
            next[*i] = o + 1;
        }
        bytes += d.cost();
        out.deliveries.push(d);
    }
    Ok(out)
}

/// One round to make: a connection's runs from its positions, read from the index or
/// the engine's ring (`ring`), and the log position they are known to cover.
pub struct Job {
    pub conn: u64,
    pub round: u64,
    pub reader: Reader,
    pub queues: Vec<QueueRuns>,
    pub horizon: u64,
    /// The batch's size at most (`batch`).
    pub max_messages: usize,
    pub max_bytes: usize,
}

#[derive(Default)]
struct Waiting {
    jobs: VecDeque<Job>,
    stop: bool,
}

/// The rounds waiting for the backlog thread (one per connection at most: a
/// connection asks for its next round once the last one is out).
#[derive(Clone, Default)]
pub struct Rounds(Arc<(Mutex<Waiting>, Condvar)>);

impl Rounds {
    pub fn push(&self, job: Job) {
        let (waiting, ready) = &*self.0;
        if let Ok(mut w) = waiting.lock() {
            w.jobs.push_back(job);
            ready.notify_one();
        }
    }

    /// Make the rounds pushed on a thread of their own, reading the segments of `dir`;
    /// each batch goes by `send` as `Command::Catch`, or the connection goes back
    /// (`Command::Release`) when the log cannot be read. Until the `Worker` is dropped.
    pub fn serve(&self, dir: &Path, send: impl Fn(Command) + Send + 'static) -> io::Result<Worker> {
        let rounds = self.clone();
        let mut segments = Segments::new(dir);
        let thread = std::thread::Builder::new()
            .name("lightgate-backlog".into())
            .spawn(move || {
                while let Some(job) = rounds.next() {
                    let made = batch(
                        &job.reader,
                        &job.queues,
                        job.horizon,
                        &mut segments,
                        job.max_messages,
                        job.max_bytes,
                    );
                    let command = match made {
                        Ok(batch) => Command::Catch {
                            conn: job.conn,
                            round: job.round,
                            batch: Box::new(batch),
                        },
                        Err(_) => Command::Release { conn: job.conn },
                    };
                    send(command);
                }
            })?;
        Ok(Worker {
            rounds: self.clone(),
            thread: Some(thread),
        })
    }

    /// The next round, waiting for one; None once stopped.
    fn next(&self) -> Option<Job> {
        let (waiting, ready) = &*self.0;
        let mut w = waiting.lock().ok()?;
        loop {
            if w.stop {
                return None;
            }
            if let Some(job) = w.jobs.pop_front() {
                return Some(job);
            }
            w = ready.wait(w).ok()?;
        }
    }
}

/// The backlog thread: stopped and joined when dropped (rounds not made are dropped:
/// their connections are going).
pub struct Worker {
    rounds: Rounds,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        let (waiting, ready) = &*self.rounds.0;
        if let Ok(mut w) = waiting.lock() {
            w.stop = true;
            w.jobs.clear();
            ready.notify_all();
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Records that follow each other in the log, read with one pread (a round of one
/// topic's records is one run of the log, most often), a batch's bytes at most.
#[derive(Default)]
struct ReadAhead {
    at: u64,
    buf: Vec<u8>,
}

impl ReadAhead {
    /// The record of `plan[k]`: from what was read ahead, or read with the ones right
    /// after it; None when it is gone.
    fn record(
        &mut self,
        segments: &mut Segments,
        plan: &[Planned],
        k: usize,
    ) -> io::Result<Option<&[u8]>> {
        let p = &plan[k];
        let end = p.phys + u64::from(p.size);
        if !(p.phys >= self.at && end <= self.at + self.buf.len() as u64) {
            let mut len = u64::from(p.size);
            for q in plan[k + 1..].iter().take(BATCH_MESSAGES) {
                if q.phys != p.phys + len || len + u64::from(q.size) > BATCH_BYTES as u64 {
                    break;
                }
                len += u64::from(q.size);
            }
            // A run that crosses a segment's end cannot be read whole: one at a time.
            let span = match len > u64::from(p.size) {
                true => segments.read(p.phys, len as u32)?,
                false => None,
            };
            let read = match span {
                Some(span) => Some(span),
                None => segments.read(p.phys, p.size)?,
            };
            (self.at, self.buf) = (p.phys, read.unwrap_or_default());
            if self.buf.is_empty() {
                return Ok(None);
            }
        }
        let from = (p.phys - self.at) as usize;
        Ok(Some(&self.buf[from..from + p.size as usize]))
    }
}

fn skip(out: &mut Batch, queues: &[QueueRuns], next: &mut [u64], p: &Planned) {
    out.dropped += 1;
    for (i, o) in &p.positions {
        next[*i] = o + 1;
        out.jumps.push((Arc::clone(&queues[*i].queue), o + 1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commitlog::LogWriter;
    use crate::record::{encode_into, Record};

    /// A record written: where, its size, its queues with offsets.
    type Written = (u64, u32, Vec<(String, u64)>);

    fn tmp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("lg-backlog-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn entry(phys: u64, size: u32) -> Vec<u8> {
        let mut e = phys.to_be_bytes().to_vec();
        e.extend_from_slice(&size.to_be_bytes());
        e.extend_from_slice(&0u64.to_be_bytes());
        e
    }

    /// Records on `topics` written by the native log writer into `dir`, in segments of
    /// `segment_size`; each one's (phys, size, queues with offsets).
    fn write(dir: &Path, segment_size: u64, messages: &[(&str, &[&str], u8)]) -> Vec<Written> {
        let mut w = LogWriter::open(dir, segment_size, 0, 0).unwrap();
        let mut next: HashMap<String, u64> = HashMap::new();
        let mut out = Vec::new();
        for (topic, queues, qos) in messages {
            let qs: Vec<(&str, u64)> = queues
                .iter()
                .map(|q| {
                    let n = next.entry(q.to_string()).or_insert(0);
                    *n += 1;
                    (*q, *n - 1)
                })
                .collect();
            let rec = Record {
                store_ts: 1,
                born_ts: 1,
                qos: *qos,
                retain: false,
                marks: 0,
                client_id: "c",
                topic,
                key: "",
                properties: b"",
                body: topic.as_bytes(),
                queues: qs.clone(),
            };
            let mut buf = Vec::new();
            encode_into(&rec, &mut buf).unwrap();
            let at = w.append(&[&buf]).unwrap().positions[0];
            out.push((
                at,
                buf.len() as u32,
                qs.iter().map(|(q, o)| (q.to_string(), *o)).collect(),
            ));
        }
        out
    }

    fn runs_of(written: &[Written], queue: &str, start: u64, max: usize) -> QueueRuns {
        let mut bytes = Vec::new();
        let mut first = None;
        let mut n = 0;
        for (phys, size, qs) in written {
            for (q, o) in qs {
                if q == queue && *o >= start && n < max {
                    first.get_or_insert(*o);
                    bytes.extend(entry(*phys, *size));
                    n += 1;
                }
            }
        }
        QueueRuns {
            queue: Arc::from(queue),
            start,
            runs: first.map(|f| vec![(f, bytes)]).unwrap_or_default(),
            full: n == max,
        }
    }

    fn reader(qos: &[(&str, u8)]) -> Reader {
        Reader {
            version: 4,
            qos: qos.iter().map(|(q, n)| (Arc::from(*q), *n)).collect(),
        }
    }

    /// The batch of one queue `t` read from `start`.
    fn one(r: &Reader, w: &[Written], start: u64, max: usize, dir: &Path) -> Batch {
        batch(
            r,
            &[runs_of(w, "t", start, max)],
            u64::MAX,
            &mut Segments::new(dir),
            BATCH_MESSAGES,
            BATCH_BYTES,
        )
        .unwrap()
    }

    fn topics(b: &Batch) -> Vec<&str> {
        b.deliveries.iter().map(|d| &*d.topic).collect()
    }

    #[test]
    fn overlapping_queues_deliver_once_in_log_order() {
        let dir = tmp("overlap");
        let w = write(
            &dir,
            1 << 20,
            &[
                ("a/1", &["a/1", "a/#"], 1),
                ("a/2", &["a/2", "a/#"], 1),
                ("a/1", &["a/1", "a/#"], 0),
                ("b", &["b"], 1),
            ],
        );
        let end = w.last().map(|(p, s, _)| p + *s as u64).unwrap();
        let qs = [runs_of(&w, "a/1", 0, 100), runs_of(&w, "a/#", 0, 100)];
        let r = reader(&[("a/1", 1), ("a/#", 0)]);
        let b = batch(
            &r,
            &qs,
            end,
            &mut Segments::new(&dir),
            BATCH_MESSAGES,
            BATCH_BYTES,
        )
        .unwrap();
        assert_eq!(topics(&b), ["a/1", "a/2", "a/1"]);
        // The highest QoS of the subscriptions whose queue holds it, at most the record's.
        assert_eq!(
            b.deliveries.iter().map(|d| d.qos).collect::<Vec<_>>(),
            [1, 0, 0]
        );
        assert_eq!(
            b.deliveries[0].positions.len(),
            2,
            "once, with both positions"
        );
        assert_eq!(&*b.deliveries[1].positions[0].0, "a/#");
        assert_eq!(b.dropped, 0);
        assert!(!b.release);
    }

    #[test]
    fn nothing_past_what_every_queue_is_known_to_hold() {
        let dir = tmp("horizon");
        let w = write(
            &dir,
            1 << 20,
            &[
                ("x", &["x", "#"], 0),
                ("y", &["#"], 0),
                ("x", &["x", "#"], 0),
                ("y", &["#"], 0),
            ],
        );
        // "#" read at most 2 entries: records past its second are not known to hold it.
        let qs = [runs_of(&w, "x", 0, 100), runs_of(&w, "#", 0, 2)];
        let r = reader(&[("x", 0), ("#", 0)]);
        let b = batch(
            &r,
            &qs,
            u64::MAX,
            &mut Segments::new(&dir),
            BATCH_MESSAGES,
            BATCH_BYTES,
        )
        .unwrap();
        assert_eq!(topics(&b), ["x", "y"]);
        // The horizon: what the index covers.
        let qs = [runs_of(&w, "x", 0, 100), runs_of(&w, "#", 0, 100)];
        let b = batch(
            &r,
            &qs,
            w[2].0,
            &mut Segments::new(&dir),
            BATCH_MESSAGES,
            BATCH_BYTES,
        )
        .unwrap();
        assert_eq!(topics(&b), ["x", "y"]);
        // From the positions: nothing before them.
        let qs = [runs_of(&w, "x", 1, 100), runs_of(&w, "#", 3, 100)];
        let b = batch(
            &r,
            &qs,
            u64::MAX,
            &mut Segments::new(&dir),
            BATCH_MESSAGES,
            BATCH_BYTES,
        )
        .unwrap();
        assert_eq!(topics(&b), ["x", "y"]);
        assert_eq!(b.deliveries[0].positions.len(), 1);
    }

    #[test]
    fn a_missing_segment_is_jumped_and_counted() {
        let dir = tmp("missing");
        let msgs: Vec<(&str, &[&str], u8)> = (0..6).map(|_| ("t", &["t"][..], 0)).collect();
        // Small segments: a few records each.
        let w = write(&dir, 200, &msgs);
        let mut segs = Segments::new(&dir);
        segs.list();
        assert!(segs.bases.len() >= 2);
        let second = w.iter().position(|(p, _, _)| *p >= segs.bases[1]).unwrap();
        std::fs::remove_file(dir.join(segment_name(0))).unwrap();
        let qs = [runs_of(&w, "t", 0, 100)];
        let r = reader(&[("t", 0)]);
        let b = batch(&r, &qs, u64::MAX, &mut segs, BATCH_MESSAGES, BATCH_BYTES).unwrap();
        assert_eq!(b.dropped, second as u64);
        assert_eq!(b.deliveries.len(), 6 - second);
        assert_eq!(b.deliveries[0].positions, [(Arc::from("t"), second as u64)]);
        assert!(b.jumps.contains(&(Arc::from("t"), second as u64)));
    }

    #[test]
    fn a_record_that_needs_python_ends_the_batch() {
        let dir = tmp("python");
        let w = write(
            &dir,
            1 << 20,
            &[("t", &["t"], 1), ("t", &["t"], 2), ("t", &["t"], 1)],
        );
        let r = reader(&[("t", 2)]);
        let b = one(&r, &w, 0, 100, &dir);
        assert_eq!(b.deliveries.len(), 1);
        assert!(
            !b.release,
            "the first goes out; the next round meets it first"
        );
        let b = one(&r, &w, 1, 100, &dir);
        assert!(b.deliveries.is_empty() && b.release);
        // At QoS 1 it is delivered at QoS 1 natively.
        let r = reader(&[("t", 1)]);
        let b = one(&r, &w, 1, 100, &dir);
        assert_eq!(b.deliveries.len(), 2);
    }

    #[test]
    fn runs_read_ahead_across_segment_ends_lose_nothing() {
        let dir = tmp("ahead");
        let msgs: Vec<(&str, &[&str], u8)> = (0..200)
            .map(|i| (if i % 7 == 0 { "u" } else { "t" }, &["t", "#"][..], 0))
            .collect();
        // Segments of a dozen records or so: many runs end at one.
        let w = write(&dir, 1000, &msgs);
        let r = reader(&[("t", 0), ("#", 0)]);
        let qs = [runs_of(&w, "t", 0, 500), runs_of(&w, "#", 0, 500)];
        let b = batch(
            &r,
            &qs,
            u64::MAX,
            &mut Segments::new(&dir),
            BATCH_MESSAGES,
            BATCH_BYTES,
        )
        .unwrap();
        assert_eq!(b.dropped, 0);
        let want: Vec<&str> = msgs.iter().map(|(t, _, _)| *t).collect();
        assert_eq!(topics(&b), want);
        let offsets: Vec<u64> = b.deliveries.iter().map(|d| d.positions[0].1).collect();
        assert_eq!(offsets, (0..200).collect::<Vec<u64>>());
    }

    #[test]
    fn a_batch_is_bounded() {
        let dir = tmp("bounded");
        let msgs: Vec<(&str, &[&str], u8)> = (0..BATCH_MESSAGES + 10)
            .map(|_| ("t", &["t"][..], 0))
            .collect();
        let w = write(&dir, 1 << 30, &msgs);
        let r = reader(&[("t", 0)]);
        let b = one(&r, &w, 0, 4096, &dir);
        assert_eq!(b.deliveries.len(), BATCH_MESSAGES);
    }
}
