//! The NCCL library itself: the functions resolved from the file the probe accepted, its
//! result codes, unique ids, its errors in ferrovod's terms, and [`RawComm`], a communicator
//! whose every call is a safe method. Everything `unsafe` about calling NCCL is here; the NCCL
//! backend (`crate::backend::nccl`) builds its communicator's life and collectives on these.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::time::Duration;

use cudarc::nccl::sys as nc;

use super::cuda::{DeviceBuf, Stream};
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

/// A communicator NCCL made (never NULL), with the functions that use it: every NCCL call a
/// communicator makes is a method here, safe because the handle is live for as long as this
/// value exists (`abort` and `destroy` consume it) and each method passes NCCL only memory it
/// has checked. The return codes are NCCL's, for the owner to settle (a non-blocking
/// communicator returns `IN_PROGRESS`).
pub struct RawComm {
    fns: CommFns,
    comm: Comm,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time; `RawComm` is not
// `Sync` (its pointer field is not), so one owner calls it at a time.
unsafe impl Send for RawComm {}

impl RawComm {
    /// `ncclCommGetAsyncError`: the call's code and the communicator's state.
    pub(crate) fn async_error(&self) -> (c_int, c_int) {
        let mut state: c_int = SUCCESS;
        // SAFETY: a live communicator; writes one int.
        let rc = unsafe { (self.fns.get_async_error)(self.comm, &mut state) };
        (rc, state)
    }

    /// `ncclGroupStart`: collectives enqueued until the matching [`RawComm::group_end`] launch
    /// together (on this thread: NCCL's group state is per thread).
    pub(crate) fn group_start(&self) -> c_int {
        // SAFETY: no arguments.
        unsafe { (self.fns.group_start)() }
    }

    /// `ncclGroupEnd`: closes the innermost group.
    pub(crate) fn group_end(&self) -> c_int {
        // SAFETY: no arguments; NCCL checks that a group is open.
        unsafe { (self.fns.group_end)() }
    }

    /// `ncclCommFinalize`: flushes pending work and waits (non-blocking: polled) for peers.
    pub(crate) fn finalize(&self) -> c_int {
        // SAFETY: a live communicator.
        unsafe { (self.fns.finalize)(self.comm) }
    }

    /// `ncclCommDestroy`: frees the communicator (after a clean finalize).
    pub(crate) fn destroy(self) -> c_int {
        // SAFETY: a live communicator, freed once: `self` is consumed.
        unsafe { (self.fns.destroy)(self.comm) }
    }

    /// `ncclCommAbort`: cancels pending work and frees the communicator.
    pub(crate) fn abort(self) -> c_int {
        // SAFETY: a live communicator, freed once: `self` is consumed.
        unsafe { (self.fns.abort)(self.comm) }
    }

    /// `ncclRedOpCreatePreMulSum`: a sum that first multiplies by `scalar` (the factor in
    /// `dtype`'s type, little-endian, read during the call). The code and the new operator.
    pub(crate) fn pre_mul_sum(&self, scalar: &mut [u8; 8], dtype: c_uint) -> (c_int, c_uint) {
        let mut op: c_uint = 0;
        // SAFETY: `scalar` holds eight bytes, enough for any dtype's factor, and is read during
        // the call (ncclScalarHostImmediate); `op` receives the new operator.
        let rc = unsafe {
            (self.fns.red_op_create_pre_mul_sum)(
                &mut op,
                scalar.as_mut_ptr().cast(),
                dtype,
                nc::ncclScalarResidence_t::ncclScalarHostImmediate as c_uint,
                self.comm,
            )
        };
        (rc, op)
    }

    /// `ncclRedOpDestroy` of an operator [`RawComm::pre_mul_sum`] made on this communicator.
    pub(crate) fn red_op_destroy(&self, op: c_uint) -> c_int {
        // SAFETY: a live communicator; NCCL checks that the operator is one of its own.
        unsafe { (self.fns.red_op_destroy)(op, self.comm) }
    }

    /// `ncclAllReduce` of `count` elements of `dtype` (`esize` bytes each) with operator `op`,
    /// `send` into `recv` (the same buffer for in place), on `stream`.
    #[allow(clippy::too_many_arguments)] // NCCL's arguments, each checked here
    pub(crate) fn all_reduce(
        &self,
        send: &DeviceBuf,
        recv: &DeviceBuf,
        (count, esize): (usize, usize),
        dtype: c_uint,
        op: c_uint,
        stream: Stream,
    ) -> Result<c_int> {
        let bytes = count.checked_mul(esize).ok_or_else(overflow)?;
        send.fits(bytes, "send")?;
        recv.fits(bytes, "receive")?;
        // SAFETY: both buffers hold `count` elements (checked; that the memory is the device's
        // is DeviceBuf's contract), the stream is Stream's contract, the communicator is live.
        Ok(unsafe {
            (self.fns.all_reduce)(
                send.src(),
                recv.dst(),
                count,
                dtype,
                op,
                self.comm,
                stream.nccl(),
            )
        })
    }

    /// `ncclAllGather` of `bytes` bytes from every one of `size` ranks, as bytes.
    pub(crate) fn all_gather(
        &self,
        send: &DeviceBuf,
        recv: &DeviceBuf,
        (bytes, size): (usize, usize),
        stream: Stream,
    ) -> Result<c_int> {
        send.fits(bytes, "send")?;
        recv.fits(bytes.checked_mul(size).ok_or_else(overflow)?, "receive")?;
        // SAFETY: as in all_reduce; moved as bytes (any dtype).
        Ok(unsafe {
            (self.fns.all_gather)(
                send.src(),
                recv.dst(),
                bytes,
                BYTE,
                self.comm,
                stream.nccl(),
            )
        })
    }

    /// `ncclBroadcast` of `bytes` bytes from `root` (whose `send` is read; `is_root`: this
    /// rank is the root) into every rank's `recv`.
    pub(crate) fn broadcast(
        &self,
        send: &DeviceBuf,
        recv: &DeviceBuf,
        bytes: usize,
        (root, is_root): (usize, bool),
        stream: Stream,
    ) -> Result<c_int> {
        if is_root {
            send.fits(bytes, "send")?;
        }
        recv.fits(bytes, "receive")?;
        let root = c_int::try_from(root).map_err(|_| overflow())?;
        // SAFETY: as in all_gather; `send` is read on the root only.
        Ok(unsafe {
            (self.fns.broadcast)(
                send.src(),
                recv.dst(),
                bytes,
                BYTE,
                root,
                self.comm,
                stream.nccl(),
            )
        })
    }

    /// `ncclReduceScatter`: `recv_count * size` elements of `send` reduced, block r to rank r's
    /// `recv` (`recv_count` elements of `esize` bytes).
    #[allow(clippy::too_many_arguments)] // NCCL's arguments, each checked here
    pub(crate) fn reduce_scatter(
        &self,
        send: &DeviceBuf,
        recv: &DeviceBuf,
        (recv_count, esize, size): (usize, usize, usize),
        dtype: c_uint,
        op: c_uint,
        stream: Stream,
    ) -> Result<c_int> {
        let bytes = recv_count.checked_mul(esize).ok_or_else(overflow)?;
        send.fits(bytes.checked_mul(size).ok_or_else(overflow)?, "send")?;
        recv.fits(bytes, "receive")?;
        // SAFETY: as in all_reduce.
        Ok(unsafe {
            (self.fns.reduce_scatter)(
                send.src(),
                recv.dst(),
                recv_count,
                dtype,
                op,
                self.comm,
                stream.nccl(),
            )
        })
    }

    /// `ncclSend` of all of `buf`, as bytes, to rank `peer` (inside a group).
    pub(crate) fn send(&self, buf: &DeviceBuf, peer: usize, stream: Stream) -> Result<c_int> {
        let peer = c_int::try_from(peer).map_err(|_| overflow())?;
        // SAFETY: the whole buffer, whose memory is DeviceBuf's contract; see all_reduce.
        Ok(unsafe { (self.fns.send)(buf.src(), buf.len(), BYTE, peer, self.comm, stream.nccl()) })
    }

    /// `ncclRecv` into all of `buf`, as bytes, from rank `peer` (inside a group).
    pub(crate) fn recv(&self, buf: &DeviceBuf, peer: usize, stream: Stream) -> Result<c_int> {
        let peer = c_int::try_from(peer).map_err(|_| overflow())?;
        // SAFETY: as in send.
        Ok(unsafe { (self.fns.recv)(buf.dst(), buf.len(), BYTE, peer, self.comm, stream.nccl()) })
    }
}

/// Data-movement collectives carry bytes: any dtype (bool and int16 included) moves as
/// `ncclUint8`.
const BYTE: c_uint = nc::ncclDataType_t::ncclUint8 as c_uint;

fn overflow() -> Error {
    Error::InvalidArgument("the collective's byte count overflows".into())
}
