//! Waiting on several descriptors at once (`poll(2)`).

use std::io::{self, ErrorKind};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Readiness flags for [`poll`]: readable.
pub const POLL_IN: i16 = libc::POLLIN;
/// Readiness flags for [`poll`]: writable.
pub const POLL_OUT: i16 = libc::POLLOUT;

/// One descriptor watched by [`poll`].
pub type PollFd = libc::pollfd;

/// A [`PollFd`] waiting for `events` on `fd`.
pub fn poll_fd(fd: &impl AsRawFd, events: i16) -> PollFd {
    libc::pollfd {
        fd: fd.as_raw_fd(),
        events,
        revents: 0,
    }
}

/// Waits until one of `fds` is ready or `timeout` passes (`None`: forever). Returns the number
/// of ready descriptors (0 on timeout); `revents` is filled in. Retries on `EINTR` with the
/// time left.
pub fn poll(fds: &mut [PollFd], timeout: Option<Duration>) -> io::Result<usize> {
    let deadline = timeout.map(|t| Instant::now().checked_add(t));
    loop {
        let ms: libc::c_int = match deadline {
            // No timeout, or one past what an Instant holds: wait for readiness alone.
            None | Some(None) => -1,
            Some(Some(d)) => {
                let left = d.saturating_duration_since(Instant::now());
                // Round up: a 0.3 ms wait must not become a busy 0 ms poll.
                let ms = left.as_nanos().div_ceil(1_000_000);
                ms.min(i32::MAX as u128) as libc::c_int
            }
        };
        // SAFETY: `fds` is a valid, exclusively borrowed slice of `pollfd` for the whole call
        // and its length is passed alongside; poll writes only the `revents` fields.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if rc >= 0 {
            return Ok(rc as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Waits until one of `fds` is readable (or closed, or in error), or `timeout` passes.
/// Returns the indices of the ready descriptors (empty on timeout).
pub fn wait_readable(fds: &[RawFd], timeout: Duration) -> Result<Vec<usize>> {
    let mut pfds: Vec<PollFd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: POLL_IN,
            revents: 0,
        })
        .collect();
    poll(&mut pfds, Some(timeout)).map_err(|e| Error::Io(format!("poll: {e}")))?;
    Ok(pfds
        .iter()
        .enumerate()
        .filter(|(_, p)| p.revents != 0)
        .map(|(i, _)| i)
        .collect())
}
