//! `hugemem qemu-wrapper`: the emulator a libvirt domain names in
//! `<devices><emulator>`, putting the domain's huge-page memory backends on
//! daemon memory.
//!
//! ```text
//! hugemem qemu-wrapper [--qemu /usr/bin/qemu-system-x86_64] [--socket S] -- QEMU-ARGS…
//! ```
//!
//! libvirt runs its emulator both to probe capabilities and to start
//! domains, with no arguments of the operator's and a scrubbed environment,
//! so the operator installs a two-line shell script as the emulator path
//! (`scripts/hugemem-qemu`), which holds the settings and runs this
//! (docs/operations.md, "libvirt").
//!
//! # What it does
//!
//! [`plan`](crate::qemu_wrapper::plan) reads QEMU's command line and decides, for each `-object
//! memory-backend-*` (JSON or key=value, [`objects`](crate::qemu_wrapper::objects)):
//!
//! * a backend that asked for huge pages (a `memory-backend-file` whose
//!   `mem-path` is a hugetlbfs directory, as libvirt writes for
//!   `<hugepages>`, or a `memory-backend-memfd` with `hugetlb`) is **taken**:
//!   the daemon allocates its size on its page size and host node
//!   (`host-nodes` with policy `bind`/`preferred`), and the object is
//!   rewritten into `memory-backend-file` on `/proc/self/fd/N` of the
//!   daemon's memfd ([`proc_fd_path`](crate::qemu_wrapper::proc_fd_path)), `share` on, with the same `id` and size. `prealloc` (and its
//!   threads and context) and the NUMA policy are dropped: the daemon placed,
//!   populated and zeroed the pages already;
//! * a backend without huge pages is **left** exactly as written, with a
//!   note on stderr (libvirt's domain log);
//! * a huge-page backend that needs what daemon memory cannot give
//!   (`discard-data`, a file of its own, a private mapping, several host
//!   nodes, virtio-mem) is an **error**: nothing is allocated, QEMU does not
//!   start, and the domain log says why.
//!
//! Every other argument stays exactly as libvirt wrote it, in place. With
//! nothing to take (every capability probe: `-help`, `-version`, `-machine
//! none -qmp …`), the real QEMU is exec'd with the arguments unchanged and
//! the daemon is not contacted.
//!
//! # Why exec, and how the memory is freed
//!
//! The wrapper **execs** QEMU, so QEMU keeps the pid libvirt started: libvirt
//! puts that pid in the domain's cgroups, signals it on `virsh destroy`,
//! reads its threads and finds it again after a libvirtd restart, and a
//! parent process in between would break each of those. The region fds and
//! the daemon connection are made inheritable (`FD_CLOEXEC` cleared, the
//! same step [`crate::launch::run_vmm`] takes in its child) and live on in
//! QEMU. When QEMU exits for any reason, `SIGKILL` included, the kernel
//! closes the connection; the daemon releases the allocations of a closed
//! connection, keeps them quarantined while any process still maps them
//! (its `/proc` holder scan and the QEMU pidfd), then scrubs and pools them
//! (docs/architecture.md). There is no FREE to send and nothing to leak.

pub mod objects;

use std::convert::Infallible;
use std::ffi::OsString;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use guest_mem::size::format_size;
use hugemem_client::client::{Allocation, Client, ClientError};
use hugemem_client::proto::{AllocPart, AllocRequest, ClearMode, PagePolicy};
use tracing::{info, warn};

use crate::launch::{self, option_name, text, LaunchError, MemoryFile};
use objects::{classify, device_driver, Decision, ObjectError, PathInfo, QemuObject, Syntax, Take};

/// The QEMU run when `--qemu` is not given.
pub const DEFAULT_QEMU: &str = "/usr/bin/qemu-system-x86_64";

/// What `hugemem qemu-wrapper` runs.
#[derive(Debug, Clone)]
pub struct WrapperConfig {
    /// The real QEMU.
    pub qemu: PathBuf,
    /// The daemon's socket.
    pub socket: PathBuf,
    /// How long the daemon may wait for pages it holds but cannot hand out
    /// yet; `None`: the daemon's default.
    pub alloc_wait: Option<Duration>,
}

/// Errors of the wrapper; each ends up in libvirt's domain log.
#[derive(Debug, thiserror::Error)]
pub enum WrapperError {
    /// A memory backend that cannot be taken, or does not parse.
    #[error(transparent)]
    Object(#[from] ObjectError),
    /// A device that needs memory the daemon cannot give.
    #[error("the domain has a {driver} device, which resizes its memory backend at run time; hugemem gives fixed-size memory, so the domain is not started (remove the device, or use the real QEMU as <emulator>)")]
    Device {
        /// The device's driver.
        driver: String,
    },
    /// An `-object` value that is not UTF-8.
    #[error("an -object value is not UTF-8: {0:?}")]
    NotUtf8(OsString),
    /// The daemon did not provide the memory.
    #[error("the hugemem daemon did not provide memory backend {id:?} ({size} on {page} pages)")]
    Client {
        /// The backend.
        id: String,
        /// Its size.
        size: String,
        /// Its page size.
        page: String,
        /// Why.
        #[source]
        source: ClientError,
    },
    /// The daemon's reply does not match what was asked.
    #[error("memory backend {id:?}: {why}")]
    Reply {
        /// The backend.
        id: String,
        /// What differs.
        why: String,
    },
    /// The region table could not be built (shared with `hugemem launch`).
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// An fd could not be made inheritable.
    #[error("cannot pass fd {fd} to QEMU")]
    Inherit {
        /// The fd.
        fd: i32,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// exec of the real QEMU failed.
    #[error("cannot exec {qemu:?}")]
    Exec {
        /// The program.
        qemu: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// One taken backend: where its value is in the arguments, and what to ask for.
#[derive(Debug, Clone, PartialEq)]
pub struct Taken {
    /// Index of the `-object` value in the arguments.
    pub index: usize,
    /// The syntax to write it back in.
    pub syntax: Syntax,
    /// The backend.
    pub take: Take,
}

/// What the wrapper will do with a command line.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Plan {
    /// Backends the daemon provides, in command-line order.
    pub taken: Vec<Taken>,
    /// Memory left to QEMU, one line each (said on stderr).
    pub notes: Vec<String>,
}

/// Reads QEMU's arguments (without the program) and decides what to take.
/// `stat` describes a `memory-backend-file`'s `mem-path` ([`PathInfo::of`]
/// in the wrapper).
///
/// # Errors
///
/// [`WrapperError::Object`] for a backend that cannot be taken,
/// [`WrapperError::Device`] for virtio-mem next to a taken backend,
/// [`WrapperError::NotUtf8`].
pub fn plan(
    args: &[OsString],
    stat: impl Fn(&str) -> Option<PathInfo>,
) -> Result<Plan, WrapperError> {
    let mut plan = Plan::default();
    let mut resizing = None;
    let mut i = 0;
    while i < args.len() {
        let name = option_name(&text(&args[i])).map(str::to_string);
        let value = args.get(i + 1);
        match (name.as_deref(), value) {
            (Some("object"), Some(v)) => {
                let v = v.to_str().ok_or_else(|| WrapperError::NotUtf8(v.clone()))?;
                let obj = QemuObject::parse(v)?;
                let info = match (obj.qom_type(), obj.get("mem-path").and_then(|p| p.as_str())) {
                    ("memory-backend-file", Some(path)) => stat(path),
                    _ => None,
                };
                match classify(&obj, info)? {
                    Decision::Other => {}
                    Decision::Leave(why) => plan.notes.push(why),
                    Decision::Take(take) => plan.taken.push(Taken {
                        index: i + 1,
                        syntax: obj.syntax,
                        take,
                    }),
                }
                i += 1;
            }
            (Some("device"), Some(v)) => {
                let driver = device_driver(&text(v)).unwrap_or_default();
                if driver.starts_with("virtio-mem") {
                    resizing = Some(driver);
                }
                i += 1;
            }
            (Some("mem-path" | "mem-prealloc"), _) => plan.notes.push(format!(
                "{} (QEMU's own guest RAM on a path): left to QEMU",
                text(&args[i])
            )),
            _ => {}
        }
        i += 1;
    }
    if let (Some(driver), false) = (resizing, plan.taken.is_empty()) {
        return Err(WrapperError::Device { driver });
    }
    Ok(plan)
}

fn page_policy(page_size: u64) -> PagePolicy {
    if page_size == 1 << 30 {
        PagePolicy::Huge1G
    } else {
        PagePolicy::Huge2M
    }
}

/// Allocates one taken backend and checks the reply against what was asked.
fn alloc_one(client: &mut Client, t: &Take) -> Result<Allocation, WrapperError> {
    let request = AllocRequest {
        total_size: t.size,
        page_policy: page_policy(t.page_size),
        clear_mode: ClearMode::Eager,
        lock: false,
        parts: t
            .node
            .map(|node| vec![AllocPart { node, size: t.size }])
            .unwrap_or_default(),
        want_paths: false,
    };
    let alloc = client
        .alloc(request)
        .map_err(|source| WrapperError::Client {
            id: t.id.clone(),
            size: format_size(t.size),
            page: format_size(t.page_size),
            source,
        })?;
    let reply = |why: String| WrapperError::Reply {
        id: t.id.clone(),
        why,
    };
    match alloc.regions.as_slice() {
        [r] if r.size == t.size && r.page_size == t.page_size => {
            if let Some(node) = t.node {
                if r.node != node {
                    return Err(reply(format!(
                        "asked for node {node}, the daemon placed it on {}",
                        r.node
                    )));
                }
            }
            Ok(alloc)
        }
        regions => Err(reply(format!(
            "asked for one region of {} on {} pages, got {:?}",
            format_size(t.size),
            format_size(t.page_size),
            regions
                .iter()
                .map(|r| (format_size(r.size), format_size(r.page_size)))
                .collect::<Vec<_>>()
        ))),
    }
}

/// The path QEMU opens for an inherited fd: `/proc/self/fd/N`, not
/// `/dev/fd/N` as `hugemem launch` writes, because the private `/dev` libvirt
/// gives QEMU (qemu.conf `namespaces = [ "mount" ]`, the default) has no
/// `/dev/fd` link, while `/proc` is the host's (docs/platform.md).
pub fn proc_fd_path(fd: i32) -> String {
    format!("/proc/self/fd/{fd}")
}

/// Clears `FD_CLOEXEC` on `fd` so that QEMU inherits it across exec.
fn inherit(fd: std::os::fd::BorrowedFd<'_>) -> Result<(), WrapperError> {
    launch::keep_across_exec(fd.as_raw_fd()).map_err(|source| WrapperError::Inherit {
        fd: fd.as_raw_fd(),
        source,
    })
}

/// Runs the wrapper: takes the huge-page backends from the daemon and execs
/// QEMU; returns only on error.
///
/// # Errors
///
/// See [`WrapperError`]. Nothing is allocated when the command line is refused.
pub fn run(cfg: &WrapperConfig, args: &[OsString]) -> Result<Infallible, WrapperError> {
    let plan = plan(args, |p| PathInfo::of(p).ok())?;
    for note in &plan.notes {
        warn!("not on hugemem memory: {note}");
    }
    let mut argv = args.to_vec();
    // Kept until exec: dropping would close the fds QEMU is to inherit.
    let mut held: Vec<Allocation> = Vec::new();
    let mut client = None;
    if !plan.taken.is_empty() {
        let started = Instant::now();
        let c =
            client.insert(
                Client::connect(&cfg.socket).map_err(|source| WrapperError::Client {
                    id: plan.taken[0].take.id.clone(),
                    size: format_size(plan.taken[0].take.size),
                    page: format_size(plan.taken[0].take.page_size),
                    source,
                })?,
            );
        c.set_alloc_wait(cfg.alloc_wait);
        for t in &plan.taken {
            let alloc = alloc_one(c, &t.take)?;
            let regions = launch::memory_regions(&alloc, false)?;
            let path = regions
                .first()
                .and_then(|r| match r.file {
                    MemoryFile::Fd(fd) => Some(proc_fd_path(fd)),
                    MemoryFile::Path(_) => None,
                })
                .ok_or_else(|| WrapperError::Reply {
                    id: t.take.id.clone(),
                    why: "no region".into(),
                })?;
            argv[t.index] = t.take.rewrite(t.syntax, &path).to_arg().into();
            info!(
                backend = %t.take.id,
                size = %format_size(t.take.size),
                page_size = %format_size(t.take.page_size),
                node = ?t.take.node,
                alloc_id = alloc.id,
                mem_path = %path,
                dropped = ?t.take.dropped,
                "memory backend on hugemem memory (populated and zeroed by the daemon)"
            );
            held.push(alloc);
        }
        info!(
            backends = plan.taken.len(),
            size = %format_size(plan.taken.iter().map(|t| t.take.size).sum()),
            ms = started.elapsed().as_secs_f64() * 1e3,
            socket = %cfg.socket.display(),
            "allocated; starting QEMU, which keeps the daemon connection (the memory is freed when QEMU exits)"
        );
        for alloc in &held {
            for fd in &alloc.fds {
                inherit(fd.as_fd())?;
            }
        }
        if let Some(c) = &client {
            inherit(c.socket())?;
        }
    }
    let source = Command::new(&cfg.qemu).args(&argv).exec();
    drop(held);
    Err(WrapperError::Exec {
        qemu: cfg.qemu.clone(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<OsString> {
        list.iter().map(OsString::from).collect()
    }

    fn hugetlb(_: &str) -> Option<PathInfo> {
        Some(PathInfo {
            hugetlbfs: true,
            block_size: 1 << 30,
            is_dir: true,
        })
    }

    #[test]
    fn probes_take_nothing() {
        for probe in [
            &["-help"][..],
            &["-version"][..],
            &[
                "-S",
                "-no-user-config",
                "-nodefaults",
                "-nographic",
                "-machine",
                "none,accel=tcg",
                "-qmp",
                "unix:/var/lib/libvirt/qemu/qmp-x/qmp.monitor,server=on,wait=off",
                "-pidfile",
                "/var/lib/libvirt/qemu/qmp-x/qmp.pid",
                "-daemonize",
            ][..],
        ] {
            assert_eq!(plan(&args(probe), hugetlb).expect("plan"), Plan::default());
        }
    }

    #[test]
    fn a_libvirt_numa_domain_takes_each_cell() {
        let cell = |n: u32| {
            format!(
                r#"{{"qom-type":"memory-backend-file","id":"ram-node{n}","mem-path":"/dev/hugepages-1G/libvirt/qemu/1-hm1","share":true,"prealloc":true,"size":1073741824,"host-nodes":[0],"policy":"bind","prealloc-context":"tc-ram-node{n}"}}"#
            )
        };
        let (c0, c1) = (cell(0), cell(1));
        let a = args(&[
            "-name",
            "guest=hm1,debug-threads=on",
            "-object",
            r#"{"qom-type":"thread-context","id":"tc-ram-node0","node-affinity":[0]}"#,
            "-object",
            &c0,
            "-numa",
            "node,nodeid=0,cpus=0,memdev=ram-node0",
            "-object",
            &c1,
            "-numa",
            "node,nodeid=1,cpus=1,memdev=ram-node1",
            "-device",
            r#"{"driver":"isa-serial","chardev":"charserial0","id":"serial0","index":0}"#,
        ]);
        let p = plan(&a, hugetlb).expect("plan");
        assert_eq!(
            p.taken
                .iter()
                .map(|t| (t.index, t.take.id.as_str()))
                .collect::<Vec<_>>(),
            [(5, "ram-node0"), (9, "ram-node1")]
        );
        assert!(p.notes.is_empty());
        // Backed by no huge pages: left, with a note.
        let a = args(&[
            "-object",
            r#"{"qom-type":"memory-backend-ram","id":"pc.ram","size":2147483648}"#,
            "-mem-prealloc",
        ]);
        let p = plan(&a, hugetlb).expect("plan");
        assert!(p.taken.is_empty());
        assert_eq!(p.notes.len(), 2, "{:?}", p.notes);
        // virtio-mem beside a taken backend: refused.
        let a = args(&[
            "-object",
            &c0,
            "-device",
            r#"{"driver":"virtio-mem-pci","memdev":"ram-node0","id":"virtiomem0"}"#,
        ]);
        let err = plan(&a, hugetlb).expect_err("virtio-mem");
        assert!(err.to_string().contains("virtio-mem-pci"), "{err}");
    }
}
