//! The operating system, in one place: the system calls std does not wrap — waiting on
//! descriptors (`poll`), a cross-thread wake-up (`eventfd`), memory maps (anonymous pages,
//! and sealed memfd segments other processes map too), futexes, descriptor passing, socket
//! options and this host's interfaces. Each call's `unsafe` sits here beside the reason it is
//! sound, and the layers above (bootstrap, transport, engine) call safe functions. What is
//! `unsafe` elsewhere is no system call: the GPU libraries' FFI (`gpu/`, `backend/`), Python's
//! buffers (`python/`), and slices over memory these maps hand out.

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
pub use socket::{detect_unreachable_peer, interfaces, recv_with_fd, send_nosignal, send_with_fd};
