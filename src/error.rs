//! The crate's error type. Everything a peer, the network or a user can cause is an `Error`;
//! internal invariants are `debug_assert!`s.

use std::time::Duration;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong. The Python layer maps each variant to a `FerrovodError` subclass.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// An operating-system level I/O failure that is not attributable to a known peer.
    #[error("I/O error: {0}")]
    Io(String),
    /// A peer closed its connection, reset it, or was reported dead by the coordinator.
    #[error("rank {rank} failed or disconnected: {detail}")]
    PeerLost {
        /// Global rank of the lost peer.
        rank: usize,
        /// What was observed (EOF, reset, timeout...).
        detail: String,
    },
    /// A blocking step exceeded its deadline.
    #[error("{}", timeout_text(what, after))]
    Timeout {
        /// What was being waited for.
        what: String,
        /// The limit that expired.
        after: Duration,
    },
    /// Ranks disagreed about a collective (shape, dtype, op, root, process set...).
    #[error("{message}")]
    Mismatch {
        /// Name of the tensor the ranks disagreed about.
        name: String,
        /// The full, human-readable explanation naming the ranks.
        message: String,
    },
    /// The caller asked for something invalid (bad root, unsupported dtype for an op...).
    #[error("{0}")]
    InvalidArgument(String),
    /// Bytes from the network did not decode.
    #[error("malformed message: {0}")]
    Decode(String),
    /// A connection did not prove knowledge of the job secret.
    #[error("authentication failed: {0}")]
    Auth(String),
    /// The engine is not running (never started, shut down, or used after fork).
    #[error("{0}")]
    NotInitialized(String),
    /// The engine has shut down, or the job was shut down because of an error elsewhere.
    #[error("{0}")]
    Shutdown(String),
    /// The caller stopped waiting (a signal such as Ctrl-C); the op was left pending or, on
    /// the fast path, abandoned by this rank.
    #[error("interrupted while {0}")]
    Interrupted(String),
}

impl Error {
    /// Wraps an I/O error seen while talking to `rank`: connection loss becomes `PeerLost`.
    pub fn from_peer_io(rank: usize, e: &std::io::Error) -> Error {
        use std::io::ErrorKind::*;
        match e.kind() {
            UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe | NotConnected => {
                Error::PeerLost {
                    rank,
                    detail: format!("connection lost ({e})"),
                }
            }
            _ => Error::Io(format!("with rank {rank}: {e}")),
        }
    }

    /// Short machine-readable kind, used for the wire and for Python exception mapping.
    pub fn kind_code(&self) -> u8 {
        match self {
            Error::Io(_) => 0,
            Error::PeerLost { .. } => 1,
            Error::Timeout { .. } => 2,
            Error::Mismatch { .. } => 3,
            Error::InvalidArgument(_) => 4,
            Error::Decode(_) => 5,
            Error::Auth(_) => 6,
            Error::NotInitialized(_) => 7,
            Error::Shutdown(_) => 8,
            Error::Interrupted(_) => 9,
        }
    }
}

impl Error {
    /// Rebuilds an error sent as (`kind_code`, message) for tensor `name`: the inverse of
    /// [`Error::kind_code`] for the kinds the coordinator sends.
    pub fn from_code(code: u8, message: &str, name: &str) -> Error {
        match code {
            1 => Error::PeerLost {
                rank: rank_named_in(message).unwrap_or(usize::MAX),
                detail: message.to_string(),
            },
            2 => Error::Timeout {
                what: message.to_string(),
                after: Duration::ZERO,
            },
            3 => Error::Mismatch {
                name: name.to_string(),
                message: message.to_string(),
            },
            4 => Error::InvalidArgument(message.to_string()),
            8 => Error::Shutdown(message.to_string()),
            _ => Error::Io(message.to_string()),
        }
    }
}

/// A timeout measured here says how long it waited; one relayed by the coordinator (its
/// `after` is zero) carries the whole story in `what`.
fn timeout_text(what: &str, after: &Duration) -> String {
    if after.is_zero() {
        what.to_string()
    } else {
        format!("timed out after {:.1} s while {what}", after.as_secs_f64())
    }
}

/// The first rank a message names ("... rank 3 ..."), if any.
pub fn rank_named_in(message: &str) -> Option<usize> {
    let rest = &message[message.find("rank ")? + 5..];
    rest.split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e.to_string())
    }
}
