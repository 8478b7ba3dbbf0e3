//! An op the worker holds from its submission until it completes.

use super::handle::Handle;
use super::OpSpec;
use crate::control::message::Request;

/// What was asked, the handle its submitter waits on, and the request sent for it.
pub(crate) struct Entry {
    pub spec: OpSpec,
    pub handle: Handle,
    pub request: Request,
}
