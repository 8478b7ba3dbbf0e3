//! New control connections: accepted on the node's listeners, authenticated off its thread.

use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::sync::{mpsc, Arc};

use super::CoordinatorConfig;
use crate::bootstrap::{auth, net};
use crate::control::connection::ControlStream;
use crate::control::message::ToCoordinator;
use crate::error::{Error, Result};
use crate::sys::Waker;
use crate::transport::shm::ShmLink;

/// Accepts pending connections on both listeners; each is authenticated on its own
/// short-lived thread so that a slow or hostile client cannot stall negotiation.
pub(super) fn accept_all(
    listener: &TcpListener,
    local: Option<&UnixListener>,
    cfg: &CoordinatorConfig,
    tx: &mpsc::Sender<(usize, ControlStream)>,
    waker: &Arc<Waker>,
) {
    while let Ok((stream, _)) = listener.accept() {
        authenticate_async(ControlStream::Tcp(stream), cfg, tx, waker);
    }
    while let Some(Ok((stream, _))) = local.map(UnixListener::accept) {
        authenticate_async(ControlStream::Unix(stream), cfg, tx, waker);
    }
}

fn authenticate_async(
    mut stream: ControlStream,
    cfg: &CoordinatorConfig,
    tx: &mpsc::Sender<(usize, ControlStream)>,
    waker: &Arc<Waker>,
) {
    let (tx, waker) = (tx.clone(), waker.clone());
    let (secret, timeout) = (cfg.secret.clone(), cfg.timeout);
    let _ = std::thread::Builder::new()
        .name("ferrovod-accept".into())
        .spawn(move || {
            let hello = (|| -> Result<usize> {
                auth::authenticate(&mut stream, &secret, false, timeout)?;
                crate::bootstrap::net::Stream::set_read_timeout(&stream, Some(timeout))?;
                let frame = net::read_frame(&mut stream, 1024)?;
                let rank = match ToCoordinator::decode(&frame)? {
                    ToCoordinator::Hello { rank } => rank,
                    _ => return Err(Error::Decode("expected hello".into())),
                };
                // A rank on this host always offers control rings next (or declines).
                if let ControlStream::Unix(s) = &mut stream {
                    if let Some(link) = ShmLink::accept_control(s, rank, timeout)? {
                        stream = ControlStream::Shm(Box::new(link));
                    }
                }
                Ok(rank)
            })();
            match hello {
                Ok(rank) => {
                    let _ = crate::bootstrap::net::Stream::set_read_timeout(&stream, None);
                    if let ControlStream::Tcp(s) = &stream {
                        let _ = crate::sys::detect_unreachable_peer(s.as_raw_fd(), timeout);
                    }
                    let _ = tx.send((rank, stream));
                    waker.wake();
                }
                Err(e) => log::warn!(
                    target: crate::LOG_TARGET,
                    "coordinator dropped a connection from {}: {e}",
                    match &stream {
                        ControlStream::Tcp(s) => s
                            .peer_addr()
                            .map_or_else(|_| "an unknown address".into(), |a| a.to_string()),
                        ControlStream::Unix(_) | ControlStream::Shm(_) => {
                            "a process on this host".into()
                        }
                    }
                ),
            }
        });
}
