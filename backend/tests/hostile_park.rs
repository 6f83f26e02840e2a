//! Hostile peers against PARK (hugemem as cloud-hypervisor's offload
//! daemon), with the real daemon in this process, real memfds and hugetlb
//! regions, and forked children that `setuid` where the uid matters. The
//! sender is a fake cloud-hypervisor (`park_peer`) that puts exactly the
//! bytes and fds a case needs on the migration socket.
//!
//! Every refusal is checked the same way (`park_peer::refuse_each`): the
//! requester reads a clear reason (status and text), the fake sender got
//! an error answer to the request that was wrong, the daemon still answers
//! STATS with balanced books (no allocation or parked VM left behind,
//! allocations made − released == active, regions created − released ==
//! held), and no fd the daemon received is still open in this process
//! (the daemon's process).
//!
//! RESTORE, UNPARK, names, tokens and the takeover: `hostile_park_restore`.
//! The tests are serialized (`serial`): they share the host's huge pages.

mod park_peer;

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::{UnixDatagram, UnixListener, UnixStream};

use backend::client::{Client, ClientError};
use backend::proto::{Request, Status};
use ch_migration::Command;
use park_peer::*;
use test_support::prelude::{reserve_2m, serial, TestDaemon};
use test_support::tenant::{alloc_2m, in_child, root_or_skip, NOBODY};

const MIB: u64 = 1 << 20;

/// Frames a cloud-hypervisor never sends, in an order it never sends them,
/// or cut short: each is refused at the request that is wrong, before a
/// byte of an oversized payload is read, and every fd that came is closed.
#[test]
fn malformed_or_cut_frames_are_refused_and_leave_nothing_behind() {
    const TEST: &str = "malformed_or_cut_frames_are_refused_and_leave_nothing_behind";
    let _g = serial();
    if !reserve_2m(8, TEST) {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut client = d.client();
    let mem = memfd("hostile-park-frames", 2 * MIB, false);
    let json = config_json(&[(0, 0, 2 * MIB, 0)]);
    let fd_on = |mut r: Req| {
        r.fds = vec![mem.try_clone().expect("dup")];
        r
    };
    let too_many: Vec<Step> = std::iter::once(Step::Send(start()))
        .chain((0..65).map(|slot| Step::Send(memory_fd(slot, &[&mem]))))
        .collect();
    use Step::{HangUp, HangUpInside, Send};
    let cases = vec![
        case(
            "unknown command",
            vec![Send(start()), Send(raw(42, 0, 0))],
            "unknown migration command 42",
        ),
        case(
            "MemoryFd without an fd",
            vec![Send(start()), Send(memory_fd(0, &[]))],
            "carried 0 fds",
        ),
        case(
            "MemoryFd with two fds",
            vec![Send(start()), Send(memory_fd(0, &[&mem, &mem]))],
            "carried 2 fds",
        ),
        case(
            "a slot sent twice",
            vec![
                Send(start()),
                Send(memory_fd(0, &[&mem])),
                Send(memory_fd(0, &[&mem])),
            ],
            "memory slot 0 sent twice",
        ),
        case("65 memory slots", too_many, "more than 64 memory fds"),
        case(
            "a MemoryFd payload of 8 bytes",
            vec![Send(start()), Send(raw(Command::MemoryFd as u16, 0, 8))],
            "a MemoryFd payload (a u32 slot) of 8 bytes",
        ),
        case(
            "a Config of 2 MiB announced",
            vec![
                Send(start()),
                Send(memory_fd(0, &[&mem])),
                Send(raw(Command::Config as u16, 0, 2 * MIB)),
            ],
            "a configuration of 2097152 bytes (at most 1048576)",
        ),
        case(
            "a Config of 2^64-1 bytes announced",
            vec![
                Send(start()),
                Send(raw(Command::Config as u16, 0, u64::MAX)),
            ],
            "at most 1048576",
        ),
        case(
            "a State over 64 MiB announced",
            vec![
                Send(start()),
                Send(memory_fd(0, &[&mem])),
                Send(config(&json)),
                Send(raw(Command::State as u16, 0, (64 * MIB) + 1)),
            ],
            "a state of 67108865 bytes (at most 67108864)",
        ),
        case(
            "MemoryFd before Start",
            vec![Send(memory_fd(0, &[&mem]))],
            "MemoryFd where Start was expected",
        ),
        case(
            "State before Config",
            vec![Send(start()), Send(state(STATE))],
            "State where MemoryFd or Config was expected",
        ),
        case(
            "MemoryFd after Config",
            vec![
                Send(start()),
                Send(config(&json)),
                Send(memory_fd(0, &[&mem])),
            ],
            "MemoryFd where State was expected",
        ),
        case(
            "a second Start",
            vec![Send(start()), Send(start())],
            "Start where MemoryFd or Config was expected",
        ),
        case(
            "CompletePaused before State",
            vec![
                Send(start()),
                Send(memory_fd(0, &[&mem])),
                Send(config(&json)),
                Send(complete_paused()),
            ],
            "CompletePaused where State was expected",
        ),
        case(
            "protocol version 1",
            vec![Send(raw(Command::Start as u16, 1, 0))],
            "migration protocol version 1",
        ),
        case(
            "a Start with a payload",
            vec![Send(raw(Command::Start as u16, 0, 8))],
            "a Start payload of 8 bytes",
        ),
        case(
            "a Complete with a payload",
            vec![
                Send(start()),
                Send(memory_fd(0, &[&mem])),
                Send(config(&json)),
                Send(state(STATE)),
                Send(raw(Command::CompletePaused as u16, 0, 4)),
            ],
            "a Complete payload of 4 bytes",
        ),
        case(
            "RAM contents",
            vec![Send(start()), Send(raw(Command::Memory as u16, 0, 4096))],
            "is not part of a local migration's snapshot",
        ),
        case(
            "a page fault",
            vec![Send(start()), Send(raw(Command::PageFault as u16, 0, 16))],
            "is not part of a local migration's snapshot",
        ),
        case(
            "Abandon",
            vec![
                Send(start()),
                Send(memory_fd(0, &[&mem])),
                Send(raw(Command::Abandon as u16, 0, 0)),
            ],
            "closed the connection with Abandon",
        ),
        case(
            "an fd on a header",
            vec![
                Send(start()),
                Send(fd_on(raw(Command::Config as u16, 0, 0))),
            ],
            "carried 1 fds",
        ),
        case(
            "an fd on the configuration",
            vec![Send(start()), Send(fd_on(config(&json)))],
            "carried 1 fds",
        ),
        case(
            "an fd on the state",
            vec![
                Send(start()),
                Send(memory_fd(0, &[&mem])),
                Send(config(&json)),
                Send(fd_on(state(STATE))),
            ],
            "carried 1 fds",
        ),
        case(
            "a hang-up inside a header",
            vec![
                Send(start()),
                HangUpInside(raw(Command::Config as u16, 0, 100), 7),
            ],
            "closed the connection before a request",
        ),
        case(
            "a hang-up inside a MemoryFd, its fd sent",
            vec![Send(start()), HangUpInside(memory_fd(0, &[&mem]), 2)],
            "closed the connection inside a MemoryFd request",
        ),
        case(
            "a hang-up inside the configuration",
            vec![
                Send(start()),
                Send(memory_fd(0, &[&mem])),
                HangUpInside(config(&json), 10),
            ],
            "closed the connection inside the configuration",
        ),
        case(
            "a hang-up after MemoryFd",
            vec![Send(start()), Send(memory_fd(0, &[&mem])), HangUp],
            "closed the connection before a request",
        ),
        case(
            "a hang-up after State, before CompletePaused",
            vec![
                Send(start()),
                Send(memory_fd(0, &[&mem])),
                Send(config(&json)),
                Send(state(STATE)),
                HangUp,
            ],
            "closed the connection before a request",
        ),
    ];
    let n = cases.len() as u64;
    refuse_each(&d, &mut client, &[identity(&mem)], cases);
    assert_eq!(d.stats().counters.parks_refused, n);
    assert_eq!(d.stats().counters.parks, 0);
    d.shutdown();
}

/// A snapshot whose configuration or memory files do not hold what they
/// claim: refused after the sender's last step (answered with an error,
/// so the sender keeps its VM), nothing allocated or parked left behind.
#[test]
fn bad_configurations_and_memory_files_are_refused() {
    const TEST: &str = "bad_configurations_and_memory_files_are_refused";
    let _g = serial();
    if !reserve_2m(8, TEST) {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut client = d.client();
    let mem = memfd("hostile-park-config", 2 * MIB, false);
    let short = memfd("hostile-park-short", MIB, false);
    let cut = memfd("hostile-park-cut", 2 * MIB, false);
    let (pipe_r, _pipe_w) = nix::unistd::pipe().expect("pipe");
    let dir: OwnedFd = std::fs::File::open("/tmp").expect("open /tmp").into();
    let json = config_json(&[(0, 0, 2 * MIB, 0)]);
    let with_config = |cfg: Req| {
        vec![
            Step::Send(start()),
            Step::Send(memory_fd(0, &[&mem])),
            Step::Send(cfg),
            Step::Send(state(STATE)),
            Step::Send(complete_paused()),
        ]
    };
    let with_memory = |slots: &[(u32, &OwnedFd)], cfg: &str| {
        let mut steps = vec![Step::Send(start())];
        steps.extend(slots.iter().map(|(s, f)| Step::Send(memory_fd(*s, &[f]))));
        steps.extend([
            Step::Send(config(cfg)),
            Step::Send(state(STATE)),
            Step::Send(complete_paused()),
        ]);
        steps
    };
    let sixty_five: Vec<(u32, u64, u64, u64)> =
        (0..65).map(|i| (0, i * 4096, 4096, i * 4096)).collect();
    let truncate_after_state = {
        let path = reopen_path(&cut);
        whole_then(&cut, 2 * MIB, move || {
            let f = std::fs::OpenOptions::new().write(true).open(&path);
            f.and_then(|f| f.set_len(0)).expect("the sender truncates");
        })
    };
    // Two sparse files of 8 EiB each, every byte claimed: far more than
    // any pool (and than a u64 can count once placed one after the other).
    let huge = i64::MAX as u64;
    let vast = [
        memfd("hostile-park-vast0", 0, false),
        memfd("hostile-park-vast1", 0, false),
    ];
    for f in &vast {
        std::fs::File::from(f.try_clone().expect("dup"))
            .set_len(huge)
            .expect("a sparse 8 EiB memfd");
    }
    let vast_json = config_json(&[(0, 0, huge, 0), (1, huge, huge - 4096, 0)]);
    let cases = vec![
        case("two files of 8 EiB", with_memory(&[(0, &vast[0]), (1, &vast[1])], &vast_json), "no pool memory to copy the VM into"),
        case("a configuration that is not JSON", with_config(config("{\"memory_manager_data\": [")), "the VM's configuration is not JSON"),
        case("a configuration that is not UTF-8", with_config(req(Command::Config, &[0x7b, 0xff, 0xfe, 0x7d])), "the VM's configuration is not UTF-8"),
        case("a state that is not UTF-8", vec![Step::Send(start()), Step::Send(memory_fd(0, &[&mem])), Step::Send(config(&json)), Step::Send(req(Command::State, &[0xc3, 0x28])), Step::Send(complete_paused())], "the VM's state is not UTF-8"),
        case("no guest_ram_mappings", with_config(config("{\"memory_manager_data\": {}}")), "has no memory_manager_data.guest_ram_mappings"),
        case("guest_ram_mappings not a list", with_config(config("{\"memory_manager_data\": {\"guest_ram_mappings\": 7}}")), "has no memory_manager_data.guest_ram_mappings"),
        case("no mapping at all", with_config(config(&config_json(&[]))), "has 0 guest RAM mappings (1 to 64)"),
        case("65 mappings", with_config(config(&config_json(&sixty_five))), "has 65 guest RAM mappings (1 to 64)"),
        case("a mapping whose file range overflows", with_config(config(&config_json(&[(0, 0, 4096, u64::MAX - 100)]))), "guest RAM mapping of slot 0 is empty or overflows"),
        case("a mapping whose guest range overflows", with_config(config(&config_json(&[(0, u64::MAX - 100, 4096, 0)]))), "guest RAM mapping of slot 0 is empty or overflows"),
        case("an empty mapping", with_config(config(&config_json(&[(0, 0, 0, 0)]))), "guest RAM mapping of slot 0 is empty or overflows"),
        case("a mapping without its size", with_config(config("{\"memory_manager_data\": {\"guest_ram_mappings\": [{\"slot\": 0, \"gpa\": 0, \"size\": \"2M\", \"file_offset\": 0}]}}")), "a guest RAM mapping without size"),
        case("a slot over u32", with_config(config(&config_json(&[(0, 0, 4096, 0)]).replace("\"slot\":0", "\"slot\":4294967296"))), "slot is over u32"),
        case("a mapping whose slot came without an fd", with_config(config(&config_json(&[(0, 0, 2 * MIB, 0), (1, 4 * MIB, 4096, 0)]))), "slot 1 has a mapping but no memory fd"),
        case("an fd no mapping uses", with_memory(&[(0, &mem), (1, &mem)], &json), "memory fd of slot 1, which no mapping uses"),
        case("a pipe as memory", with_memory(&[(0, &pipe_r)], &json), "memory fd of slot 0 is not a regular file"),
        case("a directory as memory", with_memory(&[(0, &dir)], &json), "memory fd of slot 0 is not a regular file"),
        case("a memfd shorter than its mapping", with_memory(&[(0, &short)], &json), "memory fd of slot 0 has 1048576 bytes; its mapping needs 2097152 from offset 0"),
        case("a memfd truncated after State", truncate_after_state, "memory fd of slot 0 has 0 bytes"),
        case("a QEMU slot at an offset of its file", with_config(config(&config_json(&[(0, 0, MIB, MIB)]).replacen('{', "{\"vmm\":\"qemu\",", 1))), "slot 0 of a QEMU VM is not one mapping from its file's start"),
    ];
    let watched = [&mem, &short, &cut, &pipe_r, &dir, &vast[0], &vast[1]].map(identity);
    refuse_each(&d, &mut client, &watched, cases);
    d.shutdown();
}

/// Pool memory that is not the requesting tenant's to park: another uid's
/// allocation (refused, and left as it was), a mix of an allocation's and
/// foreign memory, two allocations, a released region whose fd was kept,
/// a VM already parked.
#[test]
fn pool_memory_that_is_not_the_tenants_is_refused() {
    const TEST: &str = "pool_memory_that_is_not_the_tenants_is_refused";
    let _g = serial();
    if !root_or_skip() || !reserve_2m(16, TEST) {
        return;
    }
    let d = daemon_for_two_uids();
    let size = 2 * MIB;
    let mut owner = d.client();
    let a = owner.alloc(alloc_2m(size, false)).expect("root's ALLOC");
    fill_mapped(&a.fds[0], size);
    let a_id = identity(&a.fds[0]);
    let a_open = open_count(a_id);

    // uid 65534 got hold of root's memfd (here: by a courier socket) and
    // parks it, from a sender of its own uid.
    let (courier_in, courier_out) = UnixStream::pair().expect("socketpair");
    hugemem_client::proto::socket::send_all(courier_in.as_fd(), &[1], &[a.fds[0].as_fd()])
        .expect("the courier carries root's fd");
    let socket = d.socket();
    let code = in_child(Some(NOBODY), move || {
        let mut byte = [0u8; 1];
        let mut fds = Vec::new();
        let got =
            hugemem_client::sys::recv_with_fds(courier_out.as_fd(), &mut byte, &mut fds, 1, false);
        let (Ok(_), Some(stolen)) = (got, fds.pop()) else {
            return 10;
        };
        let Ok(mut c) = Client::connect(&socket) else {
            return 11;
        };
        let Ok((daemon_end, ch_end)) = UnixStream::pair() else {
            return 12;
        };
        let script = [
            start(),
            memory_fd(0, &[&stolen]),
            config(&config_json(&[(0, 0, 2 * MIB, 0)])),
            state(STATE),
            complete_paused(),
        ];
        if !write_script(&ch_end, &script) {
            return 13;
        }
        child_expects(
            c.park("stolen", &daemon_end),
            Status::Invalid,
            "no allocation of yours holds",
        )
    });
    drop(courier_in);
    assert_eq!(code, 0, "uid 65534 parking root's memory");
    let s = assert_serves_balanced(&d, 1, 0, "another uid's memory");
    assert_eq!(s.counters.parks_refused, 1);
    assert_eq!(open_count(a_id), a_open, "the daemon closed the stolen fd");
    assert!(
        holds_pattern(&a.fds[0], 0, size, 0),
        "root's memory is as it was"
    );

    let foreign = memfd("hostile-park-mix", size, false);
    let b = owner.alloc(alloc_2m(size, false)).expect("a second ALLOC");
    // A region released while this side kept its fd: pool memory, no one's.
    let c = owner.alloc(alloc_2m(size, false)).expect("a third ALLOC");
    let kept = c.fds[0].try_clone().expect("dup");
    let c_alloc = c.id;
    drop(c);
    owner.free(c_alloc).expect("FREE");
    let two = config_json(&[(0, 0, size, 0), (1, size, size, 0)]);
    let slots2 = |x: &OwnedFd, y: &OwnedFd| {
        vec![
            Step::Send(start()),
            Step::Send(memory_fd(0, &[x])),
            Step::Send(memory_fd(1, &[y])),
            Step::Send(config(&two)),
            Step::Send(state(STATE)),
            Step::Send(complete_paused()),
        ]
    };
    let mut parker = d.client();
    let cases = vec![
        case(
            "an allocation's memory and foreign memory",
            slots2(&a.fds[0], &foreign),
            "some memory slots are a hugemem allocation's and some are not",
        ),
        case(
            "two allocations",
            slots2(&a.fds[0], &b.fds[0]),
            "the memory slots are in more than one allocation",
        ),
        case(
            "a released region's kept fd",
            whole(&kept, size),
            "pool memory that no allocation of yours holds",
        ),
    ];
    let watched = [&a.fds[0], &b.fds[0], &kept, &foreign].map(identity);
    refuse_each(&d, &mut parker, &watched, cases);

    // A VM parked already: its memory cannot be parked again under another name.
    let first = park_via(&mut parker, "first", whole(&a.fds[0], size));
    assert_eq!(
        first
            .result
            .expect("root parks its own allocation")
            .copied_bytes,
        0
    );
    let again = park_via(&mut parker, "second", whole(&a.fds[0], size));
    assert_refused(
        &again.result,
        Status::Invalid,
        "changed hands while it was being parked",
        "a parked VM's memory",
    );
    assert_serves_balanced(&d, 2, 1, "a parked VM's memory");
    assert_eq!(open_count(a_id), a_open);
    parker.unpark("first").expect("UNPARK");
    drop((a, kept));
    owner.free(b.id).expect("FREE");
    assert_serves_balanced(&d, 0, 0, "the end");
    d.shutdown();
}

/// PARK's fd must be a connected UNIX stream socket whose peer runs as the
/// requester: a pipe, a datagram socket, a TCP socket, no fd or two, a
/// listening socket, and a stream whose peer is root while the requester
/// is uid 65534 are refused, and the fd is closed.
#[test]
fn park_fds_that_are_not_a_migration_socket_are_refused() {
    let _g = serial();
    if !root_or_skip() {
        return;
    }
    let d = daemon_for_two_uids();
    let mut client = d.client();
    let park = |client: &mut Client, fds: &[&dyn AsFd]| {
        let fds: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        client.call_with_fds(
            &Request::Park {
                name: "bad-fd".into(),
                on_demand: false,
                verify: false,
            },
            &fds,
        )
    };
    let check = |r: Result<_, ClientError>,
                 needle: &str,
                 what: &str,
                 ids: &[(u64, u64)],
                 before: &[usize]| {
        match r {
            Err(ClientError::Refused {
                status: Status::Invalid,
                message,
            }) => {
                assert!(message.contains(needle), "{what}: {message}")
            }
            other => panic!("{what}: expected a refusal, got {other:?}"),
        }
        let after: Vec<usize> = ids.iter().map(|i| open_count(*i)).collect();
        assert_eq!(after, before, "{what}: the daemon kept the fd");
        assert_serves_balanced(&d, 0, 0, what);
    };
    let (pipe_r, _pipe_w) = nix::unistd::pipe().expect("pipe");
    let (dgram, _dgram_peer) = UnixDatagram::pair().expect("datagram pair");
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").expect("tcp listener");
    let tcp_stream =
        std::net::TcpStream::connect(tcp.local_addr().expect("addr")).expect("connect");
    let dir = tempfile::tempdir().expect("tempdir");
    let listener = UnixListener::bind(dir.path().join("l.sock")).expect("bind");
    let (s1, _p1) = UnixStream::pair().expect("pair");
    let (s2, _p2) = UnixStream::pair().expect("pair");
    let cases: Vec<(&str, Vec<&dyn AsFd>, &str)> = vec![
        (
            "a pipe",
            vec![&pipe_r],
            "not a connected UNIX stream socket",
        ),
        (
            "a datagram socket",
            vec![&dgram],
            "not a connected UNIX stream socket",
        ),
        (
            "a TCP socket",
            vec![&tcp_stream],
            "not a connected UNIX stream socket",
        ),
        (
            "no fd",
            vec![],
            "exactly one fd, a connected stream socket (got 0)",
        ),
        (
            "two sockets",
            vec![&s1, &s2],
            "exactly one fd, a connected stream socket (got 2)",
        ),
        ("a listening socket", vec![&listener], "refused"),
    ];
    for (what, fds, needle) in cases {
        let ids: Vec<(u64, u64)> = fds.iter().map(identity).collect();
        let before: Vec<usize> = ids.iter().map(|i| open_count(*i)).collect();
        check(park(&mut client, &fds), needle, what, &ids, &before);
    }
    // uid 65534 brings a stream made by root: its peer runs as uid 0.
    let (daemon_end, _root_end) = UnixStream::pair().expect("pair");
    let end_id = identity(&daemon_end);
    let socket = d.socket();
    let code = in_child(Some(NOBODY), move || {
        let Ok(mut c) = Client::connect(&socket) else {
            return 10;
        };
        child_expects(
            c.park("other-uid", &daemon_end),
            Status::Invalid,
            "runs as uid 0, not as this connection's uid 65534",
        )
    });
    assert_eq!(code, 0, "a migration socket whose peer is another uid");
    // The closure (and the test's copy of the end with it) is gone here.
    assert_eq!(
        open_count(end_id),
        0,
        "the daemon kept the other uid's socket"
    );
    assert_serves_balanced(&d, 0, 0, "another uid's peer");
    assert_eq!(d.stats().counters.parks_refused, 7);
    d.shutdown();
}
