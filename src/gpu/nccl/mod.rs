//! The NCCL library itself: the functions resolved from the file the probe accepted, its
//! result codes, unique ids, its errors in ferrovod's terms, and (in `comm.rs`) [`RawComm`], a
//! communicator whose every call is a safe method. Everything `unsafe` about calling NCCL is
//! here; the NCCL backend (`crate::backend::nccl`) builds its communicator's life and
//! collectives on these.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::time::Duration;

use cudarc::nccl::sys as nc;

use super::loader::{self, Library, NcclProbe};
use super::symbols::c_text;
use crate::bootstrap::Store;
use crate::error::{Error, Result};

/// `ncclResult_t` values, read as plain integers: a Rust enum may only hold the values it
/// declares, and a newer NCCL may return one this build does not know.
pub(crate) const SUCCESS: c_int = 0;
pub(crate) const IN_PROGRESS: c_int = nc::ncclResult_t::ncclInProgress as c_int;
const INVALID_ARGUMENT: c_int = nc::ncclResult_t::ncclInvalidArgument as c_int;
const INVALID_USAGE: c_int = nc::ncclResult_t::ncclInvalidUsage as c_int;
const REMOTE_ERROR: c_int = nc::ncclResult_t::ncclRemoteError as c_int;
const NCCL_TIMEOUT: c_int = nc::ncclResult_t::ncclTimeout as c_int;
/// `NCCL_CONFIG_UNDEF_INT`: "use NCCL's default" for every int field of `ncclConfig_t`.
const UNDEF: c_int = c_int::MIN;

type Comm = nc::ncclComm_t;

/// The NCCL functions every use needs (present in every 2.x the probe accepts).
#[derive(Clone, Copy)]
struct CoreFns {
    get_version: unsafe extern "C" fn(*mut c_int) -> c_int,
    get_unique_id: unsafe extern "C" fn(*mut nc::ncclUniqueId) -> c_int,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    /// 2.13+.
    get_last_error: Option<unsafe extern "C" fn(Comm) -> *const c_char>,
}

/// The functions a communicator needs; `ncclCommInitRankConfig` and `ncclCommFinalize` make
/// this NCCL 2.14+.
#[derive(Clone, Copy)]
struct CommFns {
    init_rank_config: unsafe extern "C" fn(
        *mut Comm,
        c_int,
        nc::ncclUniqueId,
        c_int,
        *mut nc::ncclConfig_t,
    ) -> c_int,
    get_async_error: unsafe extern "C" fn(Comm, *mut c_int) -> c_int,
    finalize: unsafe extern "C" fn(Comm) -> c_int,
    destroy: unsafe extern "C" fn(Comm) -> c_int,
    abort: unsafe extern "C" fn(Comm) -> c_int,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_uint,
        c_uint,
        Comm,
        nc::cudaStream_t,
    ) -> c_int,
    all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_uint,
        Comm,
        nc::cudaStream_t,
    ) -> c_int,
    broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_uint,
        c_int,
        Comm,
        nc::cudaStream_t,
    ) -> c_int,
    reduce_scatter: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_uint,
        c_uint,
        Comm,
        nc::cudaStream_t,
    ) -> c_int,
    send:
        unsafe extern "C" fn(*const c_void, usize, c_uint, c_int, Comm, nc::cudaStream_t) -> c_int,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_uint, c_int, Comm, nc::cudaStream_t) -> c_int,
    group_start: unsafe extern "C" fn() -> c_int,
    group_end: unsafe extern "C" fn() -> c_int,
    red_op_create_pre_mul_sum:
        unsafe extern "C" fn(*mut c_uint, *mut c_void, c_uint, c_uint, Comm) -> c_int,
    red_op_destroy: unsafe extern "C" fn(c_uint, Comm) -> c_int,
}

/// An NCCL library the probe accepted, opened for use. Cheap to clone.
#[derive(Clone)]
pub struct Nccl {
    library: loader::Nccl,
    core: CoreFns,
    /// `Err` names what this NCCL lacks for communicators.
    comm: std::result::Result<CommFns, String>,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("library", &self.library)
            .finish()
    }
}

impl Nccl {
    /// Opens the library `probe` accepted. An absent or unusable library is an error that
    /// repeats what the probe found.
    pub fn open(probe: &NcclProbe) -> Result<Nccl> {
        let library = match probe {
            NcclProbe::Found(lib) => lib.clone(),
            NcclProbe::Unusable { path, reason } => {
                return Err(Error::InvalidArgument(format!(
                    "the NCCL backend cannot be used: {path} is not a usable NCCL ({reason})"
                )))
            }
            NcclProbe::Absent { tried } => {
                return Err(Error::InvalidArgument(format!(
                    "the NCCL backend cannot be used: no NCCL library was found (tried {}); \
                     install torch's nvidia-nccl wheel or set FERROVOD_NCCL_LIBRARY",
                    tried.join("; ")
                )))
            }
        };
        let path = &library.path;
        let lib = Library::open(path).map_err(|e| {
            Error::InvalidArgument(format!(
                "cannot load the NCCL the probe accepted ({path}): {e}"
            ))
        })?;
        let missing = |name: &str| {
            Error::InvalidArgument(format!("{path} does not export {name}: not a usable NCCL"))
        };
        let core = CoreFns {
            get_version: resolve!(lib, "ncclGetVersion").map_err(missing)?,
            get_unique_id: resolve!(lib, "ncclGetUniqueId").map_err(missing)?,
            get_error_string: resolve!(lib, "ncclGetErrorString").map_err(missing)?,
            get_last_error: resolve!(lib, "ncclGetLastError").ok(),
        };
        let mut code: c_int = 0;
        // SAFETY: `ncclGetVersion(int*)` only writes the int, which outlives the call.
        let rc = unsafe { (core.get_version)(&mut code) };
        if rc != SUCCESS || code != library.code {
            return Err(Error::InvalidArgument(format!(
                "{path} reports NCCL version code {code} (ncclResult {rc}), not the {} the \
                 probe accepted: another file was loaded under that name",
                library.code
            )));
        }
        let comm = comm_fns(&lib).map_err(|name| {
            let (a, b, c) = library.version;
            format!("NCCL {a}.{b}.{c} ({path}) lacks {name}: device communicators need NCCL 2.14 or newer")
        });
        // The resolved functions must stay valid: never close this handle.
        lib.keep();
        Ok(Nccl {
            library,
            core,
            comm,
        })
    }

    /// The NCCL this process's device path uses, opened once: the library
    /// `FERROVOD_NCCL_LIBRARY` names, else `libnccl.so.2` through the dynamic linker, else one
    /// in `extra_dirs` (the Python layer passes the `nvidia-nccl` wheel's). Only success is
    /// remembered, so a later call with better directories may still succeed.
    pub fn for_process(extra_dirs: &[std::path::PathBuf]) -> Result<Nccl> {
        static OPENED: std::sync::OnceLock<Nccl> = std::sync::OnceLock::new();
        if let Some(n) = OPENED.get() {
            return Ok(n.clone());
        }
        let explicit = crate::config::nccl_library();
        let nccl = Nccl::open(&loader::probe_nccl(explicit.as_deref(), extra_dirs))?;
        nccl.comm.clone().map_err(Error::InvalidArgument)?;
        Ok(OPENED.get_or_init(|| nccl).clone())
    }

    /// [`Nccl::for_process`] when CUDA tensors are to go to NCCL at all
    /// (`FERROVOD_NCCL_DISPATCH`), else the error that says it is off: the one place that
    /// decides, for the engine's route and for what `device_path` tells the adapters.
    pub fn dispatched(extra_dirs: &[std::path::PathBuf]) -> Result<Nccl> {
        if !crate::config::nccl_dispatch() {
            return Err(Error::InvalidArgument("FERROVOD_NCCL_DISPATCH is 0".into()));
        }
        Nccl::for_process(extra_dirs)
    }

    /// What the probe found: path and version.
    pub fn library(&self) -> &loader::Nccl {
        &self.library
    }

    /// A fresh unique id (`ncclGetUniqueId`). Needs no GPU; it opens the bootstrap listener
    /// the other ranks of the communicator will connect to.
    pub fn unique_id(&self) -> Result<UniqueId> {
        let mut id = nc::ncclUniqueId { internal: [0; 128] };
        // SAFETY: `ncclGetUniqueId` writes one `ncclUniqueId`, which outlives the call.
        let rc = unsafe { (self.core.get_unique_id)(&mut id) };
        if rc != SUCCESS {
            return Err(self.error(rc, "ncclGetUniqueId", None));
        }
        Ok(UniqueId(id.internal.map(|c| c as u8)))
    }

    /// Agrees on one unique id for a communicator: `rank` 0 (of the communicator's ranks)
    /// generates it and stores it under `key`; the others wait for it up to `timeout`. `key`
    /// must name this communicator alone (see [`unique_id_key`]).
    pub fn exchange_unique_id(
        &self,
        store: &dyn Store,
        key: &str,
        rank: usize,
        timeout: Duration,
    ) -> Result<UniqueId> {
        if rank == 0 {
            let id = self.unique_id()?;
            store.set(key, id.as_bytes())?;
            return Ok(id);
        }
        let bytes = store.get(key, timeout)?;
        UniqueId::from_bytes(&bytes)
            .map_err(|e| Error::Decode(format!("the NCCL unique id stored under {key:?}: {e}")))
    }

    /// NCCL's own words for `rc`, and its last error message (which may describe an earlier,
    /// asynchronous failure; `comm`'s where there is one).
    pub(crate) fn error(&self, rc: c_int, what: &str, comm: Option<&RawComm>) -> Error {
        let comm = comm.map_or(std::ptr::null_mut(), |c| c.comm);
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
        let text = unsafe { c_text((self.core.get_error_string)(rc)) };
        let last = match self.core.get_last_error {
            // SAFETY: ncclGetLastError accepts any communicator or NULL (it is unused) and
            // returns a NUL-terminated string owned by NCCL; it is copied at once.
            Some(f) => unsafe { c_text(f(comm)) },
            None => String::new(),
        };
        let mut msg = format!("NCCL {what} failed: {text} (ncclResult {rc})");
        if !last.is_empty() {
            msg.push_str(&format!(": {last}"));
        }
        match rc {
            INVALID_ARGUMENT | INVALID_USAGE => Error::InvalidArgument(msg),
            NCCL_TIMEOUT => Error::Timeout {
                what: msg,
                after: Duration::ZERO,
            },
            REMOTE_ERROR => Error::Io(format!("{msg} (a peer failed or its connection broke)")),
            _ => Error::Io(msg),
        }
    }
}

fn comm_fns(lib: &Library) -> std::result::Result<CommFns, &'static str> {
    Ok(CommFns {
        init_rank_config: resolve!(lib, "ncclCommInitRankConfig")?,
        get_async_error: resolve!(lib, "ncclCommGetAsyncError")?,
        finalize: resolve!(lib, "ncclCommFinalize")?,
        destroy: resolve!(lib, "ncclCommDestroy")?,
        abort: resolve!(lib, "ncclCommAbort")?,
        all_reduce: resolve!(lib, "ncclAllReduce")?,
        all_gather: resolve!(lib, "ncclAllGather")?,
        broadcast: resolve!(lib, "ncclBroadcast")?,
        reduce_scatter: resolve!(lib, "ncclReduceScatter")?,
        send: resolve!(lib, "ncclSend")?,
        recv: resolve!(lib, "ncclRecv")?,
        group_start: resolve!(lib, "ncclGroupStart")?,
        group_end: resolve!(lib, "ncclGroupEnd")?,
        red_op_create_pre_mul_sum: resolve!(lib, "ncclRedOpCreatePreMulSum")?,
        red_op_destroy: resolve!(lib, "ncclRedOpDestroy")?,
    })
}

/// The store key of one communicator's unique id: `generation` (the engine's `init()`
/// count), the process set, and `comm_index` (which communicator of that set, e.g. per
/// device or after a re-creation), so that two communicators never share an id.
pub fn unique_id_key(generation: u64, process_set: u32, comm_index: u32) -> String {
    format!("g{generation}/nccl/ps{process_set}/c{comm_index}/unique_id")
}

/// An `ncclUniqueId`: the 128 bytes every rank of a communicator must share.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId([u8; UniqueId::BYTES]);

impl UniqueId {
    /// Size of an `ncclUniqueId`.
    pub const BYTES: usize = 128;

    /// The raw bytes, as stored in the rendezvous store.
    pub fn as_bytes(&self) -> &[u8; UniqueId::BYTES] {
        &self.0
    }

    /// Reads an id back; any length but 128 is an error.
    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId> {
        let arr: [u8; UniqueId::BYTES] = bytes.try_into().map_err(|_| {
            Error::Decode(format!(
                "an NCCL unique id is {} bytes, got {}",
                UniqueId::BYTES,
                bytes.len()
            ))
        })?;
        Ok(UniqueId(arr))
    }

    fn to_sys(self) -> nc::ncclUniqueId {
        nc::ncclUniqueId {
            internal: self.0.map(|b| b as c_char),
        }
    }
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let head: String = self.0[..8].iter().map(|b| format!("{b:02x}")).collect();
        write!(f, "UniqueId({head}…)")
    }
}

impl Nccl {
    /// Joins the communicator `id` names as `rank` of `size` (`ncclCommInitRankConfig`,
    /// non-blocking) on the device whose context is current. Returns the call's code
    /// (`SUCCESS`, or `IN_PROGRESS` while the communicator still forms: poll its async error)
    /// and the communicator; any other code is an error, the half-made communicator aborted.
    pub(crate) fn init_comm(
        &self,
        id: &UniqueId,
        rank: usize,
        size: usize,
    ) -> Result<(c_int, RawComm)> {
        let fns = self.comm.clone().map_err(Error::InvalidArgument)?;
        if size == 0 || rank >= size || size > c_int::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} of {size} is not a valid NCCL communicator rank"
            )));
        }
        let mut config = nc::ncclConfig_t {
            size: std::mem::size_of::<nc::ncclConfig_t>(),
            magic: 0xcafe_beef,
            // A 2.30 config (these are the 2.30 headers); an older NCCL reads the prefix it
            // knows (it copies min(size, its sizeof)).
            version: 23000,
            blocking: 0,
            cgaClusterSize: UNDEF,
            minCTAs: UNDEF,
            maxCTAs: UNDEF,
            netName: std::ptr::null(),
            splitShare: UNDEF,
            trafficClass: UNDEF,
            commName: std::ptr::null(),
            collnetEnable: UNDEF,
            CTAPolicy: UNDEF,
            shrinkShare: UNDEF,
            nvlsCTAs: UNDEF,
            nChannelsPerNetPeer: UNDEF,
            nvlinkCentricSched: UNDEF,
            graphUsageMode: UNDEF,
            numRmaCtx: UNDEF,
            maxP2pPeers: UNDEF,
        };
        let mut comm: Comm = std::ptr::null_mut();
        // SAFETY: `comm` and `config` outlive the call; the id is passed by value; the rank
        // and size were checked to fit a C int.
        let rc = unsafe {
            (fns.init_rank_config)(
                &mut comm,
                size as c_int,
                id.to_sys(),
                rank as c_int,
                &mut config,
            )
        };
        if rc != SUCCESS && rc != IN_PROGRESS {
            let made = (!comm.is_null()).then_some(RawComm { fns, comm });
            let e = self.error(rc, "ncclCommInitRankConfig", made.as_ref());
            if let Some(c) = made {
                c.abort();
            }
            return Err(e);
        }
        if comm.is_null() {
            return Err(Error::Io(
                "NCCL ncclCommInitRankConfig succeeded but returned no communicator".into(),
            ));
        }
        Ok((rc, RawComm { fns, comm }))
    }
}

mod comm;
pub use comm::RawComm;
