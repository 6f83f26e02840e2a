//! Whether the directory of a control socket keeps the socket the
//! launcher's: no other uid may be able to rename, replace or remove it.
//!
//! A uid that can write the socket's directory can rename the launcher's
//! socket away and bind its own at the name; `hugemem update` would then talk
//! to it, and the launcher, at its end, would remove that uid's file. The
//! rules, like sshd's `StrictModes`, for every directory from the socket's
//! up to `/`, as the path is given and as it resolves (symlinks followed):
//!
//! * it belongs to root or to the launcher's uid;
//! * the socket's own directory is writable by nobody else: no group or other
//!   write bit, sticky or not. The sticky bit would stop others renaming the
//!   launcher's socket, but not binding the name while no launch listens on
//!   it (before it starts, after it ends), and `hugemem update` may run then;
//! * a directory above it may be writable by others only with the sticky bit
//!   (like `/tmp`): there no other uid can rename or remove an entry it does
//!   not own, and every entry on the way belongs to root or the launcher.
//!
//! A group write bit counts as "others" whatever the group's members: the
//! launcher cannot tell who may join the group later.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// A control socket's directory that fails the checks, or cannot be examined.
#[derive(Debug, thiserror::Error)]
pub enum SocketDirError {
    /// The directory would let another uid take the socket.
    #[error(
        "control socket directory {dir} (owner uid {owner}, mode {mode:04o}) {why}: another \
         user could replace the socket and receive `hugemem update` requests; put the socket \
         in a directory only you or root can write (e.g. `mkdir -m 0700`), or use --name"
    )]
    Unsafe {
        /// The directory that fails.
        dir: PathBuf,
        /// Its owner.
        owner: u32,
        /// Its permission bits.
        mode: u32,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A directory on the way cannot be examined.
    #[error("control socket directory {path}: {source}")]
    Examine {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Write permission for the group and others.
const GROUP_OR_OTHER_WRITE: u32 = 0o022;
/// The sticky bit (`S_ISVTX`).
const STICKY: u32 = 0o1000;

/// Checks `dir`, the directory a control socket is about to be bound in,
/// and every directory above it, for the launcher of uid `euid`.
///
/// # Errors
///
/// [`SocketDirError::Unsafe`] naming the first directory that fails, its
/// owner and mode; [`SocketDirError::Examine`] when one cannot be examined.
pub(crate) fn check_socket_dir(dir: &Path, euid: u32) -> Result<(), SocketDirError> {
    fn examine(path: &Path) -> impl FnOnce(std::io::Error) -> SocketDirError + '_ {
        move |source| SocketDirError::Examine {
            path: path.to_owned(),
            source,
        }
    }
    let given = if dir.is_absolute() {
        dir.to_owned()
    } else {
        std::env::current_dir().map_err(examine(dir))?.join(dir)
    };
    let resolved = std::fs::canonicalize(&given).map_err(examine(&given))?;
    for chain in [&given, &resolved] {
        for (depth, each) in chain.ancestors().enumerate() {
            let meta = std::fs::metadata(each).map_err(examine(each))?;
            if let Some(why) = unsafe_because(meta.uid(), meta.mode(), euid, depth == 0) {
                return Err(SocketDirError::Unsafe {
                    dir: PathBuf::from(each),
                    owner: meta.uid(),
                    mode: meta.mode() & 0o7777,
                    why,
                });
            }
        }
    }
    Ok(())
}

/// Why a directory of owner `owner` and mode `mode` would let another uid
/// take a launcher's socket, `None` when it would not. `own`: the socket's
/// own directory (else one above it).
fn unsafe_because(owner: u32, mode: u32, euid: u32, own: bool) -> Option<&'static str> {
    if owner != 0 && owner != euid {
        return Some("belongs to another user");
    }
    let others_write = mode & GROUP_OR_OTHER_WRITE != 0;
    if own && others_write {
        return Some("is writable by its group or by others");
    }
    if others_write && mode & STICKY == 0 {
        return Some("is writable by its group or by others, without the sticky bit");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn who_may_write_where() {
        let me = 1000;
        // The socket's own directory: only root's or mine, writable by no one else.
        assert_eq!(unsafe_because(me, 0o40700, me, true), None);
        assert_eq!(unsafe_because(0, 0o40755, me, true), None);
        assert!(unsafe_because(65534, 0o40700, me, true).is_some());
        assert!(unsafe_because(me, 0o40770, me, true).is_some());
        assert!(unsafe_because(me, 0o41777, me, true).is_some());
        // Above it: others may write only under the sticky bit.
        assert_eq!(unsafe_because(0, 0o41777, me, false), None);
        assert!(unsafe_because(0, 0o40777, me, false).is_some());
        assert!(unsafe_because(65534, 0o41777, me, false).is_some());
        // Root's launcher trusts only root's directories.
        assert!(unsafe_because(me, 0o40700, 0, true).is_some());
    }

    #[test]
    fn a_private_directory_under_tmp_passes_and_an_open_one_fails() {
        let dir = tempfile::tempdir().expect("tempdir");
        let euid = nix::unistd::geteuid().as_raw();
        check_socket_dir(dir.path(), euid).expect("a private directory under a sticky one");
        let open = dir.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .expect("chmod");
        let below = open.join("private");
        std::fs::create_dir(&below).expect("mkdir");
        for (checked, failing) in [(&open, &open), (&below, &open)] {
            match check_socket_dir(checked, euid) {
                Err(SocketDirError::Unsafe { dir, mode, .. }) => {
                    assert_eq!(&dir, failing);
                    assert_eq!(mode, 0o777);
                }
                other => panic!("{checked:?}: {other:?}"),
            }
        }
    }
}
