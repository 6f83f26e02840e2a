//! Frames over a tokio `UnixStream`, for the daemon's control plane.
//!
//! The blocking side ([`super::socket`]) loops on `recvmsg`; here each
//! `recvmsg` runs inside [`UnixStream::try_io`] after `readable()` reported
//! readiness, with `MSG_DONTWAIT`, so a partial message never blocks an
//! executor thread and `EAGAIN` simply clears the readiness and waits again.
//! The bytes go through the same sync decoder as the blocking reader's,
//! `hugemem_client::proto::FrameReader` (which the fuzzer drives with
//! hostile input): the 16-byte header is read and [`Header::decode`]d
//! (version, code, flags, payload ≤ [`super::MAX_PAYLOAD`]) before a single
//! payload byte is allocated, fds are taken into `OwnedFd` as they arrive,
//! and EOF inside a frame is [`ProtoError::UnexpectedEof`] while EOF between
//! frames is [`ProtoError::Closed`].
//!
//! Writing cannot reuse [`super::socket::send_all`]: it loops until every byte
//! is out, and on a non-blocking socket a short write followed by `EAGAIN`
//! would lose track of what was sent. [`write_frame`] keeps the offset across
//! `writable()` waits and attaches the fds to the first `sendmsg` only.

use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use tokio::io::Interest;
use tokio::net::UnixStream;

use super::socket::recv_some;
use super::{Frame, FrameReader, Header, ProtoError, HEADER_SIZE, MAX_FDS};

/// Reads one `recvmsg` worth into `buf` once the socket is readable.
async fn read_some(
    stream: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> Result<usize, ProtoError> {
    loop {
        stream.readable().await?;
        let fd = borrowed(stream);
        // `try_io` wants an `io::Result`: a `WouldBlock` inside our error is
        // handed back to it (so it clears the readiness flag), anything else
        // travels as the inner `Result`.
        let attempt = stream.try_io(Interest::READABLE, || match recv_some(fd, buf, fds, true) {
            Err(ProtoError::Io(e)) if e.kind() == io::ErrorKind::WouldBlock => Err(e),
            other => Ok(other),
        });
        match attempt {
            Ok(result) => return result,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(ProtoError::Io(e)),
        }
    }
}

fn borrowed(stream: &UnixStream) -> BorrowedFd<'_> {
    use std::os::fd::AsFd;
    stream.as_fd()
}

/// Reads one frame: header (checked before the payload is allocated), then
/// exactly `header.size` payload bytes; fds received on the way come with it.
///
/// # Errors
///
/// [`ProtoError::Closed`] at EOF before the first byte, [`ProtoError::UnexpectedEof`]
/// at EOF inside the frame, header errors ([`ProtoError::BadVersion`],
/// [`ProtoError::UnknownCode`], [`ProtoError::PayloadTooLarge`], ...),
/// [`ProtoError::TooManyFds`], and socket errors.
pub async fn read_frame(stream: &UnixStream) -> Result<Frame, ProtoError> {
    read_frame_with(stream, &mut FrameReader::new()).await
}

/// [`read_frame`] into a reader the caller keeps: cancel-safe, since the
/// only await is the socket's readiness and every byte received is in
/// `reader` at once, so a frame half read when the future is dropped (a
/// takeover, `super::super::daemon::takeover`) is still there.
///
/// # Errors
///
/// As [`read_frame`].
pub async fn read_frame_with(
    stream: &UnixStream,
    reader: &mut FrameReader,
) -> Result<Frame, ProtoError> {
    // The reassembly and every check are the client crate's sync
    // [`FrameReader`] (the code the fuzzer runs); only the waiting is here.
    loop {
        let (buf, fds) = reader.next_read();
        let n = read_some(stream, buf, fds).await?;
        if let Some(frame) = reader.advance(n)? {
            return Ok(frame);
        }
    }
}

/// One non-blocking `sendmsg` of `bytes`, with `fds` attached when given.
fn send_some(sock: BorrowedFd<'_>, bytes: &[u8], fds: &[RawFd]) -> io::Result<usize> {
    let rights = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &rights };
    let iov = [IoSlice::new(bytes)];
    loop {
        match sendmsg::<()>(
            sock.as_raw_fd(),
            &iov,
            cmsgs,
            MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT,
            None,
        ) {
            Err(nix::errno::Errno::EINTR) => continue,
            other => return other.map_err(io::Error::from),
        }
    }
}

/// Writes one frame; `fds` travel with its first byte.
///
/// # Errors
///
/// [`ProtoError::TooManyFds`] before anything is sent, [`ProtoError::PayloadTooLarge`]
/// for a payload the header cannot describe, socket errors (`EPIPE` when the
/// peer is gone).
pub async fn write_frame(
    stream: &UnixStream,
    header: &Header,
    payload: &[u8],
    fds: &[BorrowedFd<'_>],
) -> Result<(), ProtoError> {
    if fds.len() > MAX_FDS {
        return Err(ProtoError::TooManyFds {
            got: fds.len(),
            max: MAX_FDS,
        });
    }
    if payload.len() != header.size as usize {
        return Err(ProtoError::OutOfBounds(format!(
            "header says {} payload bytes, {} given",
            header.size,
            payload.len()
        )));
    }
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let mut bytes = Vec::with_capacity(HEADER_SIZE + payload.len());
    bytes.extend_from_slice(&header.encode());
    bytes.extend_from_slice(payload);
    let mut sent = 0;
    while sent < bytes.len() {
        stream.writable().await?;
        let fd = borrowed(stream);
        let attach: &[RawFd] = if sent == 0 { &raw } else { &[] };
        match stream.try_io(Interest::WRITABLE, || send_some(fd, &bytes[sent..], attach)) {
            Ok(0) => return Err(ProtoError::UnexpectedEof),
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(ProtoError::Io(e)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{Code, Request};
    use std::os::fd::AsFd;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    #[test]
    fn frames_round_trip_with_fds() {
        rt().block_on(async {
            let (a, b) = UnixStream::pair().expect("pair");
            let (x, _y) = UnixStream::pair().expect("pair");
            let req = Request::Lock {
                alloc_id: 3,
                chunk: 0,
            };
            let payload = req.encode();
            let header = Header::request(req.code(), 9, payload.len()).expect("header");
            write_frame(&a, &header, &payload, &[x.as_fd()])
                .await
                .expect("write");
            let frame = read_frame(&b).await.expect("read");
            assert_eq!(frame.header, header);
            assert_eq!(
                Request::decode(Code::Lock, &frame.payload).expect("decode"),
                req
            );
            assert_eq!(frame.fds.len(), 1);
        });
    }

    #[test]
    fn large_frames_survive_short_writes() {
        rt().block_on(async {
            let (a, b) = UnixStream::pair().expect("pair");
            let payload = vec![7u8; crate::proto::MAX_PAYLOAD];
            let header = Header::request(Code::Stats, 1, payload.len()).expect("header");
            let writer = async { write_frame(&a, &header, &payload, &[]).await };
            let reader = async { read_frame(&b).await };
            let (w, r) = tokio::join!(writer, reader);
            w.expect("write");
            assert_eq!(r.expect("read").payload.len(), crate::proto::MAX_PAYLOAD);
        });
    }

    #[test]
    fn eof_and_bad_headers() {
        rt().block_on(async {
            let (a, b) = UnixStream::pair().expect("pair");
            drop(a);
            assert!(matches!(read_frame(&b).await, Err(ProtoError::Closed)));

            let (a, b) = UnixStream::pair().expect("pair");
            let header = Header::request(Code::Free, 1, 8).expect("header");
            a.writable().await.expect("writable");
            let mut bytes = header.encode().to_vec();
            bytes.extend_from_slice(&[1, 2, 3]);
            a.try_write(&bytes).expect("write");
            drop(a);
            assert!(matches!(
                read_frame(&b).await,
                Err(ProtoError::UnexpectedEof)
            ));

            let (a, b) = UnixStream::pair().expect("pair");
            let mut bytes = Header::request(Code::Free, 1, 8).expect("header").encode();
            bytes[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
            a.try_write(&bytes).expect("write");
            assert!(matches!(
                read_frame(&b).await,
                Err(ProtoError::PayloadTooLarge(_))
            ));
        });
    }
}
