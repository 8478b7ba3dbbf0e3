//! Telling a forked child from its parent without a system call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

/// Forks of this process image so far, counted in every child by a `pthread_atfork` handler.
static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn count_fork() {
    // Runs in the child right after fork(): an atomic add is all it may safely do.
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// Forks of this process image since the first call: a different count than one read earlier
/// means this is a forked child, known without a `getpid` system call on every op (a tenth
/// of a microsecond each). Installs the counting handler on first use.
pub fn forks() -> u64 {
    static HANDLER: Once = Once::new();
    HANDLER.call_once(|| {
        // SAFETY: `count_fork` is an `extern "C"` function with no arguments that lives for
        // the whole program and only touches an atomic, as a child handler must.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(count_fork)) };
        assert_eq!(rc, 0, "pthread_atfork failed");
    });
    FORKS.load(Ordering::Relaxed)
}
