//! A predecessor's LOCK or UNLOCK racing its successor's HANDOFF.
//!
//! A VMM being replaced still has its connection while its successor takes
//! the allocation over. A LOCK (or UNLOCK) the predecessor sends at that
//! moment must either land before the move, and then the HANDOFF reply
//! reports the state it left, or after it, and then it is refused with
//! NOT_FOUND and changes nothing. It must never change the successor's
//! allocation behind the reply the successor got.
//!
//! Each round races one LOCK (or UNLOCK) against one HANDOFF, released
//! together by a barrier, and then compares three things that must agree:
//! the predecessor's answer, the LOCKED flag of the HANDOFF reply, and
//! whether the daemon's mapping of the region is really locked (its
//! `Locked:` figure in `/proc/self/smaps`; the daemon runs in this process,
//! and the test maps nothing itself).

use std::sync::{Arc, Barrier};
use std::time::Duration;

use backend::client::ClientError;
use backend::proto::{AllocRequest, ClearMode, PagePolicy, RegionInfo, Status};
use test_support::prelude::{serial, TestDaemon};
use test_support::tenant::{root_or_skip, MIB};

/// Rounds of each race: LOCK against HANDOFF, then UNLOCK against HANDOFF.
const ROUNDS: u32 = 100;
/// Large enough that an mlock takes a while (every page faulted in and
/// pinned), so the two requests overlap; 4 KiB pages need no reservation.
const SIZE: u64 = 32 * MIB;

/// The `Locked:` kB of every mapping of the file with inode `ino` in this
/// process.
fn locked_kib(ino: u64) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
    let mut ours = false;
    let mut kib = 0;
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            // A mapping's header: range perms offset dev inode [path].
            ours = words.nth(3).and_then(|w| w.parse::<u64>().ok()) == Some(ino);
        } else if ours && first == "Locked:" {
            kib += words
                .next()
                .and_then(|w| w.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    kib
}

fn inode(fd: &std::os::fd::OwnedFd) -> u64 {
    nix::sys::stat::fstat(fd).expect("fstat").st_ino
}

/// How one round ended, when every view agreed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    /// The predecessor's request landed before the move.
    RequestFirst,
    /// The HANDOFF came first; the request was refused.
    HandoffFirst,
}

/// One race: the predecessor allocates (locked when `lock` is false, so
/// its UNLOCK has something to undo), then sends LOCK (`lock`) or UNLOCK
/// while the successor sends HANDOFF. Err names the disagreement.
fn race(d: &TestDaemon, round: u32, lock: bool) -> Result<Order, String> {
    let mut predecessor = d.client();
    let mut successor = d.client();
    let a = predecessor
        .alloc(AllocRequest {
            total_size: SIZE,
            page_policy: PagePolicy::Base4K,
            clear_mode: ClearMode::Eager,
            lock: !lock,
            parts: Vec::new(),
            want_paths: false,
        })
        .map_err(|e| format!("alloc: {e}"))?;
    let (id, token) = (a.id, a.token().ok_or("no token")?);
    drop(a);
    let barrier = Arc::new(Barrier::new(2));
    let go = Arc::clone(&barrier);
    let handoff = std::thread::spawn(move || {
        go.wait();
        // Vary which side reaches the daemon first from round to round.
        for _ in 0..(round * 97) % 2000 {
            std::hint::spin_loop();
        }
        successor.handoff(id, token, false).map(|h| (h, successor))
    });
    barrier.wait();
    let asked = if lock {
        predecessor.lock(id, 0)
    } else {
        predecessor.unlock(id, 0)
    };
    let (handed, mut successor) = handoff
        .join()
        .map_err(|_| "the successor's thread panicked".to_string())?
        .map_err(|e| format!("HANDOFF refused: {e}"))?;
    let order = match &asked {
        Ok(_) => Order::RequestFirst,
        Err(ClientError::Refused {
            status: Status::NotFound,
            ..
        }) => Order::HandoffFirst,
        Err(e) => return Err(format!("the predecessor's request failed otherwise: {e}")),
    };
    // The state the allocation must be in: what the request asked for if
    // it landed, else what the allocation had.
    let want_locked = match order {
        Order::RequestFirst => lock,
        Order::HandoffFirst => !lock,
    };
    let reported = handed.regions[0].flags & RegionInfo::FLAG_LOCKED != 0;
    let mapped_kib = locked_kib(inode(&handed.fds[0]));
    let mapped_locked = mapped_kib == SIZE / 1024;
    if reported != want_locked
        || mapped_locked != want_locked
        || (mapped_kib != 0 && !mapped_locked)
    {
        return Err(format!(
            "{order:?}: the predecessor's {} got {asked:?}, the HANDOFF reply says locked={reported}, \
             the daemon's mapping has {mapped_kib} kB locked of {}",
            if lock { "LOCK" } else { "UNLOCK" },
            SIZE / 1024
        ));
    }
    // After the move the predecessor owns nothing of it.
    match predecessor.lock(id, 0) {
        Err(ClientError::Refused {
            status: Status::NotFound,
            ..
        }) => {}
        other => return Err(format!("the predecessor's LOCK after the move: {other:?}")),
    }
    // The successor's own record is the truth: its UNLOCK and LOCK work.
    successor
        .unlock(id, 0)
        .map_err(|e| format!("successor UNLOCK: {e}"))?;
    if locked_kib(inode(&handed.fds[0])) != 0 {
        return Err("the successor's UNLOCK left pages locked".into());
    }
    drop(handed);
    successor.free(id).map_err(|e| format!("free: {e}"))?;
    Ok(order)
}

#[test]
fn a_predecessors_lock_or_unlock_never_lands_after_the_handoff() {
    let _g = serial();
    if !root_or_skip() {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut wrong = Vec::new();
    for lock in [true, false] {
        let (mut first, mut second) = (0, 0);
        for round in 0..ROUNDS {
            match race(&d, round, lock) {
                Ok(Order::RequestFirst) => first += 1,
                Ok(Order::HandoffFirst) => second += 1,
                Err(e) => wrong.push(format!("round {round}: {e}")),
            }
        }
        println!(
            "OBSERVED: {} against HANDOFF, {ROUNDS} rounds: request first {first}, \
             HANDOFF first {second}, wrong {}",
            if lock { "LOCK" } else { "UNLOCK" },
            ROUNDS - first - second
        );
    }
    assert!(
        wrong.is_empty(),
        "{} wrong state(s) in {} rounds:\n{}",
        wrong.len(),
        2 * ROUNDS,
        wrong.join("\n")
    );
    let s = d.stats();
    assert_eq!(s.counters.handoff_ok, u64::from(2 * ROUNDS));
    assert_eq!(s.allocations.active, 0, "every allocation was freed");
    d.shutdown();
}

/// HANDOFF and REATTACH are served only on a connection that negotiated
/// them: the feature bits are the agreement between the two ends.
#[test]
fn handoff_and_reattach_need_their_feature_bits() {
    use backend::proto::socket::{recv_message, send_message};
    use backend::proto::{Header, Reply, Request};
    use std::os::fd::AsFd;
    let _g = serial();
    let d = TestDaemon::start(|_| {});
    let mut owner = d.client();
    let a = owner
        .alloc(AllocRequest {
            total_size: 2 * MIB,
            page_policy: PagePolicy::Base4K,
            clear_mode: ClearMode::Eager,
            lock: false,
            parts: Vec::new(),
            want_paths: false,
        })
        .expect("alloc");
    let token = a.token().expect("token");
    let sock = std::os::unix::net::UnixStream::connect(d.socket()).expect("connect");
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let call = |req: &Request, id: u32| {
        let payload = req.encode();
        let header = Header::request(req.code(), id, payload.len()).expect("header");
        send_message(&sock.as_fd(), &header, &payload, &[]).expect("send");
        let frame = recv_message(&sock.as_fd()).expect("reply");
        Reply::decode(frame.header.code, &frame.payload).expect("decode")
    };
    let hs = call(
        &Request::Handshake {
            min_version: 1,
            max_version: 1,
            features: 0,
        },
        1,
    );
    assert_eq!(hs.status, Status::Ok);
    let handoff = call(
        &Request::Handoff {
            alloc_id: a.id,
            token,
            want_paths: false,
        },
        2,
    );
    assert_eq!(handoff.status, Status::Invalid, "{}", handoff.message);
    assert!(
        handoff.message.contains("not negotiated"),
        "{}",
        handoff.message
    );
    let reattach = call(
        &Request::Reattach {
            alloc_id: a.id,
            token,
        },
        3,
    );
    assert_eq!(reattach.status, Status::Invalid, "{}", reattach.message);
    // The allocation never moved: its owner still frees it.
    drop(a.fds);
    owner.free(a.id).expect("still the owner's");
    assert_eq!(d.stats().counters.handoff_ok, 0);
    d.shutdown();
}
