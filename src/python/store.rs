//! The job's rendezvous store as Python sees it: the server a launcher runs for its workers,
//! and the client an elastic worker reads memberships with.

use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::bootstrap::tcp_store::{TcpStore, TcpStoreServer};
use crate::bootstrap::Store;
use crate::error::{Error, Result};

use super::errors::to_pyerr;

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RendezvousServer>()?;
    m.add_class::<StoreClient>()?;
    Ok(())
}

/// The rendezvous store a launcher runs for its workers.
#[pyclass(module = "ferrovod._core")]
struct RendezvousServer {
    server: Option<TcpStoreServer>,
    addr: String,
}

#[pymethods]
impl RendezvousServer {
    #[new]
    #[pyo3(signature = (secret, host="127.0.0.1"))]
    fn new(py: Python<'_>, secret: Vec<u8>, host: &str) -> PyResult<Self> {
        let bind = format!("{host}:0")
            .parse()
            .map_err(|e| to_pyerr(Error::InvalidArgument(format!("bad host {host:?}: {e}"))))?;
        // Without the GIL: nothing here needs Python, and the store's threads may log (which
        // takes the GIL) from the moment they exist.
        let server = py
            .detach(|| TcpStoreServer::start(bind, secret))
            .map_err(to_pyerr)?;
        let addr = server.local_addr().to_string();
        Ok(RendezvousServer {
            server: Some(server),
            addr,
        })
    }

    /// "host:port" workers connect to.
    #[getter]
    fn addr(&self) -> String {
        self.addr.clone()
    }

    /// Sets `key` to `value` in the store, waking the workers waiting on it (the elastic
    /// driver publishing a membership).
    fn set(&self, key: &str, value: Vec<u8>) -> PyResult<()> {
        match &self.server {
            Some(s) => {
                s.set(key, &value);
                Ok(())
            }
            None => Err(to_pyerr(Error::Shutdown(
                "the rendezvous store is closed".into(),
            ))),
        }
    }

    /// Stops serving. The store's threads are joined with the GIL released: a connection
    /// thread may be logging (e.g. a half-authenticated connection dropped by the shutdown),
    /// and logging goes to Python; joining it with the GIL held would never return.
    fn close(&mut self, py: Python<'_>) {
        if let Some(mut s) = self.server.take() {
            py.detach(move || s.shutdown());
        }
    }
}

/// A client of the job's rendezvous store (an elastic worker reading the memberships its
/// launcher publishes). Every blocking call releases the GIL.
#[pyclass(module = "ferrovod._core")]
struct StoreClient {
    store: TcpStore,
}

#[pymethods]
impl StoreClient {
    /// Connects to `addr` ("host:port") and proves `secret`, retrying for up to `timeout_s`.
    #[new]
    fn new(py: Python<'_>, addr: String, secret: Vec<u8>, timeout_s: f64) -> PyResult<Self> {
        let timeout = seconds(timeout_s)?;
        let store = py
            .detach(|| TcpStore::connect(addr.as_str(), &secret, timeout))
            .map_err(to_pyerr)?;
        Ok(StoreClient { store })
    }

    /// The value of `key`, waiting up to `timeout_s` for it to be set; `None` if it was not.
    fn get<'py>(
        &self,
        py: Python<'py>,
        key: &str,
        timeout_s: f64,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let timeout = seconds(timeout_s)?;
        match py.detach(|| self.store.get(key, timeout)) {
            Ok(v) => Ok(Some(PyBytes::new(py, &v))),
            Err(Error::Timeout { .. }) => Ok(None),
            Err(e) => Err(to_pyerr(e)),
        }
    }

    /// Adds `delta` to the counter at `key` (missing: 0) and returns the new value.
    fn add(&self, py: Python<'_>, key: &str, delta: i64) -> PyResult<i64> {
        py.detach(|| self.store.add(key, delta)).map_err(to_pyerr)
    }

    /// Sets `key` to `value`, replacing what it held.
    fn set(&self, py: Python<'_>, key: &str, value: &[u8]) -> PyResult<()> {
        py.detach(|| self.store.set(key, value)).map_err(to_pyerr)
    }
}

fn seconds(s: f64) -> PyResult<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(s.max(0.0))
        .map_err(|e| to_pyerr(Error::InvalidArgument(format!("bad timeout {s}: {e}"))))
}

impl Drop for RendezvousServer {
    /// A server never closed is shut down when Python frees it: also without the GIL (see
    /// `close`), where the GIL can be released.
    fn drop(&mut self) {
        let mut server = self.server.take();
        if server.is_none() {
            return;
        }
        Python::try_attach(|py| py.detach(|| server.take().map(|mut s| s.shutdown())));
        if let Some(mut s) = server {
            s.shutdown();
        }
    }
}

/// A torch.distributed store (`torch.distributed.Store`: `TCPStore`, `FileStore`, `HashStore`,
/// a `PrefixStore` over one) as the engine's [`Store`]: torch.distributed's front end forms its
/// job over the store torch hands the backend. Each call takes the GIL; torch's store methods
/// release it while they wait.
pub(super) struct TorchStore {
    store: Py<PyAny>,
}

impl TorchStore {
    pub(super) fn new(store: Py<PyAny>) -> Self {
        TorchStore { store }
    }

    /// Runs `f` on the store with the GIL, turning a Python exception into the engine's error:
    /// a wait that ran out (torch raises `DistStoreError`, whose text says "timeout") becomes
    /// `Timeout` for `what`, anything else an I/O error naming the store call.
    fn call<T>(
        &self,
        what: &str,
        timeout: Duration,
        f: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<T>,
    ) -> Result<T> {
        Python::attach(|py| {
            f(self.store.bind(py)).map_err(|e| {
                let text = e.to_string();
                if text.to_lowercase().contains("timeout") || text.contains("timed out") {
                    Error::Timeout {
                        what: format!("{what} in torch.distributed's store ({text})"),
                        after: timeout,
                    }
                } else {
                    Error::Io(format!(
                        "torch.distributed's store failed at {what}: {text}"
                    ))
                }
            })
        })
    }
}

impl Store for TorchStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.call(&format!("setting key {key:?}"), Duration::ZERO, |s| {
            s.call_method1("set", (key, PyBytes::new(s.py(), value)))
                .map(drop)
        })
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.call(&format!("waiting for key {key:?}"), timeout, |s| {
            let py = s.py();
            let delta = py
                .import("datetime")?
                .getattr("timedelta")?
                .call1((0, timeout.as_secs_f64()))?;
            s.call_method1("wait", (vec![key], delta))?;
            s.call_method1("get", (key,))?.extract::<Vec<u8>>()
        })
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.call(&format!("adding to key {key:?}"), Duration::ZERO, |s| {
            s.call_method1("add", (key, delta))?.extract::<i64>()
        })
    }
}
