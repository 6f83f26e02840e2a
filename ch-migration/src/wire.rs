//! The socket side both ends share: reads through `recvmsg` with room for
//! fds (a plain `read` of bytes that carry `SCM_RIGHTS` would make the
//! kernel close the fds), every fd owned the moment it arrives, and the
//! request/response round trip.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use super::{ChMigrationError, Command, RequestHeader, Response, HEADER_SIZE};

/// Fills `buf` from `sock`; the fds that came with the bytes go to `fds`.
pub(crate) fn read_exact(
    sock: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    what: &'static str,
) -> Result<(), ChMigrationError> {
    let mut got = 0;
    while got < buf.len() {
        let r = crate::sys::recv_with_fds(sock.as_fd(), &mut buf[got..], fds, 1, false)?;
        if r.bytes == 0 {
            return Err(ChMigrationError::Closed(what));
        }
        if r.truncated {
            return Err(ChMigrationError::FdCount(fds.len() + 1));
        }
        got += r.bytes;
    }
    Ok(())
}

/// Reads `buf` where no fd belongs.
pub(crate) fn read_plain(
    sock: &UnixStream,
    buf: &mut [u8],
    what: &'static str,
) -> Result<(), ChMigrationError> {
    let mut fds = Vec::new();
    read_exact(sock, buf, &mut fds, what)?;
    if fds.is_empty() {
        Ok(())
    } else {
        Err(ChMigrationError::FdCount(fds.len()))
    }
}

/// Reads a request header where no fd belongs; `None` when the peer
/// closed (or reset) the connection before its first byte: the end of a
/// connection that may end between requests.
pub(crate) fn read_header_or_end(
    sock: &UnixStream,
) -> Result<Option<[u8; HEADER_SIZE]>, ChMigrationError> {
    let mut head = [0u8; HEADER_SIZE];
    let mut fds = Vec::new();
    let first = match crate::sys::recv_with_fds(sock.as_fd(), &mut head, &mut fds, 1, false) {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    if first.bytes == 0 && fds.is_empty() {
        return Ok(None);
    }
    if first.truncated || !fds.is_empty() {
        return Err(ChMigrationError::FdCount(
            fds.len() + usize::from(first.truncated),
        ));
    }
    read_plain(sock, &mut head[first.bytes..], "inside a request header")?;
    Ok(Some(head))
}

/// Sends `bytes` with `fds` on the first byte.
pub(crate) fn write_all(
    sock: &UnixStream,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> Result<(), ChMigrationError> {
    crate::sys::send_all(sock.as_fd(), bytes, fds).map_err(ChMigrationError::Io)
}

/// Answers the last request.
pub(crate) fn respond(sock: &UnixStream, ok: bool) -> Result<(), ChMigrationError> {
    write_all(sock, &Response { ok }.encode(), &[])
}

/// Sends one request (header, payload, fds) and waits for its answer.
pub(crate) fn request(
    sock: &UnixStream,
    command: Command,
    payload: &[u8],
    fds: &[BorrowedFd<'_>],
) -> Result<(), ChMigrationError> {
    let header = RequestHeader::new(command, payload.len() as u64);
    write_all(sock, &header.encode(), &[])?;
    if !payload.is_empty() {
        write_all(sock, payload, fds)?;
    }
    let mut answer = [0u8; HEADER_SIZE];
    read_plain(sock, &mut answer, "before its answer")?;
    if Response::decode(&answer)?.ok {
        Ok(())
    } else {
        Err(ChMigrationError::Refused(command))
    }
}
