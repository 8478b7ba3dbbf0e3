//! What rank 0's node does with what reaches it: the negotiator's side of a turn.

use std::time::{Duration, Instant};

use super::{gone, CoordinatorConfig, Root};
use crate::control::negotiate::Outbox;

impl Root {
    /// A relay's claim: every member of set `set_id` among `below` submitted each of `ids`.
    pub(super) fn claimed(&mut self, set_id: u32, ids: &[u64], below: &[usize], out: &mut Outbox) {
        let members: std::borrow::Cow<[usize]> = match self.neg.members(set_id) {
            // Every rank below is a member of a set of every rank.
            Some(m) if m.len() == self.neg.size() => below.into(),
            Some(m) => below
                .iter()
                .copied()
                .filter(|r| m.binary_search(r).is_ok())
                .collect(),
            // The negotiator answers each rank that its set does not exist.
            None => below.into(),
        };
        for &id in ids {
            self.neg.claim_cached(&members, set_id, id, out);
        }
    }

    /// The link to `rank`, reaching `reach`, is gone (`detail`): `rank` left or died, and
    /// any other rank it reached that has not left is cut off from the coordinator.
    pub(super) fn lost(&mut self, rank: usize, reach: &[usize], detail: String, out: &mut Outbox) {
        for &r in reach {
            let how = gone(self.left[r]);
            let why = if r == rank {
                detail.clone()
            } else {
                format!("its control path ran through rank {rank}, which is gone: {detail}")
            };
            self.neg.rank_gone(r, how, why, out);
        }
    }

    /// Inspects for stalls, and sends what is ready once the batching window has closed.
    pub(super) fn cycle(&mut self, cfg: &CoordinatorConfig, stopping: bool, out: &mut Outbox) {
        // Cheap, but not worth doing for every message: a few times a second is plenty for
        // limits counted in seconds. Sets may have limits of their own, so it runs with the
        // stall check off too.
        if self.last_inspection.elapsed() >= Duration::from_millis(250) {
            self.last_inspection = Instant::now();
            if let Some(warning) =
                self.neg
                    .inspect(self.last_inspection, cfg.stall_check, cfg.stall_shutdown)
            {
                log::warn!(target: crate::LOG_TARGET, "{warning}");
            }
        }
        if !self.neg.has_ready() {
            return;
        }
        let since = *self.ready_since.get_or_insert_with(Instant::now);
        if !stopping && since.elapsed() < self.cycle_time {
            return;
        }
        self.neg.flush(out);
        self.ready_since = None;
        if let Some(t) = self.tuner.as_mut() {
            for (name, bytes) in self.neg.take_emitted() {
                if let Some(k) = t.observe(&name, bytes) {
                    self.neg.set_fusion_threshold(k.fusion_threshold);
                    self.cycle_time = k.cycle_time;
                }
            }
            if t.settled() {
                self.tuner = None;
                self.neg.stop_recording_emitted();
            }
        }
    }
}
