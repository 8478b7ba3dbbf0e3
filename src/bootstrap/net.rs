//! Small socket helpers shared by the bootstrap code, the transports and the engine's control
//! connections: length-prefixed frames, and fixed-size reads and writes bounded by a deadline.
//! The system calls under them are [`crate::sys`]'s.

use std::io::{self, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// A connected stream socket with per-call timeouts: TCP, or a Unix socket between processes
/// on one host. The bounded reads and writes, and authentication, work on either.
pub trait Stream: Read + Write + AsRawFd {
    /// As [`TcpStream::set_read_timeout`].
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()>;
    /// As [`TcpStream::set_write_timeout`].
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()>;
    /// As [`TcpStream::set_nonblocking`].
    fn set_nonblocking(&self, on: bool) -> io::Result<()>;
}

macro_rules! impl_stream {
    ($t:ty) => {
        impl Stream for $t {
            fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
                <$t>::set_read_timeout(self, t)
            }
            fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
                <$t>::set_write_timeout(self, t)
            }
            fn set_nonblocking(&self, on: bool) -> io::Result<()> {
                <$t>::set_nonblocking(self, on)
            }
        }
    };
}
impl_stream!(TcpStream);
impl_stream!(UnixStream);

/// Writes one frame: a u32 little-endian length, then `payload`.
///
/// Small frames go out in a single write so that a socket without `TCP_NODELAY` does not hold
/// the payload back behind the header (Nagle + delayed ACK would add ~40 ms).
pub fn write_frame(stream: &mut impl Write, payload: &[u8]) -> Result<()> {
    let len = u32::try_from(payload.len()).map_err(|_| {
        Error::InvalidArgument(format!("frame of {} bytes is too long", payload.len()))
    })?;
    if payload.len() <= 64 * 1024 {
        let mut buf = Vec::with_capacity(4 + payload.len());
        buf.extend_from_slice(&len.to_le_bytes());
        buf.extend_from_slice(payload);
        stream.write_all(&buf).map_err(frame_io_error)?;
    } else {
        stream
            .write_all(&len.to_le_bytes())
            .map_err(frame_io_error)?;
        stream.write_all(payload).map_err(frame_io_error)?;
    }
    stream.flush().map_err(frame_io_error)
}

/// Reads one frame written by [`write_frame`]. A length over `max_len` is `Error::Decode`
/// (nothing is allocated for it); end of stream, even before the first byte, is an error.
///
/// I/O failures, including end of stream and an expired read timeout set on the stream, are
/// `Error::Io` whose message says which.
pub fn read_frame(stream: &mut impl Read, max_len: usize) -> Result<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).map_err(frame_io_error)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max_len {
        return Err(Error::Decode(format!(
            "frame of {len} bytes exceeds the limit of {max_len}"
        )));
    }
    let mut buf = vec![0u8; len];
    stream.read_exact(&mut buf).map_err(frame_io_error)?;
    Ok(buf)
}

/// Like [`read_frame`] on a blocking socket, but the whole frame must arrive before `deadline`
/// (a peer that trickles bytes cannot stretch it). `what` names the wait in a timeout error.
pub fn read_frame_until(
    stream: &mut TcpStream,
    max_len: usize,
    deadline: Instant,
    what: &str,
) -> Result<Vec<u8>> {
    let mut len = [0u8; 4];
    read_exact_until(stream, &mut len, deadline, what)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max_len {
        return Err(Error::Decode(format!(
            "frame of {len} bytes exceeds the limit of {max_len}"
        )));
    }
    let mut buf = vec![0u8; len];
    read_exact_until(stream, &mut buf, deadline, what)?;
    Ok(buf)
}

fn frame_io_error(e: io::Error) -> Error {
    match e.kind() {
        // The stream's own timeout expired; its length is not known here, so this cannot be
        // an `Error::Timeout` with an honest `after` (use `read_frame_until` for that).
        ErrorKind::WouldBlock | ErrorKind::TimedOut => {
            Error::Io("timed out reading a frame (the stream's timeout expired)".into())
        }
        ErrorKind::UnexpectedEof => Error::Io("connection closed by peer".into()),
        _ => Error::Io(e.to_string()),
    }
}

/// The instant `timeout` from now; a timeout too long to represent means "practically never".
pub(crate) fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400))
}

/// Time left until `deadline`, or a timeout error naming `what` if none is left.
pub(crate) fn remaining(deadline: Instant, what: &str, total: Duration) -> Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(Error::Timeout {
            what: what.to_string(),
            after: total,
        })
    } else {
        Ok(left)
    }
}

/// Fills `buf` from a blocking stream before `deadline`. Errors: `Timeout` when the deadline
/// passes, `Io` (saying "connection closed") on EOF or reset.
pub(crate) fn read_exact_until(
    stream: &mut impl Stream,
    buf: &mut [u8],
    deadline: Instant,
    what: &str,
) -> Result<()> {
    let start = Instant::now();
    let mut off = 0;
    while off < buf.len() {
        let left = remaining(deadline, what, deadline.saturating_duration_since(start))?;
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf[off..]) {
            Ok(0) => return Err(Error::Io(format!("connection closed by peer while {what}"))),
            Ok(n) => off += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                // Loop: `remaining` turns an expired deadline into the timeout error.
            }
            Err(e) => return Err(Error::Io(format!("{e} while {what}"))),
        }
    }
    stream.set_read_timeout(None)?;
    Ok(())
}

/// Writes all of `buf` to a blocking stream before `deadline`.
pub(crate) fn write_all_until(
    stream: &mut impl Stream,
    buf: &[u8],
    deadline: Instant,
    what: &str,
) -> Result<()> {
    let start = Instant::now();
    let mut off = 0;
    while off < buf.len() {
        let left = remaining(deadline, what, deadline.saturating_duration_since(start))?;
        stream.set_write_timeout(Some(left))?;
        match stream.write(&buf[off..]) {
            Ok(0) => return Err(Error::Io(format!("connection closed while {what}"))),
            Ok(n) => off += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => return Err(Error::Io(format!("{e} while {what}"))),
        }
    }
    stream.set_write_timeout(None)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_round_trip_and_limits() {
        let mut buf = Vec::new();
        write_frame(&mut buf, b"hello").unwrap();
        write_frame(&mut buf, b"").unwrap();
        let big = vec![7u8; 100_000];
        write_frame(&mut buf, &big).unwrap();
        let mut r = &buf[..];
        assert_eq!(read_frame(&mut r, 1 << 20).unwrap(), b"hello");
        assert_eq!(read_frame(&mut r, 1 << 20).unwrap(), b"");
        assert_eq!(read_frame(&mut r, 1 << 20).unwrap(), big);
        // End of stream is an error, not an empty frame.
        assert!(matches!(read_frame(&mut r, 10), Err(Error::Io(_))));
        // Over-long length prefix: rejected before allocating.
        let mut r: &[u8] = &[0xff, 0xff, 0xff, 0xff, 1, 2];
        assert!(matches!(read_frame(&mut r, 1 << 20), Err(Error::Decode(_))));
        // Truncated payload.
        let mut r: &[u8] = &[5, 0, 0, 0, 1, 2];
        assert!(matches!(read_frame(&mut r, 1 << 20), Err(Error::Io(_))));
    }
}
