//! Hostile tenants against HANDOFF (issue 26), with real child processes
//! (`fork`, `setuid` where the uid matters) and real memory:
//!
//! - another uid that learned an allocation's id and token cannot take it;
//! - a predecessor VMM that keeps its fds and its mapping after handing the
//!   allocation off cannot keep it alive (the successor's FREE releases
//!   it), and the memory it still maps is never handed to the next tenant
//!   while it does: the next tenant reads none of its bytes and it reads
//!   none of the next tenant's.
//!
//! The daemon runs in this process; the tests are serialized (`serial`)
//! because they compare the host's huge-page counts before and after.

use test_support::prelude::{
    hugepages_2m, map_raw as map, reserve_2m, serial, unmap_raw as unmap, wait_until, TestDaemon,
};
use test_support::tenant::{
    alloc_2m, assert_hugepages_balanced, fill_secret, in_child, read_u64, root_or_skip, say,
    secret_tenant, tenant_b_sees_nothing, B_SECRET, MIB, NOBODY,
};

use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use backend::client::{Client, ClientError};
use backend::proto::{Status, TOKEN_SIZE};

/// How long the daemon may take to settle (a release, a quarantine check).
const SETTLE: Duration = Duration::from_secs(60);

/// A token as two little-endian words, for a pipe.
fn token_words(t: &[u8; TOKEN_SIZE]) -> [u64; 2] {
    let mut lo = [0u8; 8];
    let mut hi = [0u8; 8];
    lo.copy_from_slice(&t[..8]);
    hi.copy_from_slice(&t[8..]);
    [u64::from_le_bytes(lo), u64::from_le_bytes(hi)]
}

fn token_from(words: [u64; 2]) -> [u8; TOKEN_SIZE] {
    let mut t = [0u8; TOKEN_SIZE];
    t[..8].copy_from_slice(&words[0].to_le_bytes());
    t[8..].copy_from_slice(&words[1].to_le_bytes());
    t
}

fn write_u64(fd: &std::os::fd::OwnedFd, v: u64) -> bool {
    nix::unistd::write(fd, &v.to_le_bytes()).is_ok_and(|n| n == 8)
}

/// uid 65534 knows root's allocation id and token (a leak, a guess that
/// happened to be right): HANDOFF is refused exactly as for an unknown id,
/// with and without PATHS, and root's allocation stays root's.
#[test]
fn another_uid_cannot_take_an_allocation_with_its_token() {
    let _g = serial();
    if !root_or_skip() {
        return;
    }
    let d = TestDaemon::start(|c| c.allowed_uids = vec![0, NOBODY]);
    for (path, mode) in [(d.dir(), 0o755), (d.socket().as_path(), 0o777)] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }
    let mut owner = d.client();
    let a = owner
        .alloc(backend::proto::AllocRequest {
            page_policy: backend::proto::PagePolicy::Base4K,
            ..alloc_2m(2 * MIB, false)
        })
        .expect("alloc");
    let (id, token) = (a.id, a.token().expect("token"));
    let socket = d.socket();
    let code = in_child(Some(NOBODY), move || {
        let Ok(mut c) = Client::connect(&socket) else {
            return 10;
        };
        for paths in [false, true] {
            match c.handoff(id, token, paths) {
                Err(ClientError::Refused {
                    status: Status::NotFound,
                    message,
                }) if message.contains("does not exist or does not belong") => {}
                Err(e) => {
                    say(&format!("unexpected refusal: {e}"));
                    return 20;
                }
                Ok(_) => return 30,
            }
        }
        0
    });
    assert_eq!(code, 0, "the other uid's HANDOFF (30: it got the memory)");
    let s = d.stats();
    assert_eq!(s.counters.handoff_refused, 2);
    assert_eq!(s.counters.handoff_ok, 0);
    drop(a.fds);
    owner.free(id).expect("still the owner's");
    d.shutdown();
}

/// Predecessor A hands its allocation off and keeps its fds and mapping;
/// the successor FREEs at once. The allocation is gone (A cannot keep it
/// alive), its region waits in quarantine while A maps it, tenant B gets
/// other memory with none of A's bytes, and A reads none of B's. Once A
/// exits, the region comes back clean and every huge page balances.
#[test]
fn a_predecessor_that_keeps_its_mapping_keeps_nothing_alive_and_reaches_nobody() {
    let _g = serial();
    if !reserve_2m(
        8,
        "a_predecessor_that_keeps_its_mapping_keeps_nothing_alive_and_reaches_nobody",
    ) {
        return;
    }
    let free_before = hugepages_2m("free_hugepages");
    let d = TestDaemon::start(|_| {});
    let size = 4 * MIB;
    let (said_r, said_w) = nix::unistd::pipe().expect("pipe");
    let (go_r, go_w) = nix::unistd::pipe().expect("pipe");
    let socket = d.socket();
    let predecessor = std::thread::spawn(move || {
        in_child(None, move || {
            let (_connection, a, p) = match secret_tenant(&socket, size) {
                Ok(t) => t,
                Err(code) => return code,
            };
            let [lo, hi] = token_words(&a.token().unwrap_or_default());
            if !(write_u64(&said_w, a.id) && write_u64(&said_w, lo) && write_u64(&said_w, hi)) {
                return 13;
            }
            // Handed off and freed by the successor; B holds its memory now.
            // A writes on (its mapping is still its own) and looks for B's.
            let _ = read_u64(&go_r);
            fill_secret(p, size);
            // SAFETY: A's live mapping of `size` bytes.
            let bytes = unsafe { std::slice::from_raw_parts(p, size as usize) };
            let seen = bytes.iter().filter(|&&b| b == B_SECRET).count();
            unmap(p, size);
            if seen > 0 {
                say(&format!("A read {seen} bytes of B's"));
                return 40;
            }
            0
        })
    });
    let id = read_u64(&said_r);
    let token = token_from([read_u64(&said_r), read_u64(&said_r)]);

    let mut successor = d.client();
    let handed = successor.handoff(id, token, false).expect("handoff");
    drop(handed.fds);
    successor.free(id).expect("the successor frees");
    let s = d.stats();
    assert_eq!(s.allocations.active, 0, "A kept nothing alive: {s}");
    assert_eq!(
        s.counters.allocs_ok - s.counters.allocs_released,
        0,
        "accounting: {s}"
    );
    // A still maps the region: it waits in quarantine.
    d.wait_stats(SETTLE, "A's region to be quarantined", |s| {
        s.pool_sum(|p| p.quarantined_bytes) >= size
    });

    // Tenant B allocates and writes its secret over all of it; none of A's
    // bytes are in it.
    let mut b = d.client();
    let bm = b.alloc(alloc_2m(size, false)).expect("B allocates");
    assert!(
        bm.regions
            .iter()
            .all(|r| r.region_id != handed.regions[0].region_id),
        "B got the region A still maps"
    );
    let bp = map(bm.fds[0].as_raw_fd(), size);
    assert!(!bp.is_null());
    // SAFETY: B's live mapping of `size` bytes.
    let bytes = unsafe { std::slice::from_raw_parts(bp, size as usize) };
    assert_eq!(
        bytes.iter().filter(|&&x| x != 0).count(),
        0,
        "B reads A's bytes"
    );
    // SAFETY: B's live read-write mapping of `size` bytes.
    unsafe { std::ptr::write_bytes(bp, B_SECRET, size as usize) };

    assert!(write_u64(&go_w, 1));
    let code = predecessor.join().expect("predecessor thread");
    assert_eq!(code, 0, "predecessor A (40: it read B's bytes)");
    unmap(bp, size);
    drop(bm.fds);
    b.free(bm.id).expect("B frees");
    // A is gone: its region leaves quarantine, scrubbed; the next tenant
    // still reads nothing of A's.
    wait_until("the quarantine empties", SETTLE, || {
        d.stats().pool_sum(|p| p.quarantined_bytes) == 0
    });
    tenant_b_sees_nothing(&d, size, false);
    assert_hugepages_balanced(d, free_before);
}
