//! Moving frames (header, payload, fds) over a UNIX stream socket.
//!
//! File descriptors ride on the header's bytes (`SCM_RIGHTS`) and are taken
//! into `OwnedFd` the moment they arrive, so a malformed message that is
//! refused closes them instead of leaking them. `MSG_CMSG_CLOEXEC` keeps them
//! out of processes the receiver spawns. A truncated control message
//! (`MSG_CTRUNC`: more fds than [`MAX_FDS`]) is an error, after the fds that
//! did arrive were taken and closed (see [`crate::sys::recv_with_fds`]).

use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};

use super::header::Header;
use super::header::ProtoError;
use super::header::HEADER_SIZE;
use super::header::MAX_FDS;

pub use super::framing::Frame;
use super::framing::FrameReader;

/// Sends `bytes` with `fds` attached to the first byte; loops on short writes.
pub fn send_all(
    sock: BorrowedFd<'_>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> Result<(), ProtoError> {
    if fds.len() > MAX_FDS {
        return Err(ProtoError::TooManyFds {
            got: fds.len(),
            max: MAX_FDS,
        });
    }
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let mut sent = 0;
    while sent < bytes.len() {
        let cmsgs: &[ControlMessage<'_>] = if sent == 0 && !raw.is_empty() {
            &[ControlMessage::ScmRights(&raw)]
        } else {
            &[]
        };
        let iov = [IoSlice::new(&bytes[sent..])];
        match sendmsg::<()>(sock.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(0) => return Err(ProtoError::UnexpectedEof),
            Ok(n) => sent += n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(ProtoError::Io(e.into())),
        }
    }
    Ok(())
}

/// One `recvmsg` into `buf`; received fds are appended to `fds` as `OwnedFd`
/// on every path, errors included ([`crate::sys::recv_with_fds`] takes them
/// even from a truncated control buffer). Returns the byte count (0 = the
/// peer closed). `nonblocking` adds `MSG_DONTWAIT`.
///
/// # Errors
///
/// Socket errors; [`ProtoError::TooManyFds`] when the message carried more
/// than [`MAX_FDS`] fds (`MSG_CTRUNC`) or the frame has collected more than
/// that so far. The fds in `fds` are then closed with the `Vec`.
pub fn recv_some(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    nonblocking: bool,
) -> Result<usize, ProtoError> {
    let got = crate::sys::recv_with_fds(sock, buf, fds, MAX_FDS, nonblocking)?;
    if got.truncated || fds.len() > MAX_FDS {
        let got = fds.len().max(MAX_FDS + 1);
        // Close them now, not whenever the caller drops the frame's Vec.
        fds.clear();
        return Err(ProtoError::TooManyFds { got, max: MAX_FDS });
    }
    Ok(got.bytes)
}

/// Sends one message (blocking socket).
pub fn send_message(
    sock: &impl AsFd,
    header: &Header,
    payload: &[u8],
    fds: &[BorrowedFd<'_>],
) -> Result<(), ProtoError> {
    let mut bytes = Vec::with_capacity(HEADER_SIZE + payload.len());
    bytes.extend_from_slice(&header.encode());
    bytes.extend_from_slice(payload);
    send_all(sock.as_fd(), &bytes, fds)
}

/// Receives one message (blocking socket): header first (checked before the
/// payload is read or allocated), then exactly `header.size` payload bytes
/// ([`FrameReader`] does the reassembly).
pub fn recv_message(sock: &impl AsFd) -> Result<Frame, ProtoError> {
    let fd = sock.as_fd();
    let mut reader = FrameReader::new();
    loop {
        let (buf, fds) = reader.next_read();
        let n = recv_some(fd, buf, fds, false)?;
        if let Some(frame) = reader.advance(n)? {
            return Ok(frame);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{Code, Request};
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    #[test]
    fn frames_carry_payload_and_fds() {
        let (a, b) = UnixStream::pair().expect("pair");
        let file = tempfile_fd();
        let req = Request::Free { alloc_id: 4 };
        let payload = req.encode();
        let header = Header::request(req.code(), 1, payload.len()).expect("header");
        send_message(&a, &header, &payload, &[file.as_fd()]).expect("send");
        let frame = recv_message(&b).expect("recv");
        assert_eq!(frame.header, header);
        assert_eq!(
            Request::decode(Code::Free, &frame.payload).expect("decode"),
            req
        );
        assert_eq!(frame.fds.len(), 1);
    }

    #[test]
    fn eof_between_and_inside_messages() {
        let (a, b) = UnixStream::pair().expect("pair");
        drop(a);
        assert!(matches!(recv_message(&b), Err(ProtoError::Closed)));
        let (mut a, b) = UnixStream::pair().expect("pair");
        let header = Header::request(Code::Free, 1, 8).expect("header");
        a.write_all(&header.encode()).expect("write");
        a.write_all(&[1, 2, 3]).expect("write");
        drop(a);
        assert!(matches!(recv_message(&b), Err(ProtoError::UnexpectedEof)));
    }

    #[test]
    fn a_bad_header_is_refused_without_reading_the_payload() {
        let (mut a, b) = UnixStream::pair().expect("pair");
        let mut bytes = Header::request(Code::Free, 1, 8).expect("header").encode();
        bytes[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        a.write_all(&bytes).expect("write");
        assert!(matches!(
            recv_message(&b),
            Err(ProtoError::PayloadTooLarge(_))
        ));
    }

    fn tempfile_fd() -> OwnedFd {
        let (_a, b) = UnixStream::pair().expect("pair");
        OwnedFd::from(b)
    }
}
