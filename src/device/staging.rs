//! Staged responses: a CUDA op of a set two of whose ranks share a GPU (which NCCL refuses,
//! unless every member sets `FERROVOD_NCCL_SHARED_GPU`) is copied into a page-locked bounce
//! buffer, run by the host collectives there, and copied back, each copy ordered on its
//! submitter's stream.

use std::time::Duration;

use super::{device_buf, Stager};
use crate::engine::{Entry, TensorBuf};
use crate::error::{Error, Result};
use crate::gpu::cuda::{Device, DeviceBuf, PinnedBuf, Stream};
use crate::types::OpKind;

/// A staged response in flight: every tensor's bytes in the set's bounce buffer, where the
/// host collectives work on them in place, and where each result goes back to.
pub(crate) struct Staging {
    /// Per tensor: the result's place in the set's bounce buffer (offset, bytes), the
    /// caller's device output, and the submitter's stream the copies are ordered on.
    results: Vec<(usize, usize, DeviceBuf, Stream)>,
}

impl Staging {
    /// Copies every tensor's input into the bounce buffer, each on its submitter's stream
    /// (after the work the submitter enqueued before the op), waits for the copies, and points
    /// the entry's buffers there. Input and result share the bytes where the result is no
    /// larger, so the host collectives run in place (a reducescatter's share lands in this
    /// rank's rows); an allgather's or alltoall's result gets room of its own after the input.
    pub(super) fn take(
        stager: &mut Stager,
        kind: OpKind,
        n: usize,
        me: usize,
        entries: &mut [Option<Entry>],
        timeout: Duration,
    ) -> Result<Staging> {
        let apart = matches!(kind, OpKind::Allgather | OpKind::Alltoall);
        let room = |t: &crate::engine::TensorSpec| {
            t.input.len()
                + if apart {
                    t.output.as_ref().map_or(0, TensorBuf::len)
                } else {
                    0
                }
        };
        let total: usize = entries
            .iter()
            .flatten()
            .flat_map(|e| e.spec.tensors.iter())
            .map(room)
            .sum();
        let bounce = grown(&mut stager.bounce, &stager.device, total)?.as_mut_slice();
        let mut results = Vec::new();
        let mut streams: Vec<Stream> = Vec::new();
        let mut at = 0;
        for e in entries.iter_mut().flatten() {
            for t in e.spec.tensors.iter_mut() {
                let (input, stream) = t.input.device_parts().expect("checked by device_of");
                let output = t.output.as_ref().map(device_buf).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "CUDA tensor '{}' needs its output allocated by the caller",
                        e.request.name
                    ))
                })?;
                let len = input.len();
                let step = room(t);
                let region = &mut bounce[at..at + step];
                stager
                    .device
                    .read_async(&input, &mut region[..len], stream)?;
                let share = match kind {
                    _ if apart => len,
                    OpKind::Reducescatter => {
                        let rows = t.meta.shape.first().copied().unwrap_or(1).max(1);
                        let row_bytes = len / rows;
                        let (first, _) = crate::collective::split_rows(rows, n, me);
                        first * row_bytes
                    }
                    _ => 0,
                };
                // SAFETY: the bounce buffer outlives the op (it is replaced only by the next
                // `take`, after this op completed) and only the engine touches it meanwhile.
                unsafe {
                    t.input = TensorBuf::borrowed(region.as_mut_ptr(), len);
                    // `share + output.len()` is at most `step` (the region's length).
                    t.output = Some(TensorBuf::borrowed(
                        region.as_mut_ptr().add(share),
                        output.len(),
                    ));
                }
                results.push((at + share, output.len(), output, stream));
                if !streams.contains(&stream) {
                    streams.push(stream);
                }
                at += step;
            }
        }
        for stream in streams {
            stager.device.wait_for(stream, timeout)?;
        }
        Ok(Staging { results })
    }

    /// Copies the results from the bounce buffer `take` laid out in `stager` into the callers'
    /// device memory, each on its submitter's stream, and waits until they are there.
    pub(super) fn give_back(self, stager: &Stager, timeout: Duration) -> Result<()> {
        let bounce = stager
            .bounce
            .as_ref()
            .ok_or_else(|| Error::Io("internal error: a staged op without its buffer".into()))?
            .as_slice();
        let mut streams: Vec<Stream> = Vec::new();
        for &(at, len, ref output, stream) in &self.results {
            stager
                .device
                .write_async(&bounce[at..at + len], output, stream)?;
            if !streams.contains(&stream) {
                streams.push(stream);
            }
        }
        for stream in streams {
            stager.device.wait_for(stream, timeout)?;
        }
        Ok(())
    }
}

/// `buf`, replaced by a larger one when it holds fewer than `bytes`: page-locked memory kept
/// across responses, since allocating and first touching fresh host memory for every op cost
/// more than the copies themselves.
pub(super) fn grown<'a>(
    buf: &'a mut Option<PinnedBuf>,
    device: &Device,
    bytes: usize,
) -> Result<&'a mut PinnedBuf> {
    if buf.as_ref().map_or(true, |b| b.len() < bytes) {
        *buf = None; // the old one is freed before the larger one is taken
        *buf = Some(device.pinned(bytes)?);
    }
    Ok(buf.as_mut().expect("allocated above"))
}
