//! Raw syscalls of the migration socket, each behind a small safe function.
//!
//! * [`recv_with_fds`]: `recvmsg` that takes every `SCM_RIGHTS` fd the kernel
//!   installed into an [`OwnedFd`], **including when the control data was
//!   truncated** (`MSG_CTRUNC`). `nix`'s `RecvMsg::cmsgs` refuses to iterate a
//!   truncated buffer (`ENOBUFS`), but the kernel has already installed as
//!   many fds as fit into it (`scm_detach_fds`: the rest are dropped), so a
//!   caller that returns an error there leaks them: 64 per frame, from any
//!   peer, even a refused one. `hugemem-client` and the daemon receive
//!   hugemem's own protocol through the same function (re-exported as
//!   `hugemem_client::sys::recv_with_fds`).
//! * [`send_all`]: every byte, with fds on the first one (`sendmsg`).
//! * [`unread_bytes`]: what a socket holds unread (`FIONREAD`).
//!
//! [`OwnedFd`]: std::os::fd::OwnedFd

use std::io;
use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};

/// What one [`recv_with_fds`] call got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received {
    /// Payload bytes (0: the peer closed).
    pub bytes: usize,
    /// The kernel had more control data than fitted (`MSG_CTRUNC`): fds were
    /// dropped by the kernel. The ones that fitted were still taken.
    pub truncated: bool,
}

/// One `recvmsg(2)` of at most `buf.len()` bytes with room for `max_fds`
/// descriptors (`MSG_CMSG_CLOEXEC`, plus `MSG_DONTWAIT` when `nonblocking`).
/// Every descriptor the kernel installed is appended to `fds` as an
/// [`OwnedFd`] before anything else is looked at, so no return path leaks one.
///
/// # Errors
///
/// The `recvmsg` error (`EINTR` is retried; `EAGAIN` is returned).
pub fn recv_with_fds(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    max_fds: usize,
    nonblocking: bool,
) -> io::Result<Received> {
    let fd_bytes = u32::try_from(max_fds * std::mem::size_of::<RawFd>())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
    // u64 elements: cmsghdr alignment (size_t) is at most 8 on Linux.
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain old data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() * 8;
    let mut flags = libc::MSG_CMSG_CLOEXEC;
    if nonblocking {
        flags |= libc::MSG_DONTWAIT;
    }
    let n = loop {
        // SAFETY: `msg` points at `iov` (over `buf`, writable for its length)
        // and at `control` (writable for msg_controllen bytes); all outlive
        // the call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, flags) };
        if n >= 0 {
            break n;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    // Take the fds first: whatever comes next, they are owned.
    // SAFETY: `msg` was filled by the kernel: msg_control/msg_controllen
    // describe the control data it wrote (msg_controllen was shrunk to it).
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !cmsg.is_null() {
        // SAFETY: CMSG_FIRSTHDR/CMSG_NXTHDR only return headers that lie
        // inside the control buffer written by the kernel.
        let hdr = unsafe { std::ptr::read_unaligned(cmsg) };
        if hdr.cmsg_level == libc::SOL_SOCKET && hdr.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: pure size computation.
            let header_len = unsafe { libc::CMSG_LEN(0) } as usize;
            let count =
                (hdr.cmsg_len as usize).saturating_sub(header_len) / std::mem::size_of::<RawFd>();
            // SAFETY: the data of this cmsg lies inside the control buffer.
            let data = unsafe { libc::CMSG_DATA(cmsg) }.cast::<RawFd>();
            for i in 0..count {
                // SAFETY: `i < count`, so this int lies inside the cmsg's data
                // (cmsg_len counts it); unaligned reads are allowed.
                let raw = unsafe { std::ptr::read_unaligned(data.wrapping_add(i)) };
                if raw >= 0 {
                    // SAFETY: the kernel just installed `raw` in our fd table
                    // for this message; nothing else knows it.
                    fds.push(unsafe { OwnedFd::from_raw_fd(raw) });
                }
            }
        }
        // SAFETY: `cmsg` is a header inside `msg`'s control buffer.
        cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
    }
    Ok(Received {
        bytes: usize::try_from(n).unwrap_or(0),
        truncated: msg.msg_flags & libc::MSG_CTRUNC != 0,
    })
}

/// Sends all of `bytes` on `sock`, `fds` (`SCM_RIGHTS`) with the first
/// `sendmsg`; `MSG_NOSIGNAL`, so a peer that went away is an error, not a
/// `SIGPIPE`.
///
/// # Errors
///
/// The `sendmsg` error (`EINTR` is retried); `WriteZero` when the kernel
/// took no byte.
pub fn send_all(sock: BorrowedFd<'_>, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let mut sent = 0;
    while sent < bytes.len() {
        let rights = [ControlMessage::ScmRights(&raw)];
        let cmsgs: &[ControlMessage<'_>] = if sent == 0 && !raw.is_empty() {
            &rights
        } else {
            &[]
        };
        let iov = [IoSlice::new(&bytes[sent..])];
        match sendmsg::<()>(sock.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Ok(n) => sent += n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Bytes a stream socket has received that nobody has read yet
/// (`ioctl(FIONREAD)`).
///
/// # Errors
///
/// The `ioctl` error.
pub fn unread_bytes(sock: BorrowedFd<'_>) -> io::Result<usize> {
    let mut unread: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int through the pointer, which points
    // at `unread`, alive for the call; `sock` is an open descriptor.
    let ret = unsafe { libc::ioctl(sock.as_raw_fd(), libc::FIONREAD, &mut unread) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(unread).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    /// How many of this process's fds are `sock`'s description: only this
    /// test holds that socket, so tests running beside it do not change
    /// the count.
    fn open_fds_of(sock: &UnixStream) -> usize {
        let ino = nix::sys::stat::fstat(sock).expect("fstat").st_ino;
        let target = format!("socket:[{ino}]");
        std::fs::read_dir("/proc/self/fd")
            .expect("fd dir")
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|link| link.as_os_str() == target.as_str())
            .count()
    }

    #[test]
    fn truncated_rights_are_still_owned() {
        let (a, b) = UnixStream::pair().expect("pair");
        let (x, _y) = UnixStream::pair().expect("pair");
        let raw = vec![x.as_raw_fd(); 100];
        let iov = [std::io::IoSlice::new(b"h")];
        let cmsg = [nix::sys::socket::ControlMessage::ScmRights(&raw)];
        nix::sys::socket::sendmsg::<()>(
            a.as_raw_fd(),
            &iov,
            &cmsg,
            nix::sys::socket::MsgFlags::empty(),
            None,
        )
        .expect("send");
        let before = open_fds_of(&x);
        let mut fds = Vec::new();
        let mut buf = [0u8; 4];
        let got = recv_with_fds(b.as_fd(), &mut buf, &mut fds, 8, false).expect("recv");
        assert_eq!(got.bytes, 1);
        assert!(got.truncated, "100 fds into room for 8 must truncate");
        assert_eq!(fds.len(), 8, "the 8 fds that fitted are owned");
        assert_eq!(open_fds_of(&x), before + 8);
        drop(fds);
        assert_eq!(open_fds_of(&x), before, "dropping them closes them");
    }
}
