//! Bounded spinning that steps aside when the core is wanted.
//!
//! Idle waits poll for `FERROVOD_SPIN_US` before they block, because a blocking wake-up costs
//! 40–60 µs on the VMs we measure, and they yield the core between polls, because the thread
//! being waited for may be queued on this very core. A yield on a core nobody else wants
//! returns in about a microsecond. One that takes much longer means another thread ran a
//! scheduler slice here: the core is contended — in training, every core runs some rank's
//! compute thread — and a spinner that comes back for more takes its share of the core from
//! that thread for nothing. Such a spin ends at once and the wait blocks: training on 2 ranks
//! with 2 cores spent 1.5–2 ms of CPU per step in spins that ran out their full time.
//!
//! **Crowded.** Where this process has less than a core to itself (more ranks than CPUs on the
//! host, or a CPU quota below one per rank: [`crate::cpus::share`]), a contended core is the
//! normal state, and the thread that holds it is usually the rank being waited for. Blocking
//! then costs a wake-up per wait, and a spin that does not yield holds the core from that rank.
//! So a crowded wait yields the core between every poll for its whole budget, never spins
//! without yielding, and does not take a contended yield as a reason to block, as Open MPI's
//! `mpi_yield_when_idle` does when it knows a node is oversubscribed. Measured on 2 cores, a
//! 4-byte allreduce took 61, 283 and 849 us at 4, 8 and 16 ranks before, 22, 99 and 441 after.
//! A yield hands the core to a thread that wants it until that thread's slice ends, so a
//! crowded waiter costs a rank that computes only its context switches. The mode is the
//! process's (its CPUs are), set by the engine each time it forms a job.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

static CROWDED: AtomicBool = AtomicBool::new(false);

/// Sets whether this process's waits are crowded (see the module doc).
pub(crate) fn set_crowded(crowded: bool) {
    CROWDED.store(crowded, Ordering::Relaxed);
}

/// Whether this process's waits are crowded: yield between every poll, never block early.
pub(crate) fn crowded() -> bool {
    CROWDED.load(Ordering::Relaxed)
}

/// The least a crowded wait of the fast path yields before it blocks (unless waits block at
/// once, `FERROVOD_SPIN_US=0`). With 32 ranks to a core a peer can be off its core for a
/// scheduler slice (0.75-3 ms with the kernel's defaults) while the waiter's 250 us run out,
/// and every wait then costs a wake-up: a 4-byte allreduce on 64 ranks and 2 cores took
/// 1.2-1.9 ms with 250 us and 1.06 ms with 2 ms (Open MPI, which never blocks: 1.07-1.13);
/// from 4 to 32 ranks the two were within each other's noise.
pub(crate) const CROWDED_SPIN: Duration = Duration::from_millis(2);

/// A yield this long means another thread had the core: a system call alone takes about a
/// microsecond, and a scheduler slice hundreds.
const CONTENDED: Duration = Duration::from_micros(50);

/// One bounded spin: yield until [`Spin::yield_core`] says to stop.
#[derive(Debug)]
pub(crate) struct Spin {
    deadline: Instant,
}

impl Spin {
    /// A spin of at most `budget` from now.
    pub(crate) fn new(budget: Duration) -> Spin {
        Spin {
            deadline: Instant::now() + budget,
        }
    }

    /// True once the spin is over: its budget spent or the core found contended.
    pub(crate) fn over(&self) -> bool {
        Instant::now() >= self.deadline
    }

    /// Yields the core once, unless the spin is over. False when the caller should stop
    /// polling and block: the budget is spent, or this yield found the core contended.
    pub(crate) fn yield_core(&mut self) -> bool {
        let before = Instant::now();
        if before >= self.deadline {
            return false;
        }
        std::thread::yield_now();
        if !crowded() && before.elapsed() >= CONTENDED {
            self.deadline = before;
            return false;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spin_ends_when_its_budget_is_spent() {
        let mut spin = Spin::new(Duration::from_millis(2));
        let start = Instant::now();
        while spin.yield_core() {}
        assert!(start.elapsed() < Duration::from_secs(1));
        assert!(
            spin.over() && !spin.yield_core(),
            "a spin that ended stays over"
        );
        let mut none = Spin::new(Duration::ZERO);
        assert!(none.over() && !none.yield_core());
    }

    #[test]
    fn a_contended_core_ends_the_spin_early() {
        // Two busy threads per core make every yield hand the core over for a slice.
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let hogs: Vec<_> = (0..2 * cores)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        let start = Instant::now();
        let mut spin = Spin::new(Duration::from_secs(5));
        while spin.yield_core() {}
        let took = start.elapsed();
        let over = spin.over();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for h in hogs {
            h.join().unwrap();
        }
        assert!(
            took < Duration::from_secs(1),
            "spun {took:?} on a contended core"
        );
        assert!(over, "a spin that found the core contended stays over");
    }
}
