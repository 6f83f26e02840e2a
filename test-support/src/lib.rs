//! Helpers the workspace's tests share. Dev-only: no library or binary of the
//! project depends on this crate outside `[dev-dependencies]`.
//!
//! # Skips
//! A test whose prerequisite is missing (no KVM, no huge pages, no
//! cloud-hypervisor binary) calls [`skip!`] and returns. libtest captures
//! `println!`/`eprintln!` inside a test thread and then reports the test as
//! `ok`, which hid skips before; [`record_skip`] therefore writes straight to
//! file descriptor 2 (not through the capture) and appends one line
//! `<test> — <reason>` to the file named by [`SKIP_LOG_ENV`], which `.ci/run`
//! turns into a table and checks against its allow-list.
#![deny(missing_docs)]

pub mod cloud_hypervisor;
#[cfg(feature = "daemon")]
pub mod daemon;
#[cfg(feature = "daemon")]
pub mod fake_systemd;
#[cfg(feature = "daemon")]
pub mod faulty_disk;
pub mod fixture;
#[cfg(feature = "hugepages")]
pub mod hugepages;
pub mod installed;
#[cfg(feature = "daemon")]
pub mod lazy;
#[cfg(feature = "daemon")]
pub mod map;
#[cfg(feature = "daemon")]
pub mod metrics;
#[cfg(feature = "daemon")]
pub mod prelude;
#[cfg(feature = "daemon")]
pub mod process;
pub mod qemu_backport;
#[cfg(feature = "daemon")]
pub mod tenant;
#[cfg(feature = "daemon")]
pub mod tokens;

use std::fs::OpenOptions;
use std::io::Write;

/// Environment variable naming the file that collects skipped tests, one per line.
pub const SKIP_LOG_ENV: &str = "HUGEMEM_SKIP_LOG";

/// Separator between a skipped test's name and its reason in the log.
pub const SKIP_SEPARATOR: &str = " — ";

/// Records that the calling test skipped (all or part of its checks) and
/// why: `skip!("no /dev/kvm: {err}")`. The caller returns afterwards.
#[macro_export]
macro_rules! skip {
    ($($reason:tt)+) => {
        $crate::record_skip(&::std::format!($($reason)+))
    };
}

/// The name of the running test: `<test binary>::<test path>`, e.g.
/// `launch_ch::boots_on_fd_memory` or `backend::daemon::pool::tests::x`.
///
/// libtest runs each test on a thread named after it; the binary's name is
/// the executable's file name without cargo's `-<hash>` suffix.
pub fn current_test_name() -> String {
    let binary = std::env::current_exe()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .map(|name| match name.rsplit_once('-') {
            Some((stem, hash)) if hash.chars().all(|c| c.is_ascii_hexdigit()) => stem.to_owned(),
            _ => name,
        })
        .unwrap_or_else(|| "unknown".to_owned());
    let thread = std::thread::current();
    match thread.name() {
        Some(test) if test != "main" => format!("{binary}::{test}"),
        _ => binary,
    }
}

/// Writes `SKIP: <test>: <reason>` to stderr, uncaptured, and appends
/// `<test> — <reason>` to the file in [`SKIP_LOG_ENV`] when it is set.
/// Prefer the [`skip!`] macro.
pub fn record_skip(reason: &str) {
    let test = current_test_name();
    // One line, whatever the reason holds: the log is parsed line by line.
    let reason = reason.replace('\n', " ");
    // Straight to fd 2: `eprintln!` inside a test thread is captured by libtest.
    let _ = std::io::stderr().write_all(format!("SKIP: {test}: {reason}\n").as_bytes());
    if let Some(path) = std::env::var_os(SKIP_LOG_ENV) {
        let line = format!("{test}{SKIP_SEPARATOR}{reason}\n");
        let appended = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut file| file.write_all(line.as_bytes()));
        if let Err(e) = appended {
            // A lost skip would let CI pass without the test: make it loud.
            panic!(
                "cannot append to the skip log {}: {e}",
                path.to_string_lossy()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skip_is_appended_with_the_test_name() {
        let dir = std::env::temp_dir().join(format!("skiplog-{}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        // Only this test touches the variable in this binary.
        std::env::set_var(SKIP_LOG_ENV, &dir);
        skip!("reason with {} parts\nand a newline", 2);
        std::env::remove_var(SKIP_LOG_ENV);
        let log = std::fs::read_to_string(&dir).expect("the skip log was written");
        let _ = std::fs::remove_file(&dir);
        assert_eq!(
            log,
            "test_support::tests::a_skip_is_appended_with_the_test_name — reason with 2 parts and a newline\n"
        );
    }
}
