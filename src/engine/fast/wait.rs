//! Waiting on a peer's board word: spin, yield, then sleep on the peer's bell, giving up on
//! the engine's failure, this rank's shutdown or the caller's interrupt. Every meeting of the
//! fast path (a free record, a posted slot, a reduced segment) waits here, so how a rank
//! spends a wait is decided in one place, apart from what it waits for.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::spin::Spin;
use crate::transport::offers::OfferRecords;

use super::FastPath;

/// How long a wait polls without yielding the core before it polls between yields.
const PURE_SPIN: Duration = Duration::from_micros(20);
/// How long one sleep on a peer's bell lasts before the failure and shutdown checks.
const SLEEP_SLICE: Duration = Duration::from_millis(20);

impl FastPath {
    /// Waits until `ready(records)`: spins, then sleeps on rank `peer`'s bell in slices,
    /// failing when the engine fails (a peer died) or this rank shuts down, and warning once
    /// if it takes longer than the stall-check time.
    pub(super) fn wait(
        &self,
        peer: usize,
        name: &str,
        stop: &dyn Fn() -> bool,
        ready: impl Fn(&OfferRecords) -> bool,
    ) -> Result<()> {
        let b = self.peer_records();
        if ready(b) {
            return Ok(());
        }
        let start = Instant::now();
        // First without yielding: a peer on another core usually posts within a few
        // microseconds, and a yield is a system call that costs a good part of that. Not when
        // crowded: the peer is then likely waiting for this very core.
        let pure = if crate::spin::crowded() {
            Duration::ZERO
        } else {
            PURE_SPIN
        };
        while start.elapsed() < pure.min(self.spin) {
            for _ in 0..32 {
                if ready(b) {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
        }
        let mut spin = Spin::new(self.spin.saturating_sub(start.elapsed()));
        loop {
            if ready(b) {
                return Ok(());
            }
            if !spin.yield_core() {
                break;
            }
        }
        let mut warned = false;
        loop {
            b.sleep(peer, || ready(b), SLEEP_SLICE);
            if ready(b) {
                return Ok(());
            }
            if stop() {
                return Err(Error::Interrupted(format!(
                    "'{name}' waited for rank {peer}"
                )));
            }
            if self.closing.load(Ordering::Acquire) {
                // Closed by the engine's failure: that is the error, as through the engine.
                if let Some(e) = &*self.failed.lock() {
                    return Err(e.clone());
                }
                return Err(Error::Shutdown(format!(
                    "ferrovod shut down while allreduce '{name}' waited for rank {peer}"
                )));
            }
            self.warn_if_stalled(&mut warned, start, name, peer);
        }
    }

    /// Logs once (`warned`) that an op named `name` has waited on rank `peer` since `start`
    /// for longer than the stall-check time.
    pub(super) fn warn_if_stalled(
        &self,
        warned: &mut bool,
        start: Instant,
        name: &str,
        peer: usize,
    ) {
        let Some(stall) = self.stall else {
            return;
        };
        if !*warned && start.elapsed() > stall {
            *warned = true;
            log::warn!(
                target: crate::LOG_TARGET,
                "rank {}: allreduce '{name}' has waited {:.0} s for rank {peer} to submit its \
                 next op (ranks must submit the same ops)",
                self.rank,
                start.elapsed().as_secs_f64(),
            );
        }
    }
}
