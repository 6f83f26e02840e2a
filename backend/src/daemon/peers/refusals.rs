//! REATTACH and HANDOFF requests refused for their id, uid or token,
//! counted by kind and by the uid that sent them (`/metrics`
//! `hugemem_token_refusals_total{kind,uid}`), and what a connection that
//! made them is told when it is closed.
//!
//! Not in STATS: tenants read STATS `counters`, and a per-uid count would
//! tell one tenant which other uids use the daemon. The totals by kind
//! stay where they were (`reattach_refused`, `handoff_refused`).

use std::collections::BTreeMap;
use std::sync::Mutex;

use tracing::warn;

use crate::daemon::ids::{AllocId, SessionId};
use crate::daemon::peers::peer_log;

/// Uids counted apart; refusals of further uids share the label
/// `uid="other"`. Refusals come from allowed uids only (the uid check runs
/// first), so this is a bound for a misconfiguration, not a limit in use.
pub const MAX_UIDS: usize = 256;

/// The requests that carry an allocation's token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum TokenRequest {
    /// REATTACH (an orphaned allocation after a restart).
    Reattach,
    /// HANDOFF (a live allocation to its VMM's successor).
    Handoff,
}

impl TokenRequest {
    /// Both kinds, in label order.
    pub const ALL: [Self; 2] = [Self::Handoff, Self::Reattach];

    /// The request's name in the protocol and the log.
    pub fn name(self) -> &'static str {
        match self {
            Self::Reattach => "REATTACH",
            Self::Handoff => "HANDOFF",
        }
    }

    /// The `kind` label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Reattach => "reattach",
            Self::Handoff => "handoff",
        }
    }

    fn index(self) -> usize {
        match self {
            Self::Handoff => 0,
            Self::Reattach => 1,
        }
    }
}

/// Refusals by uid (`None`: the uids beyond [`MAX_UIDS`]) and kind.
#[derive(Debug, Default)]
pub struct TokenRefusals {
    by_uid: Mutex<BTreeMap<Option<u32>, [u64; 2]>>,
}

/// The prefix of these counters' names in the map a successor daemon
/// takes over (`Metrics::to_map`): `token_refusals.<kind>.<uid|other>`.
const MAP_PREFIX: &str = "token_refusals.";

impl TokenRefusals {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<Option<u32>, [u64; 2]>> {
        self.by_uid
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Counts `n` refusals of `kind` from `uid`.
    pub fn add(&self, kind: TokenRequest, uid: u32, n: u64) {
        self.add_to(kind, Some(uid), n);
    }

    /// Counts under `uid`, or under the others once [`MAX_UIDS`] uids are
    /// counted apart.
    fn add_to(&self, kind: TokenRequest, uid: Option<u32>, n: u64) {
        let mut g = self.lock();
        let key = if g.contains_key(&uid) || g.keys().flatten().count() < MAX_UIDS {
            uid
        } else {
            None
        };
        let counts = g.entry(key).or_default();
        counts[kind.index()] = counts[kind.index()].saturating_add(n);
    }

    /// Every count: (kind, uid or `None` for the others, refusals).
    pub fn snapshot(&self) -> Vec<(TokenRequest, Option<u32>, u64)> {
        let g = self.lock();
        TokenRequest::ALL
            .iter()
            .flat_map(|&kind| g.iter().map(move |(uid, c)| (kind, *uid, c[kind.index()])))
            .filter(|&(_, _, n)| n > 0)
            .collect()
    }

    /// Adds these counts to a successor's map.
    pub fn to_map(&self, map: &mut BTreeMap<String, u64>) {
        for (kind, uid, n) in self.snapshot() {
            let uid = uid.map_or_else(|| "other".to_string(), |u| u.to_string());
            map.insert(format!("{MAP_PREFIX}{}.{uid}", kind.label()), n);
        }
    }

    /// Takes a predecessor's counts over (names it does not know are
    /// ignored).
    pub fn restore_map(&self, map: &BTreeMap<String, u64>) {
        self.lock().clear();
        for (name, &n) in map {
            let Some((kind, uid)) = name
                .strip_prefix(MAP_PREFIX)
                .and_then(|rest| rest.split_once('.'))
            else {
                continue;
            };
            let Some(kind) = TokenRequest::ALL.into_iter().find(|k| k.label() == kind) else {
                continue;
            };
            match uid.parse::<u32>() {
                Ok(uid) => self.add_to(kind, Some(uid), n),
                Err(_) if uid == "other" => self.add_to(kind, None, n),
                Err(_) => {}
            }
        }
    }
}

/// One connection's refused token requests, by kind. It travels with the
/// connection through a takeover (`ConnectionRecord`), so a takeover does
/// not give a peer that guesses tokens a fresh allowance.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OnConnection {
    reattach: u32,
    handoff: u32,
}

impl OnConnection {
    /// No request refused yet.
    pub fn is_none(&self) -> bool {
        self.reattach == 0 && self.handoff == 0
    }

    /// Counts a refusal of `kind`; the connection's refusals so far.
    pub fn count(&mut self, kind: TokenRequest) -> u32 {
        match kind {
            TokenRequest::Reattach => self.reattach = self.reattach.saturating_add(1),
            TokenRequest::Handoff => self.handoff = self.handoff.saturating_add(1),
        }
        self.reattach.saturating_add(self.handoff)
    }

    /// What a connection closed for its refusals is told, and the log
    /// says: "8 refused HANDOFF requests", "5 refused REATTACH and 3
    /// refused HANDOFF requests".
    pub fn summary(&self) -> String {
        match (self.reattach, self.handoff) {
            (r, 0) => format!("{r} refused REATTACH requests"),
            (0, h) => format!("{h} refused HANDOFF requests"),
            (r, h) => format!("{r} refused REATTACH and {h} refused HANDOFF requests"),
        }
    }
}

/// The line of a refused token request, rate-limited per uid (a guesser
/// reconnects and goes on); its `suppressed` counts refusals of either
/// kind. `refused` is the connection's count so far and whether it closes.
pub fn log(
    session: SessionId,
    uid: u32,
    alloc: AllocId,
    kind: TokenRequest,
    (refused, closing): (u32, bool),
) {
    if let Some(suppressed) = peer_log::TOKEN_REFUSED.check(uid) {
        warn!(
            session,
            uid,
            alloc,
            refused,
            closing,
            suppressed,
            "{} refused",
            kind.name()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_by_kind_and_uid_and_bounds_the_uids() {
        let r = TokenRefusals::default();
        r.add(TokenRequest::Handoff, 1000, 3);
        r.add(TokenRequest::Reattach, 1000, 1);
        for uid in 0..(MAX_UIDS as u32 + 10) {
            r.add(TokenRequest::Handoff, 5000 + uid, 1);
        }
        let s = r.snapshot();
        assert!(s.contains(&(TokenRequest::Handoff, Some(1000), 3)));
        assert!(s.contains(&(TokenRequest::Reattach, Some(1000), 1)));
        // 1000 and MAX_UIDS - 1 others apart; the 11 beyond share "other".
        assert!(s.contains(&(TokenRequest::Handoff, None, 11)));
        let apart: std::collections::BTreeSet<u32> = s.iter().filter_map(|(_, u, _)| *u).collect();
        assert_eq!(apart.len(), MAX_UIDS);
        let total: u64 = s.iter().map(|(_, _, n)| n).sum();
        assert_eq!(total, 3 + 1 + MAX_UIDS as u64 + 10);
    }

    #[test]
    fn a_successor_takes_the_counts_over() {
        let r = TokenRefusals::default();
        r.add(TokenRequest::Handoff, 1000, 7);
        r.add(TokenRequest::Reattach, 0, 2);
        let mut map = BTreeMap::new();
        r.to_map(&mut map);
        map.insert("token_refusals.bogus.1".into(), 5);
        map.insert("token_refusals.handoff.x".into(), 5);
        let successor = TokenRefusals::default();
        successor.restore_map(&map);
        assert_eq!(successor.snapshot(), r.snapshot());
    }

    fn summary(reattach: u32, handoff: u32) -> String {
        let mut c = OnConnection::default();
        for _ in 0..reattach {
            c.count(TokenRequest::Reattach);
        }
        for _ in 0..handoff {
            c.count(TokenRequest::Handoff);
        }
        assert_eq!(c.count(TokenRequest::Handoff), reattach + handoff + 1);
        c.handoff -= 1;
        c.summary()
    }

    #[test]
    fn the_closing_line_names_what_was_refused() {
        assert_eq!(summary(0, 8), "8 refused HANDOFF requests");
        assert_eq!(summary(8, 0), "8 refused REATTACH requests");
        assert_eq!(
            summary(5, 3),
            "5 refused REATTACH and 3 refused HANDOFF requests"
        );
    }

    #[test]
    fn a_connections_refusals_survive_its_record() {
        let mut c = OnConnection::default();
        assert!(c.is_none());
        c.count(TokenRequest::Reattach);
        c.count(TokenRequest::Reattach);
        c.count(TokenRequest::Handoff);
        let json = serde_json::to_string(&c).expect("json");
        let back: OnConnection = serde_json::from_str(&json).expect("read back");
        assert_eq!(back, c);
        assert!(!back.is_none());
        assert_eq!(
            back.summary(),
            "2 refused REATTACH and 1 refused HANDOFF requests"
        );
    }
}
