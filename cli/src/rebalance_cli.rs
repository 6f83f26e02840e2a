//! `hugemem rebalance`: the operator's client side of REBALANCE. A client
//! like any VMM's (a new connection; the daemon's operator model decides
//! what it may move), so it lives outside the daemon.

use std::collections::BTreeMap;
use std::path::Path;

use migrate::{ByteRange, PlanError};
use numa::NodeId;

/// A region id, as in ALLOC replies.
type RegionId = u64;

/// Errors of `hugemem rebalance`.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Talking to the daemon failed, or it refused.
    #[error(transparent)]
    Client(#[from] hugemem_client::client::ClientError),
    /// `--range` does not parse.
    #[error("invalid --range")]
    Range(#[source] PlanError),
    /// `--range` is empty.
    #[error("--range {0:?} is empty")]
    EmptyRange(String),
}

/// Parses `--range` into the request's (offset, len); an open end (`A..`,
/// `..`) is len 0, "to the end", so the region's size need not be known.
///
/// # Errors
///
/// [`CliError::Range`] for bad syntax, [`CliError::EmptyRange`] for `A..A`.
pub fn parse_cli_range(text: &str) -> Result<(u64, u64), CliError> {
    let r = ByteRange::parse(text, u64::MAX).map_err(CliError::Range)?;
    if text.trim().ends_with("..") {
        return Ok((r.offset, 0));
    }
    if r.len == 0 {
        return Err(CliError::EmptyRange(text.to_string()));
    }
    Ok((r.offset, r.len))
}

/// What `hugemem rebalance` did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CliReport {
    /// The region.
    pub region: RegionId,
    /// The target node.
    pub node: NodeId,
    /// Pages moved.
    pub pages_moved: u64,
    /// Pages that did not move.
    pub pages_failed: u64,
    /// Pages per node afterwards (from STATS), when the daemon listed the region.
    pub placement: Option<BTreeMap<u32, u64>>,
}

impl std::fmt::Display for CliReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "region {} -> node {}: {} pages moved, {} failed",
            self.region, self.node, self.pages_moved, self.pages_failed
        )?;
        if let Some(p) = &self.placement {
            let parts: Vec<String> = p.iter().map(|(n, c)| format!("node {n}: {c}")).collect();
            write!(f, "; placement now {}", parts.join(", "))?;
        }
        Ok(())
    }
}

/// `hugemem rebalance --region R --to-node N [--range A..B]`: sends
/// REBALANCE on a new connection (the operator model applies: see the
/// module docs) and reads the region's placement back from STATS.
///
/// # Errors
///
/// [`CliError`]; a refusal carries the daemon's status and reason.
pub fn run_cli(
    socket: &Path,
    region: RegionId,
    node: NodeId,
    range: Option<&str>,
) -> Result<CliReport, CliError> {
    let (offset, len) = match range {
        Some(r) => parse_cli_range(r)?,
        None => (0, 0),
    };
    let mut client = hugemem_client::client::Client::connect(socket)?;
    let (pages_moved, pages_failed) = client.rebalance(region, offset, len, node)?;
    let placement = client
        .stats()
        .ok()
        .and_then(|s| s.region(region)?.placement.clone().flatten());
    Ok(CliReport {
        region,
        node,
        pages_moved,
        pages_failed,
        placement,
    })
}

// ---------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_ranges() {
        assert_eq!(parse_cli_range("1G..3G").expect("ok"), (1 << 30, 2 << 30));
        assert_eq!(parse_cli_range("2M..").expect("ok"), (2 << 20, 0));
        assert_eq!(parse_cli_range("..").expect("ok"), (0, 0));
        assert_eq!(parse_cli_range("..4M").expect("ok"), (0, 4 << 20));
        assert!(matches!(
            parse_cli_range("2M..2M"),
            Err(CliError::EmptyRange(_))
        ));
        assert!(matches!(parse_cli_range("3G..1G"), Err(CliError::Range(_))));
        assert!(matches!(parse_cli_range("lots"), Err(CliError::Range(_))));
    }
}
