//! Collective algorithms over a [`Communicator`]. Buffers are raw bytes of whole elements;
//! ranks and roots are *set* ranks. (Stubs: being implemented.)

pub mod reduce;

use crate::comm::Communicator;
use crate::error::Result;
use crate::types::{DType, ReduceOp};

/// In-place allreduce of `buf`. `op` is Sum/Min/Max/Product (`Average` reduces as Sum; the
/// engine applies scale factors). Every rank ends with bitwise-identical results.
pub fn allreduce(comm: &mut Communicator<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let _ = (comm, buf, dtype, op);
    todo!()
}

/// Gathers every rank's `input` into `output`, concatenated in rank order; `byte_counts[r]` is
/// rank r's input length (`byte_counts[comm.rank()] == input.len()`, `output.len()` = sum).
pub fn allgatherv(comm: &mut Communicator<'_>, input: &[u8], output: &mut [u8], byte_counts: &[usize]) -> Result<()> {
    let _ = (comm, input, output, byte_counts);
    todo!()
}

/// Copies `root`'s `buf` into every rank's `buf` (same length everywhere).
pub fn broadcast(comm: &mut Communicator<'_>, buf: &mut [u8], root: usize) -> Result<()> {
    let _ = (comm, buf, root);
    todo!()
}

/// Sends `input[displ(send_counts, r)..][..send_counts[r]]` to rank r and receives rank r's
/// part into `output` at offset `displ(recv_counts, r)` (displacements are prefix sums).
pub fn alltoallv(comm: &mut Communicator<'_>, input: &[u8], send_counts: &[usize], output: &mut [u8], recv_counts: &[usize]) -> Result<()> {
    let _ = (comm, input, send_counts, output, recv_counts);
    todo!()
}

/// Reduces `buf` (the full tensor, used as scratch) across ranks and writes this rank's segment
/// into `output`. Segment r has `byte_counts[r]` bytes, segments laid out in rank order.
pub fn reducescatter(comm: &mut Communicator<'_>, buf: &mut [u8], byte_counts: &[usize], dtype: DType, op: ReduceOp, output: &mut [u8]) -> Result<()> {
    let _ = (comm, buf, byte_counts, dtype, op, output);
    todo!()
}

/// Returns once every rank of the set has entered.
pub fn barrier(comm: &mut Communicator<'_>) -> Result<()> {
    let _ = comm;
    todo!()
}
