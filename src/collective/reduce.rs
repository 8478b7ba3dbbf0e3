//! Elementwise reduction and scaling kernels per dtype. (Stub: being implemented.)

use crate::error::Result;
use crate::types::{DType, ReduceOp};

/// `acc[i] = op(acc[i], src[i])` for every element. `Average` reduces as `Sum` (the caller
/// scales). `Bool` and `Adasum` are errors. Both slices hold whole elements of `dtype`, have
/// equal length, and may be unaligned.
pub fn reduce_into(dtype: DType, op: ReduceOp, acc: &mut [u8], src: &[u8]) -> Result<()> {
    let _ = (dtype, op, acc, src);
    todo!()
}

/// Multiplies every element by `factor` in place (floats in their own precision, f16/bf16
/// through f32, integers through f64 and truncated toward zero). No-op when `factor == 1.0`.
pub fn scale(dtype: DType, buf: &mut [u8], factor: f64) -> Result<()> {
    let _ = (dtype, buf, factor);
    todo!()
}
