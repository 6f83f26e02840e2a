//! The private control channel between a running daemon and the one taking
//! over from it: a UNIX socket next to the daemon's own
//! (`<socket>.takeover`, mode 0600), which only a process of the daemon's
//! own uid may use (`SO_PEERCRED`).
//!
//! ```text
//!  successor                                  running daemon
//!  "HUGEMEM-TAKEOVER 1\n"  ─────────────────▶  freezes (see the parent module)
//!                          ◀─────────────────  "HMTAKEOV" u32 n, state memfd
//!                          ◀─────────────────  batches: u32 k + k fds (k ≤ 200), until n
//!  verifies, adopts, serves
//!  "OK\n" | "REFUSED <why>\n" ─────────────▶  exits | thaws and serves on
//! ```
//!
//! A running daemon that cannot freeze (a request still running after
//! 10 s) answers the hello with `REFUSED <why>\n` instead of the state.

use std::io::{self, BufRead, BufReader, IoSlice, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};

/// First line a successor sends.
pub const HELLO: &str = "HUGEMEM-TAKEOVER 1";
const MAGIC: &[u8; 8] = b"HMTAKEOV";
/// Fds per message (the kernel's `SCM_MAX_FD` is 253).
const BATCH: usize = 200;

/// The control socket of the daemon serving `socket`.
pub fn control_path(socket: &Path) -> PathBuf {
    let mut p = socket.as_os_str().to_owned();
    p.push(".takeover");
    PathBuf::from(p)
}

/// Sends the state memfd and every fd, in order.
///
/// # Errors
///
/// Socket errors.
pub fn send_all(stream: &UnixStream, state: &OwnedFd, fds: &[OwnedFd]) -> io::Result<()> {
    let n = u32::try_from(fds.len()).map_err(|_| io::Error::other("too many fds"))?;
    let mut head = MAGIC.to_vec();
    head.extend_from_slice(&n.to_le_bytes());
    send_with(stream, &head, &[state.as_raw_fd()])?;
    for chunk in fds.chunks(BATCH) {
        let raw: Vec<RawFd> = chunk.iter().map(AsRawFd::as_raw_fd).collect();
        let k = u32::try_from(raw.len()).unwrap_or(0);
        send_with(stream, &k.to_le_bytes(), &raw)?;
    }
    Ok(())
}

fn send_with(stream: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let iov = [IoSlice::new(bytes)];
    let cmsg = [ControlMessage::ScmRights(fds)];
    let sent = sendmsg::<()>(
        stream.as_raw_fd(),
        &iov,
        &cmsg,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(io::Error::from)?;
    if sent != bytes.len() {
        return Err(io::Error::other("short write on the control channel"));
    }
    Ok(())
}

/// The running daemon's `REFUSED <why>` line, in place of the state (the
/// inner error of the `io::Error` [`recv_all`] returns then).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refusal(pub String);

/// Receives what [`send_all`] sent: the state memfd and the fds.
///
/// # Errors
///
/// Socket errors, a bad magic, missing fds; a [`Refusal`] when the
/// running daemon refused instead.
pub fn recv_all(stream: &UnixStream) -> io::Result<(OwnedFd, Vec<OwnedFd>)> {
    let mut head = [0u8; 12];
    let mut got = Vec::new();
    recv_exact(stream, &mut head, &mut got, 1)?;
    if head.starts_with(b"REFUSED") {
        let rest = read_line(stream, Duration::from_secs(1)).unwrap_or_default();
        let line = format!("{}{rest}", String::from_utf8_lossy(&head));
        return Err(io::Error::other(Refusal(line)));
    }
    if &head[..8] != MAGIC {
        return Err(io::Error::other(
            "not a hugemem daemon on the control channel",
        ));
    }
    let state = got
        .pop()
        .ok_or_else(|| io::Error::other("no state memfd"))?;
    let total = u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize;
    let mut fds = Vec::with_capacity(total);
    while fds.len() < total {
        let mut k = [0u8; 4];
        let mut batch = Vec::new();
        recv_exact(stream, &mut k, &mut batch, BATCH)?;
        let k = u32::from_le_bytes(k) as usize;
        if batch.len() != k {
            return Err(io::Error::other(format!(
                "a batch announced {k} fds and carried {}",
                batch.len()
            )));
        }
        fds.extend(batch);
    }
    if fds.len() != total {
        return Err(io::Error::other("more fds than announced"));
    }
    Ok((state, fds))
}

fn recv_exact(
    stream: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    max_fds: usize,
) -> io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        let r = crate::sys::recv_with_fds(stream.as_fd(), &mut buf[at..], fds, max_fds, false)?;
        if r.truncated {
            return Err(io::Error::other("fds were dropped on the control channel"));
        }
        if r.bytes == 0 {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        at += r.bytes;
    }
    Ok(())
}

/// Reads one line (at most 4 KiB) within `timeout`.
///
/// # Errors
///
/// Socket errors and timeouts.
pub fn read_line(stream: &UnixStream, timeout: Duration) -> io::Result<String> {
    stream.set_read_timeout(Some(timeout))?;
    let mut line = String::new();
    BufReader::new(stream.try_clone()?.take(4096)).read_line(&mut line)?;
    Ok(line.trim_end().to_string())
}

/// Writes one line.
///
/// # Errors
///
/// Socket errors.
pub fn write_line(mut stream: &UnixStream, line: &str) -> io::Result<()> {
    stream.write_all(format!("{line}\n").as_bytes())
}
