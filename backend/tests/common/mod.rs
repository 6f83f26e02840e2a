//! Helpers shared by the daemon-level test files (each test binary compiles
//! this module and uses a subset of it, hence the `dead_code` allowance).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use backend::client::Client;
use backend::daemon::{Config, Daemon, DaemonHandle};
use guest_mem::PageSize;
use serde_json::Value;

static SERIAL: Mutex<()> = Mutex::new(());

/// Serializes the tests of one binary: they share the host's huge-page pools.
pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Reserves `n` free 2 MiB pages; `false` (after printing SKIP) when impossible.
pub fn reserve_2m(n: u64, test: &str) -> bool {
    match guest_mem::ensure_free(PageSize::Huge2M, n, None) {
        Ok(r) if r.met => true,
        Ok(r) => {
            eprintln!("SKIP {test}: only {} free 2 MiB pages, {n} needed", r.free);
            false
        }
        Err(e) => {
            eprintln!("SKIP {test}: cannot reserve 2 MiB pages: {e}");
            false
        }
    }
}

/// Polls `cond` until it holds, failing the test after `timeout`.
pub fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting until {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A daemon on a socket in its own temporary directory, shut down cleanly
/// by [`TestDaemon::shutdown`] (or on drop of the handle).
pub struct TestDaemon {
    handle: Option<DaemonHandle>,
    dir: tempfile::TempDir,
}

impl TestDaemon {
    /// Starts a daemon with quick quarantine re-checks, after `tweak`.
    pub fn start(tweak: impl FnOnce(&mut Config)) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = Config {
            socket: dir.path().join("hugemem.sock"),
            ..Config::default()
        };
        cfg.pool.recheck_ms = 50;
        tweak(&mut cfg);
        let handle = Daemon::start(cfg).expect("daemon starts");
        Self {
            handle: Some(handle),
            dir,
        }
    }

    pub fn handle(&self) -> &DaemonHandle {
        self.handle.as_ref().expect("running")
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn socket(&self) -> PathBuf {
        self.handle().socket_path().to_path_buf()
    }

    pub fn client(&self) -> Client {
        let c = Client::connect(&self.socket()).expect("connect");
        c.set_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        c
    }

    pub fn stats(&self) -> Value {
        self.handle().stats()
    }

    pub fn shutdown(mut self) {
        self.handle
            .take()
            .expect("running")
            .shutdown()
            .expect("clean shutdown");
    }
}
