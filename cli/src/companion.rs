//! A companion binary of `hugemem`: another program of the project installed
//! in the same directory (`hugemem-bench` beside `hugemem`, and the other way
//! round), found there first and then on `PATH`, so that a build tree
//! (`target/release/`) and an installed package both work without `PATH`
//! set up for them.

use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// The companion is neither beside the running executable nor on `PATH`.
#[derive(Debug, thiserror::Error)]
#[error("cannot find {name}: it is not beside {} and not on PATH", .beside.as_ref().map_or_else(|| "this executable".to_string(), |d| d.display().to_string()))]
pub struct NotFound {
    /// The program looked for.
    pub name: String,
    /// The running executable's directory (`None` when it cannot be told).
    pub beside: Option<PathBuf>,
}

/// The executable file `name` beside the running executable, else the first
/// on `PATH`.
///
/// # Errors
///
/// [`NotFound`] when neither has it.
pub fn find(name: &str) -> Result<PathBuf, NotFound> {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(Path::to_path_buf));
    let path = std::env::var_os("PATH").unwrap_or_default();
    find_in(name, beside.as_deref(), &path).ok_or(NotFound {
        name: name.to_string(),
        beside,
    })
}

/// [`find`] over an explicit directory and `PATH` value.
fn find_in(name: &str, beside: Option<&Path>, path: &OsString) -> Option<PathBuf> {
    beside
        .into_iter()
        .map(Path::to_path_buf)
        .chain(std::env::split_paths(path))
        // An empty PATH entry means the current directory to a shell; a
        // companion is never looked for there.
        .filter(|dir| !dir.as_os_str().is_empty())
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable_file(candidate))
}

fn is_executable_file(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn executable(dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, "#!/bin/sh\n").expect("write");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        p
    }

    #[test]
    fn beside_first_then_path_and_never_a_plain_file() {
        let beside = tempfile::tempdir().expect("tempdir");
        let on_path = tempfile::tempdir().expect("tempdir");
        let path = std::env::join_paths([on_path.path()]).expect("PATH");
        assert_eq!(find_in("x", Some(beside.path()), &path), None);
        let via_path = executable(on_path.path(), "x");
        assert_eq!(find_in("x", Some(beside.path()), &path), Some(via_path));
        let near = executable(beside.path(), "x");
        assert_eq!(find_in("x", Some(beside.path()), &path), Some(near));
        std::fs::write(on_path.path().join("y"), "not executable").expect("write");
        assert_eq!(find_in("y", None, &path), None);
    }
}
