//! GPU support, found at run time: the same build runs on machines without CUDA.
//!
//! Nothing here links against CUDA or NCCL. [`loader`] looks for the libraries with `dlopen`
//! and asks them what they are before anything else may touch them: a dynamically loaded
//! binding that assumes the library is present aborts the process when it is not, and a
//! missing GPU library must never take a CPU job down.

pub mod loader;
