//! The clone tests' pieces: a fake clone launcher (CLONE on a socket
//! pair, `receive_snapshot` on our end), a refusal check, the hold on the
//! host's free huge pages (`hold_all_but_2m`, test-support's), and a
//! clone's private mapping of a template.

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;

use backend::client::{Client, ClientError};
use backend::proto::{CloneMode, Status};
use ch_migration::peer::{receive_snapshot, Snapshot};
use hugemem_client::park::Exported;

/// 2 MiB, the clone tests' page.
pub const PAGE: u64 = 2 << 20;

/// CLONE `name` in `mode` on `client`, a fake launcher receiving: the
/// daemon's reply and what the launcher got (`None`: nothing came whole).
/// The launcher's end of the socket closes at once (a launcher whose
/// clone mapped its memory, as far as the daemon can tell).
pub fn clone_via(
    client: &mut Client,
    name: &str,
    mode: CloneMode,
) -> (Result<Exported, ClientError>, Option<Snapshot>) {
    let (r, snap, _ours) = clone_keeping(client, name, mode);
    (r, snap)
}

/// As [`clone_via`], and the launcher's end of the socket, kept open (a
/// launcher whose cloud-hypervisor has not mapped the template yet: the
/// daemon keeps its pages promised until it closes).
pub fn clone_keeping(
    client: &mut Client,
    name: &str,
    mode: CloneMode,
) -> (Result<Exported, ClientError>, Option<Snapshot>, UnixStream) {
    let (daemon_end, ours) = UnixStream::pair().expect("socketpair");
    let (r, snap) = std::thread::scope(|s| {
        let receiver = s.spawn(|| receive_snapshot(&ours, ch_migration::Limits::default()).ok());
        let result = client.clone_parked(name, mode, &daemon_end);
        drop(daemon_end);
        (result, receiver.join().expect("the fake launcher"))
    });
    (r, snap, ours)
}

pub fn expect_refused<T: std::fmt::Debug>(r: Result<T, ClientError>, status: Status, needle: &str) {
    match r {
        Err(ClientError::Refused { status: s, message }) => {
            assert_eq!(s, status, "{message}");
            assert!(message.contains(needle), "{needle:?} not in {message:?}");
        }
        other => panic!("expected {status:?} saying {needle:?}, got {other:?}"),
    }
}

/// A private, reserved mapping of `fd` (as a shared clone's
/// cloud-hypervisor makes it: `MAP_PRIVATE` without `MAP_NORESERVE`).
pub struct Private(*mut u8, usize);

impl Private {
    pub fn of(fd: &impl AsFd, len: u64) -> Self {
        use std::os::fd::AsRawFd;
        let len = usize::try_from(len).expect("a length");
        // SAFETY: a new private mapping of a file the test holds open; it
        // aliases nothing of this process and is unmapped by Drop.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                fd.as_fd().as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "map the template privately");
        Self(p.cast(), len)
    }

    pub fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is `self.1` bytes, readable and writable,
        // and only this value hands out views of it.
        unsafe { std::slice::from_raw_parts_mut(self.0, self.1) }
    }
}

impl Drop for Private {
    fn drop(&mut self) {
        // SAFETY: the mapping Private::of made, unmapped once.
        unsafe { libc::munmap(self.0.cast(), self.1) };
    }
}
