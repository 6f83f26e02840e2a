//! QEMU command lines: one `memory-backend-file` object per region.
//!
//! * One region: `-object memory-backend-file,id=ram0,mem-path=P,share=on,size=S`,
//!   `-m S`, and `memory-backend=ram0` added to the user's `-M`/`-machine`
//!   option (or a `-machine memory-backend=ram0` of its own when the user gave
//!   none or several; QEMU merges `-machine` options). With `-M microvm` this
//!   is the form measured to boot a PVH guest in well under 0.1 s.
//! * Several regions (one per host node): one backend each, `-m` the total,
//!   and `-numa node,nodeid=I,memdev=ramI`, so the guest sees one NUMA node
//!   per host node. `-M microvm` has no NUMA, so several regions are refused
//!   there rather than silently collapsed.
//!
//! `share=on` makes QEMU map the file `MAP_SHARED`, so the guest writes the
//! daemon's pages (a private mapping would copy-on-write into pages the daemon
//! never sees, and the daemon's scrub would miss them). QEMU opens `mem-path`
//! as an existing file, takes the page size from `fstatfs` (a hugetlb memfd
//! reports its huge-page size), and does not truncate a file that is already
//! large enough. `prealloc` stays off: the pages exist already.
//!
//! User options that set guest RAM are refused: `-m`, `-mem-path`,
//! `-mem-prealloc`, `-numa`, any `-object` whose value names a
//! `memory-backend`, and a `-machine` that already has `memory-backend=`.
//! QEMU takes options with one or two dashes; both are matched. The values of
//! `-object` and `-machine` are the next argument (QEMU has no `-opt=value`).

use std::ffi::OsString;

use crate::launch::command_line::{option_name, text, BuildError, MemoryRegion, Vmm};
use guest_mem::size::format_size;

/// The `-cpu` value for QEMU under KVM on every host this project runs on.
///
/// QEMU 7.2 with `-accel kvm -cpu max` (or `-cpu host`) aborts at start on AMD
/// hosts of the software KVM these machines use: "failed to set MSR 0x10a to
/// 0x69" then a `kvm_buf_set_msrs` assertion (SIGABRT). MSR 0x10a is
/// IA32_ARCH_CAPABILITIES, which that KVM does not accept there; dropping the
/// `arch-capabilities` feature boots on AMD and on Intel alike, so the
/// choice does not depend on the host (docs/operations.md, "QEMU aborts with
/// failed to set MSR 0x10a").
pub const KVM_CPU: &str = "max,-arch-capabilities";

/// Backend object id of region `i`.
pub fn backend_id(i: usize) -> String {
    format!("ram{i}")
}

/// What [`check`] learnt about the user's `-machine` options.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Machine {
    /// Index (in the user arguments) of the value of the only `-M`/`-machine`.
    pub value_index: Option<usize>,
    /// How many `-M`/`-machine` options there are.
    pub count: usize,
    /// The machine type is `microvm`.
    pub microvm: bool,
}

/// Checks the user's arguments and finds their `-machine` option.
///
/// # Errors
///
/// [`BuildError::Conflict`] naming the first option that sets guest RAM.
pub fn check(args: &[OsString]) -> Result<Machine, BuildError> {
    let conflict = |option: String, hint| {
        Err(BuildError::Conflict {
            vmm: Vmm::Qemu,
            option,
            hint,
        })
    };
    let mut machine = Machine::default();
    let mut i = 0;
    while i < args.len() {
        let arg = text(&args[i]);
        let value = args.get(i + 1).map(|v| text(v));
        match option_name(&arg) {
            Some("m") => {
                return conflict(
                    arg,
                    "hugemem launch sets -m to the allocation's size; use hugemem launch --size",
                )
            }
            Some("mem-path" | "mem-prealloc") => {
                return conflict(
                    arg,
                    "hugemem launch provides the memory backend (memory-backend-file ram0…)",
                )
            }
            Some("numa") => {
                return conflict(
                    arg,
                    "hugemem launch adds one -numa node per region; use hugemem launch --nodes",
                )
            }
            Some("object") => {
                if let Some(v) = value.filter(|v| v.contains("memory-backend")) {
                    return conflict(
                        format!("{arg} {v}"),
                        "hugemem launch provides the memory backends (ram0…); other memory backends are not supported",
                    );
                }
                i += 1;
            }
            Some("M" | "machine") => {
                if let Some(v) = &value {
                    if v.split(',').any(|kv| kv.starts_with("memory-backend=")) {
                        return conflict(
                            format!("{arg} {v}"),
                            "hugemem launch sets memory-backend=ram0 itself",
                        );
                    }
                    machine.microvm |= machine_type(v) == Some("microvm");
                    machine.value_index = Some(i + 1);
                }
                machine.count += 1;
                i += 1;
            }
            _ => {}
        }
        i += 1;
    }
    if machine.count != 1 {
        machine.value_index = None;
    }
    Ok(machine)
}

/// The type in a `-machine` value: the first item when it has no `=`, else
/// the value of `type=`.
fn machine_type(value: &str) -> Option<&str> {
    let mut items = value.split(',');
    match items.next() {
        Some(first) if !first.contains('=') => Some(first),
        _ => value.split(',').find_map(|kv| kv.strip_prefix("type=")),
    }
}

/// QEMU option values escape a comma by doubling it.
fn escape(value: &str) -> String {
    value.replace(',', ",,")
}

/// How QEMU maps a region's file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharing {
    /// `share=on` (`MAP_SHARED`): the guest writes the daemon's pages.
    Shared,
    /// A shared clone's private (copy-on-write) mapping of its template:
    /// `share=off` (`MAP_PRIVATE`), with `readonly=on,rom=off` where QEMU
    /// has `rom` (8.2 on: it then opens the file read-only and the guest
    /// still writes its private copy). QEMU 7.2 has no `rom` and opens the
    /// file read-write (`readonly=on` would make guest RAM a ROM); see
    /// `clone.rs`.
    Private {
        /// QEMU takes `rom=off`.
        rom: bool,
    },
}

impl Sharing {
    /// The backend's options.
    fn options(self) -> &'static str {
        match self {
            Self::Shared => "share=on",
            Self::Private { rom: true } => "share=off,readonly=on,rom=off",
            Self::Private { rom: false } => "share=off",
        }
    }
}

/// Builds the arguments (without the program).
///
/// # Errors
///
/// As [`check`], [`BuildError::NoRegions`], and
/// [`BuildError::MicrovmRegions`] for several regions under `-M microvm`.
pub fn build(args: &[OsString], regions: &[MemoryRegion]) -> Result<Vec<OsString>, BuildError> {
    build_as(args, regions, Sharing::Shared)
}

/// [`build`], each region mapped as `sharing` says.
///
/// # Errors
///
/// As [`build`].
pub fn build_as(
    args: &[OsString],
    regions: &[MemoryRegion],
    sharing: Sharing,
) -> Result<Vec<OsString>, BuildError> {
    if regions.is_empty() {
        return Err(BuildError::NoRegions);
    }
    let machine = check(args)?;
    if regions.len() > 1 && machine.microvm {
        return Err(BuildError::MicrovmRegions(regions.len()));
    }
    let mut user = args.to_vec();
    let total: u64 = regions.iter().map(|r| r.size).sum();
    let mut out: Vec<OsString> = Vec::new();
    for (i, r) in regions.iter().enumerate() {
        out.push("-object".into());
        out.push(
            format!(
                "memory-backend-file,id={},mem-path={},{},size={}",
                backend_id(i),
                escape(&r.file.vmm_path()),
                sharing.options(),
                format_size(r.size)
            )
            .into(),
        );
    }
    out.push("-m".into());
    out.push(format_size(total).into());
    if regions.len() == 1 {
        let setting = format!("memory-backend={}", backend_id(0));
        match machine.value_index {
            Some(idx) => {
                let mut v = user[idx].clone();
                v.push(",");
                v.push(&setting);
                user[idx] = v;
            }
            None => {
                out.push("-machine".into());
                out.push(setting.into());
            }
        }
    } else {
        for i in 0..regions.len() {
            out.push("-numa".into());
            out.push(format!("node,nodeid={i},memdev={}", backend_id(i)).into());
        }
    }
    out.extend(user);
    Ok(out)
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

    fn one() -> Vec<MemoryRegion> {
        vec![MemoryRegion {
            size: 2 << 30,
            node: Some(0),
            file: MemoryFile::Fd(4),
        }]
    }

    fn two() -> Vec<MemoryRegion> {
        vec![
            MemoryRegion {
                size: 1 << 30,
                node: Some(0),
                file: MemoryFile::Fd(4),
            },
            MemoryRegion {
                size: 3 << 30,
                node: Some(1),
                file: MemoryFile::Path("/dev/hugepages-1G/a,b".into()),
            },
        ]
    }

    #[test]
    fn microvm_one_region_uses_the_machine_memory_backend() {
        let user = args(&["-M", "microvm", "-accel", "kvm", "-kernel", "g.elf"]);
        let out = strings(build(&user, &one()).expect("build"));
        assert_eq!(
            out,
            [
                "-object",
                "memory-backend-file,id=ram0,mem-path=/dev/fd/4,share=on,size=2G",
                "-m",
                "2G",
                "-M",
                "microvm,memory-backend=ram0",
                "-accel",
                "kvm",
                "-kernel",
                "g.elf",
            ]
        );
    }

    #[test]
    fn a_shared_clone_maps_its_template_privately() {
        let user = args(&["-M", "microvm"]);
        let backend =
            |sharing| strings(build_as(&user, &one(), sharing).expect("build"))[1].clone();
        assert_eq!(
            backend(Sharing::Private { rom: false }),
            "memory-backend-file,id=ram0,mem-path=/dev/fd/4,share=off,size=2G"
        );
        assert_eq!(
            backend(Sharing::Private { rom: true }),
            "memory-backend-file,id=ram0,mem-path=/dev/fd/4,share=off,readonly=on,rom=off,size=2G"
        );
    }

    #[test]
    fn machine_forms() {
        assert_eq!(machine_type("microvm"), Some("microvm"));
        assert_eq!(machine_type("microvm,acpi=off"), Some("microvm"));
        assert_eq!(machine_type("type=microvm,acpi=off"), Some("microvm"));
        assert_eq!(machine_type("acpi=off,type=q35"), Some("q35"));
        assert_eq!(machine_type("acpi=off"), None);
        let m = check(&args(&["--machine", "type=microvm"])).expect("check");
        assert_eq!(
            m,
            Machine {
                value_index: Some(1),
                count: 1,
                microvm: true
            }
        );
        // No -machine: a separate one; two of them: a separate one as well.
        let out = strings(build(&args(&["-kernel", "k"]), &one()).expect("build"));
        assert_eq!(
            out[4..],
            ["-machine", "memory-backend=ram0", "-kernel", "k"]
        );
        let out =
            strings(build(&args(&["-M", "pc", "-machine", "accel=kvm"]), &one()).expect("build"));
        assert!(
            out.windows(2)
                .any(|w| w == ["-machine", "memory-backend=ram0"]),
            "{out:?}"
        );
        assert!(out.contains(&"pc".to_string()) && out.contains(&"accel=kvm".to_string()));
    }

    #[test]
    fn several_regions_become_numa_nodes() {
        let out = strings(build(&args(&["-M", "q35"]), &two()).expect("build"));
        assert_eq!(
            out,
            [
                "-object",
                "memory-backend-file,id=ram0,mem-path=/dev/fd/4,share=on,size=1G",
                "-object",
                "memory-backend-file,id=ram1,mem-path=/dev/hugepages-1G/a,,b,share=on,size=3G",
                "-m",
                "4G",
                "-numa",
                "node,nodeid=0,memdev=ram0",
                "-numa",
                "node,nodeid=1,memdev=ram1",
                "-M",
                "q35",
            ]
        );
        let err = build(&args(&["-M", "microvm"]), &two()).expect_err("microvm has no NUMA");
        assert_eq!(err, BuildError::MicrovmRegions(2));
        assert!(err.to_string().contains("microvm"), "{err}");
    }

    #[test]
    fn refuses_memory_options_of_its_own() {
        for (user, what) in [
            (&["-m", "1G"][..], "-m"),
            (&["--m", "1G"][..], "--m"),
            (
                &["-M", "pc", "-mem-path", "/dev/hugepages"][..],
                "-mem-path",
            ),
            (&["-mem-prealloc"][..], "-mem-prealloc"),
            (&["-numa", "node"][..], "-numa"),
            (
                &["-object", "memory-backend-ram,id=m,size=1G"][..],
                "-object memory-backend-ram,id=m,size=1G",
            ),
            (
                &["-object", r#"{"qom-type":"memory-backend-file","id":"x"}"#][..],
                "-object {\"qom-type\"",
            ),
            (
                &["-M", "microvm,memory-backend=x"][..],
                "-M microvm,memory-backend=x",
            ),
        ] {
            let err = check(&args(user)).expect_err(what);
            let BuildError::Conflict { option, .. } = &err else {
                panic!("{err:?}")
            };
            assert!(option.starts_with(what), "{option} vs {what}");
            assert!(err.to_string().contains("conflicts"), "{err}");
        }
        // Other objects, and values that only mention memory, are fine.
        assert!(check(&args(&[
            "-object",
            "rng-random,id=r,filename=/dev/urandom",
            "-append",
            "mem=1G -m"
        ]))
        .is_ok());
    }
}
