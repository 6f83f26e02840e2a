use super::*;
use crate::check::report::Status;

/// What the build script's cloud-hypervisor prints.
const BUILT: &str = "cloud-hypervisor v54.0.0\nMigration Protocol Versions: 0\n";

fn in_entry(entry: &str) -> Found {
    Found {
        path: PathBuf::from(format!("/var/cache/hugemem-ch/{entry}/cloud-hypervisor")),
        from_env: true,
    }
}

fn ours() -> Found {
    in_entry(&format!(
        "{}-58ee63afa87fa644",
        &CLOUD_HYPERVISOR_COMMIT[..9]
    ))
}

fn on_path() -> Found {
    Found {
        path: PathBuf::from("/usr/bin/cloud-hypervisor"),
        from_env: false,
    }
}

#[test]
fn the_version_output_is_read() {
    assert_eq!(
        parse_version(BUILT),
        Some(VersionInfo {
            release: "v54.0.0".into(),
            protocols: Some(vec![0]),
        })
    );
    assert_eq!(
        parse_version("cloud-hypervisor v55.0.0\nMigration Protocol Versions: 0, 1\n")
            .and_then(|v| v.protocols),
        Some(vec![0, 1])
    );
    let old = parse_version("cloud-hypervisor v48.0.0\n").expect("an older release");
    assert_eq!(old.protocols, None);
    assert_eq!(parse_version("QEMU emulator version 9.2.0\n"), None);
    assert_eq!(parse_version(""), None);
    assert_eq!(parse_version("cloud-hypervisor \n"), None);
}

#[test]
fn the_commit_is_read_from_a_git_version_or_the_cache_entry() {
    assert_eq!(commit_in_release("v53.0-246-gae44c2971"), Some("ae44c2971"));
    assert_eq!(
        commit_in_release("v53.0-246-gae44c2971-dirty"),
        Some("ae44c2971")
    );
    assert_eq!(commit_in_release("v54.0.0"), None);
    assert_eq!(
        build_entry(Path::new("/c/ae44c2971-58ee63afa87fa644/cloud-hypervisor")),
        Some(("ae44c2971-58ee63afa87fa644".into(), "ae44c2971".into()))
    );
    for not_an_entry in [
        "/usr/bin/cloud-hypervisor",
        "/c/ae44c2971/cloud-hypervisor",
        "/c/ae44c2971-short/cloud-hypervisor",
        "/c/not-hex-58ee63afa87fa644/cloud-hypervisor",
    ] {
        assert_eq!(build_entry(Path::new(not_an_entry)), None, "{not_an_entry}");
    }
    assert_eq!(major("v54.0.0"), Some(54));
    assert_eq!(major("v53.0-246-gae44c2971"), Some(53));
}

#[test]
fn the_project_build_passes_on_software_kvm_and_says_how_it_was_decided() {
    let v = parse_version(BUILT).expect("parse");
    let item = migration(&ours(), &v, Kvm::Software);
    assert_eq!(item.status, Status::Pass, "{item:?}");
    for piece in [
        "protocol version 0",
        &CLOUD_HYPERVISOR_COMMIT[..9],
        "kvm_pvm",
        "cache entry",
        "no migration was run",
    ] {
        assert!(item.why.contains(piece), "{:?} lacks {piece:?}", item.why);
    }
    let named = identity(&ours(), &v);
    assert_eq!(named.status, Status::Pass);
    assert!(named.why.contains("(from CLOUD_HYPERVISOR): cloud-hypervisor v54.0.0, migration protocol versions 0, commit ae44c2971"), "{}", named.why);
}

#[test]
fn an_unpatched_build_on_software_kvm_warns() {
    let git =
        parse_version("cloud-hypervisor v53.0-246-gae44c2971\nMigration Protocol Versions: 0\n")
            .expect("parse");
    let item = migration(&on_path(), &git, Kvm::Software);
    assert_eq!(item.status, Status::Warn, "{item:?}");
    assert!(item.why.contains("unpatched"), "{}", item.why);
    assert!(item.fix.contains("scripts/build-cloud-hypervisor"));
    // The same commit on hardware KVM needs no patch.
    let item = migration(&on_path(), &git, Kvm::Hardware("kvm_intel"));
    assert_eq!(item.status, Status::Pass, "{item:?}");
    assert!(item.why.contains("kvm_intel"), "{}", item.why);
}

#[test]
fn other_releases_name_the_version_hugemem_speaks() {
    let newer = parse_version("cloud-hypervisor v55.0.0\nMigration Protocol Versions: 0, 1\n")
        .expect("parse");
    let item = migration(&on_path(), &newer, Kvm::Hardware("kvm_amd"));
    assert_eq!(item.status, Status::Warn, "{item:?}");
    for piece in [
        "newer than v54.0.0",
        "memory_mode=memfds",
        SPOKEN,
        "decided by its version",
    ] {
        assert!(item.why.contains(piece), "{:?} lacks {piece:?}", item.why);
    }
    // A release that dropped the protocol hugemem speaks is refused.
    let dropped = parse_version("cloud-hypervisor v57.0.0\nMigration Protocol Versions: 1, 2\n")
        .expect("parse");
    let item = migration(&on_path(), &dropped, Kvm::Hardware("kvm_amd"));
    assert_eq!(item.status, Status::Fail, "{item:?}");
    assert!(item.why.contains("versions 1, 2, not 0"), "{}", item.why);
    assert!(item.why.contains(SPOKEN), "{}", item.why);
    // A stock v54.0.0 whose commit cannot be told.
    let stock = parse_version(BUILT).expect("parse");
    let item = migration(&on_path(), &stock, Kvm::Hardware("kvm_intel"));
    assert_eq!(item.status, Status::Warn, "{item:?}");
    assert!(item.why.contains("commit unknown"), "{}", item.why);
}

#[test]
fn the_binary_is_found_in_the_environment_first_then_on_path() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bin = dir.path().join("cloud-hypervisor");
    std::fs::write(&bin, "#!/bin/sh\n").expect("write");
    let path_var = Some(OsString::from(format!(
        "/nonexistent:{}",
        dir.path().display()
    )));
    assert_eq!(
        find(None, path_var.clone()),
        None,
        "not executable: not found"
    );
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    assert_eq!(
        find(None, path_var.clone()),
        Some(Found {
            path: bin.clone(),
            from_env: false
        })
    );
    assert_eq!(
        find(Some("/opt/ch".into()), path_var.clone()),
        Some(Found {
            path: "/opt/ch".into(),
            from_env: true
        })
    );
    assert_eq!(
        find(Some(OsString::new()), path_var).map(|f| f.from_env),
        Some(false),
        "an empty CLOUD_HYPERVISOR is unset"
    );
}

#[test]
fn the_kvm_module_is_read_from_sysfs() {
    let dir = tempfile::tempdir().expect("tempdir");
    assert_eq!(kvm_kind(dir.path()), Kvm::None);
    std::fs::create_dir_all(dir.path().join("module/kvm_intel")).expect("mkdir");
    assert_eq!(kvm_kind(dir.path()), Kvm::Hardware("kvm_intel"));
    std::fs::create_dir_all(dir.path().join("module/kvm_pvm")).expect("mkdir");
    assert_eq!(kvm_kind(dir.path()), Kvm::Software);
}
