//! Futexes on words in memory several processes map: a sleeping reader of a shared-memory
//! ring or offer record, and the writer that wakes it.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Blocks while `word` holds `seen`, at most `timeout` (a shared futex: the word is in a
/// mapping other processes share). Spurious returns are fine: callers re-check.
pub fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT reads the aligned u32 behind `word` (alive for the call) and
    // sleeps; `ts` outlives the call; the unused arguments are null/0.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            seen,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        )
    };
}

/// Wakes every thread (of any process) sleeping on `word`.
pub fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only uses the address as a key; the other arguments are plain.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        )
    };
}
