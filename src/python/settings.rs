//! The environment as one `init()` reads it: Python asks for a [`Settings`] once, reads what it
//! needs before the engine starts (the log set-up, the launch, the elastic worker's settings)
//! and hands the same object to `init`, so the variables are read and parsed once, and the
//! engine starts with exactly what Python looked at.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::errors::to_pyerr;
use crate::config::{Config, Environment};
use crate::error::Result;

/// The environment of one `init()`, and the settings parsed from it.
#[pyclass(module = "ferrovod._core", frozen)]
pub(super) struct Settings {
    /// The environment as read once; the rendezvous found over MPI is parsed with it (see
    /// [`Settings::config_with`]).
    env: Environment,
    config: Config,
    with_launch: bool,
}

impl Settings {
    /// The parsed settings, with the rendezvous address and job secret that `init()` found
    /// some other way (over MPI, through torch's store) in place of the environment's, which
    /// changes what the launch detection derives from them (a derived secret, above all).
    pub(super) fn config_with(&self, addr: Option<&str>, secret: Option<&[u8]>) -> Result<Config> {
        if (addr, secret) == (None, None) {
            return Ok(self.config.clone());
        }
        Config::from_lookup_with(|k| self.env.get(k), addr, secret)
    }

    /// The parsed settings as they are.
    pub(super) fn config(&self) -> &Config {
        &self.config
    }

    /// Whether the launcher's variables were read (a job of torch.distributed's front end
    /// takes its rank and size from torch instead).
    pub(super) fn with_launch(&self) -> bool {
        self.with_launch
    }
}

/// Reads the process environment once and parses ferrovod's settings from it; without
/// `with_launch` the launcher's variables are not read (the rank is then 0), for a job whose
/// rank and size come from elsewhere (torch.distributed's front end). Bad settings fail here,
/// naming the variable.
#[pyfunction]
#[pyo3(signature = (with_launch=true))]
fn read_settings(with_launch: bool) -> PyResult<Settings> {
    let env = Environment::read();
    let get = |k: &str| env.get(k);
    let config = if with_launch {
        Config::from_lookup(get)
    } else {
        Config::from_lookup_without_launch(get)
    }
    .map_err(to_pyerr)?;
    Ok(Settings {
        env,
        config,
        with_launch,
    })
}

#[pymethods]
impl Settings {
    /// `(log_level, log_hide_time, rank)`, so that Python can set up the `ferrovod` logger
    /// before the engine starts logging.
    fn log(&self) -> (String, bool, usize) {
        let c = &self.config;
        (c.log_level.clone(), c.log_hide_time, c.launch.rank)
    }

    /// What `init()` needs to know before it starts the engine: `{"launcher": name, "rank",
    /// "size", "needs_mpi_rendezvous": bool, "secret_set": bool (FERROVOD_SECRET given),
    /// "iface": FERROVOD_IFACE or None, "agent_store": (torchrun agent store "host:port", key
    /// prefix) or None, "start_timeout": seconds}`.
    fn launch<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.config;
        let l = &c.launch;
        let d = PyDict::new(py);
        d.set_item("launcher", l.launcher.name())?;
        d.set_item("rank", l.rank)?;
        d.set_item("size", l.size)?;
        d.set_item("needs_mpi_rendezvous", l.needs_mpi_rendezvous())?;
        d.set_item("secret_set", l.secret.is_some() && !l.secret_derived)?;
        d.set_item("iface", c.iface.clone())?;
        d.set_item("agent_store", l.agent_store.clone())?;
        d.set_item("start_timeout", c.start_timeout.as_secs_f64())?;
        Ok(d)
    }

    /// An elastic worker's launch settings (so Python parses none of them again, with
    /// defaults of its own): `{"enabled": bool, "epoch": int, "local_rank": int, "timeout":
    /// seconds, "hostname": str, "rendezvous_addr": str or None, "secret": bytes or None (only
    /// one the launcher gave, never a derived one)}`.
    fn elastic<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.config;
        let e = &c.elastic;
        let d = PyDict::new(py);
        d.set_item("enabled", e.enabled)?;
        d.set_item("epoch", e.epoch)?;
        d.set_item("local_rank", e.local_rank)?;
        d.set_item("timeout", e.timeout.as_secs_f64())?;
        d.set_item("hostname", c.hostname.clone())?;
        d.set_item("rendezvous_addr", c.launch.rendezvous_addr.clone())?;
        let given = c
            .launch
            .secret
            .as_deref()
            .filter(|_| !c.launch.secret_derived);
        d.set_item("secret", given.map(|s| PyBytes::new(py, s)))?;
        Ok(d)
    }
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Settings>()?;
    m.add_function(wrap_pyfunction!(read_settings, m)?)?;
    Ok(())
}
