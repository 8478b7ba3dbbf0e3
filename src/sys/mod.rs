//! The operating system, in one place: the system calls std does not wrap — waiting on
//! descriptors (`poll`), a cross-thread wake-up (`eventfd`), memory maps (anonymous pages,
//! and sealed memfd segments other processes map too), futexes, fork detection, descriptor
//! passing, socket options and this host's interfaces — and the raw memory behind them: the
//! maps lend their bytes only as slices, and [`copy`] copies host bytes through raw pointers.
//! Each `unsafe` sits here beside the reason it is sound, and the layers above (bootstrap,
//! transport, engine) call safe functions. What is `unsafe` elsewhere is foreign code and
//! memory this process does not own: the GPU libraries' FFI (`gpu/`, `backend/`), the device
//! pointers and streams callers hand in (`device/`), the caller's tensors that
//! `engine/tensor.rs`'s `TensorBuf` borrows, and Python's buffers (`python/tensor.rs`).

pub mod copy;
mod eventfd;
#[cfg(feature = "python")]
mod fork;
mod futex;
mod memory;
mod poll;
mod socket;

pub use eventfd::Waker;
#[cfg(feature = "python")]
pub use fork::forks;
pub use futex::{futex_wait, futex_wake};
pub use memory::{Mapping, Pages};
pub use poll::{poll, poll_fd, wait_readable, PollFd, POLL_IN, POLL_OUT};
#[cfg(feature = "python")]
pub use socket::tcp_listener_from_fd;
pub use socket::{detect_unreachable_peer, interfaces, recv_with_fd, send_nosignal, send_with_fd};
