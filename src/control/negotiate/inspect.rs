//! The stall inspector's view of the negotiation: which ops some ranks have waited on too long,
//! and which ranks have not submitted them.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::respond::error_response;
use super::Negotiator;
use crate::error::Error;

impl Negotiator {
    /// The stall inspector. With `check`, names some ranks submitted more than `check` ago
    /// and others did not are reported (once per `check` interval each) in Horovod's words,
    /// listing for every missing rank the tensors it has not submitted. Names stalled longer
    /// than their set's limit (its own, else `shutdown`) fail on every rank that submitted
    /// them. Returns the warning to log, if any.
    pub fn inspect(
        &mut self,
        now: Instant,
        check: Option<Duration>,
        shutdown: Option<Duration>,
    ) -> Option<String> {
        let mut missing: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        let mut doomed: Vec<(u32, String, Duration)> = Vec::new();
        let mut shutting = false;
        for (&set_id, set) in self.sets.iter_mut() {
            let limit = set.timeout.or(shutdown);
            for (name, p) in set.table.iter_mut() {
                let age = now.saturating_duration_since(p.since);
                if let Some(limit) = limit.filter(|&l| age >= l) {
                    doomed.push((set_id, name.clone(), limit));
                }
                let Some(check) = check.filter(|&c| age >= c) else {
                    continue;
                };
                if p.warned
                    .is_some_and(|w| now.saturating_duration_since(w) < check)
                {
                    continue;
                }
                p.warned = Some(now);
                let label = if set_id == 0 {
                    name.clone()
                } else {
                    format!("{name} (process set {set_id})")
                };
                for (i, &g) in set.ranks.iter().enumerate() {
                    if !(p.has(i) || (set_id == 0 && self.joined[g])) {
                        missing.entry(g).or_default().push(label.clone());
                    }
                }
                shutting |= shutdown.is_some();
            }
        }
        for (set_id, name, limit) in doomed {
            let set = self.sets.get_mut(&set_id).expect("listed above");
            let p = set.take(&name).expect("listed above");
            let absent: Vec<usize> = set
                .ranks
                .iter()
                .enumerate()
                .filter(|&(i, _)| !p.has(i))
                .map(|(_, &g)| g)
                .collect();
            let request = p.first();
            let msg = if set.timeout.is_some() {
                // Torch's group timeout; torch's users look for "timeout" in what it raises.
                format!(
                    "{} of tensor '{name}' failed: ranks {absent:?} did not submit it within \
                     the process group's timeout of {limit:?}",
                    request.kind.name(),
                )
            } else {
                format!(
                    "{} of tensor '{name}' stalled for more than {:.0} s: ranks {absent:?} never \
                     submitted it, so ferrovod gives up on it \
                     (FERROVOD_STALL_SHUTDOWN_TIME_SECONDS)",
                    request.kind.name(),
                    limit.as_secs_f64()
                )
            };
            let code = Error::Timeout {
                what: String::new(),
                after: Duration::ZERO,
            }
            .kind_code();
            self.ready.push(error_response(request, code, msg));
        }
        // Only a check fills `missing`.
        let (Some(check), false) = (check, missing.is_empty()) else {
            return None;
        };
        let mut text = format!(
            "One or more tensors were submitted to be reduced, gathered or broadcasted by \
             subset of ranks and are waiting for remainder of ranks for more than {:.0} seconds. \
             This may indicate that different ranks are trying to submit different tensors or \
             that only subset of ranks is submitting tensors, which will cause deadlock.\n\
             Missing ranks:",
            check.as_secs_f64()
        );
        for (rank, names) in &missing {
            let shown: Vec<&str> = names.iter().take(6).map(String::as_str).collect();
            let more = if names.len() > 6 { " ..." } else { "" };
            text.push_str(&format!("\n{rank}: [{}]{more}", shown.join(", ")));
        }
        if shutting {
            text.push_str(&format!(
                "\nTensors stalled for longer than {:.0} s fail on every rank.",
                shutdown.unwrap_or_default().as_secs_f64()
            ));
        }
        Some(text)
    }

    pub(super) fn live_ranks(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.size).filter(|&r| self.gone[r].is_none())
    }
}
