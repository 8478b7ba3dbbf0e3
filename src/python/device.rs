//! The GPU side of the binding: what the engine does with CUDA tensors here, and what it was
//! built and found with. The engine exchanges NCCL ids itself; the tests' window onto that
//! exchange (`nccl_unique_id`) is built only with the `testing` feature, not into the wheel.

use pyo3::prelude::*;
#[cfg(feature = "testing")]
use pyo3::types::PyBytes;
use pyo3::types::PyDict;

use super::errors::to_pyerr;
use super::op;
use crate::error::Error;
use crate::types::OpKind;

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(device_path, m)?)?;
    m.add_function(wrap_pyfunction!(device_op_check, m)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_probe, m)?)?;
    #[cfg(feature = "testing")]
    m.add_function(wrap_pyfunction!(nccl_unique_id, m)?)?;
    Ok(())
}

/// Whether the engine hands CUDA tensors to the NCCL backend (allreduce, broadcast and
/// evenly split reducescatter; the torch adapter stages the rest, and everything where
/// [`device_path`] says no, through host memory). `build_info`'s `gpu_operations` and
/// `nccl_built()` follow it.
const DEVICE_DISPATCH: bool = true;

/// Whether the engine takes CUDA tensors in this process: `(True, what it runs them on)` —
/// NCCL (searched as `gpu_probe` does, with `extra_dirs`; the NCCL it opens is the one the
/// engine then uses), or, without NCCL or with `FERROVOD_NCCL_DISPATCH=0`, the engine's
/// staging through pinned host memory — or `(False, why not)`: no CUDA driver or GPU, so the
/// torch adapter stages them itself. Loads the libraries: ask only once a CUDA tensor is at
/// hand.
#[pyfunction]
fn device_path(py: Python<'_>, extra_dirs: Vec<String>) -> (bool, String) {
    if !DEVICE_DISPATCH {
        return (
            false,
            "this build does not dispatch CUDA tensors to NCCL".into(),
        );
    }
    let dirs: Vec<std::path::PathBuf> = extra_dirs.into_iter().map(Into::into).collect();
    let answer = py.detach(|| {
        let devices = crate::gpu::cuda::cuda_ready()?;
        let nccl = crate::backend::nccl::Nccl::dispatched(&dirs).map(|nccl| {
            let lib = nccl.library();
            let (a, b, c) = lib.version;
            format!("NCCL {a}.{b}.{c} ({})", lib.path)
        });
        Ok::<_, Error>(match nccl {
            Ok(what) => format!("{what} on {devices} CUDA device(s)"),
            Err(e) => format!(
                "{devices} CUDA device(s), no NCCL ({e}): the engine stages CUDA tensors \
                 through pinned host memory"
            ),
        })
    });
    match answer {
        Ok(what) => (true, what),
        Err(e) => (false, e.to_string()),
    }
}

/// Why the NCCL path cannot run this op on CUDA tensors as they are, or `None` when it can
/// (kind, dtype and reduce-op codes; `set_size`: ranks of the process set). The torch
/// adapter stages the op through host memory when it cannot.
#[pyfunction]
fn device_op_check(
    kind: u8,
    dtype: u8,
    op: u8,
    prescale: f64,
    postscale: f64,
    set_size: usize,
    shape: Vec<usize>,
) -> PyResult<Option<String>> {
    let kind = OpKind::from_code(kind).map_err(to_pyerr)?;
    let dtype = crate::types::DType::from_code(dtype).map_err(to_pyerr)?;
    let op = op::reduce_op(op)?;
    let red = crate::types::Reduction::new(dtype, op).scaled(postscale);
    Ok(
        crate::backend::nccl::check_device_op(kind, red, prescale, set_size, &shape)
            .err()
            .map(|e| e.to_string()),
    )
}

/// What this build contains. `nccl`: the NCCL backend is compiled in (every build); whether
/// it can be used on this machine is the run-time probe's answer (`gpu_probe`).
/// `device_dispatch`: whether the engine uses it for CUDA tensors ([`DEVICE_DISPATCH`]).
#[pyfunction]
fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("version", env!("CARGO_PKG_VERSION"))?;
    d.set_item("transports", vec!["tcp", "shm"])?;
    d.set_item("controllers", vec!["ferrovod"])?;
    d.set_item("cpu_operations", vec!["ferrovod"])?;
    let gpu_operations: &[&str] = if DEVICE_DISPATCH && crate::config::nccl_dispatch() {
        &["nccl"]
    } else {
        &[]
    };
    d.set_item("gpu_operations", gpu_operations)?;
    d.set_item("nccl", true)?;
    d.set_item(
        "device_dispatch",
        DEVICE_DISPATCH && crate::config::nccl_dispatch(),
    )?;
    d.set_item("cuda", false)?;
    d.set_item("mpi", false)?;
    d.set_item("gloo", false)?;
    Ok(d)
}

/// What the run-time search for NCCL and the CUDA driver found (`extra_dirs`: directories
/// that may hold `libnccl.so.2`, e.g. the `nvidia-nccl-*` wheel's). Never fails: a missing or
/// broken library is described, not raised.
#[pyfunction]
fn gpu_probe(py: Python<'_>, extra_dirs: Vec<String>) -> PyResult<Bound<'_, PyDict>> {
    use crate::gpu::loader::{probe_cuda, probe_nccl, CudaProbe, NcclProbe};
    let dirs: Vec<std::path::PathBuf> = extra_dirs.into_iter().map(Into::into).collect();
    let explicit = crate::config::nccl_library();
    let (nccl, cuda) = py.detach(|| (probe_nccl(explicit.as_deref(), &dirs), probe_cuda()));
    let d = PyDict::new(py);
    let n = PyDict::new(py);
    match nccl {
        NcclProbe::Found(lib) => {
            n.set_item("found", true)?;
            n.set_item("path", lib.path)?;
            let (a, b, c) = lib.version;
            n.set_item("version", format!("{a}.{b}.{c}"))?;
            n.set_item("code", lib.code)?;
        }
        NcclProbe::Unusable { path, reason } => {
            n.set_item("found", false)?;
            n.set_item("path", path)?;
            n.set_item("reason", reason)?;
        }
        NcclProbe::Absent { tried } => {
            n.set_item("found", false)?;
            n.set_item("reason", format!("not found (tried {})", tried.join("; ")))?;
        }
    }
    d.set_item("nccl", n)?;
    let c = PyDict::new(py);
    match cuda {
        CudaProbe::Ready {
            driver_version,
            devices,
        } => {
            c.set_item("found", true)?;
            c.set_item("driver_version", driver_version)?;
            c.set_item("devices", devices)?;
        }
        CudaProbe::Unusable { reason } => {
            c.set_item("found", false)?;
            c.set_item("reason", reason)?;
        }
        CudaProbe::Absent { detail } => {
            c.set_item("found", false)?;
            c.set_item("reason", format!("no CUDA driver ({detail})"))?;
        }
    }
    d.set_item("cuda", c)?;
    Ok(d)
}

/// Agrees on an NCCL unique id for a communicator of process set `process_set_id` through
/// the job's rendezvous store, as the engine does before creating one: the set's first rank
/// generates it (`ncclGetUniqueId`), the others fetch it. `comm_index` tells apart several
/// communicators of one set. Needs a usable NCCL (the probe's search, with `extra_dirs`), no
/// GPU. Returns the id's 128 bytes. For tests: not in the wheel (the `testing` feature).
#[cfg(feature = "testing")]
#[pyfunction]
#[pyo3(signature = (extra_dirs, process_set_id=0, comm_index=0))]
fn nccl_unique_id(
    py: Python<'_>,
    extra_dirs: Vec<String>,
    process_set_id: u32,
    comm_index: u32,
) -> PyResult<Bound<'_, PyBytes>> {
    use super::with_slot;
    use crate::backend::nccl::{unique_id_key, Nccl};
    use crate::bootstrap::tcp_store::TcpStore;
    let (ranks, rank, (generation, store, timeout)) = with_slot(|s| {
        let e = &s.engine;
        Ok((
            e.process_set(process_set_id),
            e.topology().rank,
            s.exchange.clone(),
        ))
    })?;
    let ranks = ranks.ok_or_else(|| {
        to_pyerr(Error::InvalidArgument(format!(
            "no process set {process_set_id}"
        )))
    })?;
    let me = ranks.iter().position(|&r| r == rank).ok_or_else(|| {
        to_pyerr(Error::InvalidArgument(format!(
            "rank {rank} is not a member of process set {process_set_id}"
        )))
    })?;
    let dirs: Vec<std::path::PathBuf> = extra_dirs.into_iter().map(Into::into).collect();
    let explicit = crate::config::nccl_library();
    let id = py
        .detach(|| {
            let probe = crate::gpu::loader::probe_nccl(explicit.as_deref(), &dirs);
            let nccl = Nccl::open(&probe)?;
            match store {
                Some((addr, secret)) if ranks.len() > 1 => {
                    let store = TcpStore::connect(addr.as_str(), &secret, timeout)?;
                    let key = unique_id_key(generation, process_set_id, comm_index);
                    nccl.exchange_unique_id(&store, &key, me, timeout)
                }
                _ => nccl.unique_id(),
            }
        })
        .map_err(to_pyerr)?;
    Ok(PyBytes::new(py, id.as_bytes()))
}
