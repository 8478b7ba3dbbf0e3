//! GPU support, found at run time: the same build runs on machines without CUDA.
//!
//! Nothing here links against CUDA or NCCL. [`loader`] looks for the libraries with `dlopen`
//! and asks them what they are before anything else may touch them: a dynamically loaded
//! binding that assumes the library is present aborts the process when it is not, and a
//! missing GPU library must never take a CPU job down.
//!
//! This layer is to the GPU libraries what `src/sys/` is to the operating system: every call
//! into CUDA or NCCL, and every `unsafe` it takes, is here, behind types whose methods are
//! safe ([`cuda::Device`], [`cuda::Event`], [`nccl::Nccl`], [`nccl::RawComm`]). The NCCL
//! backend (`crate::backend::nccl`) and the GPU dispatch (`crate::device`) build on them
//! and hold no `unsafe` of their own.
//!
//! Why the functions are resolved here instead of through `cudarc`'s loader: cudarc's dynamic
//! loader (0.19) looks for NCCL under the names `libnccl.so`, `libnccl.so.{9..12}`,
//! `libnccl.so.1` and the like, never `libnccl.so.2` — the only file the `nvidia-nccl-*` wheel
//! torch installs, and the only one the distribution's runtime package installs (`libnccl.so`
//! comes with the -dev package). It cannot be pointed at a file, and when it finds nothing it
//! panics. Loading the accepted file first with `RTLD_GLOBAL` does not help either: it opens
//! its own handle by name and looks symbols up there. So this layer takes cudarc's
//! declarations (the `ncclUniqueId` and `ncclConfig_t` layouts, the enum values of the NCCL
//! 2.30 and CUDA 12.0 headers) and resolves every function from the very library the probe
//! accepted; cudarc's loader never runs, so it can neither panic nor load a different file.

/// Resolves a C function by name into a typed field (`Err(name)` when absent).
macro_rules! resolve {
    ($lib:expr, $name:literal) => {
        // SAFETY: the field's type is `$name`'s C signature in nccl.h / cuda.h of every version
        // the probe accepts (enums passed as their 32-bit integer values).
        unsafe { $crate::gpu::symbols::function(&$lib, $name) }.ok_or($name)
    };
}

pub mod cuda;
pub mod loader;
pub mod nccl;
mod symbols;
