//! An allocation's owner: each move from each state, and the owner's part
//! of the state document (the JSON version 1 documents carry).

use super::allocation::{AllocSnapshot, Allocation, Next, Owner, Refused};
use super::parked_vm::ParkedVm;
use super::persist::AllocRecord;
use crate::daemon::persist::fds::{FdList, Fds};
use crate::daemon::persist::{Persist, RestoreContext, SaveContext};

fn vm(name: &str) -> ParkedVm {
    ParkedVm {
        name: name.to_string(),
        slots: Vec::new(),
        config: "{}".to_string(),
        state: "{}".to_string(),
        copied_bytes: 0,
        parked_at: 1,
        vmm: None,
    }
}

/// A live allocation of connection `session`.
fn live(session: u64) -> Allocation {
    Allocation::committed(session, vec![1], 7, [0; 16], true, false)
}

/// One move of an owner.
type Move<'a> = &'a dyn Fn(&Owner) -> Result<Next, Refused>;

/// `live(1)` moved as `moves` say, each applied in turn.
fn moved(moves: &[Move<'_>]) -> Owner {
    let mut a = live(1);
    for m in moves {
        let next = m(a.owner()).expect("the move is allowed");
        a.enter(next);
    }
    a.owner().clone()
}

#[test]
fn a_live_allocation_moves_to_another_connection_an_orphan_or_a_parked_vm() {
    assert_eq!(moved(&[&|o| o.hand_off(2)]), Owner::Session(2));
    assert_eq!(
        live(1).owner().hand_off(1).err(),
        Some(Refused::AlreadyYours)
    );
    assert_eq!(moved(&[&|o| Ok(o.orphan())]), Owner::Orphaned);
    assert_eq!(
        live(1).owner().reattach(1).err(),
        Some(Refused::NotOrphaned)
    );
    let parked = moved(&[&|o| o.park(Some(1), vm("a"))]);
    assert_eq!(parked.parked().map(|p| p.name.as_str()), Some("a"));
    assert_eq!(parked.session(), None);
    // A PARK that saw another owner (the allocation changed hands since).
    assert_eq!(
        live(1).owner().park(Some(2), vm("a")).err(),
        Some(Refused::Moved)
    );
    assert_eq!(
        live(1).owner().park(None, vm("a")).err(),
        Some(Refused::Moved)
    );
    assert_eq!(
        live(1).owner().restore("a", 2).err(),
        Some(Refused::NotParked)
    );
}

#[test]
fn an_orphan_waits_for_reattach_or_handoff_and_may_be_parked() {
    let orphan = || moved(&[&|o| Ok(o.orphan())]);
    assert_eq!(orphan().reattach(3).map(|_| ()), Ok(()));
    assert_eq!(
        moved(&[&|o| Ok(o.orphan()), &|o| o.reattach(3)]),
        Owner::Session(3)
    );
    assert_eq!(
        moved(&[&|o| Ok(o.orphan()), &|o| o.hand_off(3)]),
        Owner::Session(3)
    );
    let parked = moved(&[&|o| Ok(o.orphan()), &|o| o.park(None, vm("b"))]);
    assert!(parked.parked().is_some());
    assert_eq!(orphan().park(Some(1), vm("b")).err(), Some(Refused::Moved));
    assert_eq!(orphan().restore("b", 3).err(), Some(Refused::NotParked));
    assert_eq!(
        moved(&[&|o| Ok(o.orphan()), &|o| Ok(o.orphan())]),
        Owner::Orphaned
    );
}

#[test]
fn a_parked_vm_is_taken_only_by_a_restore_of_its_name() {
    let park: Move<'_> = &|o| o.park(Some(1), vm("a"));
    let parked = moved(&[park]);
    assert_eq!(parked.reattach(2).err(), Some(Refused::NotOrphaned));
    assert_eq!(parked.hand_off(2).err(), Some(Refused::Parked));
    assert_eq!(parked.park(None, vm("c")).err(), Some(Refused::Moved));
    assert_eq!(parked.restore("b", 2).err(), Some(Refused::NotParked));
    assert_eq!(moved(&[park, &|o| o.restore("a", 2)]), Owner::Session(2));
    // Its connection is long gone: orphaning it leaves it parked.
    assert_eq!(moved(&[park, &|o| Ok(o.orphan())]), parked);
}

#[test]
fn orphaning_a_lazy_allocation_hands_its_faults_to_the_fallback() {
    let mut a = live(1);
    a.orphan(Some(9));
    assert_eq!(a.owner(), &Owner::Orphaned);
    assert!(a.lazy_fallback);
    assert_eq!(a.tenant, 9);
    assert!(a.shown_by(9, &[0; 16]));
    assert!(!a.shown_by(7, &[0; 16]));
    assert!(!a.shown_by(9, &[1; 16]));
}

fn record(session: Option<u64>, parked: Option<&str>) -> serde_json::Value {
    let mut v = serde_json::json!({
        "id": 4, "session": session, "regions": [1, 2], "locked": true, "tenant": 7,
        "token": "000102030405060708090a0b0c0d0e0f", "lazy": true, "lazy_fallback": false
    });
    if let Some(name) = parked {
        v["parked"] = serde_json::json!({
            "name": name, "slots": [{"slot": 0, "region": 1}], "config": "{\"memory\":1}",
            "state": "{}", "copied_bytes": 4096, "parked_at": 1700000000
        });
    }
    v
}

/// `json` read into a snapshot and saved again, for a successor
/// (`to_store` false) or systemd's fd store.
fn read_and_save(json: &serde_json::Value, to_store: bool) -> (AllocSnapshot, serde_json::Value) {
    let state: AllocRecord = serde_json::from_value(json.clone()).expect("a record");
    let topology = numa::Topology::detect().expect("topology");
    let mut fds = Fds(Vec::new());
    let mut restore = RestoreContext {
        fds: &mut fds,
        topology: &topology,
    };
    let snap = AllocSnapshot::restore(state, &mut restore).expect("restored");
    let mut list = FdList::new(false);
    let mut save = SaveContext {
        fds: &mut list,
        to_store,
    };
    let saved = snap.save(&mut save).expect("saved");
    (snap, serde_json::to_value(saved).expect("json"))
}

#[test]
fn each_owner_reads_and_writes_the_same_json_as_version_1() {
    let cases = [
        (record(Some(3), None), Owner::Session(3)),
        (record(None, None), Owner::Orphaned),
    ];
    for (json, owner) in cases {
        let (snap, again) = read_and_save(&json, false);
        assert_eq!(snap.owner, owner, "{json}");
        assert_eq!(again, json);
    }
    // A parked VM (absent from a predecessor's document that knew no
    // parking: that one reads as an orphan, above).
    let json = record(None, Some("web"));
    let (snap, again) = read_and_save(&json, false);
    assert_eq!(snap.owner, Owner::Parked(std::sync::Arc::new(parked_web())));
    assert_eq!(again, json);
}

fn parked_web() -> ParkedVm {
    ParkedVm {
        name: "web".to_string(),
        slots: vec![super::parked_vm::ParkedSlot { slot: 0, region: 1 }],
        config: "{\"memory\":1}".to_string(),
        state: "{}".to_string(),
        copied_bytes: 4096,
        parked_at: 1_700_000_000,
        // Version 1 kept no VMM: read from the configuration when asked.
        vmm: None,
    }
}

#[test]
fn the_fd_store_keeps_every_allocation_orphaned_or_parked() {
    // No connection survives a restart from systemd's fd store: a live
    // allocation is saved orphaned, its lazy faults left to the fallback.
    let (_, saved) = read_and_save(&record(Some(3), None), true);
    let mut orphaned = record(None, None);
    orphaned["lazy_fallback"] = serde_json::json!(true);
    assert_eq!(saved, orphaned);
    // A parked VM stays parked.
    let (_, saved) = read_and_save(&record(None, Some("web")), true);
    let mut parked = record(None, Some("web"));
    parked["lazy_fallback"] = serde_json::json!(true);
    assert_eq!(saved, parked);
}
