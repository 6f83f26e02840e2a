//! Which cloud-hypervisor's migration and offload protocol this crate
//! speaks, and what hugemem says when a newer cloud-hypervisor refuses it.
//!
//! hugemem follows one cloud-hypervisor tree: the one
//! `scripts/build-cloud-hypervisor` builds and the tests run against,
//! cloud-hypervisor [`CLOUD_HYPERVISOR_RELEASE`] (as its `--version` says;
//! v54 in development) at commit [`CLOUD_HYPERVISOR_COMMIT`]. In that tree:
//!
//! - the migration protocol is version [`PROTOCOL_VERSION`]
//!   (`CURRENT_PROTOCOL_VERSION`), which `cloud-hypervisor --version` lists
//!   as "Migration Protocol Versions";
//! - a local migration passes the memory's fds when `send-migration` says
//!   [`MEMORY_FDS_OPTION`] (`"local": true` over the REST API);
//! - an on-demand restore is asked for on the receiving side,
//!   `receive-migration …,memory_mode=postcopy`.
//!
//! Upstream moved after it:
//!
//! - cloud-hypervisor pull request 8820 deprecates `local=on` in favour of
//!   [`NEWER_MEMORY_FDS_OPTION`];
//! - pull request 8819 moves the memory mode into the protocol: the sender
//!   announces it, and `receive-migration` no longer takes `memory_mode`.
//!
//! A cloud-hypervisor with those changes may refuse what this version
//! sends, or send what it does not know. The errors of this crate
//! ([`ChMigrationError`](crate::ChMigrationError)) then carry [`SPOKEN`]
//! and, where the refusal points at the memory mode (a refused `Start` or
//! `MemoryFd`), [`NEWER_EXPECTS`].

/// The literal pieces, once, so the constants and the sentences built
/// from them cannot drift apart.
macro_rules! release {
    () => {
        "v54.0.0"
    };
}
macro_rules! commit {
    () => {
        "ae44c2971c83"
    };
}
macro_rules! protocol {
    () => {
        0
    };
}
macro_rules! memory_fds_option {
    () => {
        "local=on"
    };
}
macro_rules! newer_memory_fds_option {
    () => {
        "memory_mode=memfds"
    };
}

/// The cloud-hypervisor release whose protocol this crate speaks, as its
/// `--version` prints it.
pub const CLOUD_HYPERVISOR_RELEASE: &str = release!();
/// The cloud-hypervisor commit whose protocol this crate speaks (the tree
/// `scripts/build-cloud-hypervisor` builds).
pub const CLOUD_HYPERVISOR_COMMIT: &str = commit!();
/// The migration protocol version this side speaks (that tree's
/// `CURRENT_PROTOCOL_VERSION`).
pub const PROTOCOL_VERSION: u16 = protocol!();
/// The `send-migration` option that passes the memory as fds in that tree.
pub const MEMORY_FDS_OPTION: &str = memory_fds_option!();
/// The option newer cloud-hypervisor releases take instead
/// (cloud-hypervisor pull request 8820).
pub const NEWER_MEMORY_FDS_OPTION: &str = newer_memory_fds_option!();

/// What hugemem speaks, in words, for an error message.
pub const SPOKEN: &str = concat!(
    "hugemem speaks the migration protocol of cloud-hypervisor ",
    release!(),
    " (commit ",
    commit!(),
    ", protocol version ",
    protocol!(),
    ", memory passed as fds with `",
    memory_fds_option!(),
    "`)"
);

/// What a newer cloud-hypervisor expects instead, in words.
pub const NEWER_EXPECTS: &str = concat!(
    "newer cloud-hypervisor releases use `",
    newer_memory_fds_option!(),
    "` and announce the memory mode inside the protocol (cloud-hypervisor pull requests 8819 and 8820)"
);

/// The error a cloud-hypervisor's API answer to hugemem's
/// `vm.send-migration` with `"local": true` is worth, when the answer
/// refuses the `local` field itself (a cloud-hypervisor that dropped the
/// deprecated option): `None` for any other answer.
pub fn local_option_refused(answer: &str) -> Option<LocalOptionRefused> {
    let names_local = answer.contains("`local`") || answer.contains("\"local\"");
    let refuses = ["unknown field", "deprecated", "no longer", "not supported"]
        .iter()
        .any(|word| answer.contains(word));
    (names_local && refuses).then(|| LocalOptionRefused {
        answer: answer.chars().take(512).collect(),
    })
}

/// A cloud-hypervisor refused `local=on` (see [`local_option_refused`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cloud-hypervisor refused `{MEMORY_FDS_OPTION}` ({answer}); {SPOKEN}; {NEWER_EXPECTS}")]
pub struct LocalOptionRefused {
    /// cloud-hypervisor's answer, cut to 512 characters.
    pub answer: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sentence_names_the_constants() {
        for piece in [
            CLOUD_HYPERVISOR_RELEASE,
            CLOUD_HYPERVISOR_COMMIT,
            MEMORY_FDS_OPTION,
            &format!("protocol version {PROTOCOL_VERSION}"),
        ] {
            assert!(SPOKEN.contains(piece), "{SPOKEN} lacks {piece}");
        }
        assert!(NEWER_EXPECTS.contains(NEWER_MEMORY_FDS_OPTION));
    }

    #[test]
    fn a_refused_local_field_names_both_options() {
        let answer = "Error from API: unknown field `local`, expected one of `destination_url`, `memory_mode`";
        let err = local_option_refused(answer).expect("recognised");
        let text = err.to_string();
        for piece in [
            "cloud-hypervisor refused `local=on`",
            CLOUD_HYPERVISOR_RELEASE,
            CLOUD_HYPERVISOR_COMMIT,
            NEWER_MEMORY_FDS_OPTION,
            "unknown field `local`",
        ] {
            assert!(text.contains(piece), "{text} lacks {piece}");
        }
        assert_eq!(
            local_option_refused("Error from API: the VM is not running"),
            None,
            "an answer about something else is left as it is"
        );
    }
}
