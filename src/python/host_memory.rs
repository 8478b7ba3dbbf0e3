//! A training step's flat buffer for Python (the engine's `FlatStep`): memory the optimizer's
//! tensors view without a copy, and the calls that reduce it.

use std::ops::Range;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::to_pyerr;
use super::op::{reduce_op, wait_interruptibly};
use super::with_engine;
use crate::engine::{FlatSpec, FlatStep, Route};
use crate::error::Error;
use crate::transport::host_memory::Segment;
use crate::types::DType;

/// A step's flat buffer (the engine's `FlatStep`).
#[pyclass(module = "ferrovod._core", name = "FlatStep", frozen)]
struct PyFlatStep {
    inner: FlatStep,
}

/// The flat buffer of `count` elements of dtype code `dtype` for the ranks of process set
/// `set_id` (`rank` of `size`), named `name`, with the parameters of a sharded update when
/// `sharded`. A collective over the set unless `alone` (an elastic worker's, made while its
/// peers are busy), in which the ranks agree whether they share host memory; `None` on every
/// rank when some rank has no memory for it. The GIL is released meanwhile.
#[pyfunction]
#[pyo3(signature = (name, set_id, rank, size, count, dtype, sharded, alone=false))]
#[allow(clippy::too_many_arguments)] // the Python function's arguments, as it is called
fn flat_step(
    py: Python<'_>,
    name: String,
    set_id: u32,
    rank: usize,
    size: usize,
    count: usize,
    dtype: u8,
    sharded: bool,
    alone: bool,
) -> PyResult<Option<PyFlatStep>> {
    let dtype = DType::from_code(dtype).map_err(to_pyerr)?;
    let share = !super::shm_disabled()?;
    let spec = FlatSpec {
        set_id,
        rank,
        size,
        name,
        count,
        dtype,
        sharded,
        share,
        alone,
    };
    let door = with_engine(|e| Ok(e.door()))?;
    let step = wait_interruptibly(py, |stop| door.flat_step(spec, stop))?;
    Ok(step.map(|inner| PyFlatStep { inner }))
}

#[pymethods]
impl PyFlatStep {
    /// Whether the ranks reduce in the host memory they all map (else through the rings).
    #[getter]
    fn shared(&self) -> bool {
        self.inner.route() == Route::HostMemory
    }

    /// This rank's gradient buffer, for `numpy.asarray` (which keeps it mapped).
    fn grads(&self) -> HostSegment {
        let (seg, range) = self.inner.grads();
        HostSegment { seg, range }
    }

    /// The parameters a sharded update's model views (on host memory the one copy every rank
    /// views), for `numpy.asarray`.
    fn params(&self) -> PyResult<HostSegment> {
        let (seg, range) = self.inner.params().ok_or_else(|| {
            to_pyerr(Error::InvalidArgument(
                "this flat buffer holds no parameters (it was made without sharded)".into(),
            ))
        })?;
        Ok(HostSegment { seg, range })
    }

    /// This rank's shard of either buffer, as (first byte, bytes).
    fn shard(&self) -> (usize, usize) {
        let r = self.inner.shard();
        (r.start, r.len())
    }

    /// Whether every rank is `ready`; if all are, every rank's gradients, each times
    /// `prescale`, reduced with `op` (the engine's code: Sum, or Average over the ranks) times
    /// `postscale` into each rank's. Returns the agreement. A collective; the GIL is released
    /// meanwhile.
    fn allreduce(
        &self,
        py: Python<'_>,
        ready: bool,
        op: u8,
        prescale: f64,
        postscale: f64,
    ) -> PyResult<bool> {
        let op = reduce_op(op)?;
        let door = with_engine(|e| Ok(e.door()))?;
        wait_interruptibly(py, |stop| {
            self.inner
                .allreduce(&door, ready, op, (prescale, postscale), stop)
        })
    }

    /// As `allreduce`, but only this rank's shard of the gradients is reduced: the sharded
    /// update's reduction. No rank may write its gradients until `publish`.
    fn reduce_shard(
        &self,
        py: Python<'_>,
        ready: bool,
        op: u8,
        prescale: f64,
        postscale: f64,
    ) -> PyResult<bool> {
        let op = reduce_op(op)?;
        let door = with_engine(|e| Ok(e.door()))?;
        wait_interruptibly(py, |stop| {
            self.inner
                .reduce_shard(&door, ready, op, (prescale, postscale), stop)
        })
    }

    /// Makes every rank's writes to its shard of the parameters visible to every rank. A
    /// collective; the GIL is released meanwhile.
    fn publish(&self, py: Python<'_>) -> PyResult<()> {
        let door = with_engine(|e| Ok(e.door()))?;
        wait_interruptibly(py, |stop| self.inner.publish(&door, stop))
    }
}

/// Bytes of one rank's segment as NumPy sees them: `__array_interface__`, a writable 1-d uint8
/// view; NumPy keeps this object, and so the mapping, alive as the array's base.
#[pyclass(module = "ferrovod._core", frozen)]
struct HostSegment {
    seg: Segment,
    range: Range<usize>,
}

#[pymethods]
impl HostSegment {
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let start = self.seg.as_ptr().wrapping_add(self.range.start);
        super::op::array_interface(py, start, self.range.len())
    }

    fn __len__(&self) -> usize {
        self.range.len()
    }
}

/// Adds this module's classes and functions to `ferrovod._core`.
pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyFlatStep>()?;
    m.add_class::<HostSegment>()?;
    m.add_function(wrap_pyfunction!(flat_step, m)?)?;
    Ok(())
}
