//! The migration socket a PARK or RESTORE brings: checked before a byte
//! is read or written.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use nix::sys::socket::{getsockname, getsockopt, sockopt, SockType, UnixAddr};

/// How long one read or write on a migration socket may block: a peer
/// that stops mid-sequence holds a daemon thread at most this long.
pub const MIGRATION_IO_TIMEOUT: Duration = Duration::from_secs(60);

/// Why a migration socket was refused.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// The request carried no fd, or more than one.
    #[error("PARK and RESTORE carry exactly one fd, a connected stream socket (got {0})")]
    Count(usize),
    /// Not a UNIX stream socket.
    #[error("the fd is not a connected UNIX stream socket")]
    NotUnixStream,
    /// Its peer runs as another uid.
    #[error("the migration socket's peer runs as uid {peer}, not as this connection's uid {uid}")]
    OtherUid {
        /// The peer's uid.
        peer: u32,
        /// The requester's.
        uid: u32,
    },
    /// Its options could not be set or read.
    #[error("migration socket: {0}")]
    Io(#[from] std::io::Error),
}

/// The one fd of a PARK or RESTORE as a blocking stream, checked: a
/// connected UNIX stream socket whose peer runs as `uid` (root's requests
/// may bring any peer), with reads and writes bounded by
/// [`MIGRATION_IO_TIMEOUT`].
///
/// # Errors
///
/// [`SocketError`].
pub fn migration_socket(mut fds: Vec<OwnedFd>, uid: u32) -> Result<UnixStream, SocketError> {
    if fds.len() != 1 {
        return Err(SocketError::Count(fds.len()));
    }
    let fd = fds.pop().ok_or(SocketError::Count(0))?;
    let is_stream = getsockopt(&fd.as_fd(), sockopt::SockType).is_ok_and(|t| t == SockType::Stream);
    if !is_stream || getsockname::<UnixAddr>(std::os::fd::AsRawFd::as_raw_fd(&fd)).is_err() {
        return Err(SocketError::NotUnixStream);
    }
    let cred = getsockopt(&fd.as_fd(), sockopt::PeerCredentials)
        .map_err(|_| SocketError::NotUnixStream)?;
    if uid != 0 && cred.uid() != uid {
        return Err(SocketError::OtherUid {
            peer: cred.uid(),
            uid,
        });
    }
    let stream = UnixStream::from(fd);
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(MIGRATION_IO_TIMEOUT))?;
    stream.set_write_timeout(Some(MIGRATION_IO_TIMEOUT))?;
    Ok(stream)
}
