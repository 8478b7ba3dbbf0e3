//! Finding `libnccl` and the CUDA driver at run time, and saying what was found.
//!
//! Search order for NCCL: `FERROVOD_NCCL_LIBRARY` (a file; when set, nothing else is tried),
//! then `libnccl.so.2` through the dynamic linker's own search (`LD_LIBRARY_PATH`, the
//! system cache), then the directories the caller passes — the Python layer passes the lib
//! directory of the `nvidia-nccl-*` wheel that torch installs. A library is accepted only when
//! it exports `ncclGetVersion` and reports at least [`MIN_NCCL`]. Loaded libraries stay loaded
//! for the life of the process: unloading CUDA libraries is not safe.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;

/// The oldest NCCL the backend accepts (2.12: `ncclAvg` and bfloat16 reductions, and the
/// non-blocking communicator API the backend's error handling relies on).
pub const MIN_NCCL: (u32, u32, u32) = (2, 12, 0);

/// The file name NCCL's packages install (the soname of every NCCL 2.x).
const NCCL_SONAME: &str = "libnccl.so.2";
/// The CUDA driver's soname.
const CUDA_SONAME: &str = "libcuda.so.1";

/// A usable NCCL library.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nccl {
    /// Where it was loaded from (the name given to `dlopen`).
    pub path: String,
    /// (major, minor, patch).
    pub version: (u32, u32, u32),
    /// `ncclGetVersion`'s raw code, e.g. 23007 for 2.30.7.
    pub code: i32,
}

/// What the search for NCCL found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NcclProbe {
    /// A library that can be used.
    Found(Nccl),
    /// A library was found but cannot be used; `reason` says why (too old, not NCCL).
    Unusable {
        /// The file that was loaded or tried.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No library anywhere; `tried` lists the places looked at.
    Absent {
        /// Every name or path given to `dlopen`, with its error.
        tried: Vec<String>,
    },
}

/// What the search for the CUDA driver found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaProbe {
    /// The driver loaded and initialised; `devices` GPUs are visible.
    Ready {
        /// `cuDriverGetVersion`, e.g. 12040.
        driver_version: i32,
        /// `cuDeviceGetCount`.
        devices: i32,
    },
    /// The driver library is present but unusable (no GPU, driver/toolkit mismatch, …).
    Unusable {
        /// The `CUresult` code and what it means.
        reason: String,
    },
    /// No `libcuda.so.1` on this machine.
    Absent {
        /// The loader's error.
        detail: String,
    },
}

/// Decodes `ncclGetVersion`'s code: `major*10000 + minor*100 + patch` since 2.9, and
/// `major*1000 + minor*100 + patch` before.
pub fn decode_nccl_version(code: i32) -> (u32, u32, u32) {
    let c = code.max(0) as u32;
    if c >= 10_000 {
        (c / 10_000, (c % 10_000) / 100, c % 100)
    } else {
        (c / 1000, (c % 1000) / 100, c % 100)
    }
}

/// Looks for NCCL: `explicit` (the `FERROVOD_NCCL_LIBRARY` value) alone when given, else the
/// system search and then `extra_dirs`.
pub fn probe_nccl(explicit: Option<&str>, extra_dirs: &[PathBuf]) -> NcclProbe {
    let candidates: Vec<String> = match explicit {
        Some(p) => vec![p.to_string()],
        None => std::iter::once(NCCL_SONAME.to_string())
            .chain(
                extra_dirs
                    .iter()
                    .map(|d| d.join(NCCL_SONAME))
                    .filter(|p| p.exists())
                    .map(|p| p.display().to_string()),
            )
            .collect(),
    };
    let mut tried = Vec::new();
    for name in candidates {
        let lib = match Library::open(&name) {
            Ok(lib) => lib,
            Err(e) => {
                tried.push(format!("{name}: {e}"));
                continue;
            }
        };
        let Some(get_version) = lib.symbol("ncclGetVersion") else {
            return NcclProbe::Unusable {
                path: name,
                reason: "it does not export ncclGetVersion: not an NCCL library".into(),
            };
        };
        // SAFETY: `ncclGetVersion(int*)` has this signature in every NCCL 2.x and only
        // writes the int; the symbol comes from a library that stays loaded (never closed).
        let get_version: unsafe extern "C" fn(*mut c_int) -> c_int =
            unsafe { std::mem::transmute::<*mut c_void, _>(get_version) };
        let mut code: c_int = 0;
        // SAFETY: see above; `code` outlives the call.
        let rc = unsafe { get_version(&mut code) };
        if rc != 0 {
            return NcclProbe::Unusable {
                path: name,
                reason: format!("ncclGetVersion failed with ncclResult {rc}"),
            };
        }
        let version = decode_nccl_version(code);
        if version < MIN_NCCL {
            return NcclProbe::Unusable {
                path: name,
                reason: format!(
                    "NCCL {}.{}.{} is older than the {}.{}.{} ferrovod needs",
                    version.0, version.1, version.2, MIN_NCCL.0, MIN_NCCL.1, MIN_NCCL.2
                ),
            };
        }
        lib.keep();
        return NcclProbe::Found(Nccl {
            path: name,
            version,
            code,
        });
    }
    if explicit.is_some() {
        let reason = tried.pop().unwrap_or_default();
        return NcclProbe::Unusable {
            path: explicit.unwrap_or_default().to_string(),
            reason: format!("FERROVOD_NCCL_LIBRARY cannot be loaded ({reason})"),
        };
    }
    NcclProbe::Absent { tried }
}

/// Looks for the CUDA driver and asks it how many GPUs it sees.
pub fn probe_cuda() -> CudaProbe {
    let lib = match Library::open(CUDA_SONAME) {
        Ok(lib) => lib,
        Err(detail) => return CudaProbe::Absent { detail },
    };
    let (Some(init), Some(driver_version), Some(count)) = (
        lib.symbol("cuInit"),
        lib.symbol("cuDriverGetVersion"),
        lib.symbol("cuDeviceGetCount"),
    ) else {
        return CudaProbe::Unusable {
            reason: format!("{CUDA_SONAME} lacks cuInit, cuDriverGetVersion or cuDeviceGetCount"),
        };
    };
    // SAFETY: the CUDA driver API's C signatures: `CUresult cuInit(unsigned)`,
    // `CUresult cuDriverGetVersion(int*)`, `CUresult cuDeviceGetCount(int*)`; each only
    // writes through its pointer, and the library stays loaded.
    let (init, driver_version, count) = unsafe {
        (
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn(u32) -> c_int>(init),
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut c_int) -> c_int>(
                driver_version,
            ),
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut c_int) -> c_int>(count),
        )
    };
    let mut version: c_int = 0;
    let mut devices: c_int = 0;
    // SAFETY: see above; the out-params outlive the calls.
    let rc = unsafe { init(0) };
    if rc != 0 {
        lib.keep();
        return CudaProbe::Unusable {
            reason: format!(
                "cuInit failed with CUresult {rc} ({})",
                cuda_result_name(rc)
            ),
        };
    }
    // SAFETY: as above.
    let mut rc = unsafe { driver_version(&mut version) };
    if rc == 0 {
        // SAFETY: as above.
        rc = unsafe { count(&mut devices) };
    }
    lib.keep();
    if rc != 0 {
        return CudaProbe::Unusable {
            reason: format!(
                "the CUDA driver failed with CUresult {rc} ({})",
                cuda_result_name(rc)
            ),
        };
    }
    CudaProbe::Ready {
        driver_version: version,
        devices,
    }
}

/// The few `CUresult` codes a probe meets, named.
fn cuda_result_name(rc: c_int) -> &'static str {
    match rc {
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        34 => "CUDA_ERROR_STUB_LIBRARY: a stub libcuda, no real driver",
        35 => "CUDA_ERROR_INSUFFICIENT_DRIVER",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => "see cuda.h",
    }
}

/// A `dlopen` handle. Closed on drop unless [`Library::keep`] was called. The device backend
/// (`crate::backend`) opens the libraries the probe accepted through it too.
pub(crate) struct Library {
    handle: *mut c_void,
}

impl Library {
    pub(crate) fn open(name: &str) -> Result<Library, String> {
        let c = CString::new(name).map_err(|_| "the name contains a NUL byte".to_string())?;
        // SAFETY: `c` is a valid C string for the call; RTLD_LOCAL keeps the library's
        // symbols out of the global namespace, so probing cannot change symbol resolution
        // for anything else in the process.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(dl_error());
        }
        Ok(Library { handle })
    }

    pub(crate) fn symbol(&self, name: &str) -> Option<*mut c_void> {
        let c = CString::new(name).ok()?;
        // SAFETY: `handle` came from a successful dlopen and is still open.
        let sym = unsafe { libc::dlsym(self.handle, c.as_ptr()) };
        (!sym.is_null()).then_some(sym)
    }

    /// Leaves the library loaded for the life of the process.
    pub(crate) fn keep(self) {
        std::mem::forget(self);
    }
}

impl Drop for Library {
    fn drop(&mut self) {
        // SAFETY: `handle` came from a successful dlopen and is closed once. Only libraries
        // whose probe failed are closed, before any of their code ran beyond the version query.
        unsafe {
            libc::dlclose(self.handle);
        }
    }
}

/// `dlerror()`'s message (the loader's own words: "cannot open shared object file", …).
fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl* call on
    // this thread; it is copied at once.
    let msg: *const c_char = unsafe { libc::dlerror() };
    if msg.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-null, NUL-terminated (above).
        unsafe { CStr::from_ptr(msg) }
            .to_string_lossy()
            .into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_codes_of_both_eras_decode() {
        assert_eq!(decode_nccl_version(23007), (2, 30, 7));
        assert_eq!(decode_nccl_version(21803), (2, 18, 3));
        assert_eq!(decode_nccl_version(2708), (2, 7, 8));
        assert!(decode_nccl_version(2708) < MIN_NCCL);
        assert!(decode_nccl_version(21200) >= MIN_NCCL);
    }

    #[test]
    fn a_missing_explicit_library_is_unusable_not_a_crash() {
        match probe_nccl(Some("/nonexistent/libnccl.so.2"), &[]) {
            NcclProbe::Unusable { path, reason } => {
                assert_eq!(path, "/nonexistent/libnccl.so.2");
                assert!(reason.contains("FERROVOD_NCCL_LIBRARY"), "{reason}");
                assert!(reason.contains("No such file"), "{reason}");
            }
            other => panic!("expected Unusable, got {other:?}"),
        }
    }

    #[test]
    fn a_library_that_is_not_nccl_is_named() {
        // libm is on every glibc system and exports no NCCL symbols.
        match probe_nccl(Some("libm.so.6"), &[]) {
            NcclProbe::Unusable { path, reason } => {
                assert_eq!(path, "libm.so.6");
                assert!(reason.contains("not an NCCL library"), "{reason}");
            }
            other => panic!("expected Unusable, got {other:?}"),
        }
    }
}
