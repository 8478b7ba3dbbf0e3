//! Typed functions from a loaded library, and C strings it returns: the two conversions every
//! binding in this layer makes.

use std::ffi::{c_char, c_void, CStr};

use super::loader::Library;

/// Resolves `name` from `lib` as a function pointer of type `F`.
///
/// # Safety
/// `F` must be an `unsafe extern "C" fn` type matching the C signature that `name` has in
/// every library version this is called with.
pub(super) unsafe fn function<F: Copy>(lib: &Library, name: &str) -> Option<F> {
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
pub(super) unsafe fn c_text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null and NUL-terminated (the caller's contract).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}
