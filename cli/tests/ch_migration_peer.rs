//! `ch_migration` against real cloud-hypervisors: a VM
//! running the counting micro-guest on daemon memory is migrated
//! (`send-migration …,local=on`) to this test, which plays the receiving
//! peer (`receive_snapshot`: the memory slots' fds, the configuration, the
//! state), and the snapshot is then sent (`send_snapshot`) to a new
//! cloud-hypervisor's `receive-migration`, where the guest counts on, on
//! the same pages: the park and restore of a VM in the pool, at the
//! protocol level. No byte of guest RAM travels: the receiver refuses a
//! `Memory` command, and the new process maps the very file the first one
//! did (its inode in `/proc/PID/maps`).
//!
//! Skipped (through the skip helper) without the cloud-hypervisor binary
//! that `CLOUD_HYPERVISOR` names (`scripts/build-cloud-hypervisor`), a
//! usable `/dev/kvm` or 128 free 2 MiB pages.

mod common;

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ch_migration::peer::{receive_snapshot, send_snapshot};
use ch_migration::Limits;
use guest_mem::PageSize;
use hugemem::launch::vmm::cloud_hypervisor::api::ChApi;
use hugemem::launch::vmm::cloud_hypervisor::events::{ChEvents, RECEIVE_READY};
use test_support::hugepages::hold;
use test_support::prelude::{serial, TestDaemon};

use common::{
    child_of, cloud_hypervisor, counting_past, launched_guest_ram, maps_inode, spin_elf, spin_state,
};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");
const RAM: u64 = 256 << 20;
const STRIDE: u64 = 2 << 20;
const WAIT: Duration = Duration::from_secs(30);

/// Kills a process when the test ends, passed or not.
struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `fd` stays open across `exec` (the child gets it under its number).
fn inheritable(fd: &impl AsFd) {
    let flags = nix::fcntl::FdFlag::empty();
    nix::fcntl::fcntl(fd.as_fd(), nix::fcntl::FcntlArg::F_SETFD(flags)).expect("clear CLOEXEC");
}

#[test]
fn a_vm_is_parked_with_this_peer_and_restored_into_a_new_cloud_hypervisor() {
    let _serial = serial();
    let Some(ch) = cloud_hypervisor() else {
        return;
    };
    let _pages = match hold(PageSize::Huge2M, RAM / STRIDE) {
        Ok(r) => r,
        Err(why) => {
            test_support::skip!("{why}");
            return;
        }
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let elf = spin_elf(dir.path(), STRIDE, 1 << 20, 0x5041_524b_0000_0000);
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let api = dir.path().join("api.sock");
    let launch = Command::new("timeout")
        .args(["300", HUGEMEM, "launch", "--socket"])
        .arg(daemon.socket())
        .args([
            "--size",
            "256M",
            "--page-size",
            "2M",
            "--",
            &ch,
            "--api-socket",
        ])
        .arg(format!("path={}", api.display()))
        .arg("--kernel")
        .arg(&elf)
        .args(["--cpus", "boot=1", "--serial", "null", "--console", "off"])
        .spawn()
        .expect("spawn hugemem launch");
    let mut launch = Kill(launch);
    let launcher = child_of(launch.0.id());
    let first = child_of(launcher);
    let ram = launched_guest_ram(launcher, first);
    let ino = ram.metadata().expect("fstat").ino();
    let before = counting_past(&ram, 0, "the guest to spin").count;

    // Park: the running cloud-hypervisor migrates to this test.
    let park = dir.path().join("park.sock");
    let listener = UnixListener::bind(&park).expect("bind the park socket");
    let receiver = std::thread::spawn(move || {
        let (sock, _) = listener.accept().expect("accept");
        receive_snapshot(&sock, Limits::default())
    });
    let source = ChApi::new(&api);
    test_support::prelude::wait_until("the launched cloud-hypervisor's API", WAIT, || {
        source.ping(WAIT).is_ok()
    });
    source
        .send_migration(&park, true, WAIT)
        .expect("send-migration");
    let snapshot = receiver.join().expect("join").expect("the snapshot");
    assert_eq!(snapshot.memory.len(), 1, "one memory zone, one fd");
    let parked_ino = nix::sys::stat::fstat(&snapshot.memory[0].1)
        .expect("fstat the parked fd")
        .st_ino;
    assert_eq!(parked_ino, ino, "the parked fd is the guest's very file");
    let config: serde_json::Value =
        serde_json::from_slice(&snapshot.config).expect("the configuration is JSON");
    // cloud-hypervisor's migration configuration: the VM's configuration
    // (its memory zones) with the memory manager's data and the CPUID.
    assert!(
        config.pointer("/vm_config/memory/zones").is_some(),
        "no vm_config.memory.zones in the configuration"
    );
    assert!(!snapshot.state.is_empty());
    assert!(!snapshot.paused, "the VM was running");
    eprintln!(
        "parked: {} memory fd(s), configuration {} bytes, state {} bytes (guest RAM {RAM} bytes, not sent)",
        snapshot.memory.len(),
        snapshot.config.len(),
        snapshot.state.len()
    );
    // The source hands the VM over and exits; its launcher ends with it.
    let status = launch.0.wait().expect("wait for the launcher");
    assert_ne!(status.code(), Some(124), "the launcher did not end");

    // Restore: a new cloud-hypervisor receives the parked snapshot.
    let new_api_path = dir.path().join("new-api.sock");
    let new_api_listener = UnixListener::bind(&new_api_path).expect("bind");
    inheritable(&new_api_listener);
    let (events_r, events_w): (OwnedFd, OwnedFd) = nix::unistd::pipe().expect("pipe");
    nix::fcntl::fcntl(
        events_r.as_fd(),
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
    )
    .expect("CLOEXEC on the read end");
    let restored = Command::new(&ch)
        .arg("--api-socket")
        .arg(format!("fd={}", new_api_listener.as_raw_fd()))
        .arg("--event-monitor")
        .arg(format!("fd={}", events_w.as_raw_fd()))
        .stdin(Stdio::null())
        .spawn()
        .expect("start the new cloud-hypervisor");
    let restored = Kill(restored);
    drop((new_api_listener, events_w));
    let new_api = ChApi::new(&new_api_path);
    let incoming = dir.path().join("restore.sock");
    let listen = incoming.clone();
    let api_for_thread = new_api.clone();
    let receiving = std::thread::spawn(move || api_for_thread.receive_migration(&listen, WAIT));
    let mut events = ChEvents::new(events_r);
    events
        .wait_for(RECEIVE_READY, WAIT)
        .expect("the new cloud-hypervisor listens");
    let sock = UnixStream::connect(&incoming).expect("connect to the new cloud-hypervisor");
    let memory: Vec<_> = snapshot
        .memory
        .iter()
        .map(|(slot, fd)| (*slot, fd.as_fd()))
        .collect();
    send_snapshot(&sock, &memory, &snapshot.config, &snapshot.state, false)
        .expect("the new cloud-hypervisor takes the snapshot");
    receiving
        .join()
        .expect("join")
        .expect("receive-migration answered");
    events.drain_in_background();
    assert_eq!(new_api.vm_state(WAIT).expect("vm.info"), "Running");
    let now = spin_state(&ram).count;
    assert!(
        now >= before,
        "the counter went back from {before} to {now}"
    );
    let after = counting_past(&ram, now, "the guest to count on in the restored process");
    assert_eq!(after.bad, 0, "the guest found a page changed");
    assert!(
        maps_inode(restored.0.id(), ino),
        "the restored cloud-hypervisor maps the guest's very file"
    );
    drop(restored);
    drop(snapshot);
    drop(ram);
    daemon.shutdown();
}
