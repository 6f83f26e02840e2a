//! cloud-hypervisor's `--event-monitor` stream, read from a pipe: waiting
//! for one event (a receiving process's `migration-receive-ready`, the
//! moment its migration socket listens), then draining the rest so that
//! the process never finds the pipe full.

use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

/// The event a receiving cloud-hypervisor emits once its migration socket
/// listens.
pub const RECEIVE_READY: &str = "migration-receive-ready";

/// Why [`ChEvents::wait_for`] saw no such event.
#[derive(Debug, thiserror::Error)]
pub enum ChEventsError {
    /// None came in time.
    #[error("no {name} event within {deadline:?}")]
    Timeout {
        /// The event waited for.
        name: String,
        /// How long.
        deadline: Duration,
    },
    /// The process closed the stream (it exited).
    #[error("it exited (its event stream closed)")]
    Closed,
    /// Polling or reading the pipe failed.
    #[error("cannot read its events: {0}")]
    Read(#[source] nix::errno::Errno),
}

/// cloud-hypervisor's `--event-monitor` stream: JSON objects, one after
/// the other (pretty-printed, so not one a line).
#[derive(Debug)]
pub struct ChEvents {
    fd: OwnedFd,
    buf: Vec<u8>,
}

impl ChEvents {
    /// Reads the events arriving on `fd`, the read end of the pipe whose
    /// write end the process got as `--event-monitor fd=N`.
    pub fn new(fd: OwnedFd) -> Self {
        Self {
            fd,
            buf: Vec::new(),
        }
    }

    /// Reads events until one named `name`, for at most `deadline`.
    ///
    /// # Errors
    ///
    /// [`ChEventsError`]: none in time, the stream closed, a read failed.
    pub fn wait_for(&mut self, name: &str, deadline: Duration) -> Result<(), ChEventsError> {
        let until = Instant::now() + deadline;
        loop {
            if self
                .take_events()
                .iter()
                .any(|e| e.get("event").and_then(|v| v.as_str()) == Some(name))
            {
                return Ok(());
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ChEventsError::Timeout {
                    name: name.to_owned(),
                    deadline,
                });
            }
            let millis = u16::try_from(left.as_millis()).unwrap_or(u16::MAX);
            let mut fds = [PollFd::new(self.fd.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, PollTimeout::from(millis)) {
                Ok(0) => continue,
                Ok(_) => {}
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(ChEventsError::Read(e)),
            }
            let mut chunk = [0u8; 4096];
            match nix::unistd::read(&self.fd, &mut chunk) {
                Ok(0) => return Err(ChEventsError::Closed),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(nix::errno::Errno::EINTR | nix::errno::Errno::EAGAIN) => {}
                Err(e) => return Err(ChEventsError::Read(e)),
            }
        }
    }

    /// The whole events at the front of the buffer, removed from it.
    fn take_events(&mut self) -> Vec<serde_json::Value> {
        let mut out = Vec::new();
        let mut stream =
            serde_json::Deserializer::from_slice(&self.buf).into_iter::<serde_json::Value>();
        let mut used = 0;
        while let Some(value) = stream.next() {
            match value {
                Ok(v) => {
                    out.push(v);
                    used = stream.byte_offset();
                }
                // The rest of an event is still to come.
                Err(e) if e.is_eof() => break,
                // Not JSON: drop what was read (nothing waits on it).
                Err(_) => {
                    used = self.buf.len();
                    break;
                }
            }
        }
        self.buf.drain(..used);
        out
    }

    /// Keeps reading (and dropping) events until the process closes the
    /// stream, so its writes never find the pipe full.
    pub fn drain_in_background(self) {
        let fd = self.fd;
        std::thread::spawn(move || {
            let mut chunk = [0u8; 4096];
            loop {
                match nix::unistd::read(&fd, &mut chunk) {
                    Ok(0) => break,
                    Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                    Err(_) => break,
                }
            }
        });
    }
}
