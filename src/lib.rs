//! ferrovod's engine: collective communication for data-parallel training.
//!
//! Where things live (a tensor's path, top to bottom):
//! - `python/` — the PyO3 boundary, the only code that knows Python (feature `python`);
//! - [`engine`] — one background thread per process: queue → negotiate → fuse → execute;
//! - `device` — the GPU dispatch: how a response whose tensors are on a GPU runs (on NCCL,
//!   layered across hosts, or staged through host memory). It sits in the engine's layer, not
//!   below it: the engine's worker calls it through a few `pub(crate)` items, and it works on
//!   the op records the engine hands it (`engine::Entry`, `TensorBuf`) and nothing else of the
//!   engine. Below it: [`backend`] (→ [`gpu`]), [`job`]'s store link, [`collective`]'s host
//!   layout, [`control`]'s messages;
//! - [`control`] — the control plane the engine negotiates over: the control tree's nodes,
//!   negotiation, the messages and their connections;
//! - [`collective`] — algorithms (one file per collective), written against [`comm::Communicator`];
//! - [`transport`] — point-to-point links ([`transport::tcp`]); algorithms never see which;
//! - [`job`] — [`job::form`], which forms a job for the engine from the bootstrap layer and the
//!   transports (above both);
//! - [`bootstrap`] — launch environment, job secret, authenticated connections, rendezvous
//!   store, host grouping;
//! - [`gpu`] — CUDA and NCCL, looked for at run time (nothing is linked): every call into them
//!   and its `unsafe`, behind safe types, as `sys` is for the operating system;
//! - [`backend`] — device collectives ([`backend::nccl`]) on the libraries [`gpu`] found;
//! - cross-cutting: [`types`], [`error`], [`wire`] (the only decoder of network bytes), [`config`],
//!   `spin` (how every idle wait polls before it blocks), `timeline` (the Chrome-trace writer).
#![deny(missing_docs)]

pub mod backend;
pub mod bootstrap;
pub mod collective;
pub mod comm;
pub mod config;
pub mod control;
pub mod cpus;
mod device;
pub mod engine;
pub mod error;
pub mod gpu;
pub mod job;
mod spin;
mod sys;
#[cfg(any(test, feature = "testing"))]
#[doc(hidden)]
pub mod testing;
mod timeline;
pub mod transport;
pub mod types;
pub mod wire;

#[cfg(feature = "python")]
mod python;

pub use error::{Error, Result};

/// The `log` target of every record the engine writes: Python sees them on the `ferrovod`
/// logger (the PyO3 layer bridges `log` into Python's `logging`).
pub const LOG_TARGET: &str = "ferrovod";
pub use types::{DType, OpKind, ReduceOp, Reduction};
