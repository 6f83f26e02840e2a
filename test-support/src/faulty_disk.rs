//! A disk that fails on cue, for the tests of I/O errors: an ext4
//! filesystem on a loop device, mounted in a private directory. There is
//! no device-mapper on the test hosts, so the failure is made by cutting
//! the device short: the loop device's backing file is truncated and the
//! device told its new size (`losetup -c`), after which every read or
//! write of a block past the cut fails with `EIO`, while the filesystem
//! still believes in its full size. Page caches are dropped first, so
//! reads really go to the device.
//!
//! * reads: [`FaultyDisk::fail_reads_of`] cuts the device where a file's
//!   byte lies (found with `filefrag`'s `FIEMAP`): that byte and the rest
//!   of the file past it read `EIO` (bytes before it still read);
//! * writes: [`FaultyDisk::fail_writes_after`] cuts the device `n` bytes
//!   past where the filesystem puts new data (found with a probe file):
//!   a writer gets `EIO` (at `fsync`, or at `write` once the journal
//!   failed) after about `n` bytes.
//!
//! The guard always tears down: unmount (lazily when something still
//! holds the mount), `losetup -d`, and the image removed with its
//! directory. Needs root, `losetup`, `mkfs.ext4` and `filefrag`
//! (util-linux, e2fsprogs); without them [`FaultyDisk::new`] records a
//! skip and returns `None`.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::Command;

/// An ext4 filesystem on a loop device that can be made to fail (see the
/// module docs).
pub struct FaultyDisk {
    /// The image's directory, removed last.
    _dir: tempfile::TempDir,
    image: PathBuf,
    device: String,
    mount: PathBuf,
}

/// Runs `program args`; its stdout, or why it failed.
fn run(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{program} {args:?}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Why this host cannot have a faulty disk, if it cannot.
fn missing() -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (loop devices and mounts)".into());
    }
    for (tool, arg, package) in [
        ("losetup", "--version", "util-linux"),
        ("mkfs.ext4", "-V", "e2fsprogs"),
        ("filefrag", "-V", "e2fsprogs"),
        ("blockdev", "--version", "util-linux"),
    ] {
        if Command::new(tool).arg(arg).output().is_err() {
            return Some(format!("no {tool} (install {package})"));
        }
    }
    None
}

impl FaultyDisk {
    /// A fresh ext4 filesystem of `size` bytes (at least 16 MiB) on a loop
    /// device, mounted in a new private directory; `None` after recording
    /// a skip of `test` where the host cannot have one.
    ///
    /// Up to 128 MiB the filesystem is one block group: a directory's
    /// small files then lie before the data of a large file written after
    /// them, so a cut in that file leaves them readable. On a larger one
    /// ext4 spreads directories over groups; check with
    /// [`FaultyDisk::device_offset`].
    ///
    /// # Panics
    ///
    /// When a step fails on a host that has every tool.
    pub fn new(size: u64, test: &str) -> Option<Self> {
        if let Some(why) = missing() {
            crate::skip!("{test}: {why}");
            return None;
        }
        let dir = tempfile::Builder::new()
            .prefix("hugemem-faulty-disk-")
            .tempdir()
            .expect("a directory for the image");
        let image = dir.path().join("disk.img");
        std::fs::File::create(&image)
            .and_then(|f| f.set_len(size.max(16 << 20)))
            .expect("the image file");
        let image_s = image.to_string_lossy().into_owned();
        // No journal: a journal block past the cut would fail every write at
        // once, not the writes past the cut.
        run("mkfs.ext4", &["-q", "-F", "-O", "^has_journal", &image_s]).expect("mkfs.ext4");
        let device = match run("losetup", &["--find", "--show", &image_s]) {
            Ok(d) => d.trim().to_string(),
            Err(why) => {
                crate::skip!("{test}: no free loop device: {why}");
                return None;
            }
        };
        let mount = dir.path().join("mnt");
        std::fs::create_dir(&mount).expect("the mount point");
        let disk = Self {
            _dir: dir,
            image,
            device,
            mount,
        };
        let m = disk.mount.to_string_lossy().into_owned();
        run("mount", &["-t", "ext4", &disk.device, &m]).expect("mount the loop device");
        Some(disk)
    }

    /// Where the filesystem is mounted.
    pub fn path(&self) -> &Path {
        &self.mount
    }

    /// The loop device (`/dev/loopN`).
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Where byte `offset` of `file` (on this disk) lies on the device
    /// (`filefrag -v -b1`: its extents, by `FIEMAP`), after `sync`.
    ///
    /// # Panics
    ///
    /// When the byte is in no extent (a hole, past the end).
    pub fn device_offset(&self, file: &Path, offset: u64) -> u64 {
        run("sync", &[]).expect("sync");
        let path = file.to_string_lossy().into_owned();
        let out = run("filefrag", &["-v", "-b1", &path]).expect("filefrag");
        // "   0:        0.. 6291455:   10486784..  16778239: 6291456: ..."
        for line in out.lines() {
            let fields: Vec<&str> = line.split(':').map(str::trim).collect();
            if fields.len() < 4 || fields[0].parse::<u64>().is_err() {
                continue;
            }
            let range = |s: &str| -> Option<(u64, u64)> {
                let (a, b) = s.split_once("..")?;
                Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
            };
            let (Some((lo, hi)), Some((phys, _))) = (range(fields[1]), range(fields[2])) else {
                continue;
            };
            if (lo..=hi).contains(&offset) {
                return phys + (offset - lo);
            }
        }
        panic!("byte {offset} of {path} is in no extent:\n{out}")
    }

    /// Drops what the kernel caches of this disk: every file's pages
    /// (`POSIX_FADV_DONTNEED`, after `sync`) and the device's buffers, so
    /// the next reads go to the device.
    pub fn drop_caches(&self) {
        run("sync", &[]).expect("sync");
        let mut dirs = vec![self.mount.clone()];
        while let Some(dir) = dirs.pop() {
            for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let path = e.path();
                match e.file_type() {
                    Ok(t) if t.is_dir() => dirs.push(path),
                    Ok(t) if t.is_file() => {
                        if let Ok(f) = std::fs::File::open(&path) {
                            let _ = nix::fcntl::posix_fadvise(
                                f.as_fd(),
                                0,
                                0,
                                nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
                            );
                        }
                    }
                    _ => {}
                }
            }
        }
        run("blockdev", &["--flushbufs", &self.device]).expect("blockdev --flushbufs");
    }

    /// Cuts the device at `device_offset` (rounded down to 4 KiB): every
    /// block from there on fails with `EIO`. Caches are dropped first.
    pub fn fail_from(&self, device_offset: u64) {
        self.drop_caches();
        let at = device_offset / 4096 * 4096;
        std::fs::OpenOptions::new()
            .write(true)
            .open(&self.image)
            .and_then(|f| f.set_len(at))
            .expect("truncate the backing file");
        run("losetup", &["-c", &self.device]).expect("losetup -c");
        self.drop_caches();
    }

    /// Makes byte `offset` of `file` and every later block of the device
    /// fail (see [`FaultyDisk::fail_from`]); returns the device offset of
    /// the cut. The file's bytes that lie before it still read.
    pub fn fail_reads_of(&self, file: &Path, offset: u64) -> u64 {
        let at = self.device_offset(file, offset);
        self.fail_from(at);
        at
    }

    /// Makes writes fail after about `bytes` more bytes of new data: the
    /// device is cut `bytes` past where the filesystem puts a new file's
    /// data now (a probe file, written, located and removed). Returns the
    /// device offset of the cut.
    pub fn fail_writes_after(&self, bytes: u64) -> u64 {
        let probe = self.mount.join(".faulty-disk-probe");
        std::fs::write(&probe, vec![0xA5u8; 4096]).expect("the probe file");
        std::fs::File::open(&probe)
            .and_then(|f| f.sync_all())
            .expect("fsync the probe");
        let start = self.device_offset(&probe, 0);
        std::fs::remove_file(&probe).expect("remove the probe");
        let at = start + bytes;
        self.fail_from(at);
        at
    }
}

impl Drop for FaultyDisk {
    fn drop(&mut self) {
        let m = self.mount.to_string_lossy().into_owned();
        if run("umount", &[&m]).is_err() {
            // Something still holds it (a daemon's fd of a file on it):
            // detach it now, the kernel lets go when the last user does.
            let _ = run("umount", &["-l", &m]);
        }
        let _ = run("losetup", &["-d", &self.device]);
        // The image goes with `_dir`, removed after this.
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    use super::FaultyDisk;

    const MIB: usize = 1 << 20;

    #[test]
    fn reads_past_the_cut_fail_and_reads_before_it_do_not() {
        let Some(disk) = FaultyDisk::new(64 << 20, "faulty_disk::reads") else {
            return;
        };
        let file = disk.path().join("memory");
        std::fs::write(&file, vec![7u8; 8 * MIB]).expect("write");
        disk.fail_reads_of(&file, 2 * MIB as u64);
        let f = std::fs::File::open(&file).expect("open");
        let mut buf = vec![0u8; 4096];
        f.read_exact_at(&mut buf, 0)
            .expect("a byte before the cut reads");
        assert!(buf.iter().all(|&b| b == 7));
        let e = f
            .read_exact_at(&mut buf, 2 * MIB as u64)
            .expect_err("the byte at the cut fails");
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    }

    #[test]
    fn writes_fail_after_the_bytes_allowed() {
        let Some(disk) = FaultyDisk::new(64 << 20, "faulty_disk::writes") else {
            return;
        };
        disk.fail_writes_after(4 * MIB as u64);
        let mut f = std::fs::File::create(disk.path().join("saved")).expect("create");
        let chunk = vec![1u8; MIB];
        let mut failed = None;
        for i in 0..32 {
            if let Err(e) = f.write_all(&chunk).and_then(|()| f.sync_data()) {
                failed = Some((i, e));
                break;
            }
        }
        let (at, e) = failed.expect("a write past the cut fails");
        eprintln!("the write of MiB {at} failed: {e}");
        assert!(at >= 1, "the first MiB was written before the cut");
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    }
}
