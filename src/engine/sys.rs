//! The engine's operating-system primitives: waiting on several descriptors at once
//! (`poll(2)`), a cross-thread wake-up (`eventfd(2)`) and socket options. Their `unsafe` FFI
//! lives here only.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use crate::error::{Error, Result};

/// Waits until one of `fds` is readable (or closed/errored), or `timeout` passes. Returns the
/// indices of the ready descriptors (empty on timeout).
pub fn wait_readable(fds: &[RawFd], timeout: Duration) -> Result<Vec<usize>> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // Round up: truncating a sub-millisecond wait to 0 would make callers that wait out a
    // short interval (the coordinator's cycle time) spin instead of sleep.
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    // SAFETY: `pfds` is a valid, exclusively borrowed array of `pfds.len()` pollfd structs for
    // the duration of the call; poll only writes their `revents` fields.
    let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::Interrupted {
            return Ok(Vec::new());
        }
        return Err(Error::Io(format!("poll: {e}")));
    }
    Ok(pfds
        .iter()
        .enumerate()
        .filter(|(_, p)| p.revents != 0)
        .map(|(i, _)| i)
        .collect())
}

/// Makes a connection fail within about `timeout` when the peer's host becomes unreachable
/// (a cut link, a vanished machine) even while nothing is being sent: TCP keepalive probes
/// every second, and TCP_USER_TIMEOUT bounding how long sent data or probes may stay
/// unacknowledged. A dead *process* is noticed at once anyway (its kernel closes the socket).
pub fn detect_unreachable_peer(fd: RawFd, timeout: Duration) -> Result<()> {
    let secs = timeout.as_secs().clamp(1, i32::MAX as u64) as libc::c_int;
    let ms = timeout.as_millis().clamp(1000, u32::MAX as u128) as libc::c_uint;
    let set = |level: libc::c_int, name: libc::c_int, value: libc::c_int| -> Result<()> {
        // SAFETY: passes a pointer to a live local c_int and its exact size; setsockopt only
        // reads it. An invalid fd or option is reported through the return value.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(Error::Io(format!(
                "setsockopt: {}",
                std::io::Error::last_os_error()
            )))
        }
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 1)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 1)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, secs)?;
    set(libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, ms as libc::c_int)
}

/// A counter another thread can bump to wake a thread blocked in [`wait_readable`].
#[derive(Debug)]
pub struct Waker {
    fd: OwnedFd,
}

impl Waker {
    /// Creates a non-blocking eventfd.
    pub fn new() -> Result<Waker> {
        // SAFETY: eventfd takes no pointers; a negative return is handled below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::Io(format!(
                "eventfd: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: `fd` was just returned by eventfd, is valid and owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Waker { fd })
    }

    /// Makes the descriptor readable.
    pub fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live local into our own open eventfd. A failure can only
        // be EAGAIN (counter saturated), which still leaves the fd readable.
        unsafe {
            libc::write(
                self.fd.as_raw_fd(),
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }

    /// Resets the counter after a wake-up was seen.
    pub fn clear(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads at most 8 bytes into a live local from our own non-blocking eventfd;
        // EAGAIN (nothing pending) is harmless.
        unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                (&mut v as *mut u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }

    /// The descriptor to poll.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}
