//! Bootstrap: what turning a set of processes into a job stands on — the launch environment
//! ([`launch`]), the job secret and authenticated connections ([`auth`]), the rendezvous store
//! ([`tcp_store`]) and host grouping ([`topology`]). [`crate::job::form`], above this layer and
//! the transports, forms a job from them for the engine.

pub mod auth;
pub mod launch;
pub mod net;
pub mod tcp_store;
pub mod topology;

pub use auth::{authenticate, random_secret, secret_from_hex, secret_to_hex};
pub use net::{read_frame, read_frame_until, write_frame};
pub use tcp_store::{TcpStore, TcpStoreServer};
pub use topology::{ControlTree, Topology};

use std::time::Duration;

use crate::error::Result;

/// A small key-value store every rank can reach, used once at start-up (and when process sets
/// are added) to exchange addresses. Every blocking call takes a timeout.
pub trait Store: Send + Sync {
    /// Sets `key` to `value` (overwrites).
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Waits until `key` exists, then returns its value; `Error::Timeout` after `timeout`.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
    /// Atomically adds `delta` to the integer at `key` (missing = 0) and returns the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;
}
