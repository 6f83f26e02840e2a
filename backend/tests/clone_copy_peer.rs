//! Copy clones in postcopy mode (RESTORE with COPY and POSTCOPY) against
//! the real daemon in this process, with fake cloud-hypervisor receivers
//! (`restore_peer`) that ask for pages on their fault connection, or
//! misbehave, as a script says:
//!
//! * several copy clones of one template at once: each gets fresh memory,
//!   every page it asks for holds the template's bytes when answered, the
//!   rest is filled in the background, and the template stays parked and
//!   unchanged;
//! * a receiver that asks for the guest's first page when the state comes
//!   (cloud-hypervisor's prefault) has it answered before `Complete`;
//! * a template of two regions: the copy has two regions, each filled
//!   from its own, faults of either slot served;
//! * hostile receivers: a bogus fault request (not page aligned), a fault
//!   outside the mapping, a receiver gone with `Complete` unanswered, and
//!   one gone once it ran: a refused fault request fails the RESTORE (its
//!   guest could get no more pages), the others are refused or ended, the
//!   template unchanged, an earlier copy unchanged, and the pool's books
//!   balanced once the connections end.
//!
//! The tests are serialized (`serial`): they share the host's huge pages.

mod park_peer;
mod restore_peer;

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use backend::client::{Client, ClientError};
use backend::proto::messages::{AllocPart, AllocRequest};
use backend::proto::{ClearMode, CloneMode, PagePolicy};
use ch_migration::Command;
use hugemem_client::client::Allocation;
use hugemem_client::park::RestoreOptions;
use park_peer::{
    assert_serves_balanced, complete_paused, config, fake_sender, holds_pattern, identity, memfd,
    memory_fd, pattern, read_at, start, state, Answer, Step, STATE,
};
use restore_peer::{Script, Seen, Stop};
use test_support::prelude::{map_raw, reserve_2m, serial, unmap_raw, wait_until, TestDaemon};

const MIB: u64 = 1 << 20;
/// The template: four 2 MiB units.
const SIZE: u64 = 8 * MIB;
const PAGE: u64 = 2 * MIB;

/// A configuration with `mappings` `(slot, gpa, size)` (each at file offset
/// 0 of its slot's fd) and a memory section (a postcopy restore declares
/// its zones hugetlb in it).
fn vm_config(mappings: &[(u32, u64, u64)]) -> String {
    let list: Vec<serde_json::Value> = mappings
        .iter()
        .map(|&(slot, gpa, size)| {
            serde_json::json!({
                "slot": slot, "gpa": gpa, "size": size, "file_offset": 0,
                "zone_id": format!("mem{slot}"), "virtio_mem": false
            })
        })
        .collect();
    let total: u64 = mappings.iter().map(|m| m.2).sum();
    serde_json::json!({
        "cpus": {"boot_vcpus": 1},
        "vm_config": {"memory": {"size": total}},
        "memory_manager_data": {"guest_ram_mappings": list}
    })
    .to_string()
}

/// PARK `name` from `fds` (slot i is `fds[i]`, mapped `size` bytes at
/// guest address `i * size`).
fn park(client: &mut Client, name: &str, fds: &[&OwnedFd], size: u64) {
    let mut steps = vec![Step::Send(start())];
    let mut mappings = Vec::new();
    for (i, fd) in fds.iter().enumerate() {
        let slot = u32::try_from(i).expect("a slot");
        steps.push(Step::Send(memory_fd(slot, &[fd])));
        mappings.push((slot, i as u64 * size, size));
    }
    steps.push(Step::Send(config(&vm_config(&mappings))));
    steps.push(Step::Send(state(STATE)));
    steps.push(Step::Send(complete_paused()));
    let n = steps.len();
    let (daemon_end, sender) = fake_sender(steps);
    let parked = client.park(name, &daemon_end);
    drop(daemon_end);
    let answers = sender.join().expect("the fake sender");
    parked.expect("PARK");
    assert_eq!(answers, vec![Answer::Ok; n]);
}

/// A postcopy copy clone of `name` on `client` into a fake receiver that
/// runs `script`: the daemon's reply and what the receiver saw.
fn copy_postcopy(
    client: &mut Client,
    name: &str,
    script: Script,
) -> (Result<Allocation, ClientError>, Seen) {
    let (main, fault, receiver) = restore_peer::spawn(script);
    let fault = fault.expect("a postcopy receiver");
    let how = RestoreOptions {
        paused: false,
        fault: Some(&fault),
        copy: true,
    };
    let r = client.restore_with(name, &main, how);
    drop((main, fault));
    (r, receiver.join().expect("the fake receiver"))
}

/// A read-only fd of the template's first region (a shared clone's, on
/// its own connection, which counts the clone until it is dropped).
fn template_fd(d: &TestDaemon, name: &str) -> (Client, OwnedFd) {
    let mut c = d.client();
    let (daemon_end, ours) = UnixStream::pair().expect("socketpair");
    let receiver = std::thread::spawn(move || {
        ch_migration::peer::receive_snapshot(&ours, ch_migration::Limits::default()).ok()
    });
    c.clone_parked(name, CloneMode::Shared, &daemon_end)
        .expect("a shared clone to read the template");
    drop(daemon_end);
    let mut snap = receiver.join().expect("receiver").expect("the template");
    (c, snap.memory.remove(0).1)
}

/// True when every page `seen` had holds the template's bytes there.
fn pages_hold_the_template(seen: &Seen) -> bool {
    seen.pages.iter().all(|(at, bytes)| {
        bytes
            .iter()
            .enumerate()
            .all(|(i, &b)| b == pattern(at + i as u64))
    })
}

/// True when `fd` holds `pattern` shifted by `shift` over `len` bytes.
fn holds(fd: &impl AsFd, len: u64, shift: u64) -> bool {
    read_at(fd, 0, len)
        .iter()
        .enumerate()
        .all(|(i, &b)| b == pattern(shift + i as u64))
}

#[test]
fn postcopy_copy_clones_at_once_get_the_template_page_by_page() {
    const TEST: &str = "postcopy_copy_clones_at_once_get_the_template_page_by_page";
    const COPIES: usize = 3;
    let _g = serial();
    if !reserve_2m((1 + COPIES as u64) * SIZE / PAGE + 4, TEST) {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut owner = d.client();
    let mem = memfd("copy-postcopy", SIZE, false);
    park(&mut owner, "tmpl", &[&mem], SIZE);
    let (checker, template) = template_fd(&d, "tmpl");
    let runs: Vec<_> = (0..COPIES)
        .map(|i| {
            let mut c = d.client();
            std::thread::spawn(move || {
                let mut script = Script::new(Stop::Never, true, SIZE);
                // Each asks for a different page first, as its guest runs.
                script.early_faults = vec![(i as u64 % 4) * PAGE];
                let (r, seen) = copy_postcopy(&mut c, "tmpl", script);
                (c, r, seen)
            })
        })
        .collect();
    let mut held = Vec::new();
    for run in runs {
        let (c, r, seen) = run.join().expect("a copy clone");
        let copy = r.expect("a postcopy copy clone");
        assert_eq!((seen.faults_ok, seen.faults_refused), (4, 0));
        assert!(
            pages_hold_the_template(&seen),
            "a page it had was not the template's"
        );
        let fd = seen.memory.as_ref().expect("the copy's memory");
        assert_ne!(identity(fd), identity(&template), "fresh memory");
        assert_eq!(
            identity(fd),
            identity(&copy.fds[0]),
            "the memory handed out"
        );
        assert!(holds(fd, SIZE, 0), "every byte filled from the template");
        assert!(seen.commands.contains(&Command::Complete), "the guest runs");
        held.push((c, copy));
    }
    assert!(holds(&template, SIZE, 0), "the template changed");
    let s = d.stats();
    assert_eq!(s.parked.len(), 1, "the template stays parked: {s}");
    assert_eq!(s.counters.clones, COPIES as u64 + 1, "{s}");
    assert_eq!(s.allocations.active, 1 + COPIES as u64, "{s}");
    for (mut c, copy) in held {
        c.free(copy.id).expect("FREE a copy");
    }
    drop((checker, template));
    wait_until(
        "UNPARK once the checker's clone ended",
        Duration::from_secs(10),
        || owner.unpark("tmpl").is_ok(),
    );
    assert_serves_balanced(&d, 0, 0, "the copies freed, the template dropped");
}

/// cloud-hypervisor asks for the guest's first page when the state comes
/// (its prefault), before it answers the state; its guest resumes at
/// `Complete`. The daemon sends `Complete` only once that page is
/// answered, so the guest never runs before its first page is mapped
/// (on `kvm_pvm` such a guest was seen to die: docs/operations.md,
/// "Clones"). Several copies at once, so the fills compete.
#[test]
fn complete_comes_only_once_the_page_asked_for_at_the_state_is_answered() {
    const TEST: &str = "complete_comes_only_once_the_page_asked_for_at_the_state_is_answered";
    const COPIES: usize = 3;
    let _g = serial();
    if !reserve_2m((1 + COPIES as u64) * SIZE / PAGE + 4, TEST) {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut owner = d.client();
    let mem = memfd("copy-first-page", SIZE, false);
    park(&mut owner, "tmpl", &[&mem], SIZE);
    let runs: Vec<_> = (0..COPIES)
        .map(|_| {
            let mut c = d.client();
            std::thread::spawn(move || {
                let mut script = Script::new(Stop::Never, true, SIZE);
                script.state_fault = Some(0);
                let (r, seen) = copy_postcopy(&mut c, "tmpl", script);
                (c, r, seen)
            })
        })
        .collect();
    for run in runs {
        let (mut c, r, seen) = run.join().expect("a copy clone");
        let copy = r.expect("a postcopy copy clone");
        assert_eq!(
            seen.answered_before_complete,
            Some(true),
            "Complete came before the first page's answer"
        );
        assert_eq!((seen.faults_ok, seen.faults_refused), (4, 0));
        assert!(
            pages_hold_the_template(&seen),
            "a page it had was not the template's"
        );
        c.free(copy.id).expect("FREE a copy");
    }
    owner.unpark("tmpl").expect("UNPARK");
    assert_serves_balanced(&d, 0, 0, "the copies freed, the template dropped");
}

/// Writes `pattern` shifted by `shift` over a hugemem region `fd` of `size`
/// bytes through a shared mapping (hugetlbfs files take no `write`).
fn fill_shifted(fd: &impl AsFd, size: u64, shift: u64) {
    let p = map_raw(fd.as_fd().as_raw_fd(), size);
    assert!(!p.is_null(), "mmap of a region");
    let bytes: Vec<u8> = (0..size).map(|i| pattern(shift + i)).collect();
    // SAFETY: `p` is this test's live shared mapping of `size` bytes and
    // `bytes` holds exactly `size` bytes; they do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len()) };
    unmap_raw(p, size);
}

#[test]
fn a_template_of_two_regions_is_copied_region_by_region() {
    const TEST: &str = "a_template_of_two_regions_is_copied_region_by_region";
    const HALF: u64 = SIZE / 2;
    let _g = serial();
    if !reserve_2m(2 * SIZE / PAGE + 4, TEST) {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut owner = d.client();
    let part = AllocPart {
        node: 0,
        size: HALF,
    };
    let vm = owner
        .alloc(AllocRequest {
            total_size: SIZE,
            page_policy: PagePolicy::Huge2M,
            clear_mode: ClearMode::Eager,
            lock: false,
            parts: vec![part, part],
            want_paths: false,
        })
        .expect("ALLOC of two regions");
    assert_eq!(vm.fds.len(), 2, "two regions");
    // Slot 1's bytes are the guest's bytes at HALF on.
    fill_shifted(&vm.fds[0], HALF, 0);
    fill_shifted(&vm.fds[1], HALF, HALF);
    park(&mut owner, "two", &[&vm.fds[0], &vm.fds[1]], HALF);
    let s = d.stats();
    assert_eq!(s.parked.len(), 1, "{s}");

    for postcopy in [true, false] {
        let mut cloner = d.client();
        let copy = if postcopy {
            let mut script = Script::new(Stop::Never, true, SIZE);
            // A page of each slot first.
            script.early_faults = vec![HALF + PAGE, 0];
            let (r, seen) = copy_postcopy(&mut cloner, "two", script);
            assert_eq!((seen.faults_ok, seen.faults_refused), (4, 0));
            assert!(pages_hold_the_template(&seen));
            r.expect("a postcopy copy of two regions")
        } else {
            let (daemon_end, ours) = UnixStream::pair().expect("socketpair");
            let receiver = std::thread::spawn(move || {
                ch_migration::peer::receive_snapshot(&ours, ch_migration::Limits::default()).ok()
            });
            let how = RestoreOptions {
                paused: true,
                fault: None,
                copy: true,
            };
            let r = cloner.restore_with("two", &daemon_end, how);
            drop(daemon_end);
            let snap = receiver
                .join()
                .expect("receiver")
                .expect("the copy arrived");
            assert_eq!(snap.memory.len(), 2, "one fd a slot");
            r.expect("an eager copy of two regions")
        };
        assert_eq!(copy.fds.len(), 2, "two regions (postcopy {postcopy})");
        assert!(
            holds(&copy.fds[0], HALF, 0),
            "region 0 (postcopy {postcopy})"
        );
        assert!(
            holds(&copy.fds[1], HALF, HALF),
            "region 1 (postcopy {postcopy})"
        );
        cloner.free(copy.id).expect("FREE the copy");
    }
    assert!(holds(&vm.fds[0], HALF, 0) && holds(&vm.fds[1], HALF, HALF));
    drop(vm);
    owner.unpark("two").expect("UNPARK");
    drop(owner);
    assert_serves_balanced(&d, 0, 0, "the copies freed, the template dropped");
}

/// `r` is the refusal of a copy whose receiver's fault connection ended
/// before it had every page.
fn assert_fault_connection_refused(r: Result<Allocation, ClientError>, case: &str) {
    match r {
        Err(ClientError::Refused { message, .. }) => assert!(
            message.contains("fault connection ended before it had every page"),
            "{case}: {message}"
        ),
        other => panic!("{case}: the RESTORE was not refused: {other:?}"),
    }
}

#[test]
fn hostile_receivers_of_a_copy_harm_neither_the_template_nor_a_sibling() {
    const TEST: &str = "hostile_receivers_of_a_copy_harm_neither_the_template_nor_a_sibling";
    let _g = serial();
    if !reserve_2m(4 * SIZE / PAGE + 4, TEST) {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut owner = d.client();
    let mem = memfd("copy-hostile", SIZE, false);
    park(&mut owner, "tmpl", &[&mem], SIZE);
    let (checker, template) = template_fd(&d, "tmpl");
    // A sibling that runs throughout.
    let mut sibling = d.client();
    let (r, _) = copy_postcopy(&mut sibling, "tmpl", Script::new(Stop::Never, true, SIZE));
    let sibling_copy = r.expect("the sibling");
    let baseline = d.stats().allocations.active;

    // A bogus fault request, then a fault outside the mapping: each
    // refused, which ends the fault connection; the background fill ends,
    // and the RESTORE is refused (the guest could get no more pages).
    for (page, at, case) in [
        (12_345, 0, "a fault not page aligned"),
        (PAGE, 4 * SIZE, "a fault outside the mapping"),
    ] {
        let mut c = d.client();
        let mut script = Script::new(Stop::Never, true, SIZE);
        (script.page, script.early_faults) = (page, vec![at]);
        let (r, seen) = copy_postcopy(&mut c, "tmpl", script);
        assert_eq!(seen.faults_refused, 1, "{case}: refused");
        assert!(seen.pages.is_empty(), "{case}: no page answered");
        assert_fault_connection_refused(r, case);
        drop(c);
        assert!(holds(&template, SIZE, 0), "{case}: the template changed");
    }
    // Gone with `Complete` unanswered, having had a page: refused, the
    // copy released.
    let mut c = d.client();
    let mut script = Script::new(Stop::Unanswered(Command::Complete), true, SIZE);
    script.early_faults = vec![PAGE];
    let (r, seen) = copy_postcopy(&mut c, "tmpl", script);
    assert!(r.is_err(), "a receiver gone before Complete: {r:?}");
    assert!(pages_hold_the_template(&seen));
    // Gone once it ran (`Complete` answered), with pages not asked for:
    // the background fills them, and the copy is the connection's.
    let mut script = Script::new(Stop::After(Command::Complete), true, SIZE);
    (script.early_faults, script.scribble) = (vec![0], true);
    let (r, _) = copy_postcopy(&mut c, "tmpl", script);
    let ran = r.expect("the copy of a receiver that ran");
    assert!(
        read_at(&ran.fds[0], 0, PAGE).iter().all(|&b| b == 0xEE),
        "the page its guest wrote"
    );
    assert!(
        holds_pattern(&ran.fds[0], PAGE, SIZE - PAGE, PAGE),
        "the pages it never asked for, filled in the background"
    );
    drop((ran, c));

    wait_until(
        "the hostile connections' memory released",
        Duration::from_secs(30),
        || d.stats().allocations.active == baseline,
    );
    assert!(holds(&template, SIZE, 0), "the template changed");
    assert!(holds(&sibling_copy.fds[0], SIZE, 0), "the sibling changed");
    assert_serves_balanced(&d, baseline, 1, "after the hostile receivers");
    sibling.free(sibling_copy.id).expect("FREE the sibling");
    drop((checker, template, sibling));
    wait_until(
        "UNPARK once the checker ended",
        Duration::from_secs(10),
        || owner.unpark("tmpl").is_ok(),
    );
    assert_serves_balanced(&d, 0, 0, "all freed, the template dropped");
}
