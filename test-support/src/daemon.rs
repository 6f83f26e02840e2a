//! A daemon for a test ([`TestDaemon`], in-process on a socket in its own
//! temporary directory), the lock that serializes a binary's tests, waits,
//! and readers of the STATS document.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use backend::client::{Allocation, Client, ClientError};
use backend::daemon::{Config, Daemon, DaemonHandle};
use backend::proto::{AllocPart, AllocRequest, ClearMode, PagePolicy, Status};
use backend::stats::{RegionStats, Stats};

static SERIAL: Mutex<()> = Mutex::new(());

/// Serializes the tests of one binary: they share the host's huge-page pools.
pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
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

    /// The running daemon.
    pub fn handle(&self) -> &DaemonHandle {
        self.handle.as_ref().expect("running")
    }

    /// The daemon's temporary directory (its socket is in it).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The daemon's socket.
    pub fn socket(&self) -> PathBuf {
        self.handle().socket_path().to_path_buf()
    }

    /// A connected client with a 60 s timeout.
    pub fn client(&self) -> Client {
        let c = Client::connect(&self.socket()).expect("connect");
        c.set_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        c
    }

    /// The daemon's STATS document.
    pub fn stats(&self) -> Stats {
        self.handle().stats()
    }

    /// Polls STATS until `cond` holds and returns that document; fails the
    /// test after `timeout`, naming `what` and showing the last STATS.
    pub fn wait_stats(
        &self,
        timeout: Duration,
        what: &str,
        cond: impl Fn(&Stats) -> bool,
    ) -> Stats {
        let deadline = Instant::now() + timeout;
        loop {
            let stats = self.stats();
            if cond(&stats) {
                return stats;
            }
            assert!(
                Instant::now() < deadline,
                "{what} did not happen within {timeout:?}; stats: {stats}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Shuts the daemon down and checks that it stopped cleanly.
    pub fn shutdown(mut self) {
        self.handle
            .take()
            .expect("running")
            .shutdown()
            .expect("clean shutdown");
    }
}

/// The status and message of a request the daemon refused; panics on
/// anything else.
pub fn refused<T: std::fmt::Debug>(r: Result<T, ClientError>) -> (Status, String) {
    match r {
        Err(ClientError::Refused { status, message }) => (status, message),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// Region `id` in STATS's `regions` list.
pub fn region(stats: &Stats, id: u64) -> Option<RegionStats> {
    stats.region(id).cloned()
}

/// The `state` of region `id` in STATS.
pub fn region_state(stats: &Stats, id: u64) -> Option<String> {
    stats.region(id).map(|r| r.state.clone())
}

/// `true` on a host whose only node with memory is node 0; otherwise the
/// test named `test` is skipped (it was written for one node) and `false`.
pub fn one_node(test: &str) -> bool {
    let topology = numa::Topology::detect().expect("topology");
    let nodes = migrate::memory_nodes(&topology);
    if nodes != [0] {
        crate::skip!("{test}: written for a host with node 0 only; this one has {nodes:?}");
        return false;
    }
    true
}

/// An eager ALLOC of `pages` 2 MiB pages on node 0; panics when refused.
pub fn alloc_2m_pages(client: &mut Client, pages: u64) -> Allocation {
    let size = pages * (2 << 20);
    client
        .alloc(AllocRequest {
            total_size: size,
            page_policy: PagePolicy::Huge2M,
            clear_mode: ClearMode::Eager,
            lock: false,
            parts: vec![AllocPart { node: 0, size }],
            want_paths: false,
        })
        .expect("ALLOC of 2 MiB pages on node 0")
}
