//! The subscribers a gateway node's engine carries (`remote`): clean sessions with
//! plain subscriptions, each delivered natively from its queues' positions, with no
//! Python per message. Their messages come two ways, in any order: the store's answers
//! to this gateway's own PUBLISH frames (each message's queues and offsets), and raw
//! records pulled from the store (`PULL raw`) when a queue may hold more than a reader
//! was given (another gateway's publishes, Python's: the store's notify says so, or a
//! gap seen in the offsets). Whichever way a message comes, a reader gets it only at
//! its next offset in the queue: one below was delivered already (skipped), one above
//! means some message before it has not come yet (a gap: the queue is pulled from the
//! reader's position, and the message comes again with the rest, in order). So a
//! reader gets every message of its queues once, in queue order, as Python's delivery
//! reads them.
//!
//! The positions here are what was handed to the reactors; what went out is the
//! reactor's to say (`Demoted::positions`), as on the in-process engine.
//!
//! A reader that falls past its budget is served in rounds, as on the in-process engine
//! (`reactor`'s `Report::Behind`, `Command::Catch`): its live deliveries stop, and each
//! round pulls its queues from the positions the reactor reports and hands it one
//! bounded batch of their records in log order (`round_batch`); a round that finds
//! nothing more makes it live again from there (`resume`), and a pull of its queues
//! then brings what came meanwhile.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::backlog::{no_properties, Batch};
use crate::reactor::{Command, Delivery};
use crate::record::Record;
use crate::router::FilterError;
use crate::subs::Subs;

/// Records one pull of a queue asks for, at most.
pub const PULL_RECORDS: usize = 256;

/// A stored message as its readers see it.
pub struct Stored<'a, Q: AsRef<str>> {
    pub topic: &'a str,
    pub body: &'a [u8],
    pub qos: u8,
    /// The properties as the record keeps them (JSON; empty: none).
    pub properties: &'a [u8],
    pub phys: u64,
    pub queues: &'a [(Q, u64)],
}

/// A queue's pulls from the store.
#[derive(Debug, Default)]
struct Pull {
    /// One is under way (at most one per queue).
    asked: bool,
    /// Pull again once it is answered: something more may have come meanwhile.
    again: bool,
}

#[derive(Default)]
pub struct Readers {
    subs: Subs,
    /// conn -> queue -> the next offset to hand it. A connection handed back
    /// (`Command::Release`) leaves it at once: nothing more is delivered to it.
    next: HashMap<u64, HashMap<Arc<str>, u64>>,
    /// queue -> its readers.
    readers: HashMap<Arc<str>, HashSet<u64>>,
    /// queue -> past the highest offset seen of it (an answer, a record).
    seen: HashMap<Arc<str>, u64>,
    pulls: HashMap<Arc<str>, Pull>,
    /// Queues whose last pull failed or left a reader short: pulled again by `recheck`.
    retry: HashSet<Arc<str>>,
    /// Readers served in rounds (they fell past their budget): no live deliveries.
    behind: HashSet<u64>,
    /// conn -> queue -> where it was promoted: a round's start in a queue the reactor
    /// has not delivered from yet (its positions do not name it).
    start: HashMap<u64, HashMap<Arc<str>, u64>>,
}

/// What a round of a reader that fell behind reads: its version, and per queue where it
/// starts and its subscription's QoS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundPlan {
    pub version: u8,
    pub queues: Vec<(Arc<str>, u64, u8)>,
}

/// One queue's pull for a round: its records (log position, record) in offset order,
/// where the next pull would start, and whether it stopped at its count.
pub struct QueuePull<'a> {
    pub records: Vec<(u64, Record<'a>)>,
    pub next_offset: u64,
    pub full: bool,
}

/// What a pull answer held, as `Readers::pulled` takes it.
pub struct Answered {
    /// The queue's first offset in the answer (None: no record).
    pub first: Option<u64>,
    /// Where the next pull would start (`next_offset`).
    pub next_offset: u64,
    /// More may follow (the answer was cut at its count, or the queue holds more).
    pub more: bool,
}

impl Readers {
    /// Whether any connection reads anything here.
    pub fn is_empty(&self) -> bool {
        self.next.is_empty()
    }

    /// Carry `conn`'s subscriptions (filter, QoS, next offset of its queue) from their
    /// positions. Its queues are to be pulled once (they may hold more already).
    pub fn promote(
        &mut self,
        conn: u64,
        version: u8,
        subscriptions: &[(String, u8, u64)],
    ) -> Result<Vec<Arc<str>>, FilterError> {
        for (filter, _, _) in subscriptions {
            crate::router::validate_filter(filter)?;
        }
        let mut queues = Vec::with_capacity(subscriptions.len());
        let nexts = self.next.entry(conn).or_default();
        let start = self.start.entry(conn).or_default();
        for (filter, qos, position) in subscriptions {
            self.subs.add(conn, filter, *qos, version)?;
            let queue: Arc<str> = Arc::from(filter.as_str());
            nexts.insert(Arc::clone(&queue), *position);
            start.insert(Arc::clone(&queue), *position);
            self.readers
                .entry(Arc::clone(&queue))
                .or_default()
                .insert(conn);
            queues.push(queue);
        }
        Ok(queues)
    }

    /// `conn` is gone (demoted, or it left): its subscriptions and positions go.
    pub fn forget(&mut self, conn: u64) {
        self.subs.remove_conn(conn);
        self.next.remove(&conn);
        self.behind.remove(&conn);
        self.start.remove(&conn);
        self.readers.retain(|queue, conns| {
            conns.remove(&conn);
            if conns.is_empty() {
                self.pulls.remove(queue);
                self.seen.remove(queue);
                self.retry.remove(queue);
            }
            !conns.is_empty()
        });
    }

    /// Whether `queue` has readers here.
    pub fn reads(&self, queue: &str) -> bool {
        self.readers.contains_key(queue)
    }

    /// Whether every reader of `queue` here has been handed everything below `end`
    /// (the store's notify says the queue ends there): no pull of it can bring them
    /// more. A reader served in rounds does not count (its rounds pull for it).
    pub fn at_end(&self, queue: &str, end: u64) -> bool {
        self.readers.get(queue).is_some_and(|conns| {
            conns.iter().filter(|c| !self.behind.contains(c)).all(|c| {
                self.next
                    .get(c)
                    .and_then(|n| n.get(queue))
                    .is_none_or(|n| *n >= end)
            })
        })
    }

    /// Every queue read here.
    pub fn queues(&self) -> Vec<Arc<str>> {
        self.readers.keys().cloned().collect()
    }

    /// One stored message to its readers: each reader whose next offset it is in each
    /// of its matching queues gets it (`Command::Deliver`, in `out`); one for which it is
    /// past a queue's next offset gets it later, from a pull of that queue (named in
    /// `short`); a QoS 2 message, or one with properties a 5.0 client must get, hands
    /// the reader back to the owner before it (`Command::Release`).
    pub fn offer<Q: AsRef<str>>(
        &mut self,
        m: &Stored<'_, Q>,
        out: &mut Vec<Command>,
        short: &mut Vec<Arc<str>>,
    ) {
        for (queue, offset) in m.queues {
            if let Some(seen) = self.seen.get_mut(queue.as_ref()) {
                *seen = (*seen).max(offset + 1);
            } else if let Some((q, _)) = self.readers.get_key_value(queue.as_ref()) {
                self.seen.insert(Arc::clone(q), offset + 1);
            }
        }
        let targets = self.subs.targets(m.topic, m.queues);
        if targets.is_empty() {
            return;
        }
        let mut shared: Option<(Arc<str>, Arc<[u8]>)> = None;
        for (conn, t) in targets {
            if self.behind.contains(&conn) {
                continue; // served in rounds: its queues' records come from the store
            }
            let Some(nexts) = self.next.get_mut(&conn) else {
                continue; // handed back: the owner delivers from its positions
            };
            let mut fresh = Vec::with_capacity(t.positions.len());
            let mut gap = false;
            for (queue, offset) in t.positions {
                let Some(&next) = nexts.get(&queue) else {
                    continue;
                };
                if offset == next {
                    fresh.push((queue, offset));
                } else if offset > next {
                    gap = true;
                    short.push(queue);
                }
            }
            if gap || fresh.is_empty() {
                continue;
            }
            let qos = m.qos.min(t.qos);
            if qos > 1 || (t.version == 5 && !no_properties(m.properties)) {
                self.next.remove(&conn);
                out.push(Command::Release { conn });
                continue;
            }
            for (queue, offset) in &fresh {
                nexts.insert(Arc::clone(queue), offset + 1);
            }
            let (topic, payload) = shared
                .get_or_insert_with(|| (Arc::from(m.topic), Arc::from(m.body)))
                .clone();
            out.push(Command::Deliver {
                conn,
                delivery: Delivery {
                    topic,
                    payload,
                    qos,
                    retain: false,
                    source: (0, m.phys),
                    positions: fresh,
                    from_lane: None,
                },
            });
        }
    }

    /// Where a pull of `queue` starts (its readers' lowest next offset), and the pull
    /// marked under way; None: one is under way (it pulls again once answered), or no
    /// one reads the queue.
    pub fn ask(&mut self, queue: &str) -> Option<(Arc<str>, u64)> {
        let (q, conns) = self.readers.get_key_value(queue)?;
        let q = Arc::clone(q);
        let from = conns
            .iter()
            .filter(|c| !self.behind.contains(c))
            .filter_map(|c| self.next.get(c)?.get(queue).copied())
            .min()?;
        let pull = self.pulls.entry(Arc::clone(&q)).or_default();
        if pull.asked {
            pull.again = true;
            return None;
        }
        pull.asked = true;
        pull.again = false;
        self.retry.remove(queue);
        Some((q, from))
    }

    /// A pull of `queue` from `from` was answered (`answer`; None: it failed, and the
    /// queue is pulled again by `recheck`), its records offered already. Readers whose
    /// position the store no longer holds (retention took it) go back to the owner
    /// (`out`), which moves past what is gone. Whether to pull again at once.
    pub fn pulled(
        &mut self,
        queue: &str,
        from: u64,
        answer: Option<Answered>,
        delivered: bool,
        out: &mut Vec<Command>,
    ) -> bool {
        let Some(pull) = self.pulls.get_mut(queue) else {
            return false; // no one reads it any more
        };
        pull.asked = false;
        let again = std::mem::take(&mut pull.again);
        let Some(a) = answer else {
            self.retry.insert(Arc::from(queue));
            return false;
        };
        // Past what retention took: the first record given, or where the store says
        // the queue goes on when it gave none.
        let start = a.first.unwrap_or(a.next_offset);
        if start > from {
            let conns: Vec<u64> = self
                .readers
                .get(queue)
                .map(|c| c.iter().copied().collect())
                .unwrap_or_default();
            for conn in conns {
                // (One served in rounds is not at `next`: its round jumps it.)
                let behind = !self.behind.contains(&conn)
                    && self
                        .next
                        .get(&conn)
                        .and_then(|n| n.get(queue))
                        .is_some_and(|next| *next < start);
                if behind {
                    self.next.remove(&conn);
                    out.push(Command::Release { conn });
                }
            }
        }
        let short = self.short(queue);
        // News came while it was under way, or it moved its readers on and more waits:
        // at once; short of what was seen, but moving no one (a reader stuck behind
        // another queue's gap): not before `recheck`.
        if again || (delivered && (a.more || short)) {
            return true;
        }
        if short {
            self.retry.insert(Arc::from(queue));
        }
        false
    }

    /// Whether a reader of `queue` is short of what was seen of it.
    fn short(&self, queue: &str) -> bool {
        let Some(&seen) = self.seen.get(queue) else {
            return false;
        };
        self.readers.get(queue).is_some_and(|conns| {
            conns.iter().filter(|c| !self.behind.contains(c)).any(|c| {
                self.next
                    .get(c)
                    .and_then(|n| n.get(queue))
                    .is_some_and(|n| *n < seen)
            })
        })
    }

    /// The queues to pull again (a pull failed, or left a reader short).
    pub fn take_retry(&mut self) -> Vec<Arc<str>> {
        self.retry.drain().collect()
    }

    /// `conn` fell past its budget: served in rounds from here on (`round_plan`).
    pub fn fall_behind(&mut self, conn: u64) {
        if self.next.contains_key(&conn) {
            self.behind.insert(conn);
        }
    }

    /// What a round of `conn` from the reactor's `positions` reads; None: it is not
    /// carried here (any more).
    pub fn round_plan(&self, conn: u64, positions: &[(Arc<str>, u64)]) -> Option<RoundPlan> {
        let start = self.start.get(&conn)?;
        let mut version = 4;
        let mut queues = Vec::with_capacity(start.len());
        for id in self.subs.by_conn.get(&conn)?.values() {
            let Some(sub) = self.subs.table.get(id) else {
                continue;
            };
            version = sub.version;
            let queue = &sub.filter;
            let at = positions
                .iter()
                .find(|(q, _)| q == queue)
                .map(|(_, n)| *n)
                .or_else(|| start.get(queue).copied())?;
            queues.push((Arc::clone(queue), at, sub.qos));
        }
        queues.sort();
        Some(RoundPlan { version, queues })
    }

    /// `conn` reached its queues' ends (`plan`'s starts): live again from there, if it
    /// is still carried. What came meanwhile comes from a pull of its queues.
    pub fn resume(&mut self, conn: u64, plan: &RoundPlan) -> bool {
        let Some(nexts) = self.next.get_mut(&conn) else {
            return false;
        };
        if !self.behind.remove(&conn) {
            return false;
        }
        for (queue, at, _) in &plan.queues {
            nexts.insert(Arc::clone(queue), *at);
        }
        true
    }

    /// A reader's next offset in a queue (for tests and the owner's look).
    pub fn next_of(&self, conn: u64, queue: &str) -> Option<u64> {
        self.next.get(&conn)?.get(queue).copied()
    }
}

/// A round's batch from its queues' pulls (in `plan`'s order): their records in log
/// order, a record in several of them once with its offset in each, below what every
/// queue is known to hold (a pull cut at its count, its last record), at most
/// `max_messages` and `max_bytes`; each queue's position first moved past what the
/// store no longer holds. None: nothing more in any queue (the reader is live again).
pub fn round_batch(
    plan: &RoundPlan,
    pulls: &[QueuePull<'_>],
    max_messages: usize,
    max_bytes: usize,
) -> Option<Batch> {
    let mut out = Batch::default();
    let mut moved = false;
    for ((queue, at, _), pull) in plan.queues.iter().zip(pulls) {
        let first = match pull.records.first() {
            Some((_, r)) => r
                .queues
                .iter()
                .find(|(q, _)| *q == &**queue)
                .map(|(_, o)| *o),
            None => Some(pull.next_offset),
        };
        let start = first.map_or(*at, |f| f.max(*at));
        moved |= start != *at || !pull.records.is_empty();
        out.jumps.push((Arc::clone(queue), start));
    }
    if !moved {
        return None;
    }
    let bound = plan
        .queues
        .iter()
        .zip(pulls)
        .filter(|(_, p)| p.full)
        .filter_map(|(_, p)| p.records.last().map(|(phys, _)| phys + 1))
        .min()
        .unwrap_or(u64::MAX);
    let mut by_phys: std::collections::BTreeMap<u64, &Record<'_>> = Default::default();
    for pull in pulls {
        for (phys, r) in &pull.records {
            if *phys < bound {
                by_phys.entry(*phys).or_insert(r);
            }
        }
    }
    let mut bytes = 0;
    for (phys, r) in by_phys {
        if out.deliveries.len() >= max_messages || bytes >= max_bytes {
            break;
        }
        let mut sub_qos = 0;
        let mut positions = Vec::new();
        for ((queue, _, qos), (_, start)) in plan.queues.iter().zip(&out.jumps) {
            if let Some((_, o)) = r.queues.iter().find(|(q, _)| *q == &**queue) {
                if o >= start {
                    positions.push((Arc::clone(queue), *o));
                    sub_qos = sub_qos.max(*qos);
                }
            }
        }
        if positions.is_empty() {
            continue;
        }
        let qos = r.qos.min(sub_qos);
        if qos > 1 || (plan.version == 5 && !no_properties(r.properties)) {
            out.release = out.deliveries.is_empty();
            break;
        }
        let d = Delivery {
            topic: Arc::from(r.topic),
            payload: Arc::from(r.body),
            qos,
            retain: false,
            source: (0, phys),
            positions,
            from_lane: None,
        };
        bytes += d.cost();
        out.deliveries.push(d);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg<'a>(topic: &'a str, queues: &'a [(&'a str, u64)]) -> Stored<'a, &'a str> {
        Stored {
            topic,
            body: b"x",
            qos: 1,
            properties: b"",
            phys: 0,
            queues,
        }
    }

    fn offer(r: &mut Readers, topic: &str, queue: &str, offset: u64) -> (Vec<u64>, Vec<Arc<str>>) {
        let queues = [(queue, offset)];
        let (mut out, mut short) = (Vec::new(), Vec::new());
        r.offer(&msg(topic, &queues), &mut out, &mut short);
        let delivered = out
            .iter()
            .filter_map(|c| match c {
                Command::Deliver { delivery, .. } => Some(delivery.positions[0].1),
                _ => None,
            })
            .collect();
        (delivered, short)
    }

    #[test]
    fn at_the_next_offset_delivered_below_skipped_above_pulled() {
        let mut r = Readers::default();
        let pulled = r.promote(1, 4, &[("a/#".into(), 1, 5)]).unwrap();
        assert_eq!(pulled, vec![Arc::<str>::from("a/#")]);
        assert_eq!(offer(&mut r, "a/x", "a/#", 5), (vec![5], vec![]));
        assert_eq!(r.next_of(1, "a/#"), Some(6));
        // Below: delivered already (an answer and a pull both brought it).
        assert_eq!(offer(&mut r, "a/x", "a/#", 5), (vec![], vec![]));
        // Above: 6 has not come; 7 waits for the pull from 6.
        assert_eq!(
            offer(&mut r, "a/x", "a/#", 7),
            (vec![], vec![Arc::from("a/#")])
        );
        assert_eq!(r.next_of(1, "a/#"), Some(6));
        assert_eq!(r.ask("a/#"), Some((Arc::from("a/#"), 6)));
        assert_eq!(r.ask("a/#"), None, "one pull at a time");
        assert_eq!(offer(&mut r, "a/x", "a/#", 6), (vec![6], vec![]));
        assert_eq!(offer(&mut r, "a/x", "a/#", 7), (vec![7], vec![]));
        let a = Answered {
            first: Some(6),
            next_offset: 8,
            more: false,
        };
        let mut out = Vec::new();
        // Asked again meanwhile: once more.
        assert!(r.pulled("a/#", 6, Some(a), true, &mut out));
        assert!(out.is_empty());
    }

    #[test]
    fn another_topic_or_queue_is_not_delivered() {
        let mut r = Readers::default();
        r.promote(1, 4, &[("a/#".into(), 1, 0)]).unwrap();
        assert_eq!(offer(&mut r, "b/x", "b/x", 0), (vec![], vec![]));
        // Matching, but not routed to the subscription's queue: Python's delivery,
        // which reads the queue, would not see it either.
        assert_eq!(offer(&mut r, "a/x", "a/x", 0), (vec![], vec![]));
        assert_eq!(r.next_of(1, "a/#"), Some(0));
    }

    #[test]
    fn qos2_and_a_5_0_clients_properties_hand_it_back() {
        let mut r = Readers::default();
        r.promote(1, 5, &[("a".into(), 2, 0)]).unwrap();
        let queues = [("a", 0u64)];
        let mut m = msg("a", &queues);
        m.qos = 2;
        let (mut out, mut short) = (Vec::new(), Vec::new());
        r.offer(&m, &mut out, &mut short);
        assert!(matches!(out[..], [Command::Release { conn: 1 }]));
        assert_eq!(r.next_of(1, "a"), None, "nothing more for it");
        r.forget(1);
        assert!(r.is_empty());
        r.promote(2, 5, &[("a".into(), 1, 0)]).unwrap();
        m.qos = 1;
        m.properties = br#"{"content_type":"x"}"#;
        out.clear();
        r.offer(&m, &mut out, &mut short);
        assert!(matches!(out[..], [Command::Release { conn: 2 }]));
    }

    #[test]
    fn a_position_retention_took_goes_back() {
        let mut r = Readers::default();
        r.promote(1, 4, &[("a".into(), 1, 3)]).unwrap();
        r.promote(2, 4, &[("a".into(), 1, 20)]).unwrap();
        let (_, from) = r.ask("a").unwrap();
        assert_eq!(from, 3);
        let mut out = Vec::new();
        let a = Answered {
            first: Some(10),
            next_offset: 12,
            more: false,
        };
        r.pulled("a", from, Some(a), false, &mut out);
        assert!(matches!(out[..], [Command::Release { conn: 1 }]));
        assert_eq!(r.next_of(2, "a"), Some(20));
    }

    #[test]
    fn a_failed_pull_is_retried_and_a_short_reader_too() {
        let mut r = Readers::default();
        r.promote(1, 4, &[("a".into(), 1, 0)]).unwrap();
        r.ask("a").unwrap();
        assert!(!r.pulled("a", 0, None, false, &mut Vec::new()));
        assert_eq!(r.take_retry(), vec![Arc::<str>::from("a")]);
        // Seen up to 5, given nothing: short, pulled again later.
        offer(&mut r, "a", "a", 4);
        r.ask("a").unwrap();
        let a = Answered {
            first: None,
            next_offset: 0,
            more: false,
        };
        assert!(!r.pulled("a", 0, Some(a), false, &mut Vec::new()));
        assert_eq!(r.take_retry(), vec![Arc::<str>::from("a")]);
    }

    fn rec<'a>(topic: &'a str, qos: u8, queues: Vec<(&'a str, u64)>) -> Record<'a> {
        Record {
            store_ts: 1,
            born_ts: 1,
            qos,
            retain: false,
            marks: 0,
            client_id: "",
            topic,
            key: "",
            properties: b"",
            body: b"x",
            queues,
        }
    }

    #[test]
    fn a_reader_behind_gets_rounds_not_live_deliveries_and_resumes() {
        let mut r = Readers::default();
        r.promote(1, 4, &[("a".into(), 1, 3), ("b".into(), 1, 7)])
            .unwrap();
        r.fall_behind(1);
        assert_eq!(offer(&mut r, "a", "a", 3), (vec![], vec![]));
        assert_eq!(r.ask("a"), None, "a reader behind is not pulled for live");
        // The reactor says where "a" is; "b" it never delivered from: where promoted.
        let plan = r.round_plan(1, &[(Arc::from("a"), 5)]).unwrap();
        assert_eq!(
            plan.queues,
            vec![(Arc::from("a"), 5, 1), (Arc::from("b"), 7, 1)]
        );
        assert!(r.resume(1, &plan));
        assert_eq!(r.next_of(1, "a"), Some(5));
        assert_eq!(offer(&mut r, "a", "a", 5), (vec![5], vec![]));
        assert!(!r.resume(1, &plan), "live already");
    }

    #[test]
    fn a_round_merges_its_queues_in_log_order_each_record_once() {
        let plan = RoundPlan {
            version: 4,
            queues: vec![(Arc::from("a"), 3, 1), (Arc::from("b"), 0, 0)],
        };
        let pulls = [
            QueuePull {
                records: vec![
                    (100, rec("a", 1, vec![("a", 3), ("b", 0)])),
                    (300, rec("a", 1, vec![("a", 4)])),
                ],
                next_offset: 5,
                full: false,
            },
            QueuePull {
                records: vec![
                    (100, rec("a", 1, vec![("a", 3), ("b", 0)])),
                    (200, rec("b", 1, vec![("b", 1)])),
                ],
                next_offset: 2,
                full: true, // cut at its count: nothing past 200 is known of "b"
            },
        ];
        let b = round_batch(&plan, &pulls, 256, 1 << 20).unwrap();
        let got: Vec<(u64, u8, usize)> = b
            .deliveries
            .iter()
            .map(|d| (d.source.1, d.qos, d.positions.len()))
            .collect();
        assert_eq!(got, vec![(100, 1, 2), (200, 0, 1)]);
        assert_eq!(b.jumps, vec![(Arc::from("a"), 3), (Arc::from("b"), 0)]);
        assert!(!b.release);
    }

    #[test]
    fn a_round_with_nothing_more_is_none_and_one_past_retention_jumps() {
        let plan = RoundPlan {
            version: 4,
            queues: vec![(Arc::from("a"), 3, 1)],
        };
        let empty = |next_offset| QueuePull {
            records: vec![],
            next_offset,
            full: false,
        };
        assert!(round_batch(&plan, &[empty(3)], 256, 1 << 20).is_none());
        let b = round_batch(&plan, &[empty(9)], 256, 1 << 20).unwrap();
        assert_eq!(b.jumps, vec![(Arc::from("a"), 9)]);
        assert!(b.deliveries.is_empty());
        // A QoS 2 message at a QoS 2 subscription: handed back at it.
        let plan = RoundPlan {
            version: 4,
            queues: vec![(Arc::from("a"), 3, 2)],
        };
        let pull = QueuePull {
            records: vec![(10, rec("a", 2, vec![("a", 3)]))],
            next_offset: 4,
            full: false,
        };
        let b = round_batch(&plan, &[pull], 256, 1 << 20).unwrap();
        assert!(b.release && b.deliveries.is_empty());
    }
}
