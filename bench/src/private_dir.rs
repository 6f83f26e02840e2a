//! A private (mode 0700) temporary directory, removed with everything in it
//! on drop: where `demo` and `bench compare` put their daemon's socket and
//! guest image, so no other user can reach them.

use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// See the module docs.
#[derive(Debug)]
pub(crate) struct PrivateDir(PathBuf);

impl PrivateDir {
    /// Creates `$TMPDIR/<prefix>-<pid>` (replacing a stale one of ours).
    pub(crate) fn create(prefix: &str) -> io::Result<Self> {
        Self::create_in(&std::env::temp_dir(), prefix)
    }

    /// Creates `<parent>/<prefix>-<pid>` (replacing a stale one of ours).
    pub(crate) fn create_in(parent: &Path, prefix: &str) -> io::Result<Self> {
        let path = parent.join(format!("{prefix}-{}", std::process::id()));
        // A directory with our pid in its name is a leftover of an earlier
        // process with the same pid: nothing can be using it.
        let _ = std::fs::remove_dir_all(&path);
        std::fs::DirBuilder::new().mode(0o700).create(&path)?;
        Ok(Self(path))
    }

    /// The directory.
    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn private_and_removed_on_drop() {
        let dir = PrivateDir::create("hugemem-private-dir-test").expect("create");
        let path = dir.path().to_path_buf();
        std::fs::write(path.join("f"), b"x").expect("write");
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        drop(dir);
        assert!(!path.exists());
    }
}
