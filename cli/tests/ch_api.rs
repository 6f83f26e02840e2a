//! `hugemem::launch::vmm::cloud_hypervisor::api` against a real cloud-hypervisor (the binary
//! `CLOUD_HYPERVISOR` names; `scripts/build-cloud-hypervisor` builds it):
//! a VMM started with only `--api-socket` answers `vmm.ping`, reports no VM
//! through `vm.info` as a refusal with cloud-hypervisor's own text, and
//! refuses `vm.send-migration` with no VM to send, all parsed from its
//! HTTP answers.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use hugemem::launch::vmm::cloud_hypervisor::api::{ChApi, ChApiError};

const WAIT: Duration = Duration::from_secs(10);

struct Vmm(Child);

impl Drop for Vmm {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn cloud_hypervisor() -> Option<PathBuf> {
    test_support::cloud_hypervisor::binaries_or_skip().map(|b| b.cloud_hypervisor.clone())
}

/// Waits for the API to answer: cloud-hypervisor binds the socket before
/// its API thread serves, and `vmm.ping` is the event that says it does.
fn ping_until_up(api: &ChApi, vmm: &mut Vmm) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        match api.ping(WAIT) {
            Ok(()) => return,
            Err(ChApiError::Io { .. }) if std::time::Instant::now() < deadline => {
                if let Ok(Some(status)) = vmm.0.try_wait() {
                    panic!("cloud-hypervisor exited before its API came up: {status}");
                }
                std::thread::yield_now();
            }
            Err(e) => panic!("vmm.ping: {e}"),
        }
    }
}

#[test]
fn the_api_client_speaks_to_a_real_cloud_hypervisor() {
    let Some(ch) = cloud_hypervisor() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("api.sock");
    let mut vmm = Vmm(Command::new(ch)
        .arg("--api-socket")
        .arg(format!("path={}", socket.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start cloud-hypervisor"));
    let api = ChApi::new(&socket);
    ping_until_up(&api, &mut vmm);
    match api.vm_info(WAIT) {
        Err(ChApiError::Refused {
            endpoint, status, ..
        }) => {
            assert_eq!(endpoint, "vm.info");
            assert!(status >= 400, "HTTP {status}");
        }
        other => panic!("vm.info without a VM: {other:?}"),
    }
    match api.send_migration(&dir.path().join("nowhere.sock"), true, WAIT) {
        Err(ChApiError::Refused { body, .. }) => {
            assert!(!body.is_empty(), "cloud-hypervisor says why");
        }
        other => panic!("vm.send-migration without a VM: {other:?}"),
    }
    // Still serving after the refusals.
    api.ping(WAIT).expect("ping after refusals");
}
