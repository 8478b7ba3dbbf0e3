//! `TensorBuf`: memory an op reads or writes — either owned by the engine, or borrowed from
//! the caller (a NumPy array, a torch tensor) through a raw pointer, zero-copy, or the
//! caller's CUDA device memory, which only the NCCL backend touches.

use std::ops::Range;
use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::gpu::cuda::{DeviceBuf, Stream};
use crate::transport::host_memory::Segment;

use super::pool::{PageBuf, MIN_CLASS};

/// Bytes an op works on.
pub enum TensorBuf {
    /// Engine-owned memory.
    Owned(Vec<u8>),
    /// Engine-owned pages from the engine's buffer pool (large results; see [`PageBuf`]).
    Pages(PageBuf),
    /// Caller memory. See [`TensorBuf::borrowed`] for the contract.
    Borrowed {
        /// Start of the memory.
        ptr: NonNull<u8>,
        /// Length in bytes.
        len: usize,
    },
    /// Bytes of a host-memory segment: see [`TensorBuf::in_segment`].
    Segment {
        /// The segment, kept mapped while the buffer lives.
        seg: Segment,
        /// Offset of the first byte in the segment.
        at: usize,
        /// Length in bytes.
        len: usize,
    },
    /// Caller memory on a CUDA device. See [`TensorBuf::device`] for the contract; the host
    /// never reads or writes it.
    Device {
        /// Device address (0 only for an empty tensor).
        ptr: usize,
        /// Length in bytes.
        len: usize,
        /// CUDA device ordinal.
        device: u32,
        /// The raw stream (`CUstream`) the submitter's work on this memory was enqueued on:
        /// the collective runs after it.
        stream: usize,
    },
}

// SAFETY: a Borrowed buffer is plain memory that the submitter has handed over to the engine
// thread for the duration of the op (contract of `borrowed`); nothing else accesses it then.
unsafe impl Send for TensorBuf {}

impl TensorBuf {
    /// Wraps caller memory.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes until the op completes (its
    /// handle reports done), and nothing else may access the memory in that time. The Python
    /// layer guarantees this by keeping the array referenced in the handle and by not exposing
    /// the output before `synchronize` returns.
    pub unsafe fn borrowed(ptr: *mut u8, len: usize) -> TensorBuf {
        match NonNull::new(ptr) {
            Some(ptr) => TensorBuf::Borrowed { ptr, len },
            // A null pointer only comes with empty tensors; treat them as owned and empty.
            None => TensorBuf::Owned(Vec::new()),
        }
    }

    /// `range` of a host-memory segment (a [`FlatStep`](super::FlatStep)'s own), which the
    /// buffer keeps mapped however long the op holds it. `InvalidArgument` when the range is
    /// outside the segment. Which bytes are written by whom and when is the protocol of the
    /// segment's user, as for [`HostMemory::with_own`](crate::transport::HostMemory::with_own):
    /// here, that nothing else in this process touches them while the op runs.
    pub fn in_segment(seg: Segment, range: Range<usize>) -> Result<TensorBuf> {
        if range.start > range.end || range.end > seg.len() {
            return Err(Error::InvalidArgument(format!(
                "host memory: bytes {range:?} of a {}-byte segment",
                seg.len()
            )));
        }
        Ok(TensorBuf::Segment {
            seg,
            at: range.start,
            len: range.len(),
        })
    }

    /// Wraps caller memory on CUDA device `device`.
    ///
    /// # Safety
    /// `ptr..ptr+len` is memory of that device (or managed memory), `stream` is 0 or a live
    /// stream of that device, both stay valid until the op completes (its handle reports
    /// done), and nothing else writes the memory (or reads it, where the op writes it) in that
    /// time. The torch adapter keeps the tensors referenced in its handle table until
    /// `synchronize` returns.
    pub unsafe fn device(ptr: usize, len: usize, device: u32, stream: usize) -> TensorBuf {
        TensorBuf::Device {
            ptr,
            len,
            device,
            stream,
        }
    }

    /// The device memory and the submitter's stream of a CUDA buffer, as the GPU layer takes
    /// them; `None` for host memory.
    pub fn device_parts(&self) -> Option<(DeviceBuf, Stream)> {
        let TensorBuf::Device {
            ptr, len, stream, ..
        } = self
        else {
            return None;
        };
        // SAFETY: `TensorBuf::device`'s contract is `DeviceBuf::from_raw`'s and
        // `Stream::from_raw`'s: `len` bytes of the device's memory that nothing else touches
        // until the op completes, and a live stream of that device.
        let parts = unsafe { (DeviceBuf::from_raw(*ptr, *len), Stream::from_raw(*stream)) };
        Some(parts)
    }

    /// `(device ordinal, stream)` for CUDA memory, `None` for host memory.
    pub fn cuda(&self) -> Option<(u32, usize)> {
        match self {
            TensorBuf::Device { device, stream, .. } => Some((*device, *stream)),
            _ => None,
        }
    }

    /// Engine memory for a result of `len` bytes: on the C heap when small, from the page
    /// pool when large. Its bytes are unspecified: the caller overwrites all of them.
    pub fn engine(len: usize) -> Result<TensorBuf> {
        if len < MIN_CLASS {
            Ok(TensorBuf::Owned(vec![0; len]))
        } else {
            PageBuf::new(len).map(TensorBuf::Pages)
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            TensorBuf::Owned(v) => v.len(),
            TensorBuf::Pages(p) => p.len(),
            TensorBuf::Borrowed { len, .. }
            | TensorBuf::Segment { len, .. }
            | TensorBuf::Device { len, .. } => *len,
        }
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Read access. Host memory only: the engine routes device buffers to the NCCL backend
    /// and never asks for their bytes.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            TensorBuf::Device { .. } => no_host_view(),
            TensorBuf::Owned(v) => v,
            TensorBuf::Pages(p) => p.as_slice(),
            // SAFETY: `borrowed`'s contract: valid for `len` bytes, exclusively ours until done.
            TensorBuf::Borrowed { ptr, len } => unsafe {
                std::slice::from_raw_parts(ptr.as_ptr(), *len)
            },
            // SAFETY: `at..at + len` lies in the segment (checked by `in_segment`), which `seg`
            // keeps mapped; no other view in this process meanwhile (`in_segment`'s protocol).
            TensorBuf::Segment { seg, at, len } => unsafe {
                std::slice::from_raw_parts(seg.as_ptr().add(*at), *len)
            },
        }
    }

    /// Write access. Host memory only, as [`TensorBuf::as_slice`].
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            TensorBuf::Device { .. } => no_host_view(),
            TensorBuf::Owned(v) => v,
            TensorBuf::Pages(p) => p.as_mut_slice(),
            // SAFETY: as in `as_slice`; `&mut self` makes this the only live view.
            TensorBuf::Borrowed { ptr, len } => unsafe {
                std::slice::from_raw_parts_mut(ptr.as_ptr(), *len)
            },
            // SAFETY: as in `as_slice`; `&mut self` makes this the only live view.
            TensorBuf::Segment { seg, at, len } => unsafe {
                std::slice::from_raw_parts_mut(seg.as_ptr().add(*at), *len)
            },
        }
    }

    /// Where a buffer that may share bytes with another lies (first byte, length): memory
    /// borrowed from the caller or lent from a segment. Engine-owned memory is nobody else's.
    fn host_range(&self) -> Option<(usize, usize)> {
        match self {
            TensorBuf::Borrowed { ptr, len } => Some((ptr.as_ptr() as usize, *len)),
            TensorBuf::Segment { seg, at, len } => Some((seg.as_ptr() as usize + at, *len)),
            _ => None,
        }
    }

    /// Whether `inner` is host memory lying inside this buffer exactly `offset` bytes from its
    /// start (an in-place allgather's input, a reducescatter's share of its input).
    pub fn contains_at(&self, inner: &TensorBuf, offset: usize) -> bool {
        match (self.host_range(), inner.host_range()) {
            (Some((at, len)), Some((i, il))) => {
                at.checked_add(offset) == Some(i)
                    && offset.checked_add(il).is_some_and(|end| end <= len)
            }
            _ => false,
        }
    }

    /// Whether two host buffers share any byte.
    pub fn overlaps(&self, other: &TensorBuf) -> bool {
        match (self.host_range(), other.host_range()) {
            (Some((a, al)), Some((b, bl))) => al > 0 && bl > 0 && a < b + bl && b < a + al,
            _ => false,
        }
    }

    /// Whether two buffers are the same memory (an in-place op).
    pub fn same_memory(&self, other: &TensorBuf) -> bool {
        match (self, other) {
            (TensorBuf::Device { ptr: a, .. }, TensorBuf::Device { ptr: b, .. }) => a == b,
            _ => match (self.host_range(), other.host_range()) {
                (Some((a, _)), Some((b, _))) => a == b,
                _ => false,
            },
        }
    }
}

#[cold]
fn no_host_view() -> ! {
    panic!("internal error: the host asked for the bytes of CUDA device memory")
}
