//! The node's budget for bytes of packets received only in part
//! (`serving/read_budget.py` is the reference): one count for every connection,
//! whichever plane reads it. The reactors count their connections' unfinished packets
//! here, and the Python plane counts its own through the engine, so a client that
//! announces a large packet and sends its body slowly is held to --max-partial-bytes
//! on either side of the line.
//!
//! While the node holds more than the budget, a connection that holds at least its
//! fair share (the budget over the connections holding any) must not read: a reactor
//! then hands it back, and Python holds it back and closes it past
//! --partial-timeout-s, as it does its own. One that holds nothing always reads (a
//! little, while over budget).

use std::sync::atomic::{AtomicUsize, Ordering};

/// The most a connection reads at a time while the node is over budget, and the
/// least: `read_budget.READ_WHILE_OVER`.
pub const READ_WHILE_OVER: usize = 4096;
/// While over budget the node may hold this much more per connection holding any
/// (`read_budget.OVER_PER_HOLDER`).
pub const OVER_PER_HOLDER: usize = READ_WHILE_OVER + 2048;

#[derive(Debug, Default)]
pub struct PartialBudget {
    /// Bytes past which connections holding their share stop reading; 0: no budget.
    limit: AtomicUsize,
    /// Bytes of partial packets held by all connections, of both planes.
    held: AtomicUsize,
    /// Connections holding any.
    holders: AtomicUsize,
    /// The most held at once.
    peak: AtomicUsize,
}

/// The count after an `update`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Count {
    pub held: usize,
    pub holders: usize,
    pub peak: usize,
    /// This update took the node back within the budget: whoever waits for room
    /// (Python's held-back connections) may read again.
    pub freed: bool,
}

impl PartialBudget {
    pub fn set_limit(&self, limit: usize) {
        self.limit.store(limit, Ordering::Relaxed);
    }

    /// One connection went from holding `before` bytes to `after`.
    pub fn update(&self, before: usize, after: usize) -> Count {
        let (was, held) = if after >= before {
            let was = self.held.fetch_add(after - before, Ordering::Relaxed);
            (was, was + (after - before))
        } else {
            let was = self.held.fetch_sub(before - after, Ordering::Relaxed);
            (was, was.saturating_sub(before - after))
        };
        let holders = match (before, after) {
            (0, 1..) => self.holders.fetch_add(1, Ordering::Relaxed) + 1,
            (1.., 0) => self
                .holders
                .fetch_sub(1, Ordering::Relaxed)
                .saturating_sub(1),
            _ => self.holders.load(Ordering::Relaxed),
        };
        let mut peak = self.peak.load(Ordering::Relaxed);
        if held > peak {
            peak = self.peak.fetch_max(held, Ordering::Relaxed).max(held);
        }
        let limit = self.limit.load(Ordering::Relaxed);
        Count {
            held,
            holders,
            peak,
            freed: limit != 0 && was > limit && held <= limit,
        }
    }

    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    pub fn exceeded(&self) -> bool {
        let limit = self.limit.load(Ordering::Relaxed);
        limit != 0 && self.held() > limit
    }

    /// Whether a connection holding `holding` bytes should not read now: while over
    /// budget, one that holds its share, or any once the node holds the budget plus
    /// `OVER_PER_HOLDER` per holder.
    pub fn must_wait(&self, holding: usize) -> bool {
        if holding == 0 || !self.exceeded() {
            return false;
        }
        let holders = self.holders.load(Ordering::Relaxed).max(1);
        holding.saturating_mul(holders) >= self.limit.load(Ordering::Relaxed)
            || self.over_left(holders) < READ_WHILE_OVER as i64
    }

    /// How much a connection holding `holding` bytes may read (`default` while the
    /// budget has room): while over it, no more than what is left of its share or of
    /// the allowance over it, and at least `READ_WHILE_OVER`.
    pub fn read_size(&self, holding: usize, default: usize) -> usize {
        if !self.exceeded() {
            return default;
        }
        let holders = self.holders.load(Ordering::Relaxed).max(1);
        let share = self.limit.load(Ordering::Relaxed) / holders;
        let room = (share.saturating_sub(holding) as i64).min(self.over_left(holders));
        room.clamp(READ_WHILE_OVER as i64, default.max(READ_WHILE_OVER) as i64) as usize
    }

    fn over_left(&self, holders: usize) -> i64 {
        let over = self.held() as i64 - self.limit.load(Ordering::Relaxed) as i64;
        (holders * OVER_PER_HOLDER) as i64 - over
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_holding_their_share_wait_while_the_node_is_over() {
        let b = PartialBudget::default();
        b.set_limit(100_000);
        assert_eq!(b.update(0, 60_000).holders, 1);
        assert!(!b.must_wait(60_000), "within the budget: everyone reads");
        assert_eq!(b.read_size(60_000, 65_536), 65_536);
        let over = b.update(0, 50_000);
        assert_eq!((over.held, over.holders, over.freed), (110_000, 2, false));
        // Over: a share is 50,000; both hold theirs.
        assert!(b.must_wait(60_000) && b.must_wait(50_000));
        assert!(!b.must_wait(0), "one holding nothing reads");
        // ... a little: the allowance over the budget is 2 x 6 KiB less the 10,000 over.
        assert_eq!(b.read_size(0, 65_536), READ_WHILE_OVER);
        // One finishes its packet: back within the budget, and whoever waits is told.
        let back = b.update(60_000, 0);
        assert_eq!((back.held, back.holders, back.freed), (50_000, 1, true));
        assert!(!b.must_wait(50_000));
        assert_eq!(back.peak, 110_000);
        assert!(!b.update(50_000, 10).freed, "within it already");
        // Just over, by 1,000: a newcomer reads what is left of the allowance.
        b.update(10, 101_000);
        assert_eq!(b.read_size(0, 65_536), OVER_PER_HOLDER - 1_000);
        assert!(!b.must_wait(0));
        assert!(b.must_wait(101_000));
    }

    #[test]
    fn no_budget_counts_and_never_waits() {
        let b = PartialBudget::default();
        b.update(0, 1 << 30);
        assert!(!b.exceeded() && !b.must_wait(1 << 30));
        assert_eq!(b.read_size(1 << 30, 65_536), 65_536);
        assert_eq!(b.update(0, 0).held, 1 << 30, "a look changes nothing");
    }
}
