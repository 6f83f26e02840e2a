//! A small QMP client (QEMU's JSON monitor protocol) for the live update:
//! `hugemem launch` gives each QEMU it starts one end of a socket pair as a
//! monitor (`-chardev socket,id=hm-qmp,fd=N -mon chardev=hm-qmp,mode=control`)
//! and keeps the other end, so no socket path exists that anyone else could
//! connect to.
//!
//! QMP is line-oriented JSON: a greeting, then `{"execute": …}` commands
//! answered by `{"return": …}` or `{"error": …}`, with asynchronous
//! `{"event": …}` lines in between. Events read while waiting for a reply
//! are kept for [`Qmp::wait_event`]. Every read has a deadline (the
//! socket's read timeout), so a QEMU that hangs cannot hang the launcher;
//! a QEMU that exits closes its end, which ends a read at once.

use std::collections::VecDeque;
use std::io::{self, BufRead, BufReader, IoSlice, Write};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use serde_json::{json, Value};

/// The monitor's chardev id on the QEMU command line.
pub const CHARDEV_ID: &str = "hm-qmp";

/// The QEMU options that make fd `fd` (a connected socket) its QMP monitor.
pub fn monitor_args(fd: i32) -> [String; 4] {
    monitor_args_as(CHARDEV_ID, fd)
}

/// [`monitor_args`] for a monitor whose chardev is named `id` (a QEMU may
/// have several: a restored one has one for the restore and one for
/// updates).
pub fn monitor_args_as(id: &str, fd: i32) -> [String; 4] {
    [
        "-chardev".into(),
        format!("socket,id={id},fd={fd}"),
        "-mon".into(),
        format!("chardev={id},mode=control"),
    ]
}

/// What went wrong on a QMP connection.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// Reading or writing failed, or the deadline passed.
    #[error("QMP connection: {0}")]
    Io(#[from] io::Error),
    /// QEMU closed the monitor (it exited).
    #[error("QEMU closed its monitor (it exited)")]
    Closed,
    /// A line that is not JSON, or not QMP.
    #[error("unexpected QMP message: {0}")]
    Protocol(String),
    /// QEMU refused a command.
    #[error("QEMU refused {command}: {class}: {desc}")]
    Refused {
        /// The command.
        command: String,
        /// QMP's error class.
        class: String,
        /// QEMU's text.
        desc: String,
    },
}

/// One QMP connection, capabilities negotiated.
#[derive(Debug)]
pub struct Qmp {
    reader: BufReader<UnixStream>,
    events: VecDeque<Value>,
}

impl Qmp {
    /// Reads the greeting on `stream` and enters command mode; every read
    /// waits at most `deadline`.
    ///
    /// # Errors
    ///
    /// [`QmpError`]: no greeting in time, or not QMP.
    pub fn handshake(stream: UnixStream, deadline: Duration) -> Result<Self, QmpError> {
        stream.set_read_timeout(Some(deadline))?;
        let mut qmp = Self {
            reader: BufReader::new(stream),
            events: VecDeque::new(),
        };
        let greeting = qmp.read_message()?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol(format!("no greeting: {greeting}")));
        }
        qmp.execute("qmp_capabilities", json!({}))?;
        Ok(qmp)
    }

    fn read_message(&mut self) -> Result<Value, QmpError> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err(QmpError::Closed);
        }
        serde_json::from_str(&line).map_err(|e| QmpError::Protocol(format!("{e}: {line:?}")))
    }

    fn send(
        &mut self,
        command: &str,
        arguments: &Value,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<(), QmpError> {
        let mut text = json!({"execute": command, "arguments": arguments}).to_string();
        text.push('\n');
        tracing::debug!("sending QMP command {command:?}");
        let stream = self.reader.get_mut();
        match fd {
            None => stream.write_all(text.as_bytes())?,
            Some(fd) => {
                // The fd rides on the command's first byte (QEMU takes it
                // from the message that carries the command).
                let raw = [fd.as_raw_fd()];
                let cmsg = [ControlMessage::ScmRights(&raw)];
                let sent = sendmsg::<()>(
                    stream.as_raw_fd(),
                    &[IoSlice::new(text.as_bytes())],
                    &cmsg,
                    MsgFlags::empty(),
                    None,
                )
                .map_err(io::Error::from)?;
                stream.write_all(&text.as_bytes()[sent..])?;
            }
        }
        Ok(())
    }

    fn reply(&mut self, command: &str) -> Result<Value, QmpError> {
        loop {
            let message = self.read_message()?;
            if message.get("event").is_some() {
                self.events.push_back(message);
            } else if let Some(value) = message.get("return") {
                return Ok(value.clone());
            } else if let Some(error) = message.get("error") {
                let text = |key: &str| {
                    error
                        .get(key)
                        .and_then(Value::as_str)
                        .unwrap_or("?")
                        .to_owned()
                };
                return Err(QmpError::Refused {
                    command: command.to_owned(),
                    class: text("class"),
                    desc: text("desc"),
                });
            } else {
                return Err(QmpError::Protocol(message.to_string()));
            }
        }
    }

    /// Runs `command` and returns its `return` value.
    ///
    /// # Errors
    ///
    /// [`QmpError::Refused`] with QEMU's text, or the connection's error.
    pub fn execute(&mut self, command: &str, arguments: Value) -> Result<Value, QmpError> {
        self.send(command, &arguments, None)?;
        self.reply(command)
    }

    /// Sends `command` without waiting for its reply: [`Qmp::read_reply`]
    /// reads it later (QEMU answers commands in order), so the reply's
    /// round trip overlaps other work.
    ///
    /// # Errors
    ///
    /// The connection's error.
    pub fn send_command(&mut self, command: &str, arguments: Value) -> Result<(), QmpError> {
        self.send(command, &arguments, None)
    }

    /// [`Qmp::send_command`] with `fd` passed along (SCM_RIGHTS).
    ///
    /// # Errors
    ///
    /// The connection's error.
    pub fn send_command_with_fd(
        &mut self,
        command: &str,
        arguments: Value,
        fd: BorrowedFd<'_>,
    ) -> Result<(), QmpError> {
        self.send(command, &arguments, Some(fd))
    }

    /// The reply to the oldest command sent with [`Qmp::send_command`] and
    /// not answered yet (events read meanwhile are kept).
    ///
    /// # Errors
    ///
    /// As [`Qmp::execute`].
    pub fn read_reply(&mut self, command: &str) -> Result<Value, QmpError> {
        self.reply(command)
    }

    /// Runs `command` with `fd` passed along (SCM_RIGHTS), as `getfd` needs.
    ///
    /// # Errors
    ///
    /// As [`Qmp::execute`].
    pub fn execute_with_fd(
        &mut self,
        command: &str,
        arguments: Value,
        fd: BorrowedFd<'_>,
    ) -> Result<Value, QmpError> {
        self.send(command, &arguments, Some(fd))?;
        self.reply(command)
    }

    /// Returns the first event (kept or new) for which `wanted` is true;
    /// events before it are dropped.
    ///
    /// # Errors
    ///
    /// The connection's error: closed, or no such event before the deadline.
    pub fn wait_event(&mut self, wanted: impl Fn(&Value) -> bool) -> Result<Value, QmpError> {
        while let Some(event) = self.events.pop_front() {
            if wanted(&event) {
                return Ok(event);
            }
        }
        loop {
            let message = self.read_message()?;
            if message.get("event").is_some() && wanted(&message) {
                return Ok(message);
            }
        }
    }

    /// Forgets the events read so far (those of an earlier update).
    pub fn clear_events(&mut self) {
        self.events.clear();
    }
}

/// True for an event named `name` whose `data.status` (when `status` is
/// given) is one of `status`.
pub fn is_event(event: &Value, name: &str, status: &[&str]) -> bool {
    event.get("event").and_then(Value::as_str) == Some(name)
        && (status.is_empty()
            || event
                .pointer("/data/status")
                .and_then(Value::as_str)
                .is_some_and(|s| status.contains(&s)))
}

/// The bytes of RAM a migration sent, from a `query-migrate` reply: the
/// sum of `ram`'s `precopy-bytes`, `downtime-bytes` and `postcopy-bytes`
/// (QEMU 7.0 on), else `ram.transferred`. `transferred` alone means
/// different things: QEMU 7.2 counts RAM only, QEMU 10.0 the whole stream,
/// device state included (measured: 134445 bytes of a 134445-byte stream,
/// 115053 of them RAM).
pub fn ram_bytes_sent(query_migrate: &Value) -> u64 {
    let ram = query_migrate.get("ram");
    let field = |key: &str| ram.and_then(|r| r.get(key)).and_then(Value::as_u64);
    let phases = ["precopy-bytes", "downtime-bytes", "postcopy-bytes"].map(field);
    if phases.iter().any(Option::is_some) {
        phases.iter().flatten().sum()
    } else {
        field("transferred").unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::AsFd;

    #[test]
    fn ram_bytes_are_the_phases_not_the_stream() {
        // QEMU 10.0.2's reply: `transferred` is the whole stream.
        let qemu10 = json!({"ram": {"transferred": 134445, "precopy-bytes": 0,
            "downtime-bytes": 115053, "postcopy-bytes": 0}});
        assert_eq!(ram_bytes_sent(&qemu10), 115053);
        // QEMU 7.2's: both agree.
        let qemu72 = json!({"ram": {"transferred": 33009, "precopy-bytes": 0,
            "downtime-bytes": 33009, "postcopy-bytes": 0}});
        assert_eq!(ram_bytes_sent(&qemu72), 33009);
        // Before 7.0: `transferred` only.
        assert_eq!(ram_bytes_sent(&json!({"ram": {"transferred": 7}})), 7);
        assert_eq!(ram_bytes_sent(&json!({})), 0);
    }

    /// A stand-in QEMU monitor: greets, answers each command in `replies`
    /// order (events may precede a reply), and records what it read.
    fn fake(replies: Vec<&'static str>) -> (UnixStream, std::thread::JoinHandle<String>) {
        let (ours, mut theirs) = UnixStream::pair().expect("socketpair");
        let handle = std::thread::spawn(move || {
            theirs
                .write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n")
                .expect("greet");
            let mut seen = String::new();
            let mut reader = BufReader::new(theirs.try_clone().expect("dup"));
            for reply in replies {
                let mut line = String::new();
                if reader.read_line(&mut line).expect("read") == 0 {
                    break;
                }
                seen.push_str(&line);
                theirs.write_all(reply.as_bytes()).expect("reply");
            }
            let mut rest = String::new();
            let _ = reader.read_to_string(&mut rest);
            seen
        });
        (ours, handle)
    }

    #[test]
    fn commands_replies_errors_and_events() {
        let (ours, peer) = fake(vec![
            "{\"return\": {}}\n",
            "{\"event\": \"MIGRATION\", \"data\": {\"status\": \"setup\"}}\n{\"return\": {\"status\": \"running\"}}\n",
            "{\"error\": {\"class\": \"GenericError\", \"desc\": \"no such thing\"}}\n",
            "{\"event\": \"MIGRATION\", \"data\": {\"status\": \"completed\"}}\n{\"return\": {}}\n",
        ]);
        let mut qmp = Qmp::handshake(ours, Duration::from_secs(10)).expect("handshake");
        let status = qmp.execute("query-status", json!({})).expect("status");
        assert_eq!(status["status"], "running");
        let err = qmp.execute("bogus", json!({"x": 1})).expect_err("refused");
        assert!(
            err.to_string().contains("bogus") && err.to_string().contains("no such thing"),
            "{err}"
        );
        // The event read before the reply is kept; the completion is read next.
        let setup = qmp
            .wait_event(|e| is_event(e, "MIGRATION", &[]))
            .expect("kept event");
        assert!(is_event(&setup, "MIGRATION", &["setup"]));
        let file = std::fs::File::open("/dev/null").expect("open");
        qmp.execute_with_fd("getfd", json!({"fdname": "m"}), file.as_fd())
            .expect("getfd");
        let done = qmp
            .wait_event(|e| is_event(e, "MIGRATION", &["completed", "failed"]))
            .expect("completion");
        assert_eq!(done["data"]["status"], "completed");
        drop(qmp);
        let seen = peer.join().expect("peer");
        assert!(seen.contains("\"qmp_capabilities\""), "{seen}");
        assert!(seen.contains("\"getfd\""), "{seen}");
    }

    #[test]
    fn a_closed_monitor_reads_as_closed() {
        let (ours, theirs) = UnixStream::pair().expect("socketpair");
        drop(theirs);
        let err = Qmp::handshake(ours, Duration::from_secs(10)).expect_err("closed");
        assert!(matches!(err, QmpError::Closed), "{err:?}");
    }
}
