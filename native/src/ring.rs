//! The newest light-queue index entries of the queues that subscribers which fell
//! behind read (`backlog`), kept by the engine as it appends, so that their rounds are
//! made here, with no trip through the owner's index.
//!
//! A queue's ring is kept while some connection that fell behind reads the queue: it
//! starts at the queue's end when the first such reader registers (under the log's
//! lock, as the appends fill it), so from there every entry of the queue is in it, in
//! offset order, with no gap; an append whose offset is not the next one starts the
//! ring afresh there. Entries are packed as `index.rs` packs them, so a round's
//! `QueueRuns` made from a ring are the ones the index would give.
//!
//! Bounded: entries per queue, and bytes over every ring of the node (the memory they
//! hold, in chunks of `CHUNK` entries). The oldest go first; a reader whose position
//! is below its ring's first entry is served from the index.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::backlog::QueueRuns;
use crate::index::ENTRY_SIZE;

/// Entries one queue's ring keeps, at most.
pub const RING_ENTRIES: usize = 1 << 20;
/// Bytes all the rings of a node hold, at most.
pub const RING_BYTES: usize = 32 << 20;
/// Entries of one allocation: a ring grows and lets go a chunk at a time.
pub const CHUNK: usize = 1024;
const CHUNK_BYTES: usize = CHUNK * ENTRY_SIZE;

struct Ring {
    /// The offset of the first entry of the first chunk.
    first: u64,
    /// Chunks of packed entries, each full but the last.
    chunks: VecDeque<Vec<u8>>,
    /// Readers registered on it.
    readers: usize,
}

impl Ring {
    fn len(&self) -> usize {
        match self.chunks.back() {
            Some(last) => (self.chunks.len() - 1) * CHUNK + last.len() / ENTRY_SIZE,
            None => 0,
        }
    }

    /// One past its last entry: the queue's next offset, as far as it knows.
    fn end(&self) -> u64 {
        self.first + self.len() as u64
    }
}

/// The rings of the queues read by connections that fell behind.
pub struct Rings {
    rings: HashMap<Arc<str>, Ring>,
    /// Chunks held over all the rings, in bytes.
    bytes: usize,
    max_entries: usize,
    max_bytes: usize,
}

impl Default for Rings {
    fn default() -> Self {
        Rings::new(RING_ENTRIES, RING_BYTES)
    }
}

impl Rings {
    /// Rings of `max_entries` each at most (whole chunks: one at least), `max_bytes`
    /// in all (one chunk at least).
    pub fn new(max_entries: usize, max_bytes: usize) -> Self {
        Rings {
            rings: HashMap::new(),
            bytes: 0,
            max_entries: max_entries.div_ceil(CHUNK).max(1) * CHUNK,
            max_bytes: max_bytes.max(CHUNK_BYTES),
        }
    }

    /// Whether no queue is kept (the appends then look no further).
    pub fn is_empty(&self) -> bool {
        self.rings.is_empty()
    }

    /// Bytes the rings hold now.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// A reader of `queue` registers; its ring, if it is the first, starts at `end`
    /// (the queue's next offset, read under the lock the appends take).
    pub fn register(&mut self, queue: &Arc<str>, end: u64) {
        self.rings
            .entry(Arc::clone(queue))
            .or_insert_with(|| Ring {
                first: end,
                chunks: VecDeque::new(),
                readers: 0,
            })
            .readers += 1;
    }

    /// A reader of `queue` is gone; the last one's going drops the ring.
    pub fn unregister(&mut self, queue: &str) {
        let Some(ring) = self.rings.get_mut(queue) else {
            return;
        };
        ring.readers = ring.readers.saturating_sub(1);
        if ring.readers == 0 {
            if let Some(ring) = self.rings.remove(queue) {
                self.bytes -= ring.chunks.len() * CHUNK_BYTES;
            }
        }
    }

    /// The entry of offset `offset` of `queue` was appended (nothing, unless it is kept).
    pub fn push(&mut self, queue: &str, offset: u64, entry: &[u8; ENTRY_SIZE]) {
        let Some(ring) = self.rings.get_mut(queue) else {
            return;
        };
        if offset != ring.end() {
            // Never a gap (nor an offset given twice): from here afresh.
            self.bytes -= ring.chunks.len() * CHUNK_BYTES;
            ring.chunks.clear();
            ring.first = offset;
        }
        let room = ring.chunks.back().is_some_and(|c| c.len() < CHUNK_BYTES);
        if !room {
            let chunk = if ring.len() >= self.max_entries
                || (self.bytes + CHUNK_BYTES > self.max_bytes && ring.chunks.len() > 1)
            {
                // Its own oldest chunk goes, and is used again.
                let mut old = ring.chunks.pop_front().expect("more than one chunk");
                ring.first += CHUNK as u64;
                old.clear();
                old
            } else {
                self.bytes += CHUNK_BYTES;
                Vec::with_capacity(CHUNK_BYTES)
            };
            ring.chunks.push_back(chunk);
        }
        ring.chunks
            .back_mut()
            .expect("a chunk with room")
            .extend_from_slice(entry);
        if self.bytes > self.max_bytes {
            self.evict(queue);
        }
    }

    /// Past the node's bytes: the oldest chunk of the largest other ring goes (a ring
    /// that had nothing took a chunk of its own).
    fn evict(&mut self, keep: &str) {
        let largest = self
            .rings
            .iter_mut()
            .filter(|(q, r)| &***q != keep && !r.chunks.is_empty())
            .max_by_key(|(_, r)| r.chunks.len());
        let Some((_, ring)) = largest else {
            return;
        };
        let taken = ring.chunks.pop_front().expect("not empty");
        ring.first += (taken.len() / ENTRY_SIZE) as u64;
        self.bytes -= CHUNK_BYTES;
    }

    /// `queue`'s entries from `start`, `max` at most, as a round's runs; None when its
    /// ring does not cover `start` (none kept, or `start` below its first entry or past
    /// its end).
    pub fn runs(&self, queue: &Arc<str>, start: u64, max: usize) -> Option<QueueRuns> {
        let ring = self.rings.get(&**queue)?;
        if start < ring.first || start > ring.end() {
            return None;
        }
        let skip = (start - ring.first) as usize;
        let n = (ring.len() - skip).min(max);
        let mut bytes = Vec::with_capacity(n * ENTRY_SIZE);
        let (mut chunk, mut at) = (skip / CHUNK, skip % CHUNK);
        while bytes.len() < n * ENTRY_SIZE {
            let c = &ring.chunks[chunk];
            let want = n * ENTRY_SIZE - bytes.len();
            let from = at * ENTRY_SIZE;
            let to = c.len().min(from + want);
            bytes.extend_from_slice(&c[from..to]);
            chunk += 1;
            at = 0;
        }
        Some(QueueRuns {
            queue: Arc::clone(queue),
            start,
            runs: if n == 0 {
                Vec::new()
            } else {
                vec![(start, bytes)]
            },
            full: start + (n as u64) < ring.end(),
        })
    }

    /// `queue`'s first kept offset and its end, if it is kept.
    pub fn span(&self, queue: &str) -> Option<(u64, u64)> {
        self.rings.get(queue).map(|r| (r.first, r.end()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Dispatched;
    use crate::index::{pack_entry, runs};

    fn q(name: &str) -> Arc<str> {
        Arc::from(name)
    }

    fn fill(rings: &mut Rings, queue: &str, from: u64, to: u64) {
        for o in from..to {
            rings.push(queue, o, &pack_entry(o * 100, 10, 7));
        }
    }

    fn offsets(r: &QueueRuns) -> Vec<u64> {
        r.runs
            .iter()
            .flat_map(|(first, bytes)| {
                bytes
                    .chunks_exact(ENTRY_SIZE)
                    .enumerate()
                    .map(move |(i, e)| {
                        let phys = u64::from_be_bytes(e[..8].try_into().unwrap());
                        assert_eq!(phys, (first + i as u64) * 100, "the entry of its offset");
                        first + i as u64
                    })
            })
            .collect()
    }

    #[test]
    fn a_ring_starts_at_the_end_and_covers_from_there() {
        let mut rings = Rings::default();
        assert!(rings.is_empty());
        fill(&mut rings, "a", 0, 5); // not kept: nobody reads it
        assert!(rings.is_empty() && rings.bytes() == 0);
        rings.register(&q("a"), 5);
        fill(&mut rings, "a", 5, 5 + 3000);
        assert_eq!(rings.span("a"), Some((5, 3005)));
        assert!(
            rings.runs(&q("a"), 4, 256).is_none(),
            "below it: the index's"
        );
        assert!(rings.runs(&q("a"), 3006, 256).is_none(), "past its end");
        assert!(rings.runs(&q("b"), 0, 256).is_none(), "not kept");
        let r = rings.runs(&q("a"), 1000, 256).unwrap();
        assert_eq!(offsets(&r), (1000..1256).collect::<Vec<_>>());
        assert!(r.full && r.start == 1000);
        // Across chunks, to the end.
        let r = rings.runs(&q("a"), 2900, 256).unwrap();
        assert_eq!(offsets(&r), (2900..3005).collect::<Vec<_>>());
        assert!(!r.full);
        let r = rings.runs(&q("a"), 3005, 256).unwrap();
        assert!(r.runs.is_empty() && !r.full, "at its end: nothing yet");
        assert_eq!(rings.bytes(), 3 * CHUNK_BYTES);
    }

    #[test]
    fn entries_are_the_index_ones() {
        let rows: Vec<Dispatched> = (0..10u64)
            .map(|i| Dispatched {
                phys_offset: 1000 + i * 77,
                size: 60 + i as u32,
                store_ts: 1_700_000_000_000 + i,
                queues: if i % 2 == 0 {
                    vec![("x".into(), 40 + i / 2), ("#".into(), 100 + i)]
                } else {
                    vec![("#".into(), 100 + i)]
                },
                key: String::new(),
                own: false,
                record: None,
            })
            .collect();
        let mut rings = Rings::default();
        rings.register(&q("x"), 40);
        rings.register(&q("#"), 100);
        for d in &rows {
            for (queue, offset) in &d.queues {
                rings.push(
                    queue,
                    *offset,
                    &pack_entry(d.phys_offset, d.size, d.store_ts),
                );
            }
        }
        let index = runs(&rows, 1000);
        for run in &index.runs {
            let r = rings.runs(&q(&run.queue), run.first, 1000).unwrap();
            assert_eq!(r.runs, vec![(run.first, run.entries.clone())]);
        }
    }

    #[test]
    fn a_gap_starts_the_ring_afresh() {
        let mut rings = Rings::default();
        rings.register(&q("a"), 0);
        fill(&mut rings, "a", 0, 10);
        fill(&mut rings, "a", 12, 15);
        assert_eq!(rings.span("a"), Some((12, 15)));
        assert!(rings.runs(&q("a"), 5, 256).is_none());
        assert_eq!(
            offsets(&rings.runs(&q("a"), 12, 256).unwrap()),
            [12, 13, 14]
        );
        // An offset given again (a failed write's): afresh too.
        fill(&mut rings, "a", 13, 14);
        assert_eq!(rings.span("a"), Some((13, 14)));
        assert_eq!(rings.bytes(), CHUNK_BYTES);
    }

    #[test]
    fn a_ring_keeps_its_newest_entries() {
        let mut rings = Rings::new(2 * CHUNK, RING_BYTES);
        rings.register(&q("a"), 0);
        fill(&mut rings, "a", 0, 5 * CHUNK as u64 + 7);
        let (first, end) = rings.span("a").unwrap();
        assert_eq!(end, 5 * CHUNK as u64 + 7);
        assert_eq!(
            first,
            4 * CHUNK as u64,
            "two chunks' worth at most, and the newest"
        );
        assert!(
            rings.runs(&q("a"), first - 1, 256).is_none(),
            "fell off: the index's"
        );
        assert_eq!(offsets(&rings.runs(&q("a"), first, 1).unwrap()), [first]);
        assert_eq!(rings.bytes(), 2 * CHUNK_BYTES);
    }

    #[test]
    fn the_node_bound_holds_over_every_ring() {
        let mut rings = Rings::new(RING_ENTRIES, 4 * CHUNK_BYTES);
        rings.register(&q("a"), 0);
        rings.register(&q("b"), 0);
        fill(&mut rings, "a", 0, 10 * CHUNK as u64);
        assert_eq!(rings.bytes(), 4 * CHUNK_BYTES, "a alone: the whole node's");
        fill(&mut rings, "b", 0, 3 * CHUNK as u64);
        assert!(rings.bytes() <= 4 * CHUNK_BYTES);
        let (a_first, a_end) = rings.span("a").unwrap();
        let (b_first, b_end) = rings.span("b").unwrap();
        assert_eq!((a_end, b_end), (10 * CHUNK as u64, 3 * CHUNK as u64));
        assert!(
            a_first >= 8 * CHUNK as u64,
            "the largest gave way: {a_first}"
        );
        assert!(b_first < CHUNK as u64 * 3, "b keeps some");
        // Every entry still kept is its offset's.
        assert_eq!(
            offsets(&rings.runs(&q("a"), a_first, usize::MAX).unwrap()),
            (a_first..a_end).collect::<Vec<_>>()
        );
        assert_eq!(
            offsets(&rings.runs(&q("b"), b_first, usize::MAX).unwrap()),
            (b_first..b_end).collect::<Vec<_>>()
        );
    }

    #[test]
    fn the_last_reader_drops_its_ring() {
        let mut rings = Rings::default();
        rings.register(&q("a"), 3);
        rings.register(&q("a"), 99); // a second reader: the ring stays where it began
        fill(&mut rings, "a", 3, 10);
        assert_eq!(rings.span("a"), Some((3, 10)));
        rings.unregister("a");
        assert_eq!(rings.span("a"), Some((3, 10)));
        rings.unregister("a");
        assert!(rings.span("a").is_none() && rings.is_empty());
        assert_eq!(rings.bytes(), 0);
        rings.unregister("a"); // (nothing)
    }
}
