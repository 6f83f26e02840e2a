//! Running one VMM process to its end, and reading what it and the guest
//! said: the pieces of `hugemem bench churn` that touch processes and text.

use std::ffi::OsString;
use std::io::Read;
use std::os::fd::BorrowedFd;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use guest_mem::size::parse_size;

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

/// A finished process.
#[derive(Debug)]
pub(super) struct ProcessRun {
    pub status: ExitStatus,
    pub elapsed: Duration,
    pub stdout: String,
    pub stderr: String,
    /// When the first byte 123 (`{`) came on stdout: the micro-guest's first
    /// instruction, through the VMM's debug console on port 0x3f0.
    pub ready: Option<Duration>,
    /// When the first byte 124 (`|`) came after it: the guest has touched
    /// every page of its RAM.
    pub touched: Option<Duration>,
}

/// The guest's port-0x3f0 marks in `chunk`, read `at` since the start:
/// sets `ready` at the first 123 and `touched` at the first 124 after it.
fn stamp_marks(
    chunk: &[u8],
    at: Duration,
    ready: &mut Option<Duration>,
    touched: &mut Option<Duration>,
) {
    for &b in chunk {
        match b {
            b'{' if ready.is_none() => *ready = Some(at),
            b'|' if ready.is_some() && touched.is_none() => *touched = Some(at),
            _ => {}
        }
    }
}

impl ProcessRun {
    pub(super) fn describe(&self) -> String {
        let tail = |s: &str| -> String {
            let t = s.trim();
            let start = t.len().saturating_sub(1500);
            let start = (start..t.len())
                .find(|&i| t.is_char_boundary(i))
                .unwrap_or(t.len());
            t[start..].to_string()
        };
        format!(
            "{}; stdout {:?}; stderr tail:\n{}",
            self.status,
            tail(&self.stdout),
            tail(&self.stderr)
        )
    }
}

/// Runs `argv` to its end with stdout and stderr captured, `inherit` open
/// in it under their numbers: SIGTERM after
/// `timeout` (`hugemem launch` forwards it to the VMM), SIGKILL after
/// [`KILL_GRACE`] more. The end is seen at once: EOF on stdout, then a
/// blocking wait (no polling interval in the figure).
pub(super) fn run_process(
    argv: &[OsString],
    inherit: &[BorrowedFd<'_>],
    timeout: Duration,
) -> Result<ProcessRun, String> {
    let Some((program, args)) = argv.split_first() else {
        return Err("empty command".into());
    };
    let t0 = Instant::now();
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    crate::floor::inherit_fds(&mut cmd, inherit);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", program.to_string_lossy()))?;
    let (Some(mut stdout), Some(mut stderr)) = (child.stdout.take(), child.stderr.take()) else {
        let _ = child.kill();
        let _ = child.wait();
        return Err("the child's pipes are missing".into());
    };
    let pid = i32::try_from(child.id())
        .map(nix::unistd::Pid::from_raw)
        .map_err(|_| "child pid out of range".to_string())?;
    // The watchdog signals by pid, which is safe only while the child is not
    // reaped: it is joined before the wait below.
    let (stop, stopped) = mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        use nix::sys::signal::{kill, Signal};
        if stopped.recv_timeout(timeout) != Err(mpsc::RecvTimeoutError::Timeout) {
            return false;
        }
        let _ = kill(pid, Signal::SIGTERM);
        if stopped.recv_timeout(KILL_GRACE) == Err(mpsc::RecvTimeoutError::Timeout) {
            let _ = kill(pid, Signal::SIGKILL);
        }
        true
    });
    let err_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = stderr.read_to_end(&mut v);
        v
    });
    // Read as it comes, to time the guest's marks.
    let mut out = Vec::new();
    let (mut ready, mut touched) = (None, None);
    let mut buf = [0u8; 4096];
    let read = loop {
        match stdout.read(&mut buf) {
            Ok(0) => break Ok(()),
            Ok(n) => {
                stamp_marks(&buf[..n], t0.elapsed(), &mut ready, &mut touched);
                out.extend_from_slice(&buf[..n]);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => break Err(e),
        }
    };
    if read.is_err() {
        let _ = child.kill();
    }
    // A send error means the watchdog has finished already.
    let _ = stop.send(());
    let killed = watchdog.join().unwrap_or(false);
    let status = child.wait().map_err(|e| format!("wait: {e}"))?;
    let elapsed = t0.elapsed();
    let stderr = err_reader.join().unwrap_or_default();
    let run = ProcessRun {
        status,
        elapsed,
        stdout: String::from_utf8_lossy(&out).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
        ready,
        touched,
    };
    if let Err(e) = read {
        return Err(format!("reading its output: {e}; {}", run.describe()));
    }
    if killed {
        return Err(format!(
            "ran longer than {timeout:?} and was stopped; {}",
            run.describe()
        ));
    }
    Ok(run)
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
    fn marks_are_stamped_in_order() {
        let (mut ready, mut touched) = (None, None);
        let ms = Duration::from_millis;
        stamp_marks(b"|noise", ms(1), &mut ready, &mut touched);
        assert_eq!(
            (ready, touched),
            (None, None),
            "124 before 123 is not a mark"
        );
        stamp_marks(b"{", ms(2), &mut ready, &mut touched);
        stamp_marks(b"{HUGEMEM-GUEST|", ms(3), &mut ready, &mut touched);
        stamp_marks(b"|", ms(4), &mut ready, &mut touched);
        assert_eq!((ready, touched), (Some(ms(2)), Some(ms(3))));
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

    #[test]
    fn processes_end_or_are_stopped() {
        let argv: Vec<OsString> = ["sh", "-c", "echo out; echo err >&2; exit 3"]
            .iter()
            .map(OsString::from)
            .collect();
        let run = run_process(&argv, &[], Duration::from_secs(30)).expect("run");
        assert_eq!(run.status.code(), Some(3));
        assert_eq!(
            (run.stdout.as_str(), run.stderr.as_str()),
            ("out\n", "err\n")
        );
        let argv: Vec<OsString> = ["sleep", "30"].iter().map(OsString::from).collect();
        let err = run_process(&argv, &[], Duration::from_millis(100)).expect_err("stopped");
        assert!(err.contains("was stopped"), "{err}");
        let argv = vec![OsString::from("/nonexistent/vmm")];
        assert!(run_process(&argv, &[], Duration::from_secs(1)).is_err());
    }
}
