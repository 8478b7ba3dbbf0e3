//! Device backends: collectives on GPU memory, beside the host transports of [`crate::transport`].
//!
//! [`nccl`] drives NCCL on CUDA device pointers. It is compiled into every build and usable
//! only where [`crate::gpu::loader`] finds the libraries at run time; every call it makes into
//! NCCL or CUDA goes through the safe types of [`crate::gpu`].

pub mod nccl;
