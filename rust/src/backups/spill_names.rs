//! The names of named spill files (spill_file.rs, named mode): made exclusively, kept in a process-wide table,
//! removed when their file drops or, for an exit handler, all at once (`unlink_named_files`).
//!
//! A name is removed only if it still leads to the file we made (same device and inode, not followed if it is
//! a symlink), and only by the process that made it: a forked child inherits the table, not the files.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use rustix::fs::{AtFlags, Mode, OFlags, CWD};
use rustix::io::Errno;

/// A named spill file's name, and what tells it from a file put there under the same name by someone else.
struct Name {
    path: PathBuf,
    pid: u32,
    dev: u64,
    ino: u64,
}

impl Name {
    /// Remove the name if it is still the file we made, in the process that made it. Best effort: a name gone
    /// already (the user cleaned the directory) is not an error.
    fn unlink(&self) -> bool {
        if self.pid != std::process::id() {
            return false;
        }
        let ours = rustix::fs::statat(CWD, &self.path, AtFlags::SYMLINK_NOFOLLOW)
            .is_ok_and(|st| st.st_dev == self.dev && st.st_ino == self.ino);
        ours && rustix::fs::unlink(&self.path).is_ok()
    }
}

/// Serials of named files: process-wide, so that two `SpillDir`s of one directory never pick the same name.
static SERIAL: AtomicU64 = AtomicU64::new(0);

/// The named files of this process whose names are still in their directories, by serial.
static NAMED: Mutex<BTreeMap<u64, Name>> = Mutex::new(BTreeMap::new());

fn named() -> MutexGuard<'static, BTreeMap<u64, Name>> {
    NAMED.lock().unwrap_or_else(|p| p.into_inner())
}

/// The name of the file of `serial` made by process `pid` in `dir`.
pub(super) fn name_in(dir: &Path, pid: u32, serial: u64) -> PathBuf {
    dir.join(format!("cumem_rs-{pid}-{serial}.bak"))
}

/// A new file `cumem_rs-<pid>-<serial>.bak` in `dir` (`O_CREAT | O_EXCL | O_NOFOLLOW`: never an existing file,
/// never through a symlink), exactly `mode` whatever the umask, registered; (its descriptor, its serial).
pub(super) fn create(dir: &Path, flags: OFlags, mode: Mode) -> Result<(OwnedFd, u64), Errno> {
    let pid = std::process::id();
    let excl = OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW;
    // A name taken already was left by a killed process of the same pid (or put there by someone): the next.
    for _ in 0..64 {
        let serial = SERIAL.fetch_add(1, Ordering::Relaxed);
        let path = name_in(dir, pid, serial);
        let fd = match rustix::fs::openat(CWD, &path, flags | excl, mode) {
            Ok(fd) => fd,
            Err(Errno::EXIST) => continue,
            Err(e) => return Err(e),
        };
        // A file that cannot be made private (or told apart later) is not used; made just now, exclusively, it
        // is ours to remove.
        let st = rustix::fs::fchmod(&fd, mode).and_then(|()| rustix::fs::fstat(&fd));
        let st = match st {
            Ok(st) => st,
            Err(e) => {
                let _ = rustix::fs::unlink(&path);
                return Err(e);
            }
        };
        let (dev, ino) = (st.st_dev, st.st_ino);
        named().insert(
            serial,
            Name {
                path,
                pid,
                dev,
                ino,
            },
        );
        return Ok((fd, serial));
    }
    Err(Errno::EXIST)
}

/// The file of `serial` dropped: its name goes (unless `unlink_named_files` took it already).
pub(super) fn remove(serial: u64) {
    let name = named().remove(&serial);
    if let Some(name) = name {
        name.unlink();
    }
}

/// Remove the name of every named spill file of this process from its directory (for an exit handler: the
/// interpreter's exit does not drop the backups). The backups stay readable: their files are still open, and
/// their disk space goes back when they are dropped or the process ends. Returns how many names were removed.
pub fn unlink_named_files() -> usize {
    let names = std::mem::take(&mut *named());
    names.values().filter(|n| n.unlink()).count()
}

#[cfg(test)]
mod tests {
    use super::super::spill_file::{PosixIo, SpillDir, IO_ALIGN};
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    #[repr(C, align(4096))]
    struct Block([u8; IO_ALIGN]);

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = (std::fs::read_dir(dir).unwrap())
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    /// One test (the table is process-wide, and `unlink_named_files` takes all of it).
    #[test]
    fn named_files_are_visible_private_exclusive_and_their_names_go_with_them() {
        let dir = std::env::temp_dir().join(format!("cumem-rs-names-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let spill = SpillDir::open(&dir, true).unwrap();
        assert!(names(&dir).is_empty(), "the probe file of open is gone");

        // Visible, 0600, holding what was written; its name goes when it drops.
        let f = spill.create().unwrap();
        let listed = names(&dir);
        assert_eq!(listed.len(), 1);
        let pid = std::process::id();
        assert!(listed[0].starts_with(&format!("cumem_rs-{pid}-")) && listed[0].ends_with(".bak"));
        let meta = std::fs::symlink_metadata(dir.join(&listed[0])).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert!(meta.is_file() && meta.nlink() == 1);
        let mut block = Box::new(Block([6; IO_ALIGN]));
        f.write_all_at(&PosixIo, &block.0, 0).unwrap();
        block.0.fill(0);
        f.read_exact_at(&PosixIo, &mut block.0, 0).unwrap();
        assert!(block.0.iter().all(|b| *b == 6));
        drop(f);
        assert!(names(&dir).is_empty(), "removed with its file");

        // Never through a symlink or over an existing file: the next names taken by links to a victim file.
        let victim = dir.join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        let next = SERIAL.load(Ordering::Relaxed);
        for s in next..next + 4 {
            std::os::unix::fs::symlink(&victim, name_in(&dir, pid, s)).unwrap();
        }
        let f = spill.create().unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        f.write_all_at(&PosixIo, &block.0, 0).unwrap();
        assert_eq!(
            std::fs::read(&victim).unwrap(),
            b"keep",
            "not written through a link"
        );
        drop(f);
        for s in next..next + 4 {
            let link = name_in(&dir, pid, s);
            assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
            std::fs::remove_file(link).unwrap();
        }

        // A name that leads elsewhere by the time the file drops (the user replaced it) is left alone.
        let f = spill.create().unwrap();
        let name = dir.join(&names(&dir)[0]);
        std::fs::remove_file(&name).unwrap();
        std::fs::write(&name, b"theirs").unwrap();
        drop(f);
        assert_eq!(std::fs::read(&name).unwrap(), b"theirs");
        std::fs::remove_file(&name).unwrap();

        // At exit: every name goes at once, and the files stay readable until they drop.
        let (a, b) = (spill.create().unwrap(), spill.create().unwrap());
        let nines = Box::new(Block([9; IO_ALIGN]));
        a.write_all_at(&PosixIo, &nines.0, 0).unwrap();
        assert_eq!(names(&dir).len(), 3, "two files and the victim");
        assert_eq!(unlink_named_files(), 2);
        assert_eq!(names(&dir), ["victim"]);
        let mut out = Box::new(Block([0; IO_ALIGN]));
        a.read_exact_at(&PosixIo, &mut out.0, 0).unwrap();
        assert!(out.0.iter().all(|x| *x == 9));
        drop((a, b));
        assert_eq!(unlink_named_files(), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
