//! The CUDA driver, as the NCCL backend needs it: a device's primary context, events, and
//! the caller's streams and device buffers. Every function comes from the `libcuda.so.1` that
//! [`probe_cuda`] loaded and found working; nothing is called before it said so.

use std::ffi::{c_char, c_int, c_uint, c_void};

use cudarc::driver::sys as cu;
use cudarc::nccl::sys as nc;

use super::loader::{probe_cuda, CudaProbe, Library};
use super::symbols::c_text;
use crate::error::{Error, Result};

/// `CUDA_ERROR_NOT_READY`: an event or stream still has work pending.
const CUDA_NOT_READY: c_int = 600;

/// How long a wait for GPU work polls before it sleeps between polls: most collectives and
/// copies finish within it, and a sleep's wake-up costs more than they take (about 60 µs).
pub(crate) const SPIN: std::time::Duration = std::time::Duration::from_micros(500);

/// A CUDA stream handle (`CUstream` / `cudaStream_t`) given by the caller, e.g. the
/// framework's current stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stream(usize);

impl Stream {
    /// The legacy default stream (handle 0), valid in every context.
    pub const DEFAULT: Stream = Stream(0);

    /// Wraps a raw stream handle.
    ///
    /// # Safety
    /// `raw` is 0 or a live stream of the device the communicator uses, and stays alive while
    /// work enqueued on it through this backend is pending.
    pub unsafe fn from_raw(raw: usize) -> Stream {
        Stream(raw)
    }

    /// The raw handle.
    pub fn raw(self) -> usize {
        self.0
    }

    pub(super) fn nccl(self) -> nc::cudaStream_t {
        self.0 as nc::cudaStream_t
    }

    fn driver(self) -> cu::CUstream {
        self.0 as cu::CUstream
    }
}

/// A range of device memory given by the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceBuf {
    pub(super) ptr: usize,
    bytes: usize,
}

impl DeviceBuf {
    /// Wraps `bytes` bytes of device memory at `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr+bytes` is memory the communicator's device can access (device or managed
    /// memory), and nothing else writes it (nor reads it, where a collective writes it) until
    /// the work enqueued on it through this backend has completed on its stream.
    pub unsafe fn from_raw(ptr: usize, bytes: usize) -> DeviceBuf {
        DeviceBuf { ptr, bytes }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// True when the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The `bytes` bytes at `offset` (inside this buffer, whose contract they inherit).
    pub fn slice(&self, offset: usize, bytes: usize) -> Result<DeviceBuf> {
        match offset.checked_add(bytes) {
            Some(end) if end <= self.bytes => Ok(DeviceBuf {
                ptr: self.ptr + offset,
                bytes,
            }),
            _ => Err(Error::InvalidArgument(format!(
                "bytes {offset}..{offset}+{bytes} lie outside a device buffer of {} bytes",
                self.bytes
            ))),
        }
    }

    pub(crate) fn fits(&self, bytes: usize, what: &str) -> Result<()> {
        if bytes > self.bytes {
            return Err(Error::InvalidArgument(format!(
                "the {what} buffer holds {} bytes, the collective needs {bytes}",
                self.bytes
            )));
        }
        Ok(())
    }

    pub(super) fn src(&self) -> *const c_void {
        self.ptr as *const c_void
    }

    pub(super) fn dst(&self) -> *mut c_void {
        self.ptr as *mut c_void
    }
}

/// The CUDA driver functions the backend uses.
#[derive(Clone, Copy)]
struct CudaFns {
    device_get: unsafe extern "C" fn(*mut cu::CUdevice, c_int) -> c_int,
    primary_ctx_retain: unsafe extern "C" fn(*mut cu::CUcontext, cu::CUdevice) -> c_int,
    primary_ctx_release: unsafe extern "C" fn(cu::CUdevice) -> c_int,
    ctx_set_current: unsafe extern "C" fn(cu::CUcontext) -> c_int,
    event_create: unsafe extern "C" fn(*mut cu::CUevent, c_uint) -> c_int,
    event_record: unsafe extern "C" fn(cu::CUevent, cu::CUstream) -> c_int,
    event_query: unsafe extern "C" fn(cu::CUevent) -> c_int,
    event_destroy: unsafe extern "C" fn(cu::CUevent) -> c_int,
    stream_wait_event: unsafe extern "C" fn(cu::CUstream, cu::CUevent, c_uint) -> c_int,
    stream_create: unsafe extern "C" fn(*mut cu::CUstream, c_uint) -> c_int,
    stream_destroy: unsafe extern "C" fn(cu::CUstream) -> c_int,
    get_error_string: unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int,
    device_get_uuid: unsafe extern "C" fn(*mut [c_char; 16], cu::CUdevice) -> c_int,
    memcpy_dtoh: unsafe extern "C" fn(*mut c_void, cu::CUdeviceptr, usize, cu::CUstream) -> c_int,
    memcpy_htod: unsafe extern "C" fn(cu::CUdeviceptr, *const c_void, usize, cu::CUstream) -> c_int,
    memcpy_dtod:
        unsafe extern "C" fn(cu::CUdeviceptr, cu::CUdeviceptr, usize, cu::CUstream) -> c_int,
    mem_host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> c_int,
    mem_free_host: unsafe extern "C" fn(*mut c_void) -> c_int,
    mem_alloc: unsafe extern "C" fn(*mut cu::CUdeviceptr, usize) -> c_int,
    mem_free: unsafe extern "C" fn(cu::CUdeviceptr) -> c_int,
}

/// How many GPUs the CUDA driver sees, or (`InvalidArgument`, "CUDA cannot be used: …") why
/// it cannot be used: the probe's answer, asked before anything touches the driver.
pub fn cuda_ready() -> Result<usize> {
    match probe_cuda() {
        CudaProbe::Ready { devices, .. } => Ok(devices.max(0) as usize),
        CudaProbe::Unusable { reason } => Err(Error::InvalidArgument(format!(
            "CUDA cannot be used: {reason}"
        ))),
        CudaProbe::Absent { detail } => Err(Error::InvalidArgument(format!(
            "CUDA cannot be used: no CUDA driver ({detail})"
        ))),
    }
}

/// One device's primary context, retained for the life of the communicator (or of the
/// engine's staging of a process set's CUDA tensors).
pub struct Device {
    fns: CudaFns,
    pub(crate) ordinal: usize,
    device: cu::CUdevice,
    ctx: cu::CUcontext,
}

// SAFETY: a retained primary context and a device handle are valid in every thread of the
// process; every method makes the context current on the calling thread before using it.
unsafe impl Send for Device {}

impl Device {
    /// Checks with the probe that the driver works, then retains `ordinal`'s primary context.
    pub fn open(ordinal: usize) -> Result<Device> {
        let devices = cuda_ready()?;
        if ordinal >= devices {
            return Err(Error::InvalidArgument(format!(
                "CUDA device {ordinal} does not exist ({devices} visible)"
            )));
        }
        // The name the probe opened and kept: the same loaded object.
        let lib = Library::open("libcuda.so.1")
            .map_err(|e| Error::InvalidArgument(format!("CUDA cannot be used: {e}")))?;
        let missing = |name: &str| Error::InvalidArgument(format!("the CUDA driver lacks {name}"));
        let fns = CudaFns {
            device_get: resolve!(lib, "cuDeviceGet").map_err(missing)?,
            primary_ctx_retain: resolve!(lib, "cuDevicePrimaryCtxRetain").map_err(missing)?,
            primary_ctx_release: resolve!(lib, "cuDevicePrimaryCtxRelease_v2").map_err(missing)?,
            ctx_set_current: resolve!(lib, "cuCtxSetCurrent").map_err(missing)?,
            event_create: resolve!(lib, "cuEventCreate").map_err(missing)?,
            event_record: resolve!(lib, "cuEventRecord").map_err(missing)?,
            event_query: resolve!(lib, "cuEventQuery").map_err(missing)?,
            event_destroy: resolve!(lib, "cuEventDestroy_v2").map_err(missing)?,
            stream_wait_event: resolve!(lib, "cuStreamWaitEvent").map_err(missing)?,
            stream_create: resolve!(lib, "cuStreamCreate").map_err(missing)?,
            stream_destroy: resolve!(lib, "cuStreamDestroy_v2").map_err(missing)?,
            get_error_string: resolve!(lib, "cuGetErrorString").map_err(missing)?,
            device_get_uuid: resolve!(lib, "cuDeviceGetUuid_v2").map_err(missing)?,
            memcpy_dtoh: resolve!(lib, "cuMemcpyDtoHAsync_v2").map_err(missing)?,
            memcpy_htod: resolve!(lib, "cuMemcpyHtoDAsync_v2").map_err(missing)?,
            memcpy_dtod: resolve!(lib, "cuMemcpyDtoDAsync_v2").map_err(missing)?,
            mem_host_alloc: resolve!(lib, "cuMemHostAlloc").map_err(missing)?,
            mem_free_host: resolve!(lib, "cuMemFreeHost").map_err(missing)?,
            mem_alloc: resolve!(lib, "cuMemAlloc_v2").map_err(missing)?,
            mem_free: resolve!(lib, "cuMemFree_v2").map_err(missing)?,
        };
        // The resolved functions must stay valid: never close this handle.
        lib.keep();
        let mut device: cu::CUdevice = 0;
        // SAFETY: writes one CUdevice; the ordinal was checked against the device count.
        let rc = unsafe { (fns.device_get)(&mut device, ordinal as c_int) };
        check_cu(&fns, rc, "cuDeviceGet")?;
        let mut ctx: cu::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one CUcontext for a valid device; released in Drop.
        let rc = unsafe { (fns.primary_ctx_retain)(&mut ctx, device) };
        check_cu(&fns, rc, "cuDevicePrimaryCtxRetain")?;
        let d = Device {
            fns,
            ordinal,
            device,
            ctx,
        };
        d.make_current()?;
        Ok(d)
    }

    /// Makes this device's context current on the calling thread: NCCL reads the device from
    /// it at creation, and events are created in it.
    pub(crate) fn make_current(&self) -> Result<()> {
        // SAFETY: `ctx` is a retained primary context (released only in Drop).
        let rc = unsafe { (self.fns.ctx_set_current)(self.ctx) };
        check_cu(&self.fns, rc, "cuCtxSetCurrent")
    }
}

impl Device {
    /// Records an event on `stream` after the work enqueued so far.
    pub fn record(&self, stream: Stream) -> Result<Event> {
        self.make_current()?;
        let fns = self.fns;
        let mut event: cu::CUevent = std::ptr::null_mut();
        // SAFETY: writes one event handle; flag 2 = CU_EVENT_DISABLE_TIMING (cheapest).
        let rc = unsafe { (fns.event_create)(&mut event, 2) };
        check_cu(&fns, rc, "cuEventCreate")?;
        let event = Event { fns, event };
        // SAFETY: a live event and the caller's stream (Stream's contract).
        let rc = unsafe { (fns.event_record)(event.event, stream.driver()) };
        check_cu(&fns, rc, "cuEventRecord")?;
        Ok(event)
    }

    /// Makes `stream` wait on the device (the host does not block) for `event`.
    pub(crate) fn stream_wait(&self, stream: Stream, event: &Event) -> Result<()> {
        self.make_current()?;
        // SAFETY: a live event and the caller's stream.
        let rc = unsafe { (self.fns.stream_wait_event)(stream.driver(), event.event, 0) };
        check_cu(&self.fns, rc, "cuStreamWaitEvent")
    }
}

impl Device {
    /// The GPU's UUID: the same for every process that uses this physical GPU, whatever
    /// ordinal `CUDA_VISIBLE_DEVICES` gives it there.
    pub fn uuid(&self) -> Result<[u8; 16]> {
        let mut raw: [c_char; 16] = [0; 16];
        // SAFETY: writes the 16 bytes of one CUuuid for a device handle from cuDeviceGet.
        let rc = unsafe { (self.fns.device_get_uuid)(&mut raw, self.device) };
        check_cu(&self.fns, rc, "cuDeviceGetUuid")?;
        Ok(raw.map(|c| c as u8))
    }

    /// Waits on the host, up to `timeout`, until the work enqueued on `stream` so far is done.
    pub fn wait_for(&self, stream: Stream, timeout: std::time::Duration) -> Result<()> {
        let event = self.record(stream)?;
        let deadline = std::time::Instant::now() + timeout;
        let mut spin = crate::spin::Spin::new(SPIN);
        while !event.is_complete()? {
            if std::time::Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: format!("CUDA stream {:#x} to finish its work", stream.raw()),
                    after: timeout,
                });
            }
            if !spin.yield_core() {
                std::thread::sleep(std::time::Duration::from_micros(20));
            }
        }
        Ok(())
    }

    /// Enqueues on `stream` a copy of `dst.len()` bytes of `src` into pinned host memory at
    /// `dst`: it runs after the work enqueued on `stream` before it, and the bytes are there
    /// once [`Device::wait_for`] on `stream` returns.
    pub fn read_async(&self, src: &DeviceBuf, dst: &mut [u8], stream: Stream) -> Result<()> {
        src.fits(dst.len(), "source")?;
        if dst.is_empty() {
            return Ok(());
        }
        self.make_current()?;
        // SAFETY: `src` is device memory of at least `dst.len()` bytes (DeviceBuf's contract,
        // checked length); `dst` is host memory the caller keeps, untouched, until the copy is
        // waited for; `stream` is live (Stream's contract).
        let rc = unsafe {
            (self.fns.memcpy_dtoh)(
                dst.as_mut_ptr().cast(),
                src.ptr as cu::CUdeviceptr,
                dst.len(),
                stream.driver(),
            )
        };
        check_cu(&self.fns, rc, "cuMemcpyDtoHAsync")
    }

    /// Enqueues on `stream` a copy of `src` (pinned host memory) into `dst`, which must hold
    /// at least `src.len()` bytes; done once [`Device::wait_for`] on `stream` returns, and
    /// ordered before the work enqueued on `stream` after it.
    pub fn write_async(&self, src: &[u8], dst: &DeviceBuf, stream: Stream) -> Result<()> {
        dst.fits(src.len(), "destination")?;
        if src.is_empty() {
            return Ok(());
        }
        self.make_current()?;
        // SAFETY: `dst` is device memory of at least `src.len()` bytes (DeviceBuf's contract,
        // checked length) that nothing else touches until the op completes; `src` stays
        // untouched until the copy is waited for; `stream` is live.
        let rc = unsafe {
            (self.fns.memcpy_htod)(
                dst.ptr as cu::CUdeviceptr,
                src.as_ptr().cast(),
                src.len(),
                stream.driver(),
            )
        };
        check_cu(&self.fns, rc, "cuMemcpyHtoDAsync")
    }

    /// Enqueues on `stream` a copy of `src` into `dst` (device memory both, `dst` at least as
    /// long), ordered like the other work on `stream`.
    pub fn copy_async(&self, src: &DeviceBuf, dst: &DeviceBuf, stream: Stream) -> Result<()> {
        dst.fits(src.len(), "destination")?;
        if src.is_empty() {
            return Ok(());
        }
        self.make_current()?;
        // SAFETY: both are device memory of the checked lengths (DeviceBuf's contract), which
        // nothing else touches until the work on `stream` completes; `stream` is live.
        let rc = unsafe {
            (self.fns.memcpy_dtod)(
                dst.ptr as cu::CUdeviceptr,
                src.ptr as cu::CUdeviceptr,
                src.len(),
                stream.driver(),
            )
        };
        check_cu(&self.fns, rc, "cuMemcpyDtoDAsync")
    }

    /// `bytes` of page-locked host memory: copies between it and the device run at the
    /// link's speed and asynchronously, where pageable memory is staged by the driver.
    pub fn pinned(&self, bytes: usize) -> Result<PinnedBuf> {
        self.make_current()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer; flags 0 (memory of this context); freed in Drop.
        let rc = unsafe { (self.fns.mem_host_alloc)(&mut ptr, bytes.max(1), 0) };
        check_cu(&self.fns, rc, "cuMemHostAlloc")?;
        Ok(PinnedBuf {
            fns: self.fns,
            ptr: ptr.cast(),
            len: bytes,
        })
    }

    /// A stream of this device's context that does not synchronise with the legacy default
    /// stream (`CU_STREAM_NON_BLOCKING`): work on it is ordered only by the events it waits on.
    pub(crate) fn create_stream(&self) -> Result<OwnedStream> {
        self.make_current()?;
        let mut stream: cu::CUstream = std::ptr::null_mut();
        // SAFETY: writes one stream handle; flag 1 = CU_STREAM_NON_BLOCKING.
        let rc = unsafe { (self.fns.stream_create)(&mut stream, 1) };
        check_cu(&self.fns, rc, "cuStreamCreate")?;
        Ok(OwnedStream {
            fns: self.fns,
            stream,
        })
    }
}

impl Device {
    /// `bytes` of this device's memory, for the backend's own use (the fusion buffer).
    pub(crate) fn alloc(&self, bytes: usize) -> Result<DeviceMem> {
        self.make_current()?;
        let mut ptr: cu::CUdeviceptr = 0;
        // SAFETY: writes one device pointer; freed in DeviceMem's Drop.
        let rc = unsafe { (self.fns.mem_alloc)(&mut ptr, bytes.max(1)) };
        check_cu(&self.fns, rc, "cuMemAlloc")?;
        Ok(DeviceMem {
            fns: self.fns,
            ctx: self.ctx,
            ptr,
            len: bytes,
        })
    }
}

/// Device memory from [`Device::alloc`]; freed on drop, which must come before the
/// device's context is released (declare it before the [`Device`]).
pub(crate) struct DeviceMem {
    fns: CudaFns,
    ctx: cu::CUcontext,
    ptr: cu::CUdeviceptr,
    len: usize,
}

// SAFETY: device memory and the context handle it is freed under may be used from any
// thread; the allocation has one owner, and `DeviceMem` is not `Sync`.
unsafe impl Send for DeviceMem {}

impl DeviceMem {
    /// The whole allocation, for enqueueing work on it.
    pub(crate) fn buf(&self) -> DeviceBuf {
        DeviceBuf {
            ptr: self.ptr as usize,
            bytes: self.len,
        }
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        // SAFETY: the context is still retained (see the type's doc); the pointer came from
        // cuMemAlloc in it and is freed once. cuMemFree waits for work still using it.
        unsafe {
            (self.fns.ctx_set_current)(self.ctx);
            (self.fns.mem_free)(self.ptr);
        }
    }
}

/// Page-locked host memory from [`Device::pinned`]; freed on drop.
pub struct PinnedBuf {
    fns: CudaFns,
    ptr: *mut u8,
    len: usize,
}

impl PinnedBuf {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memory, to read on the host.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes allocated by cuMemHostAlloc, owned by this value.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The memory, to read and write on the host.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes allocated by cuMemHostAlloc, owned by this value.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

// SAFETY: plain host memory owned by this value; the driver lets any thread free it.
unsafe impl Send for PinnedBuf {}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        // SAFETY: memory from cuMemHostAlloc, freed once.
        unsafe { (self.fns.mem_free_host)(self.ptr.cast()) };
    }
}

/// A stream the backend created; destroyed on drop (CUDA releases it once its work is done).
pub(crate) struct OwnedStream {
    fns: CudaFns,
    stream: cu::CUstream,
}

// SAFETY: a CUDA stream handle may be used from any thread; it has one owner, and
// `OwnedStream` is not `Sync`.
unsafe impl Send for OwnedStream {}

impl OwnedStream {
    /// The handle, for enqueueing.
    pub(crate) fn handle(&self) -> Stream {
        Stream(self.stream as usize)
    }
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        // SAFETY: a stream created by cuStreamCreate, destroyed once; pending work finishes
        // first (the driver defers the release).
        unsafe { (self.fns.stream_destroy)(self.stream) };
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: releases the retain made in `open`, once.
        unsafe { (self.fns.primary_ctx_release)(self.device) };
    }
}

fn check_cu(fns: &CudaFns, rc: c_int, what: &str) -> Result<()> {
    if rc == 0 {
        return Ok(());
    }
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string (or leaves it NULL).
    unsafe { (fns.get_error_string)(rc, &mut text) };
    // SAFETY: NULL or a static NUL-terminated string.
    let text = unsafe { c_text(text) };
    Err(Error::Io(format!(
        "{what} failed with CUresult {rc}: {text}"
    )))
}

/// A CUDA event recorded on a stream; destroyed on drop.
pub struct Event {
    fns: CudaFns,
    event: cu::CUevent,
}

impl Event {
    /// True once the work enqueued before the event has completed. Never blocks.
    pub fn is_complete(&self) -> Result<bool> {
        // SAFETY: `event` is live (destroyed only in Drop).
        match unsafe { (self.fns.event_query)(self.event) } {
            0 => Ok(true),
            CUDA_NOT_READY => Ok(false),
            rc => check_cu(&self.fns, rc, "cuEventQuery").map(|_| false),
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: destroys the live event once; CUDA defers the release if work is pending.
        unsafe { (self.fns.event_destroy)(self.event) };
    }
}

// SAFETY: CUDA events may be queried and destroyed from any thread.
unsafe impl Send for Event {}
