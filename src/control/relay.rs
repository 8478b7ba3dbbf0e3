//! A node's links in the control tree ([`ControlTree`]): which link reaches which rank, and how
//! messages for ranks become one frame per link. Rank 0's node is the coordinator; every other
//! node is a relay (`control/node/` runs both). A link is *plain* when an engine is at
//! its far end (this rank's own, or a child's that runs no node): it gets messages as they are.
//! A child's node gets one [`FromCoordinator::Down`] batch per turn, each message addressed to
//! every rank the link reaches or to some of them, so the coordinator sends a response once
//! per link rather than once per rank, and every node below does the same.
//!
//! On the way up, a relay holds the cached submissions of the ranks below it ([`Held`]) until
//! every link that reaches a member of the op's process set has submitted the same id, and then
//! sends one [`ToCoordinator::CachedBelow`] for all of them: a step whose ops are all cached
//! costs each node one message per link and op, whatever the size of the job, and the
//! coordinator reads one claim per link instead of one submission per rank. It is a tree AND
//! of readiness, as Horovod's bit vectors are an allreduce AND, but sparse and only on a step
//! that has work.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::bootstrap::ControlTree;

use super::message::{FromCoordinator, Submit, ToCoordinator};

/// How long a relay holds a cached submission while other links below it have not submitted
/// the same op, at most: then it passes each on by itself, so that the coordinator's stall
/// inspector sees which ranks are missing, as it would without the relay. An eighth of the
/// stall-check time where that is shorter, so that even a few relays deep every submission
/// has reached the coordinator before its first inspection.
pub(super) fn hold_for(stall_check: Option<Duration>) -> Duration {
    let most = Duration::from_secs(1);
    stall_check.map_or(most, |c| (c / 8).min(most))
}

/// A node's links: its own engine's and each child's.
pub(super) struct Links {
    /// This node's rank.
    pub me: usize,
    /// (link rank, the ranks it reaches, ascending, whether it is plain).
    links: Vec<(usize, Vec<usize>, bool)>,
    /// For every rank, the position in `links` of the link that reaches it.
    route: Vec<Option<usize>>,
}

/// Messages addressed by a node: to every rank the link reaches (`None`) or the listed ones.
pub(super) type Addressed = Vec<(Option<Vec<usize>>, FromCoordinator)>;

impl Links {
    /// The links of rank `me`'s node in `tree`.
    pub fn new(tree: &ControlTree, me: usize) -> Links {
        let (links, route) = tree.links(me);
        let links: Vec<(usize, Vec<usize>, bool)> = links
            .into_iter()
            .map(|(l, reach)| (l, reach, l == me || !tree.has_node(l)))
            .collect();
        let route = route
            .iter()
            .map(|l| l.and_then(|l| links.iter().position(|x| x.0 == l)))
            .collect();
        Links { me, links, route }
    }

    /// No links yet: a coordinator's before its tree is placed.
    pub fn none(me: usize) -> Links {
        Links {
            me,
            links: Vec::new(),
            route: Vec::new(),
        }
    }

    /// The ranks of the links this node expects to connect.
    pub fn expected(&self) -> impl Iterator<Item = usize> + '_ {
        self.links.iter().map(|l| l.0)
    }

    /// The ranks `link` reaches: itself alone for an engine's link.
    pub fn reach(&self, link: usize) -> &[usize] {
        self.position(link).map_or(&[], |i| &self.links[i].1)
    }

    /// Whether `rank` is reached through `link`.
    pub fn reaches(&self, link: usize, rank: usize) -> bool {
        let at = self.route.get(rank).copied().flatten();
        at.is_some() && at == self.position(link)
    }

    /// Whether an engine is at the far end of `link` (else a child's node).
    pub fn plain(&self, link: usize) -> bool {
        self.position(link).is_some_and(|i| self.links[i].2)
    }

    fn position(&self, link: usize) -> Option<usize> {
        self.links.iter().position(|l| l.0 == link)
    }

    /// Sorts `msgs`, in order, into frames per link: an engine's link gets each message meant
    /// for it as it is; a node's link gets one `Down` batch, in which consecutive equal
    /// messages to single ranks become one message to all of them (the coordinator's answer
    /// to a global op is the same for every rank) and a message to every rank the link
    /// reaches names none. Ranks this node does not reach are skipped.
    pub fn sort(&self, msgs: Addressed) -> Vec<(usize, FromCoordinator)> {
        let n = self.links.len();
        let mut plain: Vec<Vec<FromCoordinator>> = vec![Vec::new(); n];
        let mut down: Vec<Addressed> = vec![Vec::new(); n];
        for (to, msg) in msgs {
            let mut parts: Vec<Option<Vec<usize>>> = vec![None; n];
            let mut all = vec![false; n];
            match to {
                None => all.iter_mut().for_each(|a| *a = true),
                Some(ranks) => {
                    for r in ranks {
                        if let Some(i) = self.route.get(r).copied().flatten() {
                            parts[i].get_or_insert_with(Vec::new).push(r);
                        }
                    }
                }
            }
            for i in 0..n {
                let part = match (all[i], parts[i].take()) {
                    (true, _) => None,
                    (false, Some(p)) => Some(p),
                    (false, None) => continue,
                };
                if self.links[i].2 {
                    plain[i].push(msg.clone());
                    continue;
                }
                let batch = &mut down[i];
                match (batch.last_mut(), part) {
                    (Some((Some(ranks), last)), Some(p)) if *last == msg => ranks.extend(p),
                    (_, part) => batch.push((part, msg.clone())),
                }
            }
        }
        let mut frames = Vec::new();
        for (i, (link, reach, _)) in self.links.iter().enumerate() {
            frames.extend(plain[i].drain(..).map(|m| (*link, m)));
            let mut batch = std::mem::take(&mut down[i]);
            if batch.is_empty() {
                continue;
            }
            for (to, _) in batch.iter_mut() {
                if let Some(ranks) = to {
                    ranks.sort_unstable();
                    ranks.dedup();
                    if ranks.len() == reach.len() {
                        *to = None;
                    }
                }
            }
            frames.push((*link, FromCoordinator::Down(batch)));
        }
        frames
    }
}

/// Messages for the parent, each with the rank it speaks for.
pub(super) type Up = Vec<(usize, ToCoordinator)>;

/// A relay's held cached submissions (see the module doc).
pub(super) struct Held {
    /// Members of each process set (id 0: the job), as the relay learned them: at start-up,
    /// then from the coordinator's answers to `add_process_set`/`remove_process_set` passing
    /// down.
    sets: HashMap<u32, Vec<usize>>,
    size: usize,
    /// (set, cache id) → the links that have submitted it this round.
    entries: HashMap<(u32, u64), Entry>,
    /// See [`hold_for`].
    hold: Duration,
    /// A join, a departure or a failure has passed: the relay holds nothing any more. A joined
    /// rank never submits (it would be waited for), and a gone one never again; both are rare
    /// enough that passing every submission on from then on costs nothing that matters.
    off: bool,
}

struct Entry {
    marked: Vec<usize>,
    /// Passed on one by one (held too long): later links pass at once until a link submits
    /// again, which starts the next round.
    passed: bool,
    since: Instant,
}

impl Held {
    /// Nothing held; `process_sets` are the static sets (ids 1, 2, ...), `hold` from
    /// [`hold_for`].
    pub fn new(size: usize, process_sets: &[Vec<usize>], hold: Duration) -> Held {
        let mut sets: HashMap<u32, Vec<usize>> = HashMap::new();
        sets.insert(0, (0..size).collect());
        for (i, ranks) in process_sets.iter().enumerate() {
            sets.insert(i as u32 + 1, ranks.clone());
        }
        Held {
            sets,
            size,
            entries: HashMap::new(),
            hold,
            off: false,
        }
    }

    /// The links below `links`' node that reach a member of set `set_id` (`None`: a set the
    /// relay does not know).
    fn involved(&self, links: &Links, set_id: u32) -> Option<Vec<usize>> {
        let members = self.sets.get(&set_id)?;
        let mut out: Vec<usize> = Vec::new();
        for &r in members {
            if let Some(l) = links.route.get(r).copied().flatten() {
                let link = links.links[l].0;
                if !out.contains(&link) {
                    out.push(link);
                }
            }
        }
        Some(out)
    }

    /// Link `link` submitted the cached op `id` of set `set_id` (its engine, or its node for
    /// every rank below it). What is to go up now is appended to `up`.
    pub fn submit(&mut self, links: &Links, link: usize, set_id: u32, id: u64, up: &mut Up) {
        let involved = match self.involved(links, set_id) {
            Some(inv) if !self.off => inv,
            _ => return up.push(one(links, link, set_id, id)),
        };
        let e = self.entries.entry((set_id, id)).or_insert_with(|| Entry {
            marked: Vec::new(),
            passed: false,
            since: Instant::now(),
        });
        if e.marked.contains(&link) {
            // A link submits a name again only after the coordinator answered it: the last
            // round ended.
            *e = Entry {
                marked: Vec::new(),
                passed: false,
                since: Instant::now(),
            };
        }
        e.marked.push(link);
        if e.passed {
            return up.push(one(links, link, set_id, id));
        }
        if involved.iter().all(|l| e.marked.contains(l)) {
            self.entries.remove(&(set_id, id));
            claim(links.me, set_id, id, up);
        }
    }

    /// Passes on everything held, one by one, and holds nothing from now on (see `off`).
    pub fn stop(&mut self, links: &Links, up: &mut Up) {
        self.release(links, up);
        self.entries.clear();
        self.off = true;
    }

    /// Passes on everything held, one by one.
    pub fn release(&mut self, links: &Links, up: &mut Up) {
        self.pass(links, up, |_| true);
    }

    /// Passes on, one by one, what has been held for the hold time by `now`.
    pub fn expire(&mut self, links: &Links, now: Instant, up: &mut Up) {
        let hold = self.hold;
        self.pass(links, up, |e| {
            now.saturating_duration_since(e.since) >= hold
        });
    }

    fn pass(&mut self, links: &Links, up: &mut Up, due: impl Fn(&Entry) -> bool) {
        let mut keys: Vec<(u32, u64)> = self
            .entries
            .iter()
            .filter(|(_, e)| !e.passed && due(e))
            .map(|(k, _)| *k)
            .collect();
        keys.sort_unstable();
        for (set_id, id) in keys {
            let e = self.entries.get_mut(&(set_id, id)).expect("listed above");
            e.passed = true;
            for &link in &e.marked {
                up.push(one(links, link, set_id, id));
            }
        }
    }

    /// When the oldest held submission is due to be passed on, if any.
    pub fn deadline(&self) -> Option<Instant> {
        self.entries
            .values()
            .filter(|e| !e.passed)
            .map(|e| e.since + self.hold)
            .min()
    }

    /// Learns from a message passing down: set changes, and news that stops the holding.
    /// Returns whether it stops it.
    pub fn observe(&mut self, msg: &FromCoordinator) -> bool {
        match msg {
            FromCoordinator::SetAdded {
                ranks,
                result: Ok(id),
                ..
            } if ranks.iter().all(|&r| r < self.size) => {
                self.sets.insert(*id, ranks.clone());
                false
            }
            FromCoordinator::SetRemoved {
                id,
                result: Ok(true),
            } => {
                self.sets.remove(id);
                self.entries.retain(|(s, _), _| s != id);
                false
            }
            FromCoordinator::RankLeft { .. }
            | FromCoordinator::RankFailed { .. }
            | FromCoordinator::PathClosed { .. } => !self.off,
            _ => false,
        }
    }
}

/// One link's submission as it goes up on its own: an engine's, or a node's claim.
fn one(links: &Links, link: usize, set_id: u32, id: u64) -> (usize, ToCoordinator) {
    if links.plain(link) {
        (
            link,
            ToCoordinator::Submit(vec![Submit::Cached { set_id, id }]),
        )
    } else {
        (
            link,
            ToCoordinator::CachedBelow {
                set_id,
                ids: vec![id],
            },
        )
    }
}

/// Appends this node's claim for (set, id), into the last claim when it is for the same set.
fn claim(me: usize, set_id: u32, id: u64, up: &mut Up) {
    if let Some((from, ToCoordinator::CachedBelow { set_id: s, ids })) = up.last_mut() {
        if *from == me && *s == set_id {
            ids.push(id);
            return;
        }
    }
    up.push((
        me,
        ToCoordinator::CachedBelow {
            set_id,
            ids: vec![id],
        },
    ));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_batch_per_node_link_and_messages_as_they_are_for_engines() {
        // Two hosts of 4, fanout 2: rank 0 reaches itself, 1 (a node: 1 and 3), 2 (an
        // engine) and 4 (a node: 4 to 7).
        let tree = ControlTree::new(&[0, 0, 0, 0, 1, 1, 1, 1], 2);
        let links = Links::new(&tree, 0);
        assert!(links.plain(0) && !links.plain(1) && links.plain(2) && !links.plain(4));
        assert_eq!(links.reach(4), &[4, 5, 6, 7]);
        let resp = FromCoordinator::Responses(Vec::new());
        let mut msgs: Addressed = (0..8).map(|r| (Some(vec![r]), resp.clone())).collect();
        msgs.push((Some(vec![5]), FromCoordinator::RankLeft { rank: 3 }));
        let frames = links.sort(msgs);
        let to: Vec<usize> = frames.iter().map(|f| f.0).collect();
        assert_eq!(to, vec![0, 1, 2, 4]);
        assert_eq!(frames[0].1, resp);
        assert_eq!(
            frames[1].1,
            FromCoordinator::Down(vec![(None, resp.clone())])
        );
        assert_eq!(
            frames[3].1,
            FromCoordinator::Down(vec![
                (None, resp),
                (Some(vec![5]), FromCoordinator::RankLeft { rank: 3 })
            ])
        );
        // A relay passing a batch on: rank 4's node reaches 4, 5 (a node: 5 and 7) and 6.
        let links = Links::new(&tree, 4);
        let frames = links.sort(vec![(Some(vec![7, 6]), FromCoordinator::Ready)]);
        assert_eq!(
            frames,
            vec![
                (
                    5,
                    FromCoordinator::Down(vec![(Some(vec![7]), FromCoordinator::Ready)])
                ),
                (6, FromCoordinator::Ready)
            ]
        );
        assert!(links.reaches(5, 7) && !links.reaches(6, 7) && !links.reaches(5, 1));
    }

    #[test]
    fn a_relay_claims_an_op_once_every_link_with_members_has_submitted_it() {
        // Rank 4's node (two hosts of 4, fanout 2) reaches 4, 5 (a node: 5 and 7) and 6.
        let tree = ControlTree::new(&[0, 0, 0, 0, 1, 1, 1, 1], 2);
        let links = Links::new(&tree, 4);
        let hold = hold_for(None);
        let mut held = Held::new(8, &[vec![0, 6, 7]], hold);
        let mut up = Up::new();
        held.submit(&links, 4, 0, 9, &mut up);
        held.submit(&links, 6, 0, 9, &mut up);
        assert!(up.is_empty());
        held.submit(&links, 5, 0, 9, &mut up);
        // Set 1 has members below links 5 (rank 7) and 6 only.
        held.submit(&links, 6, 1, 3, &mut up);
        held.submit(&links, 5, 1, 3, &mut up);
        assert_eq!(
            up,
            vec![
                (
                    4,
                    ToCoordinator::CachedBelow {
                        set_id: 0,
                        ids: vec![9]
                    }
                ),
                (
                    4,
                    ToCoordinator::CachedBelow {
                        set_id: 1,
                        ids: vec![3]
                    }
                ),
            ]
        );
        // Held too long: passed on one by one, and so is the next link of that round.
        up.clear();
        held.submit(&links, 6, 0, 9, &mut up);
        held.expire(&links, Instant::now() + hold, &mut up);
        held.submit(&links, 5, 0, 9, &mut up);
        assert_eq!(
            up,
            vec![
                (
                    6,
                    ToCoordinator::Submit(vec![Submit::Cached { set_id: 0, id: 9 }])
                ),
                (
                    5,
                    ToCoordinator::CachedBelow {
                        set_id: 0,
                        ids: vec![9]
                    }
                ),
            ]
        );
        // A link submitting again starts a new round, held again.
        up.clear();
        held.submit(&links, 6, 0, 9, &mut up);
        assert!(up.is_empty() && held.deadline().is_some());
        // A failure passing down stops the holding; what was held goes up.
        assert!(held.observe(&FromCoordinator::RankLeft { rank: 1 }));
        held.stop(&links, &mut up);
        held.submit(&links, 4, 0, 9, &mut up);
        assert_eq!(up.len(), 2);
        assert!(held.deadline().is_none());
        assert_eq!(
            hold_for(Some(Duration::from_secs(1))),
            Duration::from_millis(125)
        );
    }
}
