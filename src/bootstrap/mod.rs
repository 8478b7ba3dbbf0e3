//! Bootstrap: everything that turns a set of processes into a job — the launch environment
//! ([`launch`]), the job secret and authenticated connections ([`auth`]), the rendezvous store
//! ([`tcp_store`]), host grouping ([`topology`]), and [`form`], the one entry that forms a job
//! (rendezvous, data mesh, shared-memory upgrade, control connection) for the engine.

pub mod auth;
pub mod job;
pub mod launch;
pub mod net;
pub mod tcp_store;
pub mod topology;

pub use auth::{authenticate, random_secret, secret_from_hex, secret_to_hex};
pub use job::{
    form, ControlPlane, CoordinatorAddr, CoordinatorListeners, Job, Membership, StoreLink,
};
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
