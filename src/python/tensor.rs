//! Raw tensor memory handed over by the Python layer (a NumPy array's data pointer, or a
//! DLPack tensor viewed through NumPy), turned into engine buffers without a copy.

use pyo3::prelude::*;

use crate::engine::{TensorBuf, TensorMeta, TensorSpec};
use crate::error::Error;
use crate::types::DType;

use super::errors::to_pyerr;

/// Builds a `TensorSpec` from `(ptr, nbytes, dtype code, shape, out_ptr)`; the output holds
/// `out_bytes` bytes (`None`: as many as the input).
pub fn spec_from_py(t: super::op::PyTensor, out_bytes: Option<usize>) -> PyResult<TensorSpec> {
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
        // SAFETY: as above; the output array holds `out_bytes` bytes (the input's size
        // unless the caller said otherwise).
        Some(unsafe { TensorBuf::borrowed(out_ptr as *mut u8, out_bytes.unwrap_or(nbytes)) })
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
    t: super::op::PyTensor,
    device: u32,
    stream: usize,
    out_bytes: usize,
) -> PyResult<TensorSpec> {
    let (ptr, nbytes, dtype, shape, out_ptr) = t;
    let mut spec = spec_from_py((0, nbytes, dtype, shape, 0), None)?;
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

/// Reads `obj`'s `PyArrayInterface` through `__array_struct__` (a capsule, ~0.2 µs, where
/// `__array_interface__` builds a dict per call, 3-4 µs) and hands it to `f`. `None` for an
/// object without a valid one.
fn with_interface<R>(obj: &Bound<'_, PyAny>, f: impl FnOnce(&ArrayInterface) -> R) -> Option<R> {
    use pyo3::types::PyCapsule;
    let attr = obj
        .getattr(pyo3::intern!(obj.py(), "__array_struct__"))
        .ok()?;
    let capsule = attr.cast::<PyCapsule>().ok()?;
    // NumPy names this capsule NULL.
    let ptr = capsule.pointer_checked(None).ok()?;
    let ptr = ptr.as_ptr() as *const ArrayInterface;
    // SAFETY: NumPy's capsule points at a `PyArrayInterface` that lives as long as the capsule,
    // which `capsule` keeps alive while `f` runs; `two == 2` is the struct's own sanity check,
    // tested before any other field is trusted.
    let iface = unsafe { &*ptr };
    (iface.two == 2).then(|| f(iface))
}

/// The data address of a NumPy array, or `None` for an object without a valid
/// `__array_struct__`; the caller then falls back to `__array_interface__`.
pub fn array_address(obj: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
    Ok(with_interface(obj, |i| i.data as usize))
}

// Flags of `PyArrayInterface` (numpy/ndarraytypes.h).
const C_CONTIGUOUS: libc::c_int = 0x0001;
const NOTSWAPPED: libc::c_int = 0x0200;
const WRITEABLE: libc::c_int = 0x0400;

/// A NumPy array as one engine tensor `(address, byte length, dtype, shape)`, read from
/// `__array_struct__` alone: for a C-contiguous array in native byte order of a dtype its
/// kind and size name unambiguously, writable when `writable`. `None` for anything else
/// (bfloat16 has no kind of its own, for one): the caller describes those the slow way, with
/// its own errors.
pub fn describe_array(
    obj: &Bound<'_, PyAny>,
    writable: bool,
) -> Option<(usize, usize, DType, Vec<usize>)> {
    with_interface(obj, |i| {
        let need = C_CONTIGUOUS | NOTSWAPPED | if writable { WRITEABLE } else { 0 };
        if i.flags & need != need || i.nd < 0 {
            return None;
        }
        let dtype = match (i.typekind as u8, i.itemsize) {
            (b'f', 2) => DType::F16,
            (b'f', 4) => DType::F32,
            (b'f', 8) => DType::F64,
            (b'i', 1) => DType::I8,
            (b'i', 2) => DType::I16,
            (b'i', 4) => DType::I32,
            (b'i', 8) => DType::I64,
            (b'u', 1) => DType::U8,
            (b'b', 1) => DType::Bool,
            _ => return None,
        };
        let shape: Vec<usize> = if i.nd == 0 {
            Vec::new()
        } else {
            // SAFETY: NumPy's interface holds `nd` dimensions at `shape` (non-negative), valid
            // while the capsule lives.
            unsafe { std::slice::from_raw_parts(i.shape, i.nd as usize) }
                .iter()
                .map(|&d| usize::try_from(d).ok())
                .collect::<Option<_>>()?
        };
        let nbytes = shape.iter().product::<usize>() * dtype.size();
        Some((i.data as usize, nbytes, dtype, shape))
    })
    .flatten()
}
