//! Plain value types shared by every layer: element types, reduction ops, op kinds.

use crate::error::{Error, Result};

/// Element type of a tensor. The discriminants are the wire and Python codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    /// `uint8`
    U8 = 0,
    /// `int8`
    I8 = 1,
    /// `int16`
    I16 = 2,
    /// `int32`
    I32 = 3,
    /// `int64`
    I64 = 4,
    /// `float16` (IEEE half)
    F16 = 5,
    /// `bfloat16`
    BF16 = 6,
    /// `float32`
    F32 = 7,
    /// `float64`
    F64 = 8,
    /// `bool`, one byte per element; not reducible.
    Bool = 9,
}

impl DType {
    /// Every dtype, in code order.
    pub const ALL: [DType; 10] = [
        DType::U8,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::Bool,
    ];

    /// The dtypes reductions accept (every one but `Bool`).
    pub const REDUCIBLE: [DType; 9] = [
        DType::U8,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 | DType::Bool => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// Decodes a wire/Python code.
    pub fn from_code(code: u8) -> Result<DType> {
        DType::ALL
            .get(code as usize)
            .copied()
            .ok_or_else(|| Error::Decode(format!("unknown dtype code {code}")))
    }

    /// The NumPy-style name (`float32`, `bfloat16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::Bool => "bool",
        }
    }

    /// True for the floating-point types.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }
}

/// Reduction operation. Codes match Horovod's (`Average=0, Sum=1, Adasum=2, Min=3, Max=4, Product=5`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    /// Sum, then divide by the number of ranks (folded into the post-scale factor).
    Average = 0,
    /// Elementwise sum.
    Sum = 1,
    /// Adaptive summation (not implemented; rejected at submission).
    Adasum = 2,
    /// Elementwise minimum.
    Min = 3,
    /// Elementwise maximum.
    Max = 4,
    /// Elementwise product.
    Product = 5,
}

impl ReduceOp {
    /// The elementwise ops ferrovod implements (every one but `Adasum`).
    pub const ELEMENTWISE: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Average,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Product,
    ];

    /// Decodes a wire/Python code.
    pub fn from_code(code: u8) -> Result<ReduceOp> {
        Ok(match code {
            0 => ReduceOp::Average,
            1 => ReduceOp::Sum,
            2 => ReduceOp::Adasum,
            3 => ReduceOp::Min,
            4 => ReduceOp::Max,
            5 => ReduceOp::Product,
            _ => return Err(Error::Decode(format!("unknown reduce op code {code}"))),
        })
    }

    /// Upper-case name used in messages (`SUM`, `AVERAGE`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Average => "AVERAGE",
            ReduceOp::Sum => "SUM",
            ReduceOp::Adasum => "ADASUM",
            ReduceOp::Min => "MIN",
            ReduceOp::Max => "MAX",
            ReduceOp::Product => "PRODUCT",
        }
    }
}

/// What a reduction computes: the elements' type, how they combine, and the factor the
/// result is multiplied by. One value travels through every reducing function, as Gloo's
/// options objects do, instead of three loose arguments that can be passed in the wrong order.
///
/// The host collectives reduce `Average` as `Sum` and expect its 1/n in `factor`, folded in
/// by the caller that knows the set's size ([`Reduction::over`]). The NCCL backend has an
/// average of its own: there `factor` is the caller's post-scale alone, and NCCL divides.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reduction {
    /// The elements' type.
    pub dtype: DType,
    /// How elements combine.
    pub op: ReduceOp,
    /// Every element of the result is multiplied by this (1.0: left as reduced).
    pub factor: f64,
}

impl Reduction {
    /// `op` over `dtype` elements, the result left as reduced.
    pub fn new(dtype: DType, op: ReduceOp) -> Reduction {
        Reduction {
            dtype,
            op,
            factor: 1.0,
        }
    }

    /// This reduction with its result multiplied by `factor` (instead of its own).
    pub fn scaled(self, factor: f64) -> Reduction {
        Reduction { factor, ..self }
    }

    /// `op` over `dtype` elements from `n` ranks, for the host collectives: the result
    /// multiplied by `postscale`, and by 1/n for `Average`.
    pub fn over(dtype: DType, op: ReduceOp, postscale: f64, n: usize) -> Reduction {
        let factor = if op == ReduceOp::Average {
            postscale / n as f64
        } else {
            postscale
        };
        Reduction { dtype, op, factor }
    }
}

/// The kind of collective a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum OpKind {
    /// Reduce across ranks, result everywhere.
    Allreduce = 0,
    /// Concatenate along the first dimension.
    Allgather = 1,
    /// Copy the root's tensor everywhere.
    Broadcast = 2,
    /// Scatter first-dimension slices to every rank.
    Alltoall = 3,
    /// Reduce, then give each rank one first-dimension slice.
    Reducescatter = 4,
    /// Wait until every rank arrives.
    Barrier = 5,
    /// This rank is out of data.
    Join = 6,
}

impl OpKind {
    /// Decodes a wire code.
    pub fn from_code(code: u8) -> Result<OpKind> {
        Ok(match code {
            0 => OpKind::Allreduce,
            1 => OpKind::Allgather,
            2 => OpKind::Broadcast,
            3 => OpKind::Alltoall,
            4 => OpKind::Reducescatter,
            5 => OpKind::Barrier,
            6 => OpKind::Join,
            _ => return Err(Error::Decode(format!("unknown op kind code {code}"))),
        })
    }

    /// Upper-case name used in messages, as Horovod prints it.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Allreduce => "ALLREDUCE",
            OpKind::Allgather => "ALLGATHER",
            OpKind::Broadcast => "BROADCAST",
            OpKind::Alltoall => "ALLTOALL",
            OpKind::Reducescatter => "REDUCESCATTER",
            OpKind::Barrier => "BARRIER",
            OpKind::Join => "JOIN",
        }
    }
}
