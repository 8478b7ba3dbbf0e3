//! The links below a node: what comes up them (read, checked that each link speaks only for
//! the ranks it reaches, then negotiated at the root or held for the parent at a relay), what
//! goes down them (answers sorted by link), and what a link that closes or breaks costs the
//! ranks it reached. Apart from the turn in `mod.rs`, which decides when each of these runs,
//! and from `up.rs`, a relay's side towards its parent.

use std::time::Instant;

use super::{tree_of, Role, State};
use crate::control::message::ToCoordinator;
use crate::control::relay::Addressed;
use crate::error::Error;

impl State {
    /// Reads and handles every complete message on `link`; notices a closed connection.
    pub(super) fn receive(&mut self, link: usize) {
        let Some(conn) = self.conns[link].as_mut() else {
            return;
        };
        let open = conn.fill();
        loop {
            let Some(conn) = self.conns[link].as_mut() else {
                return;
            };
            match conn.next_frame() {
                Ok(Some(frame)) => match ToCoordinator::decode(&frame) {
                    Ok(msg) => {
                        self.last_heard = Instant::now();
                        if let Err(why) = self.take(link, msg) {
                            self.lose(link, why);
                            return;
                        }
                    }
                    Err(e) => {
                        self.lose(link, format!("sent a malformed message ({e})"));
                        return;
                    }
                },
                Ok(None) => break,
                Err(e) => {
                    self.lose(link, e.to_string());
                    return;
                }
            }
        }
        match open {
            Ok(true) => {}
            Ok(false) | Err(_) => {
                let detail = match open {
                    Err(e) => e.to_string(),
                    _ => "its connection closed (the process exited or was killed)".into(),
                };
                self.lose(link, detail);
            }
        }
    }

    /// One message from `link`: negotiated at the coordinator, queued for the parent at a
    /// relay. A node's link may only speak for the ranks it reaches.
    fn take(&mut self, link: usize, msg: ToCoordinator) -> std::result::Result<(), String> {
        let plain = self.links.plain(link);
        let msgs = match msg {
            ToCoordinator::Relayed(msgs) if !plain => msgs,
            ToCoordinator::Relayed(_) => return Err("relayed messages as an engine".into()),
            m if plain => vec![(link, m)],
            m => return Err(format!("sent {m:?} as a node")),
        };
        for (from, m) in &msgs {
            let speaks = match m {
                ToCoordinator::Lost { rank, .. } => {
                    self.links.reaches(link, *from) && self.links.reaches(link, *rank)
                }
                _ => self.links.reaches(link, *from),
            };
            if !speaks {
                return Err(format!("spoke for rank {from}, which it does not reach"));
            }
        }
        match &mut self.role {
            Role::Relay(relay) => {
                for (from, m) in msgs {
                    relay.take(&self.links, link, from, m);
                }
            }
            Role::Root(root) => {
                for (from, m) in msgs {
                    match m {
                        ToCoordinator::CachedBelow { set_id, ids } => {
                            let below = tree_of(&self.cfg).subtree(from);
                            root.claimed(set_id, &ids, &below, &mut self.out);
                        }
                        ToCoordinator::Lost { rank, detail } => {
                            let reach = if from == rank {
                                vec![rank]
                            } else {
                                tree_of(&self.cfg).subtree(rank)
                            };
                            root.lost(rank, &reach, detail, &mut self.out);
                        }
                        m => {
                            if m == ToCoordinator::Leave {
                                root.left[from] = true;
                            }
                            root.neg.handle(from, m, &mut self.out);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// `link` closed or broke (`detail`): the coordinator counts its ranks gone; a relay
    /// tells its parent.
    pub(super) fn lose(&mut self, link: usize, detail: String) {
        if let Some(mut c) = self.conns[link].take() {
            c.close();
        }
        let me = self.links.me;
        let reach = self.links.reach(link).to_vec();
        match &mut self.role {
            Role::Root(root) => root.lost(link, &reach, detail, &mut self.out),
            Role::Relay(relay) => {
                relay.held.stop(&self.links, &mut relay.up);
                relay
                    .up
                    .push((me, ToCoordinator::Lost { rank: link, detail }));
            }
        }
    }

    pub(super) fn send_out(&mut self) {
        // A message to every rank of the job goes to every link as it is, without sorting a
        // thousand ranks into their links (destinations list each rank once).
        let everyone = match &self.role {
            Role::Root(root) => root.neg.size(),
            _ => usize::MAX,
        };
        let out: Addressed = std::mem::take(&mut self.out)
            .into_iter()
            .map(|(to, m)| ((to.len() != everyone).then_some(to), m))
            .collect();
        if out.is_empty() {
            return;
        }
        for (link, msg) in self.links.sort(out) {
            if let Some(conn) = self.conns[link].as_mut() {
                if let Err(e) = conn.send(&msg.encode(), self.cfg.timeout) {
                    self.drop_conn(link, e);
                }
            }
        }
    }

    /// Closes the connection to `to` after sending to it failed with `e`, and tells the
    /// others.
    pub(super) fn drop_conn(&mut self, to: usize, e: Error) {
        // What the rank sent before it went decides whether it left or died: a rank that
        // shut down while an answer to it was being written has its `Leave` unread yet (a
        // clean shutdown was reported as "rank N is gone" then).
        self.receive(to);
        if self.conns[to].is_none() {
            // `receive` saw the connection close and recorded how.
            return;
        }
        self.lose(to, e.to_string());
        if let Role::Root(root) = &mut self.role {
            // Notices about this failure go out on the next turn of the loop; the answers
            // they fail go now, as before any later message.
            root.neg.flush(&mut self.out);
        }
    }
}
