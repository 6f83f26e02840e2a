//! Users and groups, and running a command as another uid (with its
//! groups) through util-linux's `setpriv`: how `hugemem check` sees the
//! socket and devices as a tenant sees them, without trusting its own
//! reading of modes and ACLs.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use nix::unistd::{Gid, Group, Uid, User};

/// `setpriv` (util-linux, Essential on Debian).
const SETPRIV: &str = "setpriv";
/// The longest a command run as another account may take (coreutils'
/// `timeout` ends it; its status is then [`TIMED_OUT`]).
const RUN_AS_LIMIT_SECS: &str = "15";
/// `timeout`'s exit status when it ended the command.
pub const TIMED_OUT: i32 = 124;

/// A uid with what the system knows of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    /// The uid.
    pub uid: u32,
    /// Its name, where `/etc/passwd` (NSS) has one.
    pub name: Option<String>,
    /// Its primary group (the uid itself where there is no entry).
    pub gid: u32,
}

impl Account {
    /// `uid`, looked up.
    pub fn of_uid(uid: u32) -> Self {
        match User::from_uid(Uid::from_raw(uid)) {
            Ok(Some(u)) => Self {
                uid,
                name: Some(u.name),
                gid: u.gid.as_raw(),
            },
            _ => Self {
                uid,
                name: None,
                gid: uid,
            },
        }
    }

    /// The account named `name` (or a number, as libvirt reads `+N`/`N`).
    pub fn of_name(name: &str) -> Option<Self> {
        let numeric = name.strip_prefix('+').unwrap_or(name);
        if let Ok(uid) = numeric.parse::<u32>() {
            return Some(Self::of_uid(uid));
        }
        let u = User::from_name(name).ok().flatten()?;
        Some(Self {
            uid: u.uid.as_raw(),
            name: Some(u.name),
            gid: u.gid.as_raw(),
        })
    }

    /// `name (uid N)` or `uid N`.
    pub fn label(&self) -> String {
        match &self.name {
            Some(n) => format!("{n} (uid {})", self.uid),
            None => format!("uid {}", self.uid),
        }
    }

    /// Whether the account is a member of `gid` (primary or supplementary).
    pub fn in_group(&self, gid: u32) -> bool {
        if self.gid == gid {
            return true;
        }
        let Some(name) = &self.name else {
            return false;
        };
        Group::from_gid(Gid::from_raw(gid))
            .ok()
            .flatten()
            .is_some_and(|g| g.mem.iter().any(|m| m == name))
    }

    /// Runs `program args…` as this account (its uid, primary group and
    /// supplementary groups), for at most 15 s (then the status is
    /// [`TIMED_OUT`]); `None` when `setpriv` cannot be run at all.
    pub fn run(&self, program: &Path, args: &[&str]) -> Option<Output> {
        let mut cmd = Command::new("timeout");
        cmd.arg(RUN_AS_LIMIT_SECS)
            .arg(SETPRIV)
            .arg(format!("--reuid={}", self.uid))
            .arg(format!("--regid={}", self.gid));
        if self.name.is_some() {
            cmd.arg("--init-groups");
        } else {
            cmd.arg("--clear-groups");
        }
        cmd.arg("--").arg(program).args(args);
        // 125-127: timeout or setpriv could not run at all.
        cmd.output()
            .ok()
            .filter(|o| !matches!(o.status.code(), Some(125..=127)))
    }

    /// Whether this account may read and write `path` (`test -r -a -w`).
    pub fn can_read_write(&self, path: &Path) -> Option<bool> {
        let p = path.to_string_lossy();
        self.run(&PathBuf::from("test"), &["-r", &p, "-a", "-w", &p])
            .map(|o| o.status.success())
    }
}

/// The group named `name` (or a number), as a gid.
pub fn gid_of(name: &str) -> Option<u32> {
    let numeric = name.strip_prefix('+').unwrap_or(name);
    if let Ok(gid) = numeric.parse::<u32>() {
        return Some(gid);
    }
    Group::from_name(name)
        .ok()
        .flatten()
        .map(|g| g.gid.as_raw())
}

/// The group's name, where the system has one.
pub fn group_name(gid: u32) -> Option<String> {
    Group::from_gid(Gid::from_raw(gid))
        .ok()
        .flatten()
        .map(|g| g.name)
}

/// `name (gid N)` or `gid N`.
pub fn group_label(gid: u32) -> String {
    match Group::from_gid(Gid::from_raw(gid)).ok().flatten() {
        Some(g) => format!("{} (gid {gid})", g.name),
        None => format!("gid {gid}"),
    }
}

/// The first line of a command's stderr (else stdout), for a `why`.
pub fn first_line(out: &Output) -> String {
    if out.status.code() == Some(TIMED_OUT) {
        return format!("no answer within {RUN_AS_LIMIT_SECS} s");
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let text = if err.trim().is_empty() {
        String::from_utf8_lossy(&out.stdout).into_owned()
    } else {
        err.into_owned()
    };
    // The error and its first cause say it best: `hugemem: error: …` and
    // `caused by: …`.
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .take(3)
        .collect::<Vec<_>>()
        .join(" / ")
}
