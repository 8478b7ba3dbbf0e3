//! An op the worker holds from its submission until it completes.

use super::handle::Handle;
use super::message::Request;
use super::OpSpec;

/// What was asked, the handle its submitter waits on, and the request sent for it.
pub(super) struct Entry {
    pub spec: OpSpec,
    pub handle: Handle,
    pub request: Request,
}
