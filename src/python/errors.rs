//! Engine errors → the exception classes defined in `ferrovod.exceptions` (Python owns the
//! class hierarchy so classes can inherit from both `FerrovodError` and `ValueError`).

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::error::Error;

/// Builds the Python exception for `e`.
pub fn to_pyerr(e: Error) -> PyErr {
    let class = match &e {
        Error::PeerLost { .. } => "RankFailureError",
        Error::Timeout { .. } => "FerrovodTimeoutError",
        Error::Mismatch { .. } => "MismatchError",
        Error::InvalidArgument(_) => "InvalidArgumentError",
        Error::NotInitialized(_) => "NotInitializedError",
        Error::Shutdown(_) => "ShutdownError",
        Error::Interrupted(_) => "FerrovodError",
        Error::Auth(_) | Error::Decode(_) | Error::Io(_) => "HorovodInternalError",
    };
    let msg = e.to_string();
    Python::attach(|py| {
        let made = (|| -> PyResult<PyErr> {
            let module = py.import("ferrovod.exceptions")?;
            let exc = module.getattr(class)?.call1((msg.clone(),))?;
            if let Error::PeerLost { rank, .. } = &e {
                exc.setattr("rank", *rank)?;
            }
            if let Error::Mismatch { name, .. } = &e {
                exc.setattr("tensor_name", name.clone())?;
            }
            Ok(PyErr::from_value(exc))
        })();
        made.unwrap_or_else(|_| PyRuntimeError::new_err(msg))
    })
}
