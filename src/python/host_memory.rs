//! Host memory for Python (see `transport::host_memory`): segments every rank of a host maps,
//! which NumPy and torch view without a copy, and the reduce that reads them in place.

use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::errors::to_pyerr;
use super::op::{reduce_op, wait_interruptibly};
use super::with_engine;
use crate::error::Error;
use crate::transport::host_memory::{Exposed, HostMemory, Segment};
use crate::types::{DType, ReduceOp, Reduction};

/// This rank's new segment and the socket that hands it to the other ranks, until `share`.
#[pyclass(module = "ferrovod._core")]
struct HostExposed {
    inner: Option<Exposed>,
}

/// A new segment of `nbytes` zero bytes to share with the other ranks of this host, or `None`
/// when the running engine has shared memory off (`FERROVOD_SHM_DISABLE`).
#[pyfunction]
fn expose_host_memory(nbytes: usize) -> PyResult<Option<HostExposed>> {
    if super::shm_disabled()? {
        return Ok(None);
    }
    let inner = Exposed::new(nbytes).map_err(to_pyerr)?;
    Ok(Some(HostExposed { inner: Some(inner) }))
}

#[pymethods]
impl HostExposed {
    /// The bytes the other ranks need to map this segment (exchange them by an allgather).
    fn address<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let e = self.inner.as_ref().ok_or_else(shared_already)?;
        Ok(PyBytes::new(py, &e.address()))
    }

    /// Maps every reachable rank's segment (`addresses` in rank order, `rank` this one's),
    /// handing this one to every rank that asks; the GIL is released meanwhile. Every rank
    /// must call it (a collective). Once only.
    fn share(
        &mut self,
        py: Python<'_>,
        addresses: Vec<Vec<u8>>,
        rank: usize,
        timeout_s: f64,
    ) -> PyResult<PyHostMemory> {
        let e = self.inner.take().ok_or_else(shared_already)?;
        let timeout = Duration::from_secs_f64(timeout_s.max(0.0));
        let mem = py
            .detach(move || e.share(&addresses, rank, timeout))
            .map_err(to_pyerr)?;
        Ok(PyHostMemory {
            inner: Arc::new(mem),
        })
    }
}

fn shared_already() -> PyErr {
    to_pyerr(Error::InvalidArgument(
        "this host memory was shared already".into(),
    ))
}

/// The segments of the ranks of one host, this rank's among them.
#[pyclass(module = "ferrovod._core", name = "HostMemory")]
struct PyHostMemory {
    inner: Arc<HostMemory>,
}

#[pymethods]
impl PyHostMemory {
    /// Which ranks' segments are mapped here, in rank order.
    fn mapped(&self) -> Vec<bool> {
        self.inner.mapped()
    }

    /// Rank `rank`'s segment, for `numpy.asarray` (which keeps it mapped).
    fn segment(&self, rank: usize) -> PyResult<HostSegment> {
        self.inner
            .segment(rank)
            .map(|seg| HostSegment { seg })
            .ok_or_else(|| {
                to_pyerr(Error::InvalidArgument(format!(
                    "host memory: rank {rank}'s segment is not mapped here"
                )))
            })
    }

    /// The sharded update's reduction (the engine's `Door::reduce_shard_if_all_ready`): the
    /// ranks of process set `set_id` agree under `name` whether every one is `ready`, and if
    /// all are, bytes `shard = (offset, nbytes)` of every rank's segment are reduced into this
    /// rank's (`reduction = (dtype, op, postscale)`, the engine's codes; Average divides by the
    /// ranks). Returns the agreement; the GIL is released meanwhile. No rank may write its
    /// shard until the ranks meet again.
    fn reduce_shard_if_all_ready(
        &self,
        py: Python<'_>,
        name: &str,
        set_id: u32,
        ready: bool,
        shard: (usize, usize),
        reduction: (u8, u8, f64),
    ) -> PyResult<bool> {
        let (offset, nbytes) = shard;
        let (dtype, op) = codes(reduction.0, reduction.1)?;
        let red = Reduction::over(dtype, op, reduction.2, self.inner.mapped().len());
        let end = offset.checked_add(nbytes).ok_or_else(|| {
            to_pyerr(Error::InvalidArgument(format!(
                "host memory: {nbytes} bytes from {offset}"
            )))
        })?;
        let door = with_engine(|e| Ok(e.door()))?;
        let mem = &self.inner;
        wait_interruptibly(py, |stop| {
            door.reduce_shard_if_all_ready(mem, offset..end, red, ready, (set_id, name, stop))
        })
    }

    /// Reduces the first `nbytes` of every rank's segment (`dtype`, `op` as the engine's
    /// codes: Sum, or Average dividing by the ranks) times `postscale` into every rank's, the
    /// ranks of process set `set_id` meeting under `name` (see the engine's
    /// `Door::allreduce_in_host_memory`); the GIL is released meanwhile. A collective: every
    /// rank's bytes must be final when it calls.
    #[allow(clippy::too_many_arguments)] // the Python method's arguments, as it is called
    fn allreduce(
        &self,
        py: Python<'_>,
        name: &str,
        set_id: u32,
        nbytes: usize,
        dtype: u8,
        op: u8,
        postscale: f64,
    ) -> PyResult<()> {
        let (dtype, op) = codes(dtype, op)?;
        let red = Reduction::over(dtype, op, postscale, self.inner.mapped().len());
        let door = with_engine(|e| Ok(e.door()))?;
        let mem = &self.inner;
        wait_interruptibly(py, |stop| {
            door.allreduce_in_host_memory(mem, set_id, name, nbytes, red, stop)
        })
    }
}

/// A dtype and a reduction from their engine codes, or an error that names the bad one.
fn codes(dtype: u8, op: u8) -> PyResult<(DType, ReduceOp)> {
    Ok((DType::from_code(dtype).map_err(to_pyerr)?, reduce_op(op)?))
}

/// One rank's segment as NumPy sees it: `__array_interface__`, a writable 1-d uint8 view;
/// NumPy keeps this object, and so the mapping, alive as the array's base.
#[pyclass(module = "ferrovod._core")]
struct HostSegment {
    seg: Segment,
}

#[pymethods]
impl HostSegment {
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        super::op::array_interface(py, self.seg.as_ptr(), self.seg.len())
    }

    fn __len__(&self) -> usize {
        self.seg.len()
    }
}

/// Adds this module's classes and functions to `ferrovod._core`.
pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<HostExposed>()?;
    m.add_class::<PyHostMemory>()?;
    m.add_class::<HostSegment>()?;
    m.add_function(wrap_pyfunction!(expose_host_memory, m)?)?;
    Ok(())
}
