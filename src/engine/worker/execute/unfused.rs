//! The collectives a response runs for one entry, never fused: allgather, broadcast, alltoall,
//! reducescatter. Apart from the fused allreduce because what they need is each op's own:
//! outputs sized by the negotiated response (every rank's rows, the split matrix), checked
//! when the caller gave them, else allocated, and the in-place form where the caller's
//! memory allows it.

use crate::collective::{self, reduce, split_rows};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::sys::copy::copy;
use crate::types::Reduction;

use crate::control::message::Item;
use crate::engine::entry::Entry;
use crate::engine::handle::Output;
use crate::engine::tensor::TensorBuf;

/// A caller's output of the wrong size is refused before any byte moves. The sizes follow
/// from the negotiated request, so every rank whose caller computed them the same way agrees.
fn check_output_len(name: &str, kind: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "{kind} '{name}': the output given holds {got} bytes, the result needs {want}"
    )))
}

/// An output that shares memory with its input anywhere but where the in-place form puts
/// it: the ring would read bytes it has already overwritten.
fn misplaced(name: &str, kind: &str) -> Error {
    Error::InvalidArgument(format!(
        "{kind} '{name}': the output overlaps the input other than as this rank's block of it"
    ))
}

pub(super) fn allgather(
    comm: &mut Communicator<'_>,
    item: &Item,
    entry: &mut Entry,
) -> Result<Output> {
    let me = comm.rank();
    let mut out = Output::default();
    for (t, spec) in entry.spec.tensors.iter_mut().enumerate() {
        let meta = &spec.meta;
        let row_bytes = meta.row_elems() * meta.dtype.size();
        let dims = &item.first_dims[t];
        let counts: Vec<usize> = dims.iter().map(|d| d * row_bytes).collect();
        if let Some(result) = spec.output.as_mut() {
            // The caller's memory for the whole result: in place when the input is already
            // this rank's block of it.
            let total: usize = counts.iter().sum();
            check_output_len(&entry.request.name, "allgather", result.len(), total)?;
            let own = counts[..me].iter().sum::<usize>();
            if result.contains_at(&spec.input, own) {
                collective::allgatherv_in_place(comm, result.as_mut_slice(), &counts)?;
            } else if result.overlaps(&spec.input) {
                return Err(misplaced(&entry.request.name, "allgather"));
            } else {
                collective::allgatherv(
                    comm,
                    spec.input.as_slice(),
                    result.as_mut_slice(),
                    &counts,
                )?;
            }
            continue;
        }
        let mut result = TensorBuf::engine(counts.iter().sum())?;
        collective::allgatherv(comm, spec.input.as_slice(), result.as_mut_slice(), &counts)?;
        let mut shape = meta.shape.clone();
        shape[0] = dims.iter().sum();
        out.tensors.push((result, shape));
    }
    Ok(out)
}

pub(super) fn broadcast(
    comm: &mut Communicator<'_>,
    members: &[usize],
    entry: &mut Entry,
) -> Result<()> {
    let root = members.binary_search(&entry.request.root).map_err(|_| {
        Error::InvalidArgument(format!("root {} is not in the set", entry.request.root))
    })?;
    for spec in entry.spec.tensors.iter_mut() {
        let out = spec
            .output
            .as_mut()
            .expect("broadcast outputs are preallocated");
        if !out.same_memory(&spec.input) && comm.rank() == root {
            copy(out.as_mut_slice(), spec.input.as_slice());
        }
        collective::broadcast(comm, out.as_mut_slice(), root)?;
    }
    Ok(())
}

pub(super) fn alltoall(
    comm: &mut Communicator<'_>,
    item: &Item,
    entry: &mut Entry,
) -> Result<Output> {
    let n = comm.size();
    let me = comm.rank();
    let spec = &entry.spec.tensors[0];
    let meta = &spec.meta;
    let row_bytes = meta.row_elems() * meta.dtype.size();
    let m = &item.split_matrix;
    let send: Vec<usize> = (0..n).map(|j| m[me * n + j] * row_bytes).collect();
    let recv_rows: Vec<usize> = (0..n).map(|j| m[j * n + me]).collect();
    let recv: Vec<usize> = recv_rows.iter().map(|r| r * row_bytes).collect();
    let mut shape = meta.shape.clone();
    shape[0] = recv_rows.iter().sum();
    let spec = &mut entry.spec.tensors[0];
    // The caller's memory for the result (a staged CUDA tensor's bounce room), else the
    // engine's, handed back.
    let mut owned = match &spec.output {
        Some(result) => {
            check_output_len(
                &entry.request.name,
                "alltoall",
                result.len(),
                recv.iter().sum(),
            )?;
            if result.overlaps(&spec.input) {
                return Err(misplaced(&entry.request.name, "alltoall"));
            }
            None
        }
        None => Some(TensorBuf::engine(recv.iter().sum())?),
    };
    let result = match owned.as_mut() {
        Some(buf) => buf,
        None => spec.output.as_mut().expect("checked above"),
    };
    collective::alltoallv(
        comm,
        spec.input.as_slice(),
        &send,
        result.as_mut_slice(),
        &recv,
    )?;
    let tensors = owned.map(|buf| vec![(buf, shape)]).unwrap_or_default();
    Ok(Output {
        tensors,
        received_splits: recv_rows,
        ..Output::default()
    })
}

pub(super) fn reducescatter(comm: &mut Communicator<'_>, entry: &mut Entry) -> Result<Output> {
    let n = comm.size();
    let me = comm.rank();
    let req = &entry.request;
    let pre = req.prescale;
    let mut out = Output::default();
    for spec in entry.spec.tensors.iter_mut() {
        let meta = &spec.meta;
        let rows = meta.shape[0];
        let row_bytes = meta.row_elems() * meta.dtype.size();
        let red = Reduction::over(meta.dtype, req.op, req.postscale, n);
        let counts: Vec<usize> = (0..n)
            .map(|r| split_rows(rows, n, r).1 * row_bytes)
            .collect();
        if let Some(result) = spec.output.as_ref() {
            check_output_len(&req.name, "reducescatter", result.len(), counts[me])?;
            let own = counts[..me].iter().sum::<usize>();
            if spec.input.contains_at(result, own) {
                // In place: the caller gave its tensor up, so the ring reduces in it (partial
                // sums are left in the other ranks' rows) and its share lands where it lies.
                let buf = spec.input.as_mut_slice();
                reduce::scale(meta.dtype, buf, pre)?;
                collective::reducescatter_in_place(comm, buf, &counts, red)?;
                continue;
            }
            if result.overlaps(&spec.input) {
                return Err(misplaced(&req.name, "reducescatter"));
            }
        }
        // The ring reads the caller's tensor in place; only a pre-scale needs a copy of it,
        // and only more than two ranks need room for partial sums in transit.
        let scaled = if pre == 1.0 {
            None
        } else {
            let mut b = TensorBuf::engine(spec.input.len())?;
            copy(b.as_mut_slice(), spec.input.as_slice());
            reduce::scale(meta.dtype, b.as_mut_slice(), pre)?;
            Some(b)
        };
        let input = scaled
            .as_ref()
            .map_or(spec.input.as_slice(), |b| b.as_slice());
        let mut scratch = TensorBuf::engine(if n > 2 { input.len() } else { 0 })?;
        let mut owned = None;
        let result = match spec.output.as_mut() {
            Some(caller) => caller,
            None => owned.insert(TensorBuf::engine(counts[me])?),
        };
        collective::reducescatter(
            comm,
            input,
            scratch.as_mut_slice(),
            &counts,
            red,
            result.as_mut_slice(),
        )?;
        let Some(result) = owned else {
            continue;
        };
        let mut shape = meta.shape.clone();
        shape[0] = counts[me] / row_bytes.max(1);
        if row_bytes == 0 {
            shape[0] = rows / n + usize::from(me < rows % n);
        }
        out.tensors.push((result, shape));
    }
    Ok(out)
}
