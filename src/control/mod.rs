//! The control plane: how the ranks agree on what runs next. Each rank's engine sends its
//! submissions up the control tree and runs the responses that come back down, in the order
//! rank 0 decided; no tensor bytes travel here.
//!
//! - [`node`] — a node of the control tree on its own thread: rank 0's root negotiates, every
//!   other node relays (with [`relay`]: which link reaches which rank, and the cached
//!   submissions a relay holds until every link below has made them);
//! - [`negotiate`] — the root's state machine, no I/O: submissions in, ordered responses out,
//!   mismatches turned into errors naming the tensor, the ranks and what disagreed;
//! - [`message`] — the messages and their codec (every decode through [`crate::wire`]);
//! - [`connection`] — framed, non-blocking control connections (TCP, or shared-memory rings
//!   on the root's host);
//! - [`names`] — the names of this rank's ops in flight;
//! - [`lease`] — how a waiting caller keeps the node's thread asleep while it turns the node
//!   itself; [`autotune`] — the root's tuner of the fusion threshold and cycle time.
//!
//! The engine ([`crate::engine`]) uses this layer; nothing here reaches into the engine.

// Public: what the wire's fuzzers and decoders (connection, message) reach.
pub(crate) mod autotune;
pub mod connection;
pub(crate) mod lease;
pub mod message;
pub(crate) mod names;
pub(crate) mod negotiate;
pub(crate) mod node;
pub(crate) mod relay;
