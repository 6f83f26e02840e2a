//! `hugemem serve` as a process of its own, for the tests of restart and
//! upgrade (`cli/tests/takeover.rs`, `cli/tests/fdstore.rs`), and the pool
//! state they wait for.

use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

use backend::client::Client;

/// A daemon process, killed if the test fails while it runs (it would hold
/// the tests' huge pages otherwise).
#[derive(Debug)]
pub struct ServeProcess(pub Child);

impl ServeProcess {
    /// Sends `sig` to the daemon.
    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.0.id()).expect("pid"));
        nix::sys::signal::kill(pid, sig).expect("signal");
    }

    /// Waits for the daemon to exit (at most 60 s; `what` names it in the
    /// failure).
    pub fn wait(&mut self, what: &str) -> ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(s) = self.0.try_wait().expect("try_wait") {
                return s;
            }
            assert!(Instant::now() < deadline, "{what} did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Waits (at most 30 s) until `client`'s STATS shows a clean pooled region
/// of `bytes`, every page of every region present (a freed region detached
/// and refaulted).
pub fn wait_clean_and_present(client: &mut Client, bytes: u64) {
    crate::daemon::wait_until(
        "a clean, present region in the pool",
        Duration::from_secs(30),
        || {
            client.stats().is_ok_and(|s| {
                s.pools.iter().any(|p| p.clean_bytes == bytes)
                    && s.regions
                        .as_ref()
                        .is_some_and(|r| r.iter().all(|r| r.not_present.unwrap_or(0) == 0))
            })
        },
    );
}
