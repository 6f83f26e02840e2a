//! The daemon's socket file: bound with its permissions, replaced when
//! stale, and removed at shutdown only while it is still this daemon's.

use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;

use tracing::warn;

use crate::daemon::process::error::{DaemonError, Result};

/// Binds the socket: creates the parent directory (0700) when missing,
/// replaces a stale socket nobody answers on, refuses to replace a live one
/// or a non-socket, and sets mode 0600 before anyone is told it exists.
/// Returns the listener and the socket file's (dev, inode), so shutdown
/// removes only its own file.
pub(crate) fn bind_socket(
    path: &Path,
    group: Option<u32>,
) -> Result<(tokio::net::UnixListener, (u64, u64))> {
    let bind_err = |source: io::Error| DaemonError::Bind {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        if !dir.as_os_str().is_empty() && !dir.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(bind_err)?;
            if let Some(gid) = group {
                // Members of the socket group may traverse it, not list it.
                std::os::unix::fs::chown(dir, None, Some(gid))
                    .and_then(|()| {
                        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o710))
                    })
                    .map_err(bind_err)?;
            }
        }
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            match std::os::unix::net::UnixStream::connect(path) {
                Ok(_) => return Err(DaemonError::AlreadyRunning(path.to_path_buf())),
                Err(e) => {
                    warn!(socket = %path.display(), error = %e, "removing a stale socket (a daemon that did not shut down cleanly?)");
                    std::fs::remove_file(path).map_err(bind_err)?;
                }
            }
        }
        Ok(_) => return Err(DaemonError::NotASocket(path.to_path_buf())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(bind_err(e)),
    }
    let std_listener = std::os::unix::net::UnixListener::bind(path).map_err(bind_err)?;
    // The socket is born with the process umask: `hugemem serve` sets 077
    // (the packaged unit too, UMask=0077), so it is 0600 from the bind on,
    // even in the unit's RuntimeDirectory (0711: traversable by all, for
    // socket_group). The chmod below makes the mode hold whatever the
    // umask, and every connection's uid is checked (SO_PEERCRED) anyway.
    let mode = if group.is_some() { 0o660 } else { 0o600 };
    let secured = group
        .map_or(Ok(()), |gid| {
            std::os::unix::fs::chown(path, None, Some(gid))
        })
        .and_then(|()| std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)))
        .and_then(|()| std_listener.set_nonblocking(true))
        .and_then(|()| std::fs::metadata(path));
    let meta = match secured {
        Ok(m) => m,
        Err(e) => {
            let _ = std::fs::remove_file(path);
            return Err(bind_err(e));
        }
    };
    let listener = tokio::net::UnixListener::from_std(std_listener).map_err(bind_err)?;
    Ok((listener, (meta.dev(), meta.ino())))
}

/// Removes the socket file if it is still the one this daemon created;
/// `None` (a socket systemd passed) is never removed.
pub(crate) fn remove_socket(path: &Path, id: Option<(u64, u64)>) {
    let Some(id) = id else {
        return;
    };
    match std::fs::symlink_metadata(path) {
        Ok(m) if (m.dev(), m.ino()) == id => {
            if let Err(e) = std::fs::remove_file(path) {
                warn!(socket = %path.display(), error = %e, "cannot remove the socket");
            }
        }
        Ok(_) => {
            warn!(socket = %path.display(), "socket file was replaced by someone else; leaving it")
        }
        Err(_) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_socket_is_replaced_and_a_file_is_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s.sock");
        drop(std::os::unix::net::UnixListener::bind(&path).expect("bind"));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("rt");
        let _g = rt.enter();
        let (l, id) = bind_socket(&path, None).expect("stale socket replaced");
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(matches!(
            bind_socket(&path, None),
            Err(DaemonError::AlreadyRunning(_))
        ));
        drop(l);
        remove_socket(&path, Some(id));
        assert!(!path.exists());
        std::fs::write(&path, b"x").expect("file");
        assert!(matches!(
            bind_socket(&path, None),
            Err(DaemonError::NotASocket(_))
        ));
    }
}
