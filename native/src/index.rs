//! The light-queue index's rows for a batch of appends (`lightqueue/index.py`
//! `write_messages`), packed as the Python index stores them: per queue, runs of
//! consecutive offsets, each run one value of 20-byte entries (physical offset, size,
//! store time, big-endian) under the key of its first offset; and a key reference per
//! message with a key. The dispatcher then writes one value per run, not one Python
//! object per message, under the keys made here (`queue_key`, `key_ref`).

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use crate::engine::Dispatched;

/// Bytes of one entry: phys offset (u64), size (u32), store time (u64).
pub const ENTRY_SIZE: usize = 20;

/// One entry as the index packs it: phys offset, size, store time, big-endian.
pub fn pack_entry(phys_offset: u64, size: u32, store_ts: u64) -> [u8; ENTRY_SIZE] {
    let mut entry = [0u8; ENTRY_SIZE];
    entry[..8].copy_from_slice(&phys_offset.to_be_bytes());
    entry[8..12].copy_from_slice(&size.to_be_bytes());
    entry[12..].copy_from_slice(&store_ts.to_be_bytes());
    entry
}

/// Consecutive offsets of one queue, from `first`, as packed entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    pub queue: String,
    pub first: u64,
    pub entries: Vec<u8>,
}

impl Run {
    pub fn len(&self) -> usize {
        self.entries.len() / ENTRY_SIZE
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn next(&self) -> u64 {
        self.first + self.len() as u64
    }
}

/// What a batch adds to the index: its runs, the key references (key, phys offset) and
/// the number of entries. The last `grown` runs are the last of each queue that grew,
/// in the order the batch first names them (`ends`).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Rows {
    pub runs: Vec<Run>,
    pub keys: Vec<(String, u64)>,
    pub entries: usize,
    pub grown: usize,
}

impl Rows {
    /// Each queue that grew, with its end after the batch (one past its last offset).
    pub fn ends(&self) -> impl Iterator<Item = (&str, u64)> {
        self.runs[self.runs.len() - self.grown..]
            .iter()
            .map(|r| (r.queue.as_str(), r.next()))
    }
}

/// The index's key of a run (`lightqueue/index.py`): b"q", the queue's name, a NUL, its
/// first offset (u64, big-endian). Queue names never hold a NUL.
pub fn queue_key(queue: &str, first: u64) -> Vec<u8> {
    tagged(b'q', queue, first)
}

/// The index's key of a key reference: b"k", the message key, a NUL, its phys offset.
pub fn key_ref(key: &str, phys_offset: u64) -> Vec<u8> {
    tagged(b'k', key, phys_offset)
}

fn tagged(tag: u8, name: &str, n: u64) -> Vec<u8> {
    let mut key = Vec::with_capacity(name.len() + 10);
    key.push(tag);
    key.extend_from_slice(name.as_bytes());
    key.push(0);
    key.extend_from_slice(&n.to_be_bytes());
    key
}

/// The runs of `rows` (in log order): a run ends at a gap in its queue's offsets (a
/// floor) or at `run_max` entries, as the Python index cuts them.
pub fn runs(rows: &[Dispatched], run_max: usize) -> Rows {
    let run_max = run_max.max(1);
    let mut out = Rows::default();
    let mut open: Vec<Run> = Vec::new();
    let mut at: HashMap<&str, usize> = HashMap::with_capacity(rows.len().min(1 << 16));
    // The open run of each queue of the row before: a device, or a burst of one topic,
    // names the same queues row after row, found without hashing them again.
    let mut before: Vec<(&str, usize)> = Vec::new();
    for d in rows {
        let entry = pack_entry(d.phys_offset, d.size, d.store_ts);
        for (j, (queue, offset)) in d.queues.iter().enumerate() {
            let fresh = || Run {
                queue: queue.clone(),
                first: *offset,
                entries: Vec::with_capacity(ENTRY_SIZE),
            };
            let known = match before.get(j) {
                Some(&(name, i)) if name == queue.as_str() => Some(i),
                _ => match at.entry(queue.as_str()) {
                    Entry::Occupied(e) => Some(*e.get()),
                    Entry::Vacant(e) => {
                        e.insert(open.len());
                        None
                    }
                },
            };
            let i = match known {
                Some(i) => {
                    if open[i].next() != *offset || open[i].len() >= run_max {
                        out.runs.push(std::mem::replace(&mut open[i], fresh()));
                    }
                    i
                }
                None => {
                    open.push(fresh());
                    open.len() - 1
                }
            };
            open[i].entries.extend_from_slice(&entry);
            out.entries += 1;
            match before.get_mut(j) {
                Some(slot) => *slot = (queue.as_str(), i),
                None => before.push((queue.as_str(), i)),
            }
        }
        if !d.key.is_empty() {
            out.keys.push((d.key.clone(), d.phys_offset));
        }
    }
    out.grown = open.len();
    out.runs.extend(open);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(phys: u64, queues: &[(&str, u64)]) -> Dispatched {
        Dispatched {
            phys_offset: phys,
            size: 30,
            store_ts: 7,
            queues: queues.iter().map(|(q, o)| (q.to_string(), *o)).collect(),
            key: String::new(),
            own: false,
            record: None,
        }
    }

    fn entry(phys: u64) -> Vec<u8> {
        let mut e = phys.to_be_bytes().to_vec();
        e.extend_from_slice(&30u32.to_be_bytes());
        e.extend_from_slice(&7u64.to_be_bytes());
        e
    }

    #[test]
    fn consecutive_offsets_make_one_run_per_queue() {
        let rows = [
            row(0, &[("a/b", 4), ("a#0", 10)]),
            row(30, &[("a/b", 5)]),
            row(60, &[("a#0", 11)]),
        ];
        let got = runs(&rows, 4096);
        assert_eq!(got.entries, 4);
        assert_eq!(
            got.runs,
            vec![
                Run {
                    queue: "a/b".into(),
                    first: 4,
                    entries: [entry(0), entry(30)].concat()
                },
                Run {
                    queue: "a#0".into(),
                    first: 10,
                    entries: [entry(0), entry(60)].concat()
                },
            ]
        );
        assert!(got.keys.is_empty());
        assert_eq!(
            got.ends().collect::<Vec<_>>(),
            vec![("a/b", 6), ("a#0", 12)]
        );
    }

    #[test]
    fn a_gap_or_a_full_run_starts_another() {
        let rows = [
            row(0, &[("q", 0)]),
            row(30, &[("q", 1)]),
            row(60, &[("q", 5)]), // a floor moved the queue on
            row(90, &[("q", 6)]),
            row(120, &[("q", 7)]), // the run of two is full
        ];
        let got = runs(&rows, 2);
        let firsts: Vec<(u64, usize)> = got.runs.iter().map(|r| (r.first, r.len())).collect();
        assert_eq!(firsts, vec![(0, 2), (5, 2), (7, 1)]);
        assert_eq!(got.runs[2].entries, entry(120));
        assert_eq!(got.ends().collect::<Vec<_>>(), vec![("q", 8)]);
    }

    #[test]
    fn keys_are_referenced_by_position() {
        let mut keyed = row(30, &[("q", 1)]);
        keyed.key = "k1".into();
        let got = runs(&[row(0, &[("q", 0)]), keyed], 4096);
        assert_eq!(got.keys, vec![("k1".to_string(), 30)]);
        assert_eq!(runs(&[], 4096), Rows::default());
    }

    /// The runs as `lightqueue/index.py`'s write_messages cuts them, one queue at a time.
    fn reference(rows: &[Dispatched], run_max: usize) -> Vec<(String, u64, usize)> {
        let mut open: Vec<(String, u64, usize)> = Vec::new();
        let mut closed = Vec::new();
        for d in rows {
            for (queue, offset) in &d.queues {
                match open.iter_mut().find(|r| r.0 == *queue) {
                    Some(r) if r.1 + r.2 as u64 == *offset && r.2 < run_max => r.2 += 1,
                    Some(r) => closed.push(std::mem::replace(r, (queue.clone(), *offset, 1))),
                    None => open.push((queue.clone(), *offset, 1)),
                }
            }
        }
        closed.extend(open);
        closed
    }

    proptest::proptest! {
        #[test]
        fn runs_are_the_python_index_s(
            picks in proptest::collection::vec(
                (proptest::collection::vec(0usize..4, 0..4), proptest::bool::ANY), 0..60),
            run_max in 1usize..5,
        ) {
            let names = ["a/b", "a/+", "a#0", "c"];
            let mut next = [0u64; 4];
            let rows: Vec<Dispatched> = picks.iter().enumerate().map(|(n, (qs, gap))| {
                let mut seen = Vec::new();
                let queues: Vec<(&str, u64)> = qs.iter().filter(|q| {
                    let fresh = !seen.contains(*q);
                    seen.push(**q);
                    fresh
                }).map(|&q| {
                    next[q] += if *gap { 3 } else { 1 }; // a floor moved a queue on, or not
                    (names[q], next[q])
                }).collect();
                row(n as u64 * 30, &queues)
            }).collect();
            let got = runs(&rows, run_max);
            let cut: Vec<(String, u64, usize)> =
                got.runs.iter().map(|r| (r.queue.clone(), r.first, r.len())).collect();
            proptest::prop_assert_eq!(cut, reference(&rows, run_max));
            let mut ends: Vec<(&str, u64)> = got.ends().collect();
            ends.sort();
            let mut want: Vec<(&str, u64)> = (0..4)
                .filter(|&q| rows.iter().any(|d| d.queues.iter().any(|(n, _)| n == names[q])))
                .map(|q| (names[q], next[q] + 1)).collect();
            want.sort();
            proptest::prop_assert_eq!(ends, want);
        }
    }

    #[test]
    fn keys_are_the_python_index_s() {
        // lightqueue/index.py: queue_prefix(q) + U64.pack(first), key_prefix(k) + U64.pack(phys)
        assert_eq!(
            queue_key("a/b", 258),
            b"qa/b\0\0\0\0\0\0\0\x01\x02".to_vec()
        );
        assert_eq!(key_ref("k1", 7), b"kk1\0\0\0\0\0\0\0\0\x07".to_vec());
        assert_eq!(queue_key("é", 0).len(), 1 + 2 + 1 + 8);
    }
}
