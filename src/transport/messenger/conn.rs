//! One messages connection as the service moves bytes on it: the TCP connection itself, or,
//! with a peer on this host, the shared-memory link set up over it as a data link's is
//! (`super::super::shm`), which the service sleeps on through its doorbell.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;

use super::super::dial::Made;
use super::super::shm::ShmLink;
use crate::error::{Error, Result};
use crate::sys::{poll_fd, PollFd, POLL_IN, POLL_OUT};

pub(super) enum Conn {
    Tcp(TcpStream),
    Shm(Box<ShmLink>),
}

impl Conn {
    /// What the connection is carried over, for the log.
    pub(super) fn kind(&self) -> &'static str {
        match self {
            Conn::Tcp(_) => "TCP",
            Conn::Shm(_) => "shared memory",
        }
    }

    /// The connection a made link becomes: a TCP one non-blocking and without delay.
    pub(super) fn new(made: Made) -> Result<Conn> {
        Ok(match made {
            Made::Tcp(s) => {
                s.set_nonblocking(true)?;
                s.set_nodelay(true)?;
                Conn::Tcp(s)
            }
            Made::Shm(link) => Conn::Shm(link),
        })
    }

    /// Writes what it can of `buf` now: how many bytes (`None`: none could go).
    pub(super) fn write_some(&mut self, buf: &[u8], peer: usize) -> Result<Option<usize>> {
        match self {
            Conn::Tcp(s) => loop {
                return match s.write(buf) {
                    Ok(0) if !buf.is_empty() => Err(closed(peer)),
                    Ok(n) => Ok(Some(n)),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(None),
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => Err(Error::from_peer_io(peer, &e)),
                };
            },
            Conn::Shm(link) => Ok(Some(link.write_some(buf)?).filter(|&n| n > 0)),
        }
    }

    /// Reads what is there into `buf`: how many bytes (`None`: none yet). A connection the
    /// peer closed is `PeerLost`, once what it sent before is read.
    pub(super) fn read_some(&mut self, buf: &mut [u8], peer: usize) -> Result<Option<usize>> {
        if buf.is_empty() {
            return Ok(Some(0));
        }
        match self {
            Conn::Tcp(s) => loop {
                return match s.read(buf) {
                    Ok(0) => Err(closed(peer)),
                    Ok(n) => Ok(Some(n)),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(None),
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => Err(Error::from_peer_io(peer, &e)),
                };
            },
            Conn::Shm(link) => Ok(Some(link.read_some(buf)?).filter(|&n| n > 0)),
        }
    }

    /// Appends what is there to `buf`, reading at most `chunk` bytes: how many (0: none yet).
    pub(super) fn fill(&mut self, buf: &mut Vec<u8>, chunk: usize, peer: usize) -> Result<usize> {
        let have = buf.len();
        buf.resize(have + chunk, 0);
        let got = self.read_some(&mut buf[have..], peer);
        let n = got.as_ref().map_or(0, |n| n.unwrap_or(0));
        buf.truncate(have + n);
        got.map(|_| n)
    }

    /// Before the service sleeps: the descriptor to wait on, and whether bytes could move
    /// already (then it must not sleep). A shared-memory link is armed here, so that its peer
    /// rings its doorbell from now on; `woke` disarms it.
    pub(super) fn sleep_on(&self, writing: bool) -> (PollFd, bool) {
        match self {
            Conn::Tcp(s) => {
                let events = POLL_IN | if writing { POLL_OUT } else { 0 };
                (poll_fd(s, events), false)
            }
            Conn::Shm(link) => {
                link.arm();
                let ready = link.ready(false) || (writing && link.ready(true));
                (poll_fd(link.doorbell(), POLL_IN), ready)
            }
        }
    }

    /// After the sleep, with what `poll` reported on the descriptor.
    pub(super) fn woke(&mut self, revents: i16) {
        if let Conn::Shm(link) = self {
            link.disarm();
            if revents != 0 {
                link.drain_doorbell(revents);
            }
        }
    }
}

pub(super) fn closed(peer: usize) -> Error {
    Error::PeerLost {
        rank: peer,
        detail: "its point-to-point connection closed".into(),
    }
}
