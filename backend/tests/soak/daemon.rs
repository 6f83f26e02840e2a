//! The parent's side: one live in-process daemon that the parent takes
//! over now and then while the tenants run (`takeover::receive` and
//! `Daemon::start_inherited`, as `hugemem serve --takeover` does), the
//! orphaning service that stands for a restart (a tenant asks over its
//! control socket, the parent orphans the allocation with
//! `DaemonHandle::orphan_for_tests`, the tenant takes it back with
//! REATTACH), and the books that must balance.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use backend::client::Client;
use backend::daemon::{restart::takeover, Config, Daemon, DaemonHandle};
use backend::stats::Stats;

/// One daemon at a time, replaced by its successor at each takeover.
pub struct SoakDaemon {
    cfg: Config,
    dir: tempfile::TempDir,
    current: Mutex<Option<DaemonHandle>>,
}

impl SoakDaemon {
    /// Starts a daemon on a socket in a new temporary directory, after `tweak`.
    pub fn start(tweak: impl FnOnce(&mut Config)) -> Arc<Self> {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = Config {
            socket: dir.path().join("hugemem.sock"),
            ..Config::default()
        };
        cfg.pool.recheck_ms = 50;
        tweak(&mut cfg);
        let handle = Daemon::start(cfg.clone()).expect("daemon starts");
        Arc::new(Self {
            cfg,
            dir,
            current: Mutex::new(Some(handle)),
        })
    }

    fn handle(&self) -> MutexGuard<'_, Option<DaemonHandle>> {
        self.current.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The daemon's directory (its socket is in it).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The socket.
    pub fn socket(&self) -> PathBuf {
        self.cfg.socket.clone()
    }

    /// A connected client with a 60 s timeout.
    pub fn client(&self) -> Client {
        let c = Client::connect(&self.cfg.socket).expect("connect");
        c.set_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        c
    }

    /// The running daemon's STATS.
    pub fn stats(&self) -> Stats {
        self.handle().as_ref().expect("a daemon runs").stats()
    }

    /// A takeover: a successor receives everything from the running
    /// daemon and serves; the predecessor exits. Returns the predecessor's
    /// STATS as it stood frozen: nothing moves in it once it handed over,
    /// so its books must balance exactly.
    pub fn takeover(&self) -> Result<Stats, String> {
        let mut current = self.handle();
        let inherited = takeover::receive(&self.cfg.socket)
            .map_err(|e| format!("the successor did not receive the state: {e}"))?;
        let new = Daemon::start_inherited(self.cfg.clone(), inherited)
            .map_err(|e| format!("the successor did not start: {e}"))?;
        let old = current.replace(new).ok_or("no daemon ran")?;
        let frozen = old.stats();
        old.shutdown()
            .map_err(|e| format!("the predecessor did not exit cleanly: {e}"))?;
        Ok(frozen)
    }

    /// Orphans allocation `alloc` in the running daemon (a stand-in for a
    /// restart: its connection no longer owns it, its token takes it back).
    pub fn orphan(&self, alloc: u64) -> bool {
        self.handle()
            .as_ref()
            .is_some_and(|h| h.orphan_for_tests(alloc, None))
    }

    /// Shuts the running daemon down cleanly.
    pub fn shutdown(&self) {
        if let Some(h) = self.handle().take() {
            h.shutdown().expect("clean shutdown");
        }
    }
}

/// Serves one tenant's orphan requests until it closes its end: an
/// allocation id in (8 bytes), 1 (orphaned) or 0 (unknown) out.
pub fn serve_orphans(d: Arc<SoakDaemon>, mut ctl: UnixStream) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut served = 0;
        let mut id = [0u8; 8];
        while ctl.read_exact(&mut id).is_ok() {
            let ok = d.orphan(u64::from_le_bytes(id));
            if ctl.write_all(&[u8::from(ok)]).is_err() {
                break;
            }
            served += 1;
        }
        served
    })
}

/// The tenant's side of [`serve_orphans`]: asks the parent to orphan
/// `alloc`; true once it did.
pub fn ask_orphan(ctl: &mut UnixStream, alloc: u64) -> Result<bool, String> {
    ctl.write_all(&alloc.to_le_bytes())
        .map_err(|e| format!("ask the parent to orphan {alloc}: {e}"))?;
    let mut ok = [0u8; 1];
    ctl.read_exact(&mut ok)
        .map_err(|e| format!("the parent's answer on orphaning {alloc}: {e}"))?;
    Ok(ok[0] == 1)
}

/// The books of one STATS document: allocations made − released ==
/// active, regions created − released == held, every parked VM an active
/// allocation of its own, its bytes within the allocations' bytes and the
/// regions in use. `None` when they balance, else what does not.
pub fn unbalanced(s: &Stats) -> Option<String> {
    let c = &s.counters;
    let mut wrong = Vec::new();
    if c.allocs_ok.checked_sub(c.allocs_released) != Some(s.allocations.active) {
        wrong.push(format!(
            "allocations made {} − released {} ≠ active {}",
            c.allocs_ok, c.allocs_released, s.allocations.active
        ));
    }
    let t = &s.totals;
    if t.created_bytes.checked_sub(t.released_bytes) != Some(t.held_bytes) {
        wrong.push(format!(
            "bytes created {} − released {} ≠ held {}",
            t.created_bytes, t.released_bytes, t.held_bytes
        ));
    }
    let mut allocs: Vec<u64> = s.parked.iter().map(|p| p.alloc).collect();
    allocs.sort_unstable();
    allocs.dedup();
    let parked_bytes: u64 = s.parked.iter().map(|p| p.bytes).sum();
    let in_use = s.pool_sum(|p| p.in_use_bytes);
    if allocs.len() != s.parked.len()
        || s.parked.len() as u64 > s.allocations.active
        || parked_bytes > s.allocations.bytes
        || parked_bytes > in_use
    {
        wrong.push(format!(
            "parked VMs {:?} (bytes {parked_bytes}) against {} active allocations of {} bytes, {in_use} bytes in use",
            s.parked
                .iter()
                .map(|p| (p.uid, &p.name, p.alloc, p.bytes))
                .collect::<Vec<_>>(),
            s.allocations.active,
            s.allocations.bytes
        ));
    }
    (!wrong.is_empty()).then(|| wrong.join("; "))
}
