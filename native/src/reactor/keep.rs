//! A persistent session's deliveries on the native plane (`gateway/kept_sends.py` is
//! Python's): a QoS 1 PUBLISH goes to the client only once its in-flight record is in
//! the store, so that a crash resends it with its packet id and DUP instead of
//! forgetting it (the client would get it again as a new message, under another id).
//!
//! The deliveries a pass brings (a round's batch from the store, or live ones) are
//! *staged*: each QoS 1 one gets its packet id at once (reserved: not taken from the
//! client's window yet), and at the pass's end the owner is told the whole batch's
//! (packet id, queue, offset) in one `Report::Keep`, which it writes as one record.
//! Once it says the record is kept (`Command::Kept`) the batch is *ready*: sent as the
//! client's window allows, each with its reserved id. Reserving ids ahead of the window
//! lets a record cover a round's 256 deliveries where the window (32 by default) would
//! have cut it into eight records, each a round trip to the owner with the window idle.
//!
//! Acks complete the batches; a `Report::Progress` then tells the owner where each
//! queue resumes (the lowest offset still in flight, and the first never sent) and
//! which batches are complete, whose records it deletes in the same write.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use super::{Counters, Delivery};
use crate::protocol::Connection;

/// Messages and bytes (their cost as held) of a persistent session's round from the
/// store, at most (`backlog::batch`): four times a clean session's. Each round
/// costs the owner a read of the index and a record, whatever its size; with rounds of
/// 256 a reconnecting session caught up with 1,000,000 messages at 200,000-220,000
/// msg/s, with 1,024 at 377,000-417,000 (a loaded 2-core machine; 2,048 was no
/// faster). What it holds stays within its budget (`Conn::waiting`) and a round.
pub const ROUND_MESSAGES: usize = 1024;
pub const ROUND_BYTES: usize = 1024 * 1024;

/// Batches are numbered across the node, and across restarts (the first is the clock's
/// microseconds): a record's key names its batch, and a record left over from before a
/// restart must not be taken for a new one.
static BATCHES: AtomicU64 = AtomicU64::new(0);

fn next_batch() -> u64 {
    if BATCHES.load(Ordering::Relaxed) == 0 {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_micros() as u64);
        let _ = BATCHES.compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed);
    }
    BATCHES.fetch_add(1, Ordering::Relaxed)
}

/// One delivery waiting to go out, with the packet id reserved for it (QoS 1).
pub(super) struct Staged {
    pub delivery: Delivery,
    pub pid: Option<u16>,
}

/// A QoS 1 send in a record and not acknowledged yet: its first position, its batch.
struct Send {
    queue: Arc<str>,
    offset: u64,
    batch: u64,
}

/// What a persistent connection keeps beside its core.
pub(super) struct Keeper {
    /// The next packet id to reserve.
    next_pid: u16,
    /// Each queue's position after the last delivery staged: where the next round
    /// from the store starts (the sent positions lag behind while a batch waits).
    pub upto: BTreeMap<Arc<str>, u64>,
    staged: Vec<Staged>,
    /// Batches told to the owner, in order, and whether their record is kept.
    unkept: VecDeque<(u64, bool, Vec<Staged>)>,
    /// Kept, waiting for the client's window.
    ready: VecDeque<Staged>,
    /// The `cost` of every delivery in `staged`, `unkept` and `ready`.
    pub cost: usize,
    sends: HashMap<u16, Send>,
    /// Batch -> its sends not acknowledged yet.
    batches: HashMap<u64, u32>,
    /// Batches completed since the last progress report.
    done: Vec<u64>,
    /// Something was sent or acknowledged since the last progress report.
    dirty: bool,
    last_progress: f64,
    /// Seconds between progress reports while no batch completes.
    every: f64,
}

/// A batch for the owner to keep, its QoS 1 sends in runs: (first packet id, queue,
/// first offset, count), the packet ids of a run consecutive (65535 followed by 1), and
/// so are its offsets. A round from the store is one run, as a rule: its record is a few
/// bytes, where a list of each send's made the owner build and encode 256 of them.
pub type KeepSends = Vec<(u16, Arc<str>, u64, u32)>;
/// Where each queue resumes: queue -> (lowest offset in flight or next, next).
pub type Resume = Vec<(Arc<str>, u64, u64)>;

impl Keeper {
    pub fn new(next_pid: u16, every: f64) -> Self {
        Keeper {
            next_pid: next_pid.max(1),
            upto: BTreeMap::new(),
            staged: Vec::new(),
            unkept: VecDeque::new(),
            ready: VecDeque::new(),
            cost: 0,
            sends: HashMap::new(),
            batches: HashMap::new(),
            done: Vec::new(),
            dirty: false,
            last_progress: 0.0,
            every,
        }
    }

    /// Deliveries waiting (staged, unkept or ready).
    pub fn pending(&self) -> usize {
        self.staged.len() + self.unkept.iter().map(|b| b.2.len()).sum::<usize>() + self.ready.len()
    }

    pub fn holds(&self) -> bool {
        !self.staged.is_empty() || !self.unkept.is_empty() || !self.ready.is_empty()
    }

    fn reserve(&mut self, core: &Connection) -> Option<u16> {
        for _ in 0..65535 {
            let pid = self.next_pid;
            self.next_pid = pid % 65535 + 1;
            if !core.outgoing().contains_key(&pid) && !self.sends.contains_key(&pid) {
                return Some(pid);
            }
        }
        None
    }

    /// A delivery for the client, behind every one before it. False, and nothing
    /// staged: it is a QoS 0 one, which the owner delivers (a persistent session
    /// resumes at the first QoS 0 message its socket did not take, which the owner
    /// keeps track of): the connection goes back before it.
    pub fn stage(&mut self, core: &Connection, d: Delivery, counters: &Counters) -> bool {
        if d.qos == 0 {
            return false;
        }
        for (queue, offset) in &d.positions {
            let next = self.upto.entry(Arc::clone(queue)).or_insert(0);
            *next = (*next).max(offset + 1);
        }
        let Some(pid) = self.reserve(core) else {
            Counters::add(&counters.dropped, 1);
            return true;
        };
        self.cost += d.cost();
        self.staged.push(Staged {
            delivery: d,
            pid: Some(pid),
        });
        true
    }

    /// At a pass's end: the staged batch for the owner to keep.
    pub fn take_batch(&mut self) -> Option<(u64, KeepSends)> {
        if self.staged.is_empty() {
            return None;
        }
        let staged = std::mem::take(&mut self.staged);
        let sends: Vec<(u16, Arc<str>, u64)> = staged
            .iter()
            .filter_map(|s| {
                let (queue, offset) = s.delivery.positions.first()?;
                Some((s.pid?, Arc::clone(queue), *offset))
            })
            .collect();
        if sends.is_empty() && self.unkept.is_empty() {
            self.ready.extend(staged);
            return None;
        }
        let batch = next_batch();
        for (pid, queue, offset) in &sends {
            self.sends.insert(
                *pid,
                Send {
                    queue: Arc::clone(queue),
                    offset: *offset,
                    batch,
                },
            );
        }
        if !sends.is_empty() {
            self.batches.insert(batch, sends.len() as u32);
        }
        self.unkept.push_back((batch, sends.is_empty(), staged));
        self.release_kept();
        (!sends.is_empty()).then(|| (batch, runs(sends)))
    }

    /// The owner kept the record of `batch`: it (and any kept after it) may go out.
    pub fn kept(&mut self, batch: u64) {
        if let Some(b) = self.unkept.iter_mut().find(|b| b.0 == batch) {
            b.1 = true;
        }
        self.release_kept();
    }

    fn release_kept(&mut self) {
        while self.unkept.front().is_some_and(|b| b.1) {
            let (_, _, staged) = self.unkept.pop_front().expect("front exists");
            self.ready.extend(staged);
        }
    }

    /// The next ready delivery, if the window and `room` allow it.
    pub fn next_ready(&mut self, window: usize, room: bool) -> Option<Staged> {
        let front = self.ready.front()?;
        if (front.pid.is_some() && window == 0) || !room {
            return None;
        }
        let s = self.ready.pop_front()?;
        self.cost -= s.delivery.cost();
        Some(s)
    }

    /// A send went out (or was dropped: `gone`, counted as completed).
    pub fn sent(&mut self, pid: Option<u16>, gone: bool) {
        self.dirty = true;
        if let (Some(pid), true) = (pid, gone) {
            self.acked(pid);
        }
    }

    /// The client acknowledged `pid`.
    pub fn acked(&mut self, pid: u16) {
        let Some(send) = self.sends.remove(&pid) else {
            return;
        };
        self.dirty = true;
        if let Some(left) = self.batches.get_mut(&send.batch) {
            *left -= 1;
            if *left == 0 {
                self.batches.remove(&send.batch);
                self.done.push(send.batch);
            }
        }
    }

    /// Where each queue delivered from resumes, and the completed batches, when a batch
    /// completed or `every` passed with something new.
    pub fn progress(
        &mut self,
        positions: &BTreeMap<Arc<str>, u64>,
        now: f64,
    ) -> Option<(Resume, Vec<u64>)> {
        if self.done.is_empty() && !(self.dirty && now - self.last_progress >= self.every) {
            return None;
        }
        self.dirty = false;
        self.last_progress = now;
        let mut floor: HashMap<&str, u64> = HashMap::new();
        for s in self.sends.values() {
            let f = floor.entry(&*s.queue).or_insert(u64::MAX);
            *f = (*f).min(s.offset);
        }
        let resume = positions
            .iter()
            .map(|(q, next)| {
                let acked = floor.get(&**q).map_or(*next, |f| (*f).min(*next));
                (Arc::clone(q), acked, *next)
            })
            .collect();
        Some((resume, std::mem::take(&mut self.done)))
    }

    /// At a demotion: the queue and offset of each send in flight (by packet id), and
    /// each queue's position moved back to the first delivery that did not go out (it
    /// was never on the wire: the owner delivers it anew).
    pub fn hand_back(
        &mut self,
        outgoing: impl Iterator<Item = u16>,
        positions: &mut BTreeMap<Arc<str>, u64>,
    ) -> Vec<(u16, Arc<str>, u64)> {
        let unsent = self
            .staged
            .iter()
            .chain(self.unkept.iter().flat_map(|b| b.2.iter()))
            .chain(self.ready.iter());
        for s in unsent {
            for (queue, offset) in &s.delivery.positions {
                if let Some(p) = positions.get_mut(queue) {
                    *p = (*p).min(*offset);
                }
            }
        }
        outgoing
            .filter_map(|pid| {
                let s = self.sends.get(&pid)?;
                Some((pid, Arc::clone(&s.queue), s.offset))
            })
            .collect()
    }
}

/// Sends as runs (`KeepSends`).
fn runs(sends: Vec<(u16, Arc<str>, u64)>) -> KeepSends {
    let mut out: KeepSends = Vec::new();
    for (pid, queue, offset) in sends {
        if let Some((first, q, start, n)) = out.last_mut() {
            let next_pid = ((*first as u32 - 1 + *n) % 65535 + 1) as u16;
            if pid == next_pid && *q == queue && offset == *start + *n as u64 {
                *n += 1;
                continue;
            }
        }
        out.push((pid, queue, offset, 1));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_sends_make_one_run_across_the_packet_id_wrap() {
        let q: Arc<str> = Arc::from("q");
        let r: Arc<str> = Arc::from("r");
        let sends = vec![
            (65534, q.clone(), 7),
            (65535, q.clone(), 8),
            (1, q.clone(), 9),
            (2, r.clone(), 3),
            (3, r.clone(), 5),
        ];
        assert_eq!(
            runs(sends),
            vec![(65534, q, 7, 3), (2, r.clone(), 3, 1), (3, r, 5, 1)]
        );
    }
}
