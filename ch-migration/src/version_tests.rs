//! The errors a newer cloud-hypervisor's refusals turn into: each says
//! which protocol hugemem speaks and, where the refusal is about the
//! memory mode, what the newer release expects. The peer here is a fake:
//! raw response headers on a socket pair, as a cloud-hypervisor that does
//! not speak this version would answer.

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;

use super::peer::{receive_snapshot, send_snapshot};
use super::version::{
    CLOUD_HYPERVISOR_COMMIT, CLOUD_HYPERVISOR_RELEASE, MEMORY_FDS_OPTION, NEWER_MEMORY_FDS_OPTION,
};
use super::*;

/// A receiver that reads one request header and answers it with `status`.
fn answer_first_request(status: u16) -> UnixStream {
    let (ours, theirs) = UnixStream::pair().expect("pair");
    std::thread::spawn(move || {
        let mut head = [0u8; HEADER_SIZE];
        std::io::Read::read_exact(&mut &theirs, &mut head).expect("a request");
        let mut answer = [0u8; HEADER_SIZE];
        answer[..2].copy_from_slice(&status.to_le_bytes());
        crate::sys::send_all(theirs.as_fd(), &answer, &[]).expect("answer");
    });
    ours
}

fn assert_names_the_version(text: &str) {
    for piece in [
        CLOUD_HYPERVISOR_RELEASE,
        CLOUD_HYPERVISOR_COMMIT,
        &format!("protocol version {PROTOCOL_VERSION}"),
    ] {
        assert!(text.contains(piece), "{text:?} lacks {piece:?}");
    }
}

#[test]
fn a_refused_start_names_the_version_and_the_newer_option() {
    let sock = answer_first_request(2);
    let err = send_snapshot(&sock, &[], b"{}", b"{}", true).expect_err("refused");
    assert!(
        matches!(err, ChMigrationError::Refused(Command::Start)),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(text.starts_with("the peer refused Start"), "{text}");
    assert_names_the_version(&text);
    for option in [MEMORY_FDS_OPTION, NEWER_MEMORY_FDS_OPTION] {
        assert!(text.contains(option), "{text:?} lacks {option:?}");
    }
}

#[test]
fn an_unknown_response_status_names_the_version() {
    let sock = answer_first_request(3);
    let err = send_snapshot(&sock, &[], b"{}", b"{}", true).expect_err("unparsable");
    assert!(matches!(err, ChMigrationError::UnknownStatus(3)), "{err:?}");
    assert_names_the_version(&err.to_string());
}

#[test]
fn a_newer_senders_start_and_commands_name_the_version() {
    let (ours, theirs) = UnixStream::pair().expect("pair");
    let mut start = RequestHeader::new(Command::Start, 0).encode();
    start[2..4].copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
    crate::sys::send_all(ours.as_fd(), &start, &[]).expect("send");
    let err = receive_snapshot(&theirs, Limits::default()).expect_err("another version");
    assert!(matches!(err, ChMigrationError::Version(v) if v == PROTOCOL_VERSION + 1));
    assert_names_the_version(&err.to_string());

    let err = RequestHeader::decode(&[10; HEADER_SIZE]).expect_err("no command 2570");
    assert!(err.to_string().starts_with("unknown migration command"));
    assert_names_the_version(&err.to_string());
}

#[test]
fn a_refusal_later_in_the_sequence_is_about_the_vm_not_the_protocol() {
    let text = ChMigrationError::Refused(Command::Config).to_string();
    assert_eq!(text, "the peer refused Config");
}
