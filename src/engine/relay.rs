//! A node's links in the control tree ([`ControlTree`]): which link reaches which rank, and how
//! messages for ranks become one frame per link. Rank 0's node is the coordinator; every other
//! node is a relay (`engine/coordinator.rs` runs both). A link is *plain* when an engine is at
//! its far end (this rank's own, or a child's that runs no node): it gets messages as they are.
//! A child's node gets one [`FromCoordinator::Down`] batch per turn, each message addressed to
//! every rank the link reaches or to some of them, so the coordinator sends a response once
//! per link rather than once per rank, and every node below does the same.

use crate::bootstrap::ControlTree;

use super::message::FromCoordinator;

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
}
