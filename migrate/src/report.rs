//! What a move did: [`MoveReport`], and why a page did not move
//! ([`FailReason`], mapped from the kernel's per-page errno).
//!
//! The report is `serde`-serializable so the daemon can put it in a reply and
//! the CLI can print it as JSON without a second set of types.

use std::fmt;
use std::io;

use numa::{NodeId, PageLocation};
use serde::Serialize;

/// Why a page was not moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailReason {
    /// `ENOMEM`: the kernel found no page on the target to copy into (for
    /// hugetlb: the target's pool was empty and, for 1 GiB pages, no fresh
    /// page can be made).
    NoFreeTargetPage,
    /// `EBUSY`: the page could not be isolated (pinned, e.g. by
    /// `FOLL_LONGTERM` DMA or vfio, or being migrated already).
    Busy,
    /// `EACCES`: another process (or mapping) maps the page too and the move
    /// did not use `MPOL_MF_MOVE_ALL`.
    NeedsMoveAll,
    /// `ENOENT`: the page is not present (never touched).
    NotPresent,
    /// `EFAULT`: the address is not mapped (or maps a special page).
    NotMapped,
    /// `EPERM`: moving needs a capability this process lacks.
    PermissionDenied,
    /// `ENODEV`: the target node is not online.
    NodeUnavailable,
    /// The page stayed where it was and the kernel gave no per-page status
    /// (it returns a count of failures instead, see `numa::move_pages`). The
    /// target pool had free pages afterwards, so it was not for lack of a
    /// page: typically a page that could not be isolated or copied.
    NotMigrated,
    /// Any other errno (positive).
    Errno(i32),
}

impl FailReason {
    /// The reason for a per-page errno; either sign is accepted (`move_pages`
    /// status entries are negative).
    pub fn from_errno(errno: i32) -> Self {
        match errno.checked_abs().unwrap_or(i32::MAX) {
            libc::ENOMEM => Self::NoFreeTargetPage,
            libc::EBUSY => Self::Busy,
            libc::EACCES => Self::NeedsMoveAll,
            libc::ENOENT => Self::NotPresent,
            libc::EFAULT => Self::NotMapped,
            libc::EPERM => Self::PermissionDenied,
            libc::ENODEV => Self::NodeUnavailable,
            other => Self::Errno(other),
        }
    }
}

impl fmt::Display for FailReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoFreeTargetPage => f.write_str("no free page on the target"),
            Self::Busy => f.write_str("page busy (pinned or being migrated)"),
            Self::NeedsMoveAll => f.write_str("mapped by other processes: needs MOVE_ALL"),
            Self::NotPresent => f.write_str("not present"),
            Self::NotMapped => f.write_str("not mapped"),
            Self::PermissionDenied => {
                f.write_str("permission denied (MOVE_ALL needs CAP_SYS_NICE)")
            }
            Self::NodeUnavailable => f.write_str("target node not online"),
            Self::NotMigrated => f.write_str("the kernel did not migrate it (no per-page status)"),
            Self::Errno(e) => write!(f, "errno {e} ({})", io::Error::from_raw_os_error(*e)),
        }
    }
}

/// A page that did not move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct FailedPage {
    /// Page index in the mapping.
    pub page: usize,
    /// Why.
    pub reason: FailReason,
}

/// A page that verification found away from the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct StrayPage {
    /// Page index in the mapping.
    pub page: usize,
    /// The node it is on, when the query could say.
    pub node: Option<NodeId>,
    /// The (negative) errno of the query, when it could not.
    pub errno: Option<i32>,
}

impl StrayPage {
    /// From a query result.
    pub fn new(page: usize, loc: PageLocation) -> Self {
        match loc {
            PageLocation::Node(n) => Self {
                page,
                node: Some(n),
                errno: None,
            },
            PageLocation::Error(e) => Self {
                page,
                node: None,
                errno: Some(e),
            },
        }
    }
}

/// What [`crate::move_range`] did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MoveReport {
    /// The target node.
    pub target: NodeId,
    /// Page size in bytes.
    pub page_size: u64,
    /// First page of the range (index into the mapping).
    pub first_page: usize,
    /// Pages in the range.
    pub pages_total: usize,
    /// Pages moved to the target by this call.
    pub pages_moved: usize,
    /// Pages that were on the target already.
    pub already_there: usize,
    /// Pages not present (never touched): nothing to move; the new policy
    /// places them on the target when they are touched.
    pub not_present: usize,
    /// Pages that did not move, with the reason.
    pub failed: Vec<FailedPage>,
    /// Present pages that the final `move_pages` query found away from the
    /// target (failed pages are here too; a page here but not in `failed`
    /// moved and then went elsewhere, or was never attempted because the
    /// move was cut short).
    pub not_on_target: Vec<StrayPage>,
    /// Whether the final query ran (not after cancellation or an error).
    pub verified: bool,
    /// Bytes moved (`pages_moved * page_size`).
    pub bytes_moved: u64,
    /// Seconds spent in the move batches (rate-limit waits included).
    pub seconds: f64,
    /// `bytes_moved / seconds`, GB/s (10^9).
    pub gb_per_s: f64,
    /// `move_pages` calls made.
    pub batches: usize,
    /// The plan's one-line summary.
    pub plan: String,
}

impl MoveReport {
    /// Pages that did not move (for the REBALANCE reply).
    pub fn pages_failed(&self) -> usize {
        self.failed.len()
    }

    /// True when every present page of the range is on the target and
    /// verification ran.
    pub fn complete(&self) -> bool {
        self.verified && self.failed.is_empty() && self.not_on_target.is_empty()
    }

    /// Failed pages counted by reason, most frequent first.
    pub fn failure_counts(&self) -> Vec<(FailReason, usize)> {
        let mut counts: Vec<(FailReason, usize)> = Vec::new();
        for f in &self.failed {
            match counts.iter_mut().find(|(r, _)| *r == f.reason) {
                Some((_, n)) => *n += 1,
                None => counts.push((f.reason, 1)),
            }
        }
        counts.sort_by_key(|c| std::cmp::Reverse(c.1));
        counts
    }
}

pub(crate) use guest_mem::size::gb_per_s;

impl fmt::Display for MoveReport {
    /// `node 1: 30 moved, 2 already there, 0 not present, 2 failed (2 no free
    /// page on the target) in 0.120 s (0.52 GB/s)`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "node {}: {} moved, {} already there, {} not present, {} failed",
            self.target,
            self.pages_moved,
            self.already_there,
            self.not_present,
            self.failed.len()
        )?;
        let counts = self.failure_counts();
        if !counts.is_empty() {
            let parts: Vec<String> = counts.iter().map(|(r, n)| format!("{n} {r}")).collect();
            write!(f, " ({})", parts.join(", "))?;
        }
        write!(f, " in {:.3} s ({:.2} GB/s)", self.seconds, self.gb_per_s)?;
        if self.verified && !self.not_on_target.is_empty() {
            write!(f, "; {} pages not on the target", self.not_on_target.len())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_maps_to_reason() {
        let cases = [
            (
                libc::ENOMEM,
                FailReason::NoFreeTargetPage,
                "no free page on the target",
            ),
            (
                libc::EBUSY,
                FailReason::Busy,
                "page busy (pinned or being migrated)",
            ),
            (
                libc::EACCES,
                FailReason::NeedsMoveAll,
                "mapped by other processes: needs MOVE_ALL",
            ),
            (libc::ENOENT, FailReason::NotPresent, "not present"),
            (libc::EFAULT, FailReason::NotMapped, "not mapped"),
            (
                libc::EPERM,
                FailReason::PermissionDenied,
                "permission denied (MOVE_ALL needs CAP_SYS_NICE)",
            ),
            (
                libc::ENODEV,
                FailReason::NodeUnavailable,
                "target node not online",
            ),
        ];
        for (errno, reason, text) in cases {
            assert_eq!(FailReason::from_errno(-errno), reason);
            assert_eq!(FailReason::from_errno(errno), reason);
            assert_eq!(reason.to_string(), text);
        }
        let other = FailReason::from_errno(-libc::EIO);
        assert_eq!(other, FailReason::Errno(libc::EIO));
        assert!(other.to_string().starts_with("errno 5 ("), "{other}");
        // i32::MIN has no absolute value: kept as an unknown errno.
        assert_eq!(
            FailReason::from_errno(i32::MIN),
            FailReason::Errno(i32::MAX)
        );
    }

    #[test]
    fn report_counts_and_serializes() {
        let report = MoveReport {
            target: 1,
            page_size: 2 << 20,
            first_page: 0,
            pages_total: 6,
            pages_moved: 2,
            already_there: 1,
            not_present: 0,
            failed: vec![
                FailedPage {
                    page: 3,
                    reason: FailReason::Busy,
                },
                FailedPage {
                    page: 4,
                    reason: FailReason::NoFreeTargetPage,
                },
                FailedPage {
                    page: 5,
                    reason: FailReason::NoFreeTargetPage,
                },
            ],
            not_on_target: vec![StrayPage::new(3, PageLocation::Node(0))],
            verified: true,
            bytes_moved: 4 << 20,
            seconds: 0.5,
            gb_per_s: gb_per_s(4 << 20, 0.5),
            batches: 1,
            plan: String::new(),
        };
        assert_eq!(report.pages_failed(), 3);
        assert!(!report.complete());
        assert_eq!(
            report.failure_counts(),
            vec![(FailReason::NoFreeTargetPage, 2), (FailReason::Busy, 1)]
        );
        assert_eq!(
            report.to_string(),
            "node 1: 2 moved, 1 already there, 0 not present, 3 failed (2 no free page on the \
             target, 1 page busy (pinned or being migrated)) in 0.500 s (0.01 GB/s); 1 pages not on the target"
        );
        let json = serde_json::to_value(&report).expect("serialize");
        assert_eq!(json["failed"][1]["reason"], "no_free_target_page");
        assert_eq!(json["not_on_target"][0]["node"], 0);
        let errno = serde_json::to_value(FailReason::Errno(5)).expect("serialize");
        assert_eq!(errno, serde_json::json!({"errno": 5}));
    }

    #[test]
    fn rate_of_nothing_is_zero() {
        assert_eq!(gb_per_s(1 << 30, 0.0), 0.0);
        assert!((gb_per_s(2_000_000_000, 2.0) - 1.0).abs() < 1e-12);
    }
}
