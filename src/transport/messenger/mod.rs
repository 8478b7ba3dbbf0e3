//! Point-to-point messages between two ranks (torch.distributed's `send` and `recv`), apart
//! from the collectives: nothing is negotiated with the coordinator and no process set is
//! made for the pair, so a message costs its two ranks alone, whatever the job's size.
//!
//! - **Connections.** A rank sends to a peer over a connection of its own to that peer,
//!   made on its first message to it: the data listener's acceptor ([`super::dial`]) takes
//!   it after the same authentication as a data link, told apart by its hello, and hands it to
//!   the receiver's messenger. One connection per direction: neither side waits for the
//!   other's to exist, and no tie-break is needed.
//! - **Matching.** Each message carries the name both sides gave it (torch's front end names
//!   a group's tag), its byte length and a description of its tensor (dtype and shape). A
//!   receive takes the first message of its name from its peer (messages on one connection
//!   arrive in the order sent, so the n-th receive of a name takes the n-th message), or,
//!   from any rank, the first of its name to arrive from any peer: straight into the
//!   receive's memory when the receive was posted first, else from a buffer the message
//!   waited in. A receive that names its peer is served before one from any rank.
//! - **Large messages wait for their receive.** A payload of more than
//!   [`held::EAGER_BYTES`] does not follow its header: the header announces it, the receive
//!   that takes it clears it, and then the payload comes straight into the receive's memory.
//!   So a receiver never holds more than that of a message nobody has received, and messages
//!   sent after a large one overtake it while it waits.
//! - **Agreement on both sides.** The receiver answers every message once a receive has taken
//!   it: accepted, or the text of a disagreement (length, dtype or shape), with which both
//!   sides fail. So a send completes when its receive has taken it (as gloo's does), and a
//!   mismatch fails the sender too, naming both ranks.
//! - **Failure.** A connection that closes fails every message in flight on it and every
//!   receive waiting for that peer (`PeerLost`, naming it); every message has a deadline (the
//!   caller's timeout); [`Messenger::fail`] fails everything at once, as the engine does when
//!   the job fails.
//!
//! One service thread per rank, started by the first message either way, moves every
//! message's bytes on non-blocking sockets and sleeps in `poll` when nothing moves; the
//! callers never touch a socket.

mod conn;
mod frame;
mod held;
mod service;

use std::net::SocketAddr;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::sys::Waker;
use service::{Cmd, Reach, Service};

/// Memory a message is sent from or received into, valid until the message completes.
pub trait Payload: Send {
    /// The bytes sent.
    fn bytes(&self) -> &[u8];
    /// Where received bytes go.
    fn bytes_mut(&mut self) -> &mut [u8];
}

/// Called once with a message's outcome, on the messenger's thread: the peer it went to or
/// came from (for a receive from any rank, the one whose message it took), or why it failed.
pub type Done = Box<dyn FnOnce(Result<usize>) + Send>;

/// A receive's peer that takes the first message of its name from whichever rank sent one.
pub const ANY_PEER: usize = usize::MAX;

/// One message to send or receive.
pub struct Message {
    /// The global rank sent to or received from ([`ANY_PEER`] for a receive from any rank).
    pub peer: usize,
    /// The name both sides give the message.
    pub name: String,
    /// What the tensor is (dtype and shape): the two sides' must be equal.
    pub desc: String,
    /// The bytes (a receive's are overwritten).
    pub payload: Box<dyn Payload>,
    /// How long the message may wait for its other side.
    pub timeout: Duration,
    /// Told the outcome.
    pub done: Done,
}

/// This rank's messenger (see the module doc): a cheap clone.
#[derive(Clone)]
pub struct Messenger {
    inner: Arc<Inner>,
}

struct Inner {
    rank: usize,
    size: usize,
    tx: mpsc::Sender<Cmd>,
    /// Wakes the service thread for a command.
    waker: Arc<Waker>,
    /// What the service thread takes when it starts (the first message starts it).
    unstarted: Mutex<Option<Service>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Messenger {
    /// The messenger of rank `rank` of `size`, whose peers listen at `addrs` and prove
    /// `secret`; `handshake` bounds making a connection, and `finish` says what it becomes (shared
    /// memory with a peer on this host, as for the data links). Starts no thread yet.
    pub(super) fn new(
        rank: usize,
        size: usize,
        addrs: Arc<[SocketAddr]>,
        secret: Arc<[u8]>,
        handshake: Duration,
        finish: Option<super::dial::Finish>,
    ) -> Result<Messenger> {
        let waker = Arc::new(Waker::new()?);
        let (tx, rx) = mpsc::channel();
        let reach = Reach {
            rank,
            size,
            addrs,
            secret,
            handshake,
            finish,
            spin: super::tcp::DEFAULT_SPIN,
        };
        let service = Service::new(reach, (tx.clone(), rx), waker.clone());
        Ok(Messenger {
            inner: Arc::new(Inner {
                rank,
                size,
                tx,
                waker,
                unstarted: Mutex::new(Some(service)),
                thread: Mutex::new(None),
            }),
        })
    }

    /// Sends `m`; `m.done` is told once the peer's receive has taken it (or why not).
    pub fn send(&self, m: Message) {
        self.post(m, true);
    }

    /// Receives `m` from `m.peer` into its payload; `m.done` is told once it has arrived.
    pub fn recv(&self, m: Message) {
        self.post(m, false);
    }

    fn post(&self, m: Message, sending: bool) {
        let (rank, size) = (self.inner.rank, self.inner.size);
        let anyone = !sending && m.peer == ANY_PEER;
        if !anyone && (m.peer >= size || m.peer == rank) {
            let why = format!(
                "rank {rank} cannot {} '{}' {} rank {} (the job has ranks 0 to {})",
                if sending { "send" } else { "receive" },
                m.name,
                if sending { "to" } else { "from" },
                m.peer,
                size - 1
            );
            (m.done)(Err(Error::InvalidArgument(why)));
            return;
        }
        self.command(if sending { Cmd::Send(m) } else { Cmd::Recv(m) });
    }

    /// Sets how long the messenger's thread polls before it sleeps (the job's
    /// `FERROVOD_SPIN_US`); it takes effect when the first message starts the thread.
    pub fn set_spin(&self, spin: Duration) {
        if let Some(s) = self.inner.unstarted.lock().as_mut() {
            s.set_spin(spin);
        }
    }

    /// Fails every message in flight and every later one with `err` (the job has failed),
    /// and closes this rank's connections so that its peers' messages fail too.
    pub fn fail(&self, err: Error) {
        // Under the lock `start` takes first, so that the service cannot start in between
        // and miss the failure.
        let thread = self.inner.thread.lock();
        if thread.is_none() {
            if let Some(s) = self.inner.unstarted.lock().as_mut() {
                s.fail_unstarted(err);
                return;
            }
        }
        drop(thread);
        self.command(Cmd::Fail(err));
    }

    /// A connection a peer made to send to this rank (from the acceptor).
    pub(super) fn incoming(&self, peer: usize, made: Result<super::dial::Made>) {
        self.command(Cmd::Incoming(peer, made));
    }

    fn command(&self, cmd: Cmd) {
        if let Err(e) = self.start() {
            cmd.refuse(e);
            return;
        }
        if let Err(mpsc::SendError(cmd)) = self.inner.tx.send(cmd) {
            cmd.refuse(Error::Shutdown(
                "the point-to-point service has stopped".into(),
            ));
            return;
        }
        self.inner.waker.wake();
    }

    fn start(&self) -> Result<()> {
        let mut thread = self.inner.thread.lock();
        if thread.is_some() {
            return Ok(());
        }
        let Some(service) = self.inner.unstarted.lock().take() else {
            return Err(Error::Shutdown(
                "the point-to-point service has stopped".into(),
            ));
        };
        let spawned = std::thread::Builder::new()
            .name(format!("ferrovod-p2p-{}", self.inner.rank))
            .spawn(move || service.run())?;
        *thread = Some(spawned);
        Ok(())
    }
}

impl Drop for Inner {
    /// The last clone gone (the engine and the acceptor both let go): the service stops,
    /// failing what is still in flight.
    fn drop(&mut self) {
        if let Some(t) = self.thread.get_mut().take() {
            let _ = self.tx.send(Cmd::Stop);
            self.waker.wake();
            let _ = t.join();
        }
    }
}
