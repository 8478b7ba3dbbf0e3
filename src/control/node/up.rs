//! A relay's way up: holding the ranks' cached submissions, the link to the parent's node,
//! and what the ranks below are told when the path above is gone.

use super::{Relay, Role, State};
use crate::control::message::{FromCoordinator, Submit, ToCoordinator};
use crate::control::relay::{Addressed, Links};

impl Relay {
    /// One message from `from` that came in on `link`: cached submissions that speak for the
    /// whole link (an engine's own on its link, a node's claim on its) are held; anything that
    /// could be ordered after them (a join, a departure, a set change, a stall) first lets go
    /// of what is held. A node passes its own rank's submissions on under its own rank too, one
    /// by one: those speak for that rank alone.
    pub(super) fn take(&mut self, links: &Links, link: usize, from: usize, msg: ToCoordinator) {
        match msg {
            ToCoordinator::Submit(subs) if links.plain(link) => {
                let mut rest = Vec::new();
                for sub in subs {
                    match sub {
                        Submit::Cached { set_id, id } => {
                            self.held.submit(links, link, set_id, id, &mut self.up)
                        }
                        other => rest.push(other),
                    }
                }
                if !rest.is_empty() {
                    self.up.push((from, ToCoordinator::Submit(rest)));
                }
            }
            ToCoordinator::CachedBelow { set_id, ids } if from == link => {
                for id in ids {
                    self.held.submit(links, link, set_id, id, &mut self.up);
                }
            }
            m @ (ToCoordinator::Submit(_) | ToCoordinator::CachedBelow { .. }) => {
                self.up.push((from, m))
            }
            m @ (ToCoordinator::AddSet { .. }
            | ToCoordinator::AddMemberSet { .. }
            | ToCoordinator::RemoveSet { .. }) => {
                // Held ops of a set keep it from being removed, as at the coordinator.
                self.held.release(links, &mut self.up);
                self.up.push((from, m));
            }
            m => {
                self.held.stop(links, &mut self.up);
                self.up.push((from, m));
            }
        }
    }
}

impl State {
    /// Every link has connected: the coordinator tells each that the job is formed; a relay
    /// first connects to its parent, which answers once the whole job has, and then tells its
    /// links.
    pub(super) fn all_connected(&mut self) {
        if let Role::Relay(relay) = &mut self.role {
            let Some(connect) = relay.connect.take() else {
                return;
            };
            match connect() {
                Ok(conn) => relay.parent = Some(conn),
                Err(e) => {
                    self.cut_off(self.path_closed(false, format!("could not reach its node: {e}")));
                    return;
                }
            }
        }
        // This node's own rank last: once its init returns, its process may end (a Ray actor
        // is killed as soon as its function returns), and the others' word must be out by then.
        let me = self.cfg.rank;
        let mut links: Vec<usize> = self.links.expected().collect();
        links.sort_by_key(|&l| l == me);
        for l in links {
            if let Some(c) = self.conns[l].as_mut() {
                let _ = c.send(&FromCoordinator::Ready.encode(), self.cfg.timeout);
            }
        }
    }

    /// A relay reads its parent: batches to pass down, or the news that the path above is
    /// gone.
    pub(super) fn read_parent(&mut self) {
        let Role::Relay(relay) = &mut self.role else {
            return;
        };
        let Some(p) = relay.parent.as_mut() else {
            return;
        };
        let open = p.fill();
        let mut down: Addressed = Vec::new();
        let mut closed: Option<FromCoordinator> = None;
        loop {
            match p.next_frame() {
                Ok(Some(frame)) => match FromCoordinator::decode(&frame) {
                    Ok(FromCoordinator::Down(msgs)) => down.extend(msgs),
                    Ok(m @ FromCoordinator::PathClosed { .. }) => {
                        closed = Some(m);
                        break;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        closed = Some(self.path_closed(false, format!("malformed ({e})")));
                        break;
                    }
                },
                Ok(None) => break,
                Err(e) => {
                    closed = Some(self.path_closed(false, e.to_string()));
                    break;
                }
            }
        }
        let parent = self.tree().parent(self.cfg.rank).unwrap_or(0);
        if let Role::Relay(relay) = &mut self.role {
            relay.parent_left |= down
                .iter()
                .any(|(_, m)| matches!(m, FromCoordinator::RankLeft { rank } if *rank == parent));
            let mut stop = false;
            for (_, m) in &down {
                stop |= relay.held.observe(m);
            }
            if stop {
                relay.held.stop(&self.links, &mut relay.up);
            }
        }
        for (link, msg) in self.links.sort(down) {
            if let Some(c) = self.conns[link].as_mut() {
                if let Err(e) = c.send(&msg.encode(), self.cfg.timeout) {
                    self.lose(link, e.to_string());
                }
            }
        }
        if closed.is_none() && !matches!(open, Ok(true)) {
            let clean = matches!(&self.role, Role::Relay(r) if r.parent_left);
            let detail = match open {
                Err(e) => e.to_string(),
                _ => "its connection closed (the process exited or was killed)".into(),
            };
            closed = Some(self.path_closed(clean, detail));
        }
        if let Some(notice) = closed {
            self.cut_off(notice);
        }
    }

    /// The notice for the links below when the link to this relay's parent is gone.
    pub(super) fn path_closed(&self, clean: bool, detail: String) -> FromCoordinator {
        FromCoordinator::PathClosed {
            rank: self.tree().parent(self.cfg.rank).unwrap_or(0),
            clean,
            detail,
        }
    }

    /// The path above this relay is gone (`notice`, a `PathClosed`): tells every link below,
    /// then closes them all; from then on the relay does nothing.
    pub(super) fn cut_off(&mut self, notice: FromCoordinator) {
        let notice = notice.encode();
        for l in self.links.expected().collect::<Vec<_>>() {
            if let Some(mut c) = self.conns[l].take() {
                let _ = c.send(&notice, self.cfg.timeout);
                let _ = c.flush_all(self.cfg.timeout);
                c.close();
            }
        }
        if let Role::Relay(relay) = &mut self.role {
            if let Some(mut p) = relay.parent.take() {
                p.close();
            }
            relay.up.clear();
            relay.cut = true;
        }
    }

    /// A relay sends what the ranks below said since its last turn, in one frame. Returns
    /// whether it sent anything.
    pub(super) fn send_up(&mut self) -> bool {
        let Role::Relay(relay) = &mut self.role else {
            return false;
        };
        let Some(p) = relay.parent.as_mut() else {
            return false;
        };
        if relay.up.is_empty() {
            return false;
        }
        let batch = ToCoordinator::Relayed(std::mem::take(&mut relay.up));
        if let Err(e) = p.send(&batch.encode(), self.cfg.timeout) {
            self.cut_off(self.path_closed(false, e.to_string()));
        }
        true
    }
}
