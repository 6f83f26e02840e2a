//! Keeping the daemon connection while the VMM runs: when the daemon
//! closes it (a crash or `systemctl restart`; the restarted daemon restores
//! the allocation orphaned), reconnect and re-attach the allocation with its
//! token (issue 20, `docs/protocol.md` "REATTACH").
//!
//! The VMM never stops for this: its memory stays mapped whatever happens
//! here, and a daemon keeps a region some process maps quarantined, never
//! scrubbed or reused. What is at stake is only who FREEs the allocation
//! at the end; without a re-attach the daemon releases it on its own.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use backend::client::Client;
use backend::proto::{RegionInfo, TOKEN_SIZE};
use tracing::{info, warn};

/// How often the watcher looks at the connection and at the stop flag.
const POLL_MS: u16 = 100;

/// Each connect attempt window: the stop flag is checked between windows.
const SLICE: Duration = Duration::from_millis(250);

/// The allocation a launch holds, as the watcher needs it.
#[derive(Debug, Clone)]
pub(crate) struct Held {
    /// Allocation id.
    pub(crate) id: u64,
    /// Its token (`None`: the daemon does not speak `FEATURE_REATTACH`).
    pub(crate) token: Option<[u8; TOKEN_SIZE]>,
    /// The region table the VMM mapped.
    pub(crate) regions: Vec<RegionInfo>,
}

impl Held {
    /// What the watcher needs of `alloc`.
    pub(crate) fn of(alloc: &hugemem_client::client::Allocation) -> Self {
        Self {
            id: alloc.id,
            token: alloc.token(),
            regions: alloc.regions.clone(),
        }
    }
}

/// True when the daemon closed `client`'s connection (or wrote to it,
/// which it never does between requests: treated the same).
fn closed(client: &Client, timeout_ms: u16) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    // EOF makes the socket readable; POLLHUP and POLLERR come unasked.
    let mut fds = [PollFd::new(client.socket(), PollFlags::POLLIN)];
    match poll(&mut fds, PollTimeout::from(timeout_ms)) {
        Ok(0) => false,
        Ok(_) => fds[0].revents().is_some_and(|r| !r.is_empty()),
        // EINTR: look again next round.
        Err(_) => false,
    }
}

/// Watches `client` until `stop` (the VMM exited); when the daemon closes
/// the connection, reconnects within `timeout` and re-attaches `held`.
/// Returns the connection to FREE the allocation on, or `None` when there
/// is none (re-attach impossible, refused, or the VMM exited first).
pub(crate) fn watch(
    mut client: Client,
    socket: &Path,
    held: &Held,
    timeout: Duration,
    stop: &AtomicBool,
) -> Option<Client> {
    loop {
        if stop.load(Ordering::Acquire) {
            return Some(client);
        }
        if !closed(&client, POLL_MS) {
            continue;
        }
        warn!(
            alloc = held.id,
            fd = client.socket().as_raw_fd(),
            "the daemon closed this launch's connection while the VMM runs (a daemon restart?); \
             reconnecting to re-attach the allocation"
        );
        drop(client);
        client = reconnect(socket, held, timeout, stop)?;
    }
}

/// One reconnect and re-attach, or `None` with the reason logged.
fn reconnect(socket: &Path, held: &Held, timeout: Duration, stop: &AtomicBool) -> Option<Client> {
    let kept = "the VMM keeps running on its memory (still mapped; the daemon keeps it \
                quarantined, never scrubbed or reused, until the VMM lets it go)";
    let Some(token) = held.token else {
        warn!(
            alloc = held.id,
            "the daemon gave no re-attach token for this allocation (it does not speak \
             FEATURE_REATTACH), so it cannot be re-attached; {kept}"
        );
        return None;
    };
    let started = Instant::now();
    let deadline = started + timeout;
    let mut client = loop {
        if stop.load(Ordering::Acquire) {
            warn!(
                alloc = held.id,
                "the VMM exited before the daemon came back; the allocation stays with \
                 the daemon, which releases it"
            );
            return None;
        }
        let window = (Instant::now() + SLICE).min(deadline);
        match Client::reconnect(socket, &[], window) {
            Ok(c) => break c,
            Err(e) if Instant::now() < deadline => {
                tracing::debug!(error = %e, "daemon not back yet");
            }
            Err(e) => {
                warn!(
                    alloc = held.id,
                    seconds = timeout.as_secs_f64(),
                    error = %backend::diag::chain(&e),
                    "the daemon did not come back in time; {kept}"
                );
                return None;
            }
        }
    };
    match client.reattach(held.id, token) {
        Ok(regions) => {
            let same = regions.len() == held.regions.len()
                && regions.iter().zip(&held.regions).all(|(now, mapped)| {
                    (now.region_id, now.guest_phys, now.size, now.page_size)
                        == (
                            mapped.region_id,
                            mapped.guest_phys,
                            mapped.size,
                            mapped.page_size,
                        )
                });
            if same {
                info!(
                    alloc = held.id,
                    seconds = started.elapsed().as_secs_f64(),
                    "re-attached the allocation on a new daemon connection"
                );
            } else {
                warn!(
                    alloc = held.id,
                    mapped = ?held.regions,
                    daemon = ?regions,
                    "re-attached, but the daemon's region table differs from what the VMM mapped"
                );
            }
            Some(client)
        }
        Err(e) => {
            warn!(
                alloc = held.id,
                error = %backend::diag::chain(&e),
                "the daemon refused to re-attach the allocation; {kept}"
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use backend::proto::{AllocPart, AllocRequest, ClearMode, PagePolicy};
    use std::net::Shutdown;
    use std::os::unix::net::UnixStream;
    use test_support::prelude::{serial, wait_until, TestDaemon};

    fn alloc(client: &mut Client) -> backend::client::Allocation {
        client
            .alloc(AllocRequest {
                total_size: 1 << 20,
                page_policy: PagePolicy::Base4K,
                clear_mode: ClearMode::Eager,
                lock: false,
                parts: vec![AllocPart {
                    node: 0,
                    size: 1 << 20,
                }],
                want_paths: false,
            })
            .expect("alloc")
    }

    /// Closes `client`'s connection under it, as a daemon restart would.
    fn cut(client: &Client) {
        let fd = client.socket().try_clone_to_owned().expect("dup");
        UnixStream::from(fd)
            .shutdown(Shutdown::Both)
            .expect("shutdown");
    }

    #[test]
    fn a_closed_connection_is_reattached_and_freed_on_the_new_one() {
        let _s = serial();
        let d = TestDaemon::start(|_| {});
        let mut client = d.client();
        let a = alloc(&mut client);
        let held = Held::of(&a);
        // The restarted daemon's view: the allocation is orphaned.
        assert!(d.handle().orphan_for_tests(a.id, None));
        cut(&client);
        let socket = d.socket();
        let stop = AtomicBool::new(false);
        let again = std::thread::scope(|s| {
            let w = s.spawn(|| watch(client, &socket, &held, Duration::from_secs(10), &stop));
            wait_until("the re-attach", Duration::from_secs(10), || {
                d.stats().counters.reattach_ok == 1
            });
            stop.store(true, Ordering::Release);
            w.join().expect("watcher")
        });
        let mut again = again.expect("a connection to free on");
        drop(a.fds);
        again.free(a.id).expect("FREE on the new connection");
        d.shutdown();
    }

    #[test]
    fn a_refused_reattach_gives_up_with_the_vmm_running() {
        let _s = serial();
        let d = TestDaemon::start(|_| {});
        let mut client = d.client();
        let a = alloc(&mut client);
        // Not orphaned: the daemon releases it when the connection closes,
        // and the re-attach is refused.
        let held = Held::of(&a);
        cut(&client);
        let stop = AtomicBool::new(false);
        let started = Instant::now();
        let r = watch(client, &d.socket(), &held, Duration::from_secs(10), &stop);
        assert!(r.is_none());
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "gave up at once"
        );
        assert_eq!(d.stats().counters.reattach_refused, 1);
        d.shutdown();
    }
}
