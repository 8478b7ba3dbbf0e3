//! Raw tensor memory handed over by the Python layer (a NumPy array's data pointer, or a
//! DLPack tensor viewed through NumPy), turned into engine buffers without a copy.

use pyo3::prelude::*;

use crate::engine::{TensorBuf, TensorMeta, TensorSpec};
use crate::error::Error;
use crate::types::DType;

use super::errors::to_pyerr;

/// Builds a `TensorSpec` from `(ptr, nbytes, dtype code, shape, out_ptr)`.
pub fn spec_from_py(t: super::PyTensor) -> PyResult<TensorSpec> {
    let (ptr, nbytes, dtype, shape, out_ptr) = t;
    let dtype = DType::from_code(dtype).map_err(to_pyerr)?;
    let meta = TensorMeta { dtype, shape };
    if meta.nbytes() != nbytes {
        return Err(to_pyerr(Error::InvalidArgument(format!(
            "tensor of shape {:?} and dtype {} needs {} bytes, got {nbytes}",
            meta.shape,
            dtype.name(),
            meta.nbytes()
        ))));
    }
    // SAFETY: the Python layer (ferrovod/_api.py) passes pointers to C-contiguous arrays of
    // exactly `nbytes` bytes that it keeps referenced in its handle table until `synchronize`
    // returns, and never exposes output arrays before then — the contract of
    // `TensorBuf::borrowed`.
    let input = unsafe { TensorBuf::borrowed(ptr as *mut u8, nbytes) };
    let output = if out_ptr == 0 {
        None
    } else {
        // SAFETY: as above; the output array has the same size as the input.
        Some(unsafe { TensorBuf::borrowed(out_ptr as *mut u8, nbytes) })
    };
    Ok(TensorSpec {
        meta,
        input,
        output,
    })
}

/// Builds a `TensorSpec` of CUDA memory from `(ptr, nbytes, dtype code, shape, out_ptr)` on
/// device `device`, ordered after `stream`; the output holds `out_bytes` bytes.
pub fn device_spec_from_py(
    t: super::PyTensor,
    device: u32,
    stream: usize,
    out_bytes: usize,
) -> PyResult<TensorSpec> {
    let (ptr, nbytes, dtype, shape, out_ptr) = t;
    let mut spec = spec_from_py((0, nbytes, dtype, shape, 0))?;
    // SAFETY: the torch adapter (ferrovod/torch/ops.py) passes the data pointers of
    // contiguous tensors on CUDA device `device` holding `nbytes` (output: `out_bytes`) bytes,
    // and that device's current stream, and keeps the tensors referenced in its handle table
    // until `synchronize` returns, never exposing the outputs before — the contract of
    // `TensorBuf::device`.
    spec.input = unsafe { TensorBuf::device(ptr, nbytes, device, stream) };
    if out_ptr != 0 {
        // SAFETY: as above, for the output tensor.
        spec.output = Some(unsafe { TensorBuf::device(out_ptr, out_bytes, device, stream) });
    }
    Ok(spec)
}

/// NumPy's `PyArrayInterface` (numpy/ndarraytypes.h), what `__array_struct__` points to.
#[repr(C)]
struct ArrayInterface {
    two: libc::c_int,
    nd: libc::c_int,
    typekind: libc::c_char,
    itemsize: libc::c_int,
    flags: libc::c_int,
    shape: *const isize,
    strides: *const isize,
    data: *mut libc::c_void,
    descr: *mut libc::c_void,
}

/// The data address of a NumPy array, read through `__array_struct__` (a capsule, ~0.2 µs)
/// instead of `__array_interface__` (a dict built per call, 3-4 µs: two of them were a tenth of
/// a small allreduce). `None` for an object without a valid `__array_struct__`; the caller
/// then falls back to `__array_interface__`.
pub fn array_address(obj: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
    use pyo3::types::PyCapsule;
    let Ok(attr) = obj.getattr(pyo3::intern!(obj.py(), "__array_struct__")) else {
        return Ok(None);
    };
    let Ok(capsule) = attr.cast::<PyCapsule>() else {
        return Ok(None);
    };
    // NumPy names this capsule NULL.
    let Ok(ptr) = capsule.pointer_checked(None) else {
        return Ok(None);
    };
    let ptr = ptr.as_ptr() as *const ArrayInterface;
    // SAFETY: NumPy's capsule points at a `PyArrayInterface` that lives as long as the capsule,
    // which `capsule` keeps alive for this read; `two == 2` is the struct's own sanity check,
    // tested before any other field is trusted.
    let iface = unsafe { &*ptr };
    if iface.two != 2 {
        return Ok(None);
    }
    Ok(Some(iface.data as usize))
}
