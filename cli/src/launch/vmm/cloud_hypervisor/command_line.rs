//! cloud-hypervisor command lines: `--memory size=0` and one shared file
//! zone per region.
//!
//! Facts this relies on, written down with their sources in
//! docs/platform.md#cloud-hypervisor and `docs/operations.md`; checked with cloud-hypervisor
//! at ae44c2971 built from source by `scripts/build-cloud-hypervisor` (`docs/benchmarks.md`):
//!
//! * `--memory size=0 --memory-zone id=Z,size=S,file=PATH,shared=on` maps an
//!   existing file; PATH may be a hugetlbfs file or `/dev/fd/N` of an
//!   inherited memfd. The file is opened without create, `ftruncate` or
//!   `fallocate`, so it must already be `S` bytes: the daemon's regions are.
//! * `host_numa_node` is refused for `file` + `shared`, so it is not emitted:
//!   the daemon placed each region on its node already.
//! * `--memory …,file=` is accepted and silently ignored, one more reason to
//!   refuse a user `--memory` instead of merging with it.
//! * Under `--landlock`, cloud-hypervisor's landlock rule for a memfd's
//!   `/dev/fd/N` fails (EBADFD: the memfd lives on the kernel's internal
//!   hugetlbfs mount); hugetlbfs paths work.
//!
//! hugemem's options come first, right after the program: cloud-hypervisor's
//! multi-value options (`--memory-zone a b`, `--disk a b`) take values up to
//! the next option, so appending ours after a user's `--disk …` would be
//! parsed as more disks. All zones go after one `--memory-zone`, the
//! documented form, and all guest NUMA nodes after one `--numa`.
//!
//! The `launch_ch` test boots the project's PVH guest under a real
//! cloud-hypervisor (when `CLOUD_HYPERVISOR` names one): fd mode,
//! `--hugetlbfs` with `--landlock`, and two zones with `--guest-numa`.

use std::ffi::OsString;

use crate::launch::command_line::{option_name, text, BuildError, BuildOptions, MemoryRegion, Vmm};
use guest_mem::size::format_size;

/// Zone id of region `i`.
pub fn zone_id(i: usize) -> String {
    format!("hugemem{i}")
}

/// Checks the user's arguments.
///
/// # Errors
///
/// [`BuildError::Conflict`] for `--memory`, `--memory-zone`, `--numa`,
/// `--restore`; [`BuildError::LandlockNeedsPaths`] for `--landlock` in fd mode.
pub fn check(args: &[OsString], opts: &BuildOptions) -> Result<(), BuildError> {
    for arg in args {
        let arg = text(arg);
        let Some(name) = arg.strip_prefix("--").and_then(|_| option_name(&arg)) else {
            continue;
        };
        let hint = match name {
            "memory" | "memory-zone" => {
                "hugemem launch sets `--memory size=0 --memory-zone …` itself; give sizes and nodes to hugemem launch \
                 (--size, --node, --nodes) instead"
            }
            "numa" => {
                "hugemem launch names the memory zones itself; pass --guest-numa to hugemem launch for one guest \
                 NUMA node per zone"
            }
            "restore" => "a restored VM brings its own memory from the snapshot",
            "landlock" if !opts.hugetlbfs => return Err(BuildError::LandlockNeedsPaths),
            _ => continue,
        };
        return Err(BuildError::Conflict {
            vmm: Vmm::CloudHypervisor,
            option: arg,
            hint,
        });
    }
    Ok(())
}

/// Builds the arguments (without the program).
///
/// # Errors
///
/// As [`check`], [`BuildError::NoRegions`], and [`BuildError::BadPath`]
/// for a path with a character the option syntax splits on.
pub fn build(
    args: &[OsString],
    regions: &[MemoryRegion],
    opts: &BuildOptions,
) -> Result<Vec<OsString>, BuildError> {
    if regions.is_empty() {
        return Err(BuildError::NoRegions);
    }
    check(args, opts)?;
    // fds under --hugetlbfs (or paths without it) would defeat the landlock
    // check above; run() never builds such a table.
    if regions.iter().any(|r| r.file.is_fd() == opts.hugetlbfs) {
        return Err(BuildError::MixedFiles(opts.hugetlbfs));
    }
    let mut out: Vec<OsString> = vec!["--memory".into(), "size=0".into(), "--memory-zone".into()];
    for (i, r) in regions.iter().enumerate() {
        let path = r.file.vmm_path();
        if let Some(why) = bad_path_char(&path) {
            return Err(BuildError::BadPath {
                vmm: Vmm::CloudHypervisor,
                path,
                why,
            });
        }
        out.push(
            format!(
                "id={},size={},file={path},shared=on",
                zone_id(i),
                format_size(r.size)
            )
            .into(),
        );
    }
    if opts.guest_numa {
        out.push("--numa".into());
        for i in 0..regions.len() {
            out.push(format!("guest_numa_id={i},memory_zones={}", zone_id(i)).into());
        }
    }
    out.extend(args.iter().cloned());
    Ok(out)
}

/// cloud-hypervisor's option parser splits on `,` and `=` and its list
/// syntax uses brackets; the daemon's paths never contain them.
fn bad_path_char(path: &str) -> Option<&'static str> {
    if path.contains(',') {
        Some("a comma")
    } else if path.contains('=') {
        Some("an equals sign")
    } else if path.contains(['[', ']']) {
        Some("a bracket")
    } else if path.contains(char::is_whitespace) {
        Some("white space")
    } else {
        None
    }
}

/// The user's `--api-socket` value and where it is in `args`.
pub(crate) fn api_socket_arg(args: &[OsString]) -> Option<(usize, String)> {
    let mut i = 0;
    while i < args.len() {
        let a = args[i].to_string_lossy();
        if let Some(v) = a.strip_prefix("--api-socket=") {
            return Some((i, v.to_string()));
        }
        if a == "--api-socket" {
            return args
                .get(i + 1)
                .map(|v| (i, v.to_string_lossy().into_owned()));
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::MemoryFile;

    fn args(list: &[&str]) -> Vec<OsString> {
        list.iter().map(OsString::from).collect()
    }

    fn strings(v: Vec<OsString>) -> Vec<String> {
        v.into_iter()
            .map(|s| s.into_string().expect("utf-8"))
            .collect()
    }

    fn fd_regions() -> Vec<MemoryRegion> {
        vec![
            MemoryRegion {
                size: 2 << 30,
                node: Some(0),
                file: MemoryFile::Fd(5),
            },
            MemoryRegion {
                size: 2 << 30,
                node: Some(1),
                file: MemoryFile::Fd(6),
            },
        ]
    }

    #[test]
    fn one_zone_per_region_before_the_user_arguments() {
        let user = args(&[
            "--kernel",
            "guest.elf",
            "--disk",
            "path=a",
            "path=b",
            "--cpus",
            "boot=2",
        ]);
        let out = strings(build(&user, &fd_regions(), &BuildOptions::default()).expect("build"));
        assert_eq!(
            out,
            [
                "--memory",
                "size=0",
                "--memory-zone",
                "id=hugemem0,size=2G,file=/dev/fd/5,shared=on",
                "id=hugemem1,size=2G,file=/dev/fd/6,shared=on",
                "--kernel",
                "guest.elf",
                "--disk",
                "path=a",
                "path=b",
                "--cpus",
                "boot=2",
            ]
        );
        // Never host_numa_node (refused for shared file zones), never prefault.
        assert!(out
            .iter()
            .all(|a| !a.contains("host_numa_node") && !a.contains("prefault")));
    }

    #[test]
    fn guest_numa_nodes_name_the_zones() {
        let opts = BuildOptions {
            guest_numa: true,
            ..Default::default()
        };
        let out = strings(build(&[], &fd_regions(), &opts).expect("build"));
        let at = out.iter().position(|a| a == "--numa").expect("--numa");
        assert_eq!(
            out[at + 1..],
            [
                "guest_numa_id=0,memory_zones=hugemem0",
                "guest_numa_id=1,memory_zones=hugemem1"
            ]
        );
    }

    #[test]
    fn hugetlbfs_paths() {
        let regions = vec![MemoryRegion {
            size: 1 << 30,
            node: None,
            file: MemoryFile::Path("/dev/hugepages-1G/vm.7.0".into()),
        }];
        let opts = BuildOptions {
            hugetlbfs: true,
            ..Default::default()
        };
        let out = strings(
            build(&args(&["--landlock"]), &regions, &opts).expect("landlock works with paths"),
        );
        assert_eq!(
            out[3],
            "id=hugemem0,size=1G,file=/dev/hugepages-1G/vm.7.0,shared=on"
        );
        let bad = vec![MemoryRegion {
            size: 1 << 30,
            node: None,
            file: MemoryFile::Path("/mnt/a,b".into()),
        }];
        assert!(matches!(
            build(&[], &bad, &opts),
            Err(BuildError::BadPath { .. })
        ));
    }

    #[test]
    fn refuses_memory_options_of_its_own() {
        for (user, what) in [
            (&["--memory", "size=1G"][..], "--memory"),
            (&["--memory=size=1G"][..], "--memory=size=1G"),
            (
                &["--kernel", "k", "--memory-zone", "id=a,size=1G"][..],
                "--memory-zone",
            ),
            (&["--numa", "guest_numa_id=0"][..], "--numa"),
            (&["--restore", "source_url=file:///snap"][..], "--restore"),
        ] {
            let err = check(&args(user), &BuildOptions::default()).expect_err(what);
            match &err {
                BuildError::Conflict { option, .. } => assert_eq!(option, what),
                other => panic!("{other:?}"),
            }
            assert!(err.to_string().contains(what), "{err}");
            assert!(build(&args(user), &fd_regions(), &BuildOptions::default()).is_err());
        }
        // Values that merely contain the word are fine.
        assert!(check(
            &args(&["--cmdline", "memory=1G", "--serial", "tty"]),
            &BuildOptions::default()
        )
        .is_ok());
        // --memory-zone's "hugepages" etc. are not checked piecemeal: the whole option is refused.
        assert!(check(&args(&["--memory-zone=id=x"]), &BuildOptions::default()).is_err());
    }

    #[test]
    fn landlock_needs_hugetlbfs_paths() {
        assert_eq!(
            check(&args(&["--landlock"]), &BuildOptions::default()),
            Err(BuildError::LandlockNeedsPaths)
        );
        assert!(check(
            &args(&["--landlock"]),
            &BuildOptions {
                hugetlbfs: true,
                ..Default::default()
            }
        )
        .is_ok());
        let msg = BuildError::LandlockNeedsPaths.to_string();
        assert!(msg.contains("--hugetlbfs"), "{msg}");
    }
}
