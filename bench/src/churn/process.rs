//! Running one VMM process to its end (`crate::harness::vmm`), and reading
//! what it and the guest said: the pieces of `hugemem bench churn` that touch processes and text.

use std::ffi::OsString;
use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use guest_mem::size::parse_size;

use crate::harness::vmm::{run_to_end, Stop, VmmRun};

/// Extra time a launch gets after SIGTERM before SIGKILL.
const KILL_GRACE: Duration = Duration::from_secs(5);

pub(super) use backend::diag::chain;

/// `HUGEMEM-GUEST pages=N nonzero=B status=S`.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct GuestLine {
    pub pages: u64,
    pub nonzero: bool,
    pub status: u64,
}

impl GuestLine {
    pub(super) fn parse(line: &str) -> Option<Self> {
        let field = |name: &str| -> Option<u64> {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
                .and_then(|v| v.parse().ok())
        };
        Some(Self {
            pages: field("pages")?,
            nonzero: field("nonzero")? != 0,
            status: field("status")?,
        })
    }
}

/// From `hugemem launch`'s summary line (`hugemem launch: 2G on 1G pages
/// allocated in 3.1 ms; …`): the ALLOC time and the page sizes.
pub(super) fn parse_launch_summary(stderr: &str) -> Option<(f64, Vec<u64>)> {
    let line = stderr
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("hugemem launch: "))?;
    let (_, rest) = line.split_once(" on ")?;
    let (pages, rest) = rest.split_once(" pages allocated in ")?;
    let (ms, _) = rest.split_once(" ms")?;
    let sizes = pages
        .split('+')
        .map(|p| parse_size(p).ok())
        .collect::<Option<Vec<u64>>>()?;
    Some((ms.parse().ok()?, sizes))
}

/// Runs `argv` to its end (`crate::harness::vmm`), `inherit` open in it
/// under their numbers: SIGTERM after `timeout` (`hugemem launch` forwards
/// it to the VMM), SIGKILL after [`KILL_GRACE`] more.
pub(super) fn run_process(
    argv: &[OsString],
    inherit: &[BorrowedFd<'_>],
    timeout: Duration,
) -> Result<VmmRun, String> {
    let stop = Stop {
        after: timeout,
        grace: Some(KILL_GRACE),
    };
    run_to_end(argv, inherit, Instant::now(), stop).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_lines() {
        assert_eq!(
            GuestLine::parse("HUGEMEM-GUEST pages=1023 nonzero=1 status=0"),
            Some(GuestLine {
                pages: 1023,
                nonzero: true,
                status: 0
            })
        );
        assert_eq!(GuestLine::parse("HUGEMEM-GUEST pages=3 status=0"), None);
        assert_eq!(
            GuestLine::parse("HUGEMEM-GUEST pages=x nonzero=0 status=0"),
            None
        );
    }

    #[test]
    fn launch_summaries() {
        let stderr = "INFO something\nhugemem launch: 2G on 1G pages allocated in 3.1 ms; \
                      the VMM ran 40.2 ms and ended with exit status 0\n";
        assert_eq!(parse_launch_summary(stderr), Some((3.1, vec![1 << 30])));
        let two = "hugemem launch: 4G on 1G+2M pages allocated in 12.0 ms; the VMM ran 1.0 ms and ended with exit status 1";
        assert_eq!(
            parse_launch_summary(two),
            Some((12.0, vec![1 << 30, 2 << 20]))
        );
        assert_eq!(parse_launch_summary("hugemem: error: no daemon"), None);
    }
}
