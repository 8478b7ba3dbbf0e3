//! The lease a caller driving the worker or the coordinator holds (see `engine::progress`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// While a caller is driving (and for `spin` after it last did), the background thread
/// stays asleep instead of waking for every message the caller will handle anyway: each such
/// wake-up takes a core from a thread that is doing the work. The thread still wakes when the
/// lease runs out, so nothing waits longer than `spin` for it; a caller that gives up ends the
/// lease and wakes it at once.
#[derive(Default)]
pub struct Lease {
    /// Deadline in nanoseconds after [`epoch`]; 0: none.
    until: AtomicU64,
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

impl Lease {
    fn now() -> u64 {
        epoch().elapsed().as_nanos() as u64
    }

    /// Extends the lease to `spin` from now.
    pub fn renew(&self, spin: Duration) {
        self.until
            .store(Self::now() + spin.as_nanos() as u64, Ordering::Release);
    }

    /// Ends the lease.
    pub fn end(&self) {
        self.until.store(0, Ordering::Release);
    }

    /// Time left, if a caller holds the lease.
    pub fn remaining(&self) -> Option<Duration> {
        let until = self.until.load(Ordering::Acquire);
        let now = Self::now();
        (until > now).then(|| Duration::from_nanos(until - now))
    }
}
