//! A QEMU VM's snapshot as the daemon sees it (docs/protocol.md, "A QEMU
//! VM's snapshot"): `hugemem launch` sends it as any local migration, with
//! `"vmm":"qemu"` in the configuration and QEMU's migration stream in the
//! state. The daemon neither parses the stream nor trusts it: an
//! oversized state is refused before a byte of it is read, and the
//! tenant's allocation stays its own, untouched; a state whose stream is
//! garbage parks (it is the tenant's own business) and comes back byte for
//! byte; another uid finds no such VM; a receiver that refuses the last
//! step (a QEMU that refused the stream) leaves it parked. The daemon runs
//! in this process; a forked child `setuid`s for the other uid.

mod park_peer;

use std::os::unix::net::UnixStream;

use backend::client::Client;
use backend::proto::Status;
use ch_migration::Command;
use park_peer::*;
use test_support::prelude::{reserve_2m, serial};
use test_support::tenant::{alloc_2m, in_child, root_or_skip, NOBODY};

const MIB: u64 = 1 << 20;

/// The configuration `hugemem launch` sends for a QEMU VM of one 2 MiB
/// region.
fn qemu_config() -> String {
    serde_json::json!({
        "vmm": "qemu",
        "format": 1,
        "program": "qemu-system-x86_64",
        "args": ["-M", "microvm", "-accel", "kvm"],
        "regions": [{"size": 2 * MIB, "node": null}],
        "memory_manager_data": {"guest_ram_mappings": [
            {"slot": 0, "gpa": 0, "size": 2 * MIB, "file_offset": 0}
        ]},
    })
    .to_string()
}

#[test]
fn a_qemu_vms_state_is_bounded_kept_as_it_came_and_the_tenants_own() {
    const TEST: &str = "a_qemu_vms_state_is_bounded_kept_as_it_came_and_the_tenants_own";
    let _g = serial();
    if !root_or_skip() || !reserve_2m(8, TEST) {
        return;
    }
    let d = daemon_for_two_uids();
    let mut launcher = d.client();
    let a = launcher.alloc(alloc_2m(2 * MIB, false)).expect("ALLOC");
    fill_mapped(&a.fds[0], 2 * MIB);
    let config = qemu_config();

    // A state over the bound: refused at its header, the VM still the
    // launcher's and untouched.
    let oversized = vec![
        Step::Send(start()),
        Step::Send(memory_fd(0, &[&a.fds[0]])),
        Step::Send(park_peer::config(&config)),
        Step::Send(raw(Command::State as u16, 0, 64 * MIB + 1)),
    ];
    let run = park_via(&mut d.client(), "qvm", oversized);
    assert_refused(
        &run.result,
        Status::Invalid,
        "a state of 67108865 bytes (at most 67108864)",
        "an oversized QEMU state",
    );
    let stats = assert_serves_balanced(&d, 1, 0, "after the oversized state");
    assert_eq!(stats.counters.parks, 0);
    assert!(holds_pattern(&a.fds[0], 0, 2 * MIB, 0), "the VM's bytes");

    // A stream that is no QEMU's: the daemon keeps it as it came.
    let forged = serde_json::json!({
        "vmm": "qemu", "bytes": 3, "migration_stream": "not base64, not QEMU's",
    })
    .to_string();
    let steps = vec![
        Step::Send(start()),
        Step::Send(memory_fd(0, &[&a.fds[0]])),
        Step::Send(park_peer::config(&config)),
        Step::Send(state(forged.as_bytes())),
        Step::Send(complete_paused()),
    ];
    let parked = park_via(&mut d.client(), "qvm", steps)
        .result
        .expect("PARK of a QEMU VM");
    assert_eq!((parked.alloc_id, parked.copied_bytes), (a.id, 0), "moved");

    // Another uid finds no VM of that name.
    let socket = d.socket();
    let code = in_child(Some(NOBODY), move || {
        let Ok(mut c) = Client::connect(&socket) else {
            return 10;
        };
        let Ok((daemon_end, _peer)) = UnixStream::pair() else {
            return 11;
        };
        let restored = child_expects(
            c.restore("qvm", &daemon_end, false),
            Status::NotFound,
            "no VM named \"qvm\" is parked",
        );
        let unparked = child_expects(
            c.unpark("qvm"),
            Status::NotFound,
            "no VM named \"qvm\" is parked",
        );
        restored + unparked
    });
    assert_eq!(code, 0, "uid 65534's RESTORE and UNPARK of root's QEMU VM");

    // A receiver that refuses the last step (a QEMU that refused the
    // stream): the VM stays parked.
    let (daemon_end, receiver_end) = UnixStream::pair().expect("socketpair");
    let receiver = std::thread::spawn(move || {
        let limits = ch_migration::Limits::default();
        let got = ch_migration::peer::receive_until_complete(&receiver_end, limits);
        let _ = ch_migration::peer::answer_complete(&receiver_end, false);
        got.map(|s| (s.config, s.state))
    });
    let refused = d.client().restore("qvm", &daemon_end, false);
    drop(daemon_end);
    let (sent_config, sent_state) = receiver
        .join()
        .expect("the receiver")
        .expect("the snapshot");
    assert!(refused.is_err(), "a refused Complete hands nothing out");
    assert_eq!(
        sent_config,
        config.as_bytes(),
        "the configuration as it came"
    );
    assert_eq!(sent_state, forged.as_bytes(), "the state as it came");
    assert_serves_balanced(&d, 1, 1, "after the refused restore");

    // A receiver that takes it: the same bytes, on the same memory.
    let mut restorer = d.client();
    let (restored, snapshot) = restore_via(&mut restorer, "qvm");
    let restored = restored.expect("RESTORE");
    let snapshot = snapshot.expect("received");
    assert_eq!(restored.id, a.id);
    assert_eq!(snapshot.state, forged.as_bytes());
    assert!(
        holds_pattern(&restored.fds[0], 0, 2 * MIB, 0),
        "the VM's bytes"
    );
    drop((a, restored, snapshot));
    d.shutdown();
}
