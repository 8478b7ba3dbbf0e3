//! Names of this rank's ops in flight. Horovod refuses, at submission, a second op under a name
//! still pending in the same process set (its tensor table is keyed by name), and so does this
//! engine: a duplicate that got through would be matched against another rank's op and leave
//! one op on each side waiting forever.
//!
//! A name is claimed when an op enters (the fast path included, so that two threads of one
//! rank cannot pair their blocking ops with a peer's by arrival order) and released when the
//! submitter has seen the op complete — its result taken (synchronize), a poll that said
//! done, or the handle dropped — not when the engine completes it: a rank whose first op
//! completed at once (its peers had submitted theirs) would otherwise accept a second op under
//! the name that peers which had refused it never match.

use std::collections::HashSet;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::types::OpKind;

/// The names in flight on this rank, per process set.
#[derive(Debug, Default)]
pub struct InFlight {
    names: Mutex<HashSet<(u32, String)>>,
}

/// A name held by one op until this is dropped.
#[derive(Debug)]
pub struct NameClaim {
    owner: Arc<InFlight>,
    key: (u32, String),
}

impl InFlight {
    /// Claims `name` in process set `set_id` for an op of `kind`, or fails with Horovod's
    /// duplicate-name error when an op under that name is still in flight here.
    pub fn claim(self: &Arc<Self>, set_id: u32, name: &str, kind: OpKind) -> Result<NameClaim> {
        let key = (set_id, name.to_string());
        if !self.names.lock().insert(key.clone()) {
            let set = if set_id == 0 {
                String::new()
            } else {
                format!(" in process set {set_id}")
            };
            return Err(Error::InvalidArgument(format!(
                "Requested to {} a tensor with the same name as another tensor that is \
                 currently being processed{set}: '{name}'. Wait for the first op (synchronize) \
                 or give the second a different name.",
                kind.name().to_lowercase()
            )));
        }
        Ok(NameClaim {
            owner: self.clone(),
            key,
        })
    }
}

impl Drop for NameClaim {
    fn drop(&mut self) {
        self.owner.names.lock().remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_taken_until_its_claim_drops() {
        let f = Arc::new(InFlight::default());
        let a = f.claim(0, "x", OpKind::Allreduce).unwrap();
        let e = f.claim(0, "x", OpKind::Allgather).unwrap_err().to_string();
        assert!(e.contains("allgather") && e.contains("'x'"), "{e}");
        // Another set, another name: independent.
        let _b = f.claim(1, "x", OpKind::Allreduce).unwrap();
        let _c = f.claim(0, "y", OpKind::Allreduce).unwrap();
        drop(a);
        let _d = f.claim(0, "x", OpKind::Allreduce).unwrap();
        assert_eq!(f.names.lock().len(), 3);
    }
}
