//! TCP transport: one connection per pair of ranks, non-blocking sockets progressed with poll(2).
//! (Stub: being implemented.)

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use super::{Transport, Xfer};
use crate::error::Result;

/// Full mesh of authenticated TCP connections to every other rank.
pub struct TcpTransport {
    rank: usize,
    size: usize,
}

impl TcpTransport {
    /// Builds the full mesh. `listener` is this rank's bound data listener and `addrs[r]` is
    /// rank r's listener address (as published through the rendezvous store). Every connection
    /// proves knowledge of `secret` in both directions before anything else is read.
    pub fn connect_mesh(
        rank: usize,
        size: usize,
        listener: &TcpListener,
        addrs: &[SocketAddr],
        secret: &[u8],
        timeout: Duration,
    ) -> Result<TcpTransport> {
        let _ = (listener, addrs, secret, timeout);
        Ok(TcpTransport { rank, size })
    }

    /// Test support: `n` transports fully connected over 127.0.0.1, index = rank.
    #[doc(hidden)]
    pub fn loopback_mesh(n: usize, secret: &[u8]) -> Result<Vec<TcpTransport>> {
        let _ = secret;
        Ok((0..n).map(|rank| TcpTransport { rank, size: n }).collect())
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn exchange(&mut self, xfers: &mut [Xfer<'_>], idle_timeout: Duration) -> Result<()> {
        let _ = (xfers, idle_timeout);
        todo!("tcp exchange")
    }
    fn abort(&mut self) {}
}
