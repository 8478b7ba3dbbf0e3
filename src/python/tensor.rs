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
