//! Device backends: collectives on GPU memory, beside the host transports of [`crate::transport`].
//!
//! [`nccl`] drives NCCL on CUDA device pointers. It is compiled into every build and usable
//! only where [`crate::gpu::loader`] finds the libraries at run time.
//!
//! Why the backend resolves NCCL's functions itself instead of calling `cudarc`'s: cudarc's
//! dynamic loader (0.19) looks for NCCL under the names `libnccl.so`, `libnccl.so.{9..12}`,
//! `libnccl.so.1` and the like, never `libnccl.so.2` — the only file the `nvidia-nccl-*` wheel
//! torch installs, and the only one the distribution's runtime package installs (`libnccl.so`
//! comes with the -dev package). It cannot be pointed at a file, and when it finds nothing it
//! panics. Loading the accepted file first with `RTLD_GLOBAL` does not help either: it opens
//! its own handle by name and looks symbols up there. So the backend takes cudarc's
//! declarations (the `ncclUniqueId` and `ncclConfig_t` layouts, the enum values of the NCCL
//! 2.30 and CUDA 12.0 headers) and resolves every function from the very library the probe
//! accepted; cudarc's loader never runs, so it can neither panic nor load a different file.

/// Resolves a C function by name into a typed field (`Err(name)` when absent).
macro_rules! resolve {
    ($lib:expr, $name:literal) => {
        // SAFETY: the field's type is `$name`'s C signature in nccl.h / cuda.h of every version
        // the probe accepts (enums passed as their 32-bit integer values).
        unsafe { function(&$lib, $name) }.ok_or($name)
    };
}

pub mod cuda;
pub mod nccl;

use std::ffi::{c_char, c_void, CStr};

use crate::gpu::loader::Library;

/// Resolves `name` from `lib` as a function pointer of type `F`.
///
/// # Safety
/// `F` must be an `unsafe extern "C" fn` type matching the C signature that `name` has in
/// every library version this is called with.
unsafe fn function<F: Copy>(lib: &Library, name: &str) -> Option<F> {
    const { assert!(std::mem::size_of::<F>() == std::mem::size_of::<*mut c_void>()) };
    let sym = lib.symbol(name)?;
    // SAFETY: `F` is a function pointer type of pointer size (checked above) whose signature
    // the caller vouches for; the library is never unloaded, so the pointer stays valid.
    Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&sym) })
}

/// Copies a C string NCCL or CUDA returned (NULL reads as empty).
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string valid for the call.
unsafe fn c_text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null and NUL-terminated (the caller's contract).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}
