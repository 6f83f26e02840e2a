//! Keeping the daemon connection while the VMM runs: when the daemon
//! closes it (a crash or `systemctl restart`; the restarted daemon restores
//! the allocation orphaned), reconnect and re-attach the allocation with its
//! token (`docs/protocol.md` "REATTACH").
//!
//! The VMM never stops for this: its memory stays mapped whatever happens
//! here, and a daemon keeps a region some process maps quarantined, never
//! scrubbed or reused. What is at stake is only who FREEs the allocation
//! at the end; without a re-attach the daemon releases it on its own.
//!
//! The watcher sleeps in `poll` on the connection and on the VMM's exit
//! event (`exit_event.rs`), with no timeout: the exit wakes it at once, so
//! the launch's FREE follows the VMM's exit without a polling delay.
//!
//! A live update moves the allocation to a connection of its own (HANDOFF,
//! `update/`) and posts that connection in its mailbox, which is in the
//! same `poll` set: the watcher then watches the new connection, and the
//! old one, which owns nothing any more, is closed.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use hugemem_client::client::{Client, ClientError};
use hugemem_client::diag::chain;
use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use tracing::{debug, info, warn};

use super::allocation::HeldAllocation;
use super::exit_event::ExitEvent;
use super::update::SuccessorMailbox;

/// First wait between connect attempts while the daemon is not back; it
/// doubles up to [`LAST_RETRY`] (the backoff of `Client::reconnect`). A
/// timer, because nothing the launch can wait on says "listening again":
/// the socket file appears at `bind`, before `listen`, and under socket
/// activation or a takeover it never goes away. The VMM's exit still ends
/// the wait at once: the exit event is in the same `poll` set.
const FIRST_RETRY: Duration = Duration::from_millis(10);
/// Longest wait between connect attempts.
const LAST_RETRY: Duration = Duration::from_millis(200);
/// A reply timeout is refused by the socket call when zero: at least this.
const MIN_REPLY_WAIT: Duration = Duration::from_millis(10);

/// What woke the watcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Woken {
    /// The VMM exited: time to give the connection back for FREE.
    VmmExited,
    /// The daemon closed the connection (or wrote to it, which it never
    /// does between requests: treated the same).
    DaemonClosed,
    /// A live update handed the allocation to a new connection.
    Successor,
}

/// Sleeps until the VMM exits, the daemon closes `client`'s connection or
/// a successor connection arrives, whichever comes first; no timeout.
fn wait(client: &Client, exit: &ExitEvent, successor: Option<&SuccessorMailbox>) -> Woken {
    loop {
        // EOF makes the socket readable; POLLHUP and POLLERR come unasked.
        let mut fds = vec![
            PollFd::new(exit.fd(), PollFlags::POLLIN),
            PollFd::new(client.socket(), PollFlags::POLLIN),
        ];
        if let Some(s) = successor {
            fds.push(PollFd::new(s.fd(), PollFlags::POLLIN));
        }
        let ready = |fds: &[PollFd<'_>], i: usize| {
            fds.get(i)
                .and_then(PollFd::revents)
                .is_some_and(|r| !r.is_empty())
        };
        match poll(&mut fds, PollTimeout::NONE) {
            // The exit first: when both happened, FREE is what is left to do.
            Ok(_) if exit.fired() => return Woken::VmmExited,
            // Before the old connection: it may close once it owns nothing.
            Ok(_) if ready(&fds, 2) => return Woken::Successor,
            Ok(_) if ready(&fds, 1) => return Woken::DaemonClosed,
            Ok(_) | Err(Errno::EINTR) => {}
            Err(e) => {
                // ENOMEM (or a bug): not a reason to lose the FREE; try again
                // after a pause rather than spin.
                warn!(error = %e, "cannot poll the daemon connection; trying again");
                let mut exit_only = [PollFd::new(exit.fd(), PollFlags::POLLIN)];
                let _ = poll(&mut exit_only, PollTimeout::from(100u16));
            }
        }
    }
}

/// Watches `client` until the VMM exits (`exit` fires); when the daemon
/// closes the connection, reconnects within `timeout` and re-attaches
/// `held`. Returns the connection to FREE the allocation on, or `None` when
/// there is none (re-attach impossible, refused, or the VMM exited first).
pub(crate) fn watch(
    mut client: Client,
    socket: &Path,
    held: &HeldAllocation,
    timeout: Duration,
    exit: &ExitEvent,
    successor: Option<&SuccessorMailbox>,
) -> Option<Client> {
    let mut held = held.clone();
    loop {
        match wait(&client, exit, successor) {
            Woken::Successor => {
                if let Some((next, next_held)) = successor.and_then(SuccessorMailbox::take) {
                    info!(
                        alloc = next_held.id,
                        "a live update moved the allocation to a new daemon connection; \
                         watching that one (the old one owns nothing now)"
                    );
                    client = next;
                    held = next_held;
                }
            }
            Woken::VmmExited => {
                debug!(
                    alloc = held.id,
                    "the VMM's exit woke the daemon watcher; handing its connection back for FREE"
                );
                return Some(client);
            }
            Woken::DaemonClosed => {
                warn!(
                    alloc = held.id,
                    fd = client.socket().as_raw_fd(),
                    "the daemon closed this launch's connection while the VMM runs (a daemon \
                     restart?); reconnecting to re-attach the allocation"
                );
                drop(client);
                client = reconnect(socket, &held, timeout, exit)?;
            }
        }
    }
}

/// One attempt at a new daemon connection.
enum Attempt {
    Connected(Client),
    Failed(ClientError),
    /// The VMM exited before or while connecting.
    VmmExited,
}

/// Connects to `socket` and does the handshake, its reply waited for until
/// `deadline` at most (a daemon that accepts but is not serving yet must not
/// hold the watcher past it) or until the VMM exits.
fn connect_once(socket: &Path, deadline: Instant, exit: &ExitEvent) -> Attempt {
    if exit.fired() {
        return Attempt::VmmExited;
    }
    let connect_error = |source| ClientError::Connect {
        path: socket.display().to_string(),
        source,
    };
    let sock = match UnixStream::connect(socket) {
        Ok(sock) => sock,
        Err(e) => return Attempt::Failed(connect_error(e)),
    };
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(MIN_REPLY_WAIT);
    if let Err(e) = sock.set_read_timeout(Some(left)) {
        return Attempt::Failed(connect_error(e));
    }
    match exit.interruptible(sock, Client::from_stream) {
        // Shut down under the handshake, or just after it: either way the
        // VMM is gone.
        _ if exit.fired() => Attempt::VmmExited,
        None => Attempt::VmmExited,
        Some(Err(e)) => Attempt::Failed(e),
        Some(Ok(client)) => match client.set_timeout(None) {
            // Like a fresh connection: no reply timeout.
            Ok(()) => Attempt::Connected(client),
            Err(e) => Attempt::Failed(e),
        },
    }
}

/// One reconnect and re-attach, or `None` with the reason logged.
fn reconnect(
    socket: &Path,
    held: &HeldAllocation,
    timeout: Duration,
    exit: &ExitEvent,
) -> Option<Client> {
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
    let mut retry = FIRST_RETRY;
    let mut client = loop {
        let error = match connect_once(socket, deadline, exit) {
            Attempt::Connected(c) => break c,
            Attempt::VmmExited => {
                warn!(
                    alloc = held.id,
                    "the VMM exited before the daemon came back; the allocation stays with \
                     the daemon, which releases it"
                );
                return None;
            }
            Attempt::Failed(e) => e,
        };
        let now = Instant::now();
        if now >= deadline {
            warn!(
                alloc = held.id,
                seconds = timeout.as_secs_f64(),
                error = %chain(&error),
                "the daemon did not come back in time; {kept}"
            );
            return None;
        }
        debug!(error = %error, "daemon not back yet");
        // Until the next attempt, or the VMM's exit, whichever is first.
        let pause = retry.min(deadline - now);
        let mut fds = [PollFd::new(exit.fd(), PollFlags::POLLIN)];
        let millis = u16::try_from(pause.as_millis()).unwrap_or(u16::MAX);
        let _ = poll(&mut fds, PollTimeout::from(millis));
        retry = (retry * 2).min(LAST_RETRY);
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
                error = %chain(&e),
                "the daemon refused to re-attach the allocation; {kept}"
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hugemem_client::client::Allocation;
    use hugemem_client::proto::{AllocPart, AllocRequest, ClearMode, PagePolicy, TOKEN_SIZE};
    use std::net::Shutdown;
    use std::os::unix::net::UnixStream;
    use test_support::prelude::{serial, wait_until, TestDaemon};

    fn alloc(client: &mut Client) -> Allocation {
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
        let held = HeldAllocation::of(&a);
        // The restarted daemon's view: the allocation is orphaned.
        assert!(d.handle().orphan_for_tests(a.id, None));
        cut(&client);
        let socket = d.socket();
        let exit = ExitEvent::new().expect("eventfd");
        let again = std::thread::scope(|s| {
            let w = s.spawn(|| watch(client, &socket, &held, Duration::from_secs(10), &exit, None));
            wait_until("the re-attach", Duration::from_secs(10), || {
                d.stats().counters.reattach_ok == 1
            });
            exit.fire();
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
        let held = HeldAllocation::of(&a);
        cut(&client);
        let exit = ExitEvent::new().expect("eventfd");
        let started = Instant::now();
        let r = watch(
            client,
            &d.socket(),
            &held,
            Duration::from_secs(10),
            &exit,
            None,
        );
        assert!(r.is_none());
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "gave up at once"
        );
        assert_eq!(d.stats().counters.reattach_refused, 1);
        d.shutdown();
    }

    #[test]
    fn a_successor_connection_replaces_the_watched_one() {
        let _s = serial();
        let d = TestDaemon::start(|_| {});
        let mut old = d.client();
        let a = alloc(&mut old);
        let held = HeldAllocation::of(&a);
        // A live update: a second connection takes the allocation over.
        let mut next = d.client();
        let moved = next
            .handoff(a.id, a.token().expect("token"), false)
            .expect("HANDOFF");
        let successor = SuccessorMailbox::new().expect("eventfd");
        let exit = ExitEvent::new().expect("eventfd");
        let socket = d.socket();
        let back = std::thread::scope(|s| {
            let w = s.spawn(|| {
                watch(
                    old,
                    &socket,
                    &held,
                    Duration::from_secs(10),
                    &exit,
                    Some(&successor),
                )
            });
            successor.offer(next, HeldAllocation::of(&moved));
            // The watcher drops the old connection once it takes the new one.
            wait_until("the old connection closed", Duration::from_secs(10), || {
                d.stats().sessions.active == 1
            });
            exit.fire();
            w.join().expect("watcher")
        });
        let mut back = back.expect("the successor back for FREE");
        drop(a.fds);
        drop(moved.fds);
        back.free(moved.id)
            .expect("FREE on the successor connection");
        assert_eq!(d.stats().allocations.active, 0);
        d.shutdown();
    }

    #[test]
    fn the_vmms_exit_wakes_the_watcher_of_a_live_connection() {
        let _s = serial();
        let d = TestDaemon::start(|_| {});
        let mut client = d.client();
        let a = alloc(&mut client);
        let held = HeldAllocation::of(&a);
        let exit = ExitEvent::new().expect("eventfd");
        // Fired before the watcher starts or while it sleeps in poll: either
        // way it hands the same, still open connection back.
        exit.fire();
        let mut back = watch(
            client,
            &d.socket(),
            &held,
            Duration::from_secs(10),
            &exit,
            None,
        )
        .expect("the connection back");
        drop(a.fds);
        back.free(a.id).expect("FREE on the watched connection");
        assert_eq!(d.stats().counters.reattach_ok, 0);
        d.shutdown();
    }

    #[test]
    fn the_vmms_exit_ends_a_reconnect_wait() {
        // A daemon that never comes back, and a deadline far away: only the
        // exit ends the wait.
        let dir = tempfile::tempdir().expect("tempdir");
        let held = HeldAllocation {
            id: 1,
            token: Some([7; TOKEN_SIZE]),
            regions: Vec::new(),
        };
        let exit = ExitEvent::new().expect("eventfd");
        let gone = dir.path().join("no-daemon.sock");
        let deadline = Duration::from_secs(60);
        let started = Instant::now();
        let r = std::thread::scope(|s| {
            let w = s.spawn(|| reconnect(&gone, &held, deadline, &exit));
            exit.fire();
            w.join().expect("watcher")
        });
        assert!(r.is_none(), "no daemon: nothing to FREE on");
        assert!(
            started.elapsed() < deadline,
            "the wait ended by the exit, not by the reconnect deadline"
        );
    }
}
