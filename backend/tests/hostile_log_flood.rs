//! A token-guessing flood must not fill the disk: a tenant that guesses
//! HANDOFF and REATTACH tokens as fast as it can, reconnecting each time
//! the daemon closes it after 8 refusals, gets its log lines rate-limited
//! per uid (suppressed lines counted in the next line), every refusal
//! counted on `/metrics` by kind and uid, and cannot silence another
//! uid's lines.
//!
//! The daemon runs in this process; its log is captured as the shipped
//! daemon writes it (`tracing_subscriber::fmt` at INFO, without colours).
//! The flooding tenant is a forked child running as another uid.

use test_support::prelude::{http_get, parse_openmetrics, serial, TestDaemon};
use test_support::tenant::{in_child, root_or_skip, say, NOBODY};

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use backend::client::{Client, ClientError};
use backend::proto::{Status, TOKEN_SIZE};

/// Connections of the flood that guess 8 HANDOFF tokens each.
const HANDOFF_CONNECTIONS: u64 = 1250;
/// Connections of the flood that guess 5 REATTACH and then 3 HANDOFF tokens.
const MIXED_CONNECTIONS: u64 = 50;
/// Refusals after which the daemon closes a connection.
const REFUSALS_PER_CONNECTION: u64 = 8;
/// How long the daemon may take to settle (every session closed).
const SETTLE: Duration = Duration::from_secs(60);
/// A little over the daemon's rate-limit period (1 s): a line after this
/// long is let through again, and reports what its uid's lines suppressed
/// before it.
const A_PERIOD_AND_MORE: Duration = Duration::from_millis(1100);

/// Everything the process logged, as the daemon writes it.
static LOG: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOG.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Captures the process's log at INFO, the shipped daemon's level and
/// format (`cli`'s `main`), without colour codes.
fn capture_log() {
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_writer(|| LogWriter)
        .finish();
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
}

fn log_len() -> usize {
    LOG.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .len()
}

fn log_text() -> String {
    let log = LOG
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    String::from_utf8_lossy(&log).into_owned()
}

/// A guess: an id and token nobody was given.
fn guess(i: u64) -> (u64, [u8; TOKEN_SIZE]) {
    (1_000_000 + i, [(i % 251) as u8; TOKEN_SIZE])
}

/// One connection that guesses `reattach` REATTACH then `handoff` HANDOFF
/// tokens, each refused as an unknown id; after the 8th refusal the daemon
/// must have closed it. Err: the child's exit code.
fn guessing_connection(socket: &Path, i: u64, reattach: u64, handoff: u64) -> Result<(), i32> {
    let mut c = Client::connect(socket).map_err(|_| 10)?;
    let refused = |r: Result<(), ClientError>| match r {
        Err(ClientError::Refused {
            status: Status::NotFound,
            ..
        }) => Ok(()),
        Err(e) => {
            say(&format!("unexpected answer to a guess: {e}"));
            Err(20)
        }
        Ok(()) => Err(30),
    };
    for n in 0..reattach + handoff {
        let (id, token) = guess(i * REFUSALS_PER_CONNECTION + n);
        if n < reattach {
            refused(c.reattach(id, token).map(drop))?;
        } else {
            refused(c.handoff(id, token, false).map(drop))?;
        }
    }
    if reattach + handoff >= REFUSALS_PER_CONNECTION && c.stats().is_ok() {
        say("the daemon kept a connection open after 8 refusals");
        return Err(40);
    }
    Ok(())
}

/// The flood, in a child running as [`NOBODY`].
fn flood(socket: std::path::PathBuf) -> i32 {
    in_child(Some(NOBODY), move || {
        for i in 0..HANDOFF_CONNECTIONS {
            if let Err(code) = guessing_connection(&socket, i, 0, REFUSALS_PER_CONNECTION) {
                return code;
            }
        }
        for i in 0..MIXED_CONNECTIONS {
            let i = HANDOFF_CONNECTIONS + i;
            if let Err(code) = guessing_connection(&socket, i, 5, 3) {
                return code;
            }
        }
        0
    })
}

/// The value of `key=` in a log line, when it is a number.
fn field(line: &str, key: &str) -> Option<u64> {
    let at = line.find(&format!(" {key}="))?;
    let rest = &line[at + key.len() + 2..];
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// Log lines of `uid` whose message is `message` (at `level`), and what
/// they report suppressed, summed.
fn lines_of(log: &str, level: &str, message: &str, uid: u32) -> (u64, u64) {
    let mut lines = 0;
    let mut suppressed = 0;
    for line in log.lines() {
        let Some((head, rest)) = line.split_once(": ") else {
            continue;
        };
        let is_it = head.contains(level)
            && rest
                .strip_prefix(message)
                .is_some_and(|after| after.starts_with(' '));
        if is_it && field(rest, "uid") == Some(u64::from(uid)) {
            lines += 1;
            suppressed += field(rest, "suppressed").unwrap_or(0);
        }
    }
    (lines, suppressed)
}

/// A refused HANDOFF of uid 0 while `NOBODY` floods; its line must be
/// logged (per-uid limits: another uid's flood does not silence it).
fn refusal_of_another_uid(d: &TestDaemon, total: u64) {
    d.wait_stats(SETTLE, "the flood to be under way", |s| {
        s.counters.handoff_refused >= 2000
    });
    let before = log_len();
    let mut root = d.client();
    let (id, token) = guess(u64::from(u32::MAX));
    let r = root.handoff(id, token, false);
    assert!(
        matches!(
            r,
            Err(ClientError::Refused {
                status: Status::NotFound,
                ..
            })
        ),
        "{r:?}"
    );
    let s = d.stats();
    assert!(
        s.counters.handoff_refused + s.counters.reattach_refused < total,
        "the flood ended before uid 0's refusal; it proves nothing"
    );
    drop(root);
    let log = log_text();
    let during = &log[before..];
    assert_eq!(
        lines_of(during, "WARN", "HANDOFF refused", 0).0,
        1,
        "uid 0's refusal during uid {NOBODY}'s flood was not logged:\n{during}"
    );
}

/// The `/metrics` samples of the refusals of `uid` by kind.
fn refusals_on_metrics(d: &TestDaemon, kind: &str, uid: u32) -> f64 {
    let addr = d.handle().metrics_addr().expect("metrics on");
    let (status, _, body) = http_get(addr, "GET", "/metrics");
    assert!(status.contains("200"), "{status}");
    let m = parse_openmetrics(&body);
    let series = format!("hugemem_token_refusals_total{{kind=\"{kind}\",uid=\"{uid}\"}}");
    *m.get(&series)
        .unwrap_or_else(|| panic!("{series} not on /metrics:\n{body}"))
}

/// One connection of `NOBODY` with `reattach` + `handoff` guesses, after
/// each rate limit has earned a line again.
fn after_a_period(d: &TestDaemon, i: u64, reattach: u64, handoff: u64) {
    std::thread::sleep(A_PERIOD_AND_MORE);
    let socket = d.socket();
    let code = in_child(Some(NOBODY), move || {
        match guessing_connection(&socket, i, reattach, handoff) {
            Ok(()) => 0,
            Err(code) => code,
        }
    });
    assert_eq!(code, 0, "a guessing connection (see its exit code)");
    d.wait_stats(SETTLE, "every session to end", |s| s.sessions.active == 0);
}

/// 10,000 refused HANDOFFs and 250 refused REATTACHes from one uid, over
/// 1,300 connections the daemon closes after 8 refusals each: the log
/// stays a few lines a second, its suppressed counts add up to the
/// refusals, `/metrics` counts each refusal by kind and uid, another uid's
/// refusal during the flood is logged, and the closing lines name what was
/// refused.
#[test]
fn a_token_guessing_flood_is_counted_not_logged_line_by_line() {
    let _g = serial();
    if !root_or_skip() {
        return;
    }
    capture_log();
    let d = TestDaemon::start(|c| {
        c.allowed_uids = vec![0, NOBODY];
        c.metrics.listen = Some("127.0.0.1:0".parse().expect("addr"));
    });
    for (path, mode) in [(d.dir(), 0o755), (d.socket().as_path(), 0o777)] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }
    let flood_handoffs = HANDOFF_CONNECTIONS * REFUSALS_PER_CONNECTION + MIXED_CONNECTIONS * 3;
    let flood_reattaches = MIXED_CONNECTIONS * 5;
    let flood_refusals = flood_handoffs + flood_reattaches;

    // The flood, and uid 0's refusal in its middle.
    let start_bytes = log_len();
    let started = Instant::now();
    let socket = d.socket();
    let flooder = std::thread::spawn(move || flood(socket));
    refusal_of_another_uid(&d, flood_refusals);
    assert_eq!(flooder.join().expect("flood thread"), 0, "the flood child");
    d.wait_stats(SETTLE, "every session to end", |s| s.sessions.active == 0);
    let seconds = started.elapsed().as_secs_f64();
    let flood_bytes = (log_len() - start_bytes) as u64;
    let per_10k = flood_bytes * 10_000 / flood_refusals;
    eprintln!(
        "flood: {flood_refusals} refusals over {} connections in {seconds:.1} s: \
         {flood_bytes} bytes of log, {per_10k} bytes per 10,000 refusals",
        HANDOFF_CONNECTIONS + MIXED_CONNECTIONS
    );

    // Each limit earns a line again; the next line of each reports what the
    // flood's lines suppressed. A mixed connection names both kinds when
    // it is closed; its refusals are reported by one more guess.
    after_a_period(&d, HANDOFF_CONNECTIONS + MIXED_CONNECTIONS, 5, 3);
    after_a_period(&d, HANDOFF_CONNECTIONS + MIXED_CONNECTIONS + 1, 0, 1);
    let handoffs = flood_handoffs + 3 + 1;
    let reattaches = flood_reattaches + 5;
    let connections = HANDOFF_CONNECTIONS + MIXED_CONNECTIONS + 2;

    let log = log_text();
    // Every line of uid NOBODY's refusals, and what each reports
    // suppressed, account for every refusal exactly.
    let (h_lines, h_suppressed) = lines_of(&log, "WARN", "HANDOFF refused", NOBODY);
    let (r_lines, r_suppressed) = lines_of(&log, "WARN", "REATTACH refused", NOBODY);
    assert_eq!(
        h_lines + r_lines + h_suppressed + r_suppressed,
        handoffs + reattaches,
        "refusal lines ({h_lines} HANDOFF, {r_lines} REATTACH) plus suppressed counts"
    );
    for message in ["session started", "session ended"] {
        let (lines, suppressed) = lines_of(&log, "INFO", message, NOBODY);
        assert_eq!(
            lines + suppressed,
            connections,
            "{message}: lines plus suppressed"
        );
    }
    let (lines, suppressed) = lines_of(&log, "WARN", "closing connection", NOBODY);
    // The last connection ended on its own (no refusal closed it).
    assert_eq!(
        lines + suppressed,
        connections - 1,
        "closing lines plus suppressed"
    );
    assert!(
        log.contains("8 refused HANDOFF requests on one connection"),
        "no closing line names 8 refused HANDOFFs:\n{log}"
    );
    assert!(
        log.contains("5 refused REATTACH and 3 refused HANDOFF requests on one connection"),
        "the mixed connection's closing line does not name both kinds:\n{log}"
    );

    // The bound: four per-uid limits are at work (refusals and closings
    // with a burst of 1, session starts and ends with a burst of 4), each
    // earns one line a second after its burst, and every line is under 400
    // bytes; uid 0's few lines and the scrape fit in 4 KiB of headroom.
    let earned = seconds.ceil() as u64;
    let lines = 2 * (1 + earned) + 2 * (4 + earned);
    let bound = lines * 400 + 4096;
    assert!(
        flood_bytes <= bound,
        "{flood_bytes} bytes of log for {flood_refusals} refusals in {seconds:.1} s (bound {bound})"
    );

    // `/metrics` counts every refusal by kind and uid; the totals stay.
    assert_eq!(refusals_on_metrics(&d, "handoff", NOBODY), handoffs as f64);
    assert_eq!(
        refusals_on_metrics(&d, "reattach", NOBODY),
        reattaches as f64
    );
    assert_eq!(refusals_on_metrics(&d, "handoff", 0), 1.0);
    let s = d.stats();
    assert_eq!(s.counters.handoff_refused, handoffs + 1);
    assert_eq!(s.counters.reattach_refused, reattaches);
    d.shutdown();
}
