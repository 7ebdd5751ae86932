//! The spill directory and its files: where backups past the host budget go (file_tier.rs moves the bytes).
//!
//! A spill file is created already unlinked (`O_TMPFILE`, or open-then-unlink where the file system lacks it),
//! mode 0600, so nothing of a backup is readable by other users and a killed process leaves nothing behind: the
//! space is the kernel's to reclaim when the last descriptor closes, which is soon after the last backup in the
//! file is dropped (woken, freed, closed): the close runs on the reclaim thread (spill_reclaim.rs). `O_DIRECT` is tried first (no page-cache copy of what is already in pinned
//! memory); where the file system refuses it, buffered I/O is used and one INFO line says so.
//!
//! Named mode (`SpillDir::open(path, true)`, torch_memory_saver's disk backup: the directory is the user's and
//! they look into it): every file-tier backup gets a file of its own, visible in the directory as
//! `cumem_rs-<pid>-<serial>.bak`, created exclusively (`O_EXCL`, never through a symlink), mode 0600. Its name
//! is removed when its backup is dropped (the `SpillFile` drops: woken without retention, freed, discarded,
//! trimmed, closed), or at interpreter exit by `unlink_named_files` (spill_names.rs). A killed process leaves its named files
//! behind (so does torch_memory_saver); the unnamed default leaves nothing.
//!
//! The file I/O goes through `SpillIo`, so that tests can make a write short, run out of space or fail with EIO
//! at any position of the pipelines (`Faults`).

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use rustix::fs::{Mode, OFlags, CWD};
use rustix::io::Errno;

use super::{spill_names, spill_reclaim, NOTHING_RELEASED};
use crate::error::{Error, Result};

pub use crate::host::staging::IO_ALIGN;

/// The environment variable read into the engine's configuration.
pub const SPILL_DIR_ENV: &str = "CUMEM_RS_SPILL_DIR";

/// A validated spill directory.
pub struct SpillDir {
    path: PathBuf,
    /// False once a file there was refused O_DIRECT (then every later file is buffered, said once).
    direct: AtomicBool,
    files: AtomicU64,
    /// Named mode (see the module comment): a visible file per backup instead of an unlinked one per sleep.
    named: bool,
}

/// Disk a spill file must hold for its close to go to the reclaim thread (spill_reclaim.rs): a smaller one closes
/// in well under a millisecond.
const DEFER_CLOSE_BYTES: u64 = 64 << 20;

/// One spill file: unlinked, a sleep's file-tier backups back to back; or named, one backup.
pub struct SpillFile {
    /// Always there until the drop hands it to the reclaim thread.
    fd: Option<OwnedFd>,
    dir: PathBuf,
    /// Byte ranges no backup holds any more, whose blocks `punch_released` gives back.
    released: Mutex<Vec<(u64, u64)>>,
    /// The serial of a named file (spill_names.rs), whose name is removed from the directory when it drops.
    name: Option<u64>,
}

impl Drop for SpillFile {
    /// The name goes now (the directory shows only live backups); the close, in which the file system frees the
    /// blocks (a second for a few GiB), on the reclaim thread when the file holds many, here otherwise (the
    /// descriptor is free when this returns: a sleep refused at the open-file limit leaves none open).
    fn drop(&mut self) {
        if let Some(serial) = self.name {
            spill_names::remove(serial);
        }
        let Some(fd) = self.fd.take() else { return };
        let blocks = rustix::fs::fstat(&fd).map_or(u64::MAX, |s| s.st_blocks as u64 * 512);
        if blocks >= DEFER_CLOSE_BYTES {
            spill_reclaim::defer(move || drop(fd));
        }
    }
}

impl SpillDir {
    /// `path` if it is an existing directory this process can create files in; else InvalidArgument naming it.
    /// A relative path is made absolute now (against the current directory), so a later `chdir` of the process
    /// does not move the spill files to a directory that was never checked. `named`: named mode (module comment).
    pub fn open(path: &Path, named: bool) -> Result<SpillDir> {
        let bad = |why: &str| Error::invalid(format!("spill_dir {}: {why}", path.display()));
        let absolute = std::path::absolute(path)
            .map_err(|e| bad(&format!("cannot be made absolute ({e})")))?;
        let meta =
            std::fs::metadata(&absolute).map_err(|e| bad(&format!("cannot be used ({e})")))?;
        if !meta.is_dir() {
            return Err(bad("is not a directory"));
        }
        let dir = SpillDir {
            path: absolute,
            direct: AtomicBool::new(true),
            files: AtomicU64::new(0),
            named,
        };
        // Writable (and what kind of files it takes): make one and drop it.
        dir.create()
            .map_err(|e| bad(&format!("no file can be created there ({e})")))?;
        Ok(dir)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether each backup gets a named file of its own (module comment).
    pub fn named(&self) -> bool {
        self.named
    }

    /// Bytes that can still be written there (statvfs: blocks available to unprivileged users).
    pub fn free_bytes(&self) -> Result<u64> {
        let s = rustix::fs::statvfs(&self.path).map_err(|e| {
            Error::InvalidState(format!(
                "statvfs of the spill directory {}: {e}",
                self.path.display()
            ))
        })?;
        Ok(s.f_bavail.saturating_mul(s.f_frsize))
    }

    /// Err(OutOfMemory) when fewer than `needed` bytes can be written there (before anything is released).
    pub fn check_space(&self, needed: u64) -> Result<()> {
        // The blocks of files and holes given back before now count as free: wait for their reclaim.
        spill_reclaim::settle();
        let free = self.free_bytes()?;
        if needed > free {
            return Err(Error::OutOfMemory {
                what: format!(
                    "sleep ({NOTHING_RELEASED}: every allocation stays awake) needs {needed} \
                     bytes in the spill directory {} but only {free} bytes are free there",
                    self.path.display()
                ),
            });
        }
        Ok(())
    }

    /// A new file, mode 0600, with O_DIRECT where the file system takes it: unlinked, or named in named mode.
    pub fn create(&self) -> Result<SpillFile> {
        let err = |e: Errno| {
            let hint = if matches!(e, Errno::MFILE | Errno::NFILE) {
                " (each backup in a named spill file holds an open file: raise the limit, ulimit -n)"
            } else {
                ""
            };
            Error::InvalidState(format!(
                "creating a spill file in {}: {e}{hint}",
                self.path.display()
            ))
        };
        let base = OFlags::RDWR | OFlags::CLOEXEC;
        let mode = Mode::RUSR | Mode::WUSR;
        if self.named {
            return self.create_named(base, mode).map_err(err);
        }
        if self.direct.load(Ordering::Relaxed) {
            match self.open_unlinked(base | OFlags::DIRECT, mode) {
                Ok(fd) => return Ok(self.file(fd, None)),
                Err(Errno::INVAL) | Err(Errno::OPNOTSUPP) => self.say_buffered(),
                Err(e) => return Err(err(e)),
            }
        }
        self.open_unlinked(base, mode)
            .map(|fd| self.file(fd, None))
            .map_err(err)
    }

    /// O_DIRECT was refused here: every later file is buffered; said once.
    fn say_buffered(&self) {
        if self.direct.swap(false, Ordering::Relaxed) {
            log::info!(
                "cumem_rs: the spill directory {} does not take O_DIRECT; using buffered I/O",
                self.path.display()
            );
        }
    }

    /// A named file (module comment). O_DIRECT is set after the open (`fcntl`), not asked of it: a file system
    /// that refuses O_DIRECT refuses it after creating the file, which would leave the name behind.
    fn create_named(&self, flags: OFlags, mode: Mode) -> std::result::Result<SpillFile, Errno> {
        let (fd, serial) = spill_names::create(&self.path, flags, mode)?;
        let file = self.file(fd, Some(serial)); // from here on, dropping `file` removes the name
        if self.direct.load(Ordering::Relaxed) {
            let fl = rustix::fs::fcntl_getfl(file.fd())?;
            match rustix::fs::fcntl_setfl(file.fd(), fl | OFlags::DIRECT) {
                Ok(()) => {}
                Err(Errno::INVAL) | Err(Errno::OPNOTSUPP) => self.say_buffered(),
                Err(e) => return Err(e),
            }
        }
        Ok(file)
    }

    fn file(&self, fd: OwnedFd, name: Option<u64>) -> SpillFile {
        SpillFile {
            fd: Some(fd),
            dir: self.path.clone(),
            released: Mutex::new(Vec::new()),
            name,
        }
    }

    /// O_TMPFILE, or (file systems without it) a fresh name opened exclusively and unlinked at once.
    fn open_unlinked(&self, flags: OFlags, mode: Mode) -> std::result::Result<OwnedFd, Errno> {
        match rustix::fs::openat(CWD, &self.path, flags | OFlags::TMPFILE, mode) {
            Ok(fd) => return Ok(fd),
            Err(Errno::OPNOTSUPP) | Err(Errno::ISDIR) | Err(Errno::NOENT) => {}
            Err(e) => return Err(e),
        }
        let n = self.files.fetch_add(1, Ordering::Relaxed);
        let name = self
            .path
            .join(format!(".cumem-rs-{}-{n}.spill", std::process::id()));
        let fd = rustix::fs::openat(CWD, &name, flags | OFlags::CREATE | OFlags::EXCL, mode)?;
        rustix::fs::unlink(&name)?;
        Ok(fd)
    }
}

impl SpillFile {
    fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd
            .as_ref()
            .expect("a spill file's descriptor goes only when it drops")
            .as_fd()
    }

    /// Give the disk blocks of [offset, offset+len) back (a backup in the file is no longer needed while others
    /// in it still are). Best effort: a file system without hole punching keeps them until the file closes.
    pub fn punch(&self, offset: u64, len: usize) {
        let flags = rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
        let len = len.next_multiple_of(IO_ALIGN) as u64;
        let _ = rustix::fs::fallocate(self.fd(), flags, offset, len);
    }

    /// [offset, offset+len) is no longer needed: its blocks go back at the next `punch_released`. Deferred so that
    /// the ranges one call releases (a wake drops every backup it restored, one by one) are punched as a few
    /// merged runs, or not at all when the file closes first (the last backup in it went): one punch per backup
    /// was measured at about 1 ms each with O_DIRECT on ext4, hundreds of ms per wake of a model's tensors.
    pub fn release(&self, offset: u64, len: usize) {
        let end = offset + len.next_multiple_of(IO_ALIGN) as u64;
        let mut released = self.released.lock().unwrap_or_else(|p| p.into_inner());
        released.push((offset, end));
    }

    /// Whether ranges wait for `punch_released`.
    pub fn has_released(&self) -> bool {
        !self
            .released
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty()
    }

    /// Punch the released ranges, merged where they meet.
    pub fn punch_released(&self) {
        let mut ranges =
            std::mem::take(&mut *self.released.lock().unwrap_or_else(|p| p.into_inner()));
        ranges.sort_unstable();
        let mut run: Option<(u64, u64)> = None;
        for (start, end) in ranges {
            match &mut run {
                Some(r) if start <= r.1 => r.1 = r.1.max(end),
                _ => {
                    if let Some((s, e)) = run.replace((start, end)) {
                        self.punch(s, (e - s) as usize);
                    }
                }
            }
        }
        if let Some((s, e)) = run {
            self.punch(s, (e - s) as usize);
        }
    }

    /// Allocate the disk blocks of the first `len` bytes now (`fallocate`), before a sleep releases anything: the
    /// space `check_space` saw cannot be taken by another writer meanwhile, and the blocks of one sleep lie in few
    /// extents (no extent blocks beside the data). OutOfMemory on ENOSPC; where the file system cannot
    /// preallocate, the blocks are allocated as the writes come (the statvfs check stands).
    pub fn reserve(&self, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        match rustix::fs::fallocate(self.fd(), rustix::fs::FallocateFlags::empty(), 0, len) {
            Err(Errno::NOSPC) => Err(Error::OutOfMemory {
                what: format!(
                    "sleep ({NOTHING_RELEASED}: every allocation stays awake) needs {len} \
                     bytes in the spill directory {}, which could not be allocated there (ENOSPC)",
                    self.dir.display()
                ),
            }),
            _ => Ok(()),
        }
    }

    /// Bytes of disk the file takes now (blocks allocated), for tests of the space given back.
    #[cfg(test)]
    pub fn disk_bytes(&self) -> u64 {
        rustix::fs::fstat(self.fd()).map_or(0, |s| s.st_blocks as u64 * 512)
    }

    /// Write all of `buf` at `offset` through `io`; a write that makes no progress is an error.
    pub fn write_all_at(&self, io: &dyn SpillIo, buf: &[u8], offset: u64) -> Result<()> {
        let mut done = 0;
        while done < buf.len() {
            match io.write_at(self, &buf[done..], offset + done as u64) {
                Ok(0) => {
                    return Err(self.io_error(
                        "write",
                        offset,
                        buf.len(),
                        Errno::IO,
                        "wrote 0 bytes",
                    ))
                }
                Ok(n) => done += n,
                Err(Errno::INTR) => {}
                Err(e) => return Err(self.io_error("write", offset, buf.len(), e, "")),
            }
        }
        Ok(())
    }

    /// Fill all of `buf` from `offset` through `io`; an end of file before that is an error.
    pub fn read_exact_at(&self, io: &dyn SpillIo, buf: &mut [u8], offset: u64) -> Result<()> {
        let mut done = 0;
        while done < buf.len() {
            let len = buf.len();
            match io.read_at(self, &mut buf[done..], offset + done as u64) {
                Ok(0) => return Err(self.io_error("read", offset, len, Errno::IO, "end of file")),
                Ok(n) => done += n,
                Err(Errno::INTR) => {}
                Err(e) => return Err(self.io_error("read", offset, len, e, "")),
            }
        }
        Ok(())
    }

    fn io_error(&self, op: &str, offset: u64, len: usize, e: Errno, note: &str) -> Error {
        let what = format!(
            "spill file in {}: {op} of {len} bytes at offset {offset} failed: {e}{}{note}",
            self.dir.display(),
            if note.is_empty() { "" } else { ", " }
        );
        if e == Errno::NOSPC {
            Error::OutOfMemory { what }
        } else {
            Error::InvalidState(what)
        }
    }
}

/// The store's file I/O: positional reads and writes of a spill file (`pwrite`/`pread`), behind a trait so that
/// tests can put faults in the way.
pub trait SpillIo: Send + Sync {
    fn write_at(
        &self,
        file: &SpillFile,
        buf: &[u8],
        offset: u64,
    ) -> std::result::Result<usize, Errno>;
    fn read_at(
        &self,
        file: &SpillFile,
        buf: &mut [u8],
        offset: u64,
    ) -> std::result::Result<usize, Errno>;
}

/// The plain system calls.
pub struct PosixIo;

impl SpillIo for PosixIo {
    fn write_at(
        &self,
        file: &SpillFile,
        buf: &[u8],
        offset: u64,
    ) -> std::result::Result<usize, Errno> {
        rustix::io::pwrite(file.fd(), buf, offset)
    }

    fn read_at(
        &self,
        file: &SpillFile,
        buf: &mut [u8],
        offset: u64,
    ) -> std::result::Result<usize, Errno> {
        rustix::io::pread(file.fd(), buf, offset)
    }
}

/// What an injected fault does to the call it hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The call moves half the bytes asked for, then the next call of the same operation moves none.
    Short,
    /// ENOSPC (writes) or EIO.
    NoSpace,
    Eio,
}

impl FaultKind {
    pub const NAMES: [&'static str; 3] = ["short", "enospc", "eio"];

    pub fn parse(name: &str) -> Result<FaultKind> {
        match name {
            "short" => Ok(FaultKind::Short),
            "enospc" => Ok(FaultKind::NoSpace),
            "eio" => Ok(FaultKind::Eio),
            _ => Err(Error::invalid(format!(
                "spill fault error must be one of {:?}, got {name:?}",
                FaultKind::NAMES
            ))),
        }
    }
}

/// Which call a fault hits: the `nth` next write (or read) of any spill file.
struct Armed {
    write: bool,
    nth: u64,
    kind: FaultKind,
    /// A short transfer happened: the next call of this operation makes no progress.
    stalled: bool,
}

/// `SpillIo` with faults injected around `inner` (tests; nothing is armed otherwise and the calls pass through).
pub struct Faults<I> {
    inner: I,
    armed: Mutex<Vec<Armed>>,
    any: AtomicBool,
}

impl<I: SpillIo> Faults<I> {
    pub fn new(inner: I) -> Self {
        Faults {
            inner,
            armed: Mutex::new(Vec::new()),
            any: AtomicBool::new(false),
        }
    }

    /// Make the `nth` (1 = next) write (`write`) or read fail with `kind`.
    pub fn inject(&self, write: bool, nth: u64, kind: FaultKind) -> Result<()> {
        if nth == 0 {
            return Err(Error::invalid("nth must be at least 1"));
        }
        self.armed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Armed {
                write,
                nth,
                kind,
                stalled: false,
            });
        self.any.store(true, Ordering::Release);
        Ok(())
    }

    pub fn clear(&self) {
        self.armed.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.any.store(false, Ordering::Release);
    }

    /// What the armed faults make of this call: None to pass it through, Some(Ok(n)) to cut it to `n` bytes.
    fn hit(&self, write: bool, len: usize) -> Option<std::result::Result<usize, Errno>> {
        if !self.any.load(Ordering::Acquire) {
            return None;
        }
        let mut armed = self.armed.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = None;
        armed.retain_mut(|a| {
            if a.write != write || out.is_some() {
                return true;
            }
            if a.stalled {
                out = Some(Ok(0));
                return false;
            }
            a.nth -= 1;
            if a.nth > 0 {
                return true;
            }
            out = Some(match a.kind {
                FaultKind::Short => {
                    a.stalled = true;
                    Ok(len / 2 / IO_ALIGN * IO_ALIGN) // still aligned, as O_DIRECT wants
                }
                FaultKind::NoSpace if write => Err(Errno::NOSPC),
                _ => Err(Errno::IO),
            });
            a.stalled
        });
        out
    }
}

impl<I: SpillIo> SpillIo for Faults<I> {
    fn write_at(
        &self,
        file: &SpillFile,
        buf: &[u8],
        offset: u64,
    ) -> std::result::Result<usize, Errno> {
        match self.hit(true, buf.len()) {
            None => self.inner.write_at(file, buf, offset),
            Some(Ok(n)) => self.inner.write_at(file, &buf[..n], offset),
            Some(Err(e)) => Err(e),
        }
    }

    fn read_at(
        &self,
        file: &SpillFile,
        buf: &mut [u8],
        offset: u64,
    ) -> std::result::Result<usize, Errno> {
        match self.hit(false, buf.len()) {
            None => self.inner.read_at(file, buf, offset),
            Some(Ok(n)) => self.inner.read_at(file, &mut buf[..n], offset),
            Some(Err(e)) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// Two I/O blocks, aligned as O_DIRECT wants.
    #[repr(C, align(4096))]
    struct Blocks([u8; 2 * IO_ALIGN]);

    fn temp_dir(name: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("cumem-rs-spill-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        p
    }

    #[test]
    fn files_are_unlinked_private_and_hold_what_was_written() {
        let p = temp_dir("private");
        let dir = SpillDir::open(&p, false).unwrap();
        let f = dir.create().unwrap();
        assert_eq!(
            std::fs::read_dir(&p).unwrap().count(),
            0,
            "unlinked at creation"
        );
        let meta = std::fs::File::from(f.fd().try_clone_to_owned().unwrap())
            .metadata()
            .unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600, "readable by this user only");
        assert_eq!(meta.nlink(), 0);
        let mut page = Box::new(Blocks([7; 2 * IO_ALIGN]));
        f.write_all_at(&PosixIo, &page.0, IO_ALIGN as u64).unwrap();
        page.0.fill(0);
        f.read_exact_at(&PosixIo, &mut page.0, IO_ALIGN as u64)
            .unwrap();
        assert!(page.0.iter().all(|b| *b == 7));
        std::fs::remove_dir_all(&p).unwrap();
    }

    /// Descriptors of this process open on files in `dir` (unlinked ones read as "dir/#inode (deleted)").
    fn open_in(dir: &Path) -> usize {
        let prefix = format!("{}/", dir.display());
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|t| t.to_string_lossy().starts_with(&prefix))
            .count()
    }

    #[test]
    fn a_small_file_closes_when_it_drops_and_a_large_one_once_the_reclaim_settles() {
        let p = temp_dir("reclaim");
        let dir = SpillDir::open(&p, false).unwrap();
        let small = dir.create().unwrap();
        small.reserve(IO_ALIGN as u64).unwrap();
        drop(small);
        assert_eq!(open_in(&p), 0, "a small file is closed by its drop");
        let large = dir.create().unwrap();
        large.reserve(DEFER_CLOSE_BYTES).unwrap();
        if large.disk_bytes() < DEFER_CLOSE_BYTES {
            // No preallocation here: the file holds no blocks, so it closes at once like a small one.
            std::fs::remove_dir_all(&p).unwrap();
            return;
        }
        drop(large);
        spill_reclaim::settle();
        assert_eq!(open_in(&p), 0, "the reclaim thread closed the large file");
        std::fs::remove_dir_all(&p).unwrap();
    }

    #[test]
    fn punched_ranges_give_their_disk_blocks_back() {
        let p = temp_dir("punch");
        let f = SpillDir::open(&p, false).unwrap().create().unwrap();
        // Allocated whole first, as a sleep does: written piece by piece into a fragmented file system, the file
        // could need an extent block once punched (measured on ext4: one more 4 KiB block than the data).
        f.reserve((16 * IO_ALIGN) as u64).unwrap();
        let page = Box::new(Blocks([3; 2 * IO_ALIGN]));
        for i in 0..8 {
            f.write_all_at(&PosixIo, &page.0, (i * 2 * IO_ALIGN) as u64)
                .unwrap();
        }
        let full = f.disk_bytes();
        assert!(full >= (16 * IO_ALIGN) as u64, "{full}");
        f.punch(0, 8 * IO_ALIGN);
        assert!(
            f.disk_bytes() <= full - (8 * IO_ALIGN) as u64,
            "{} of {full}",
            f.disk_bytes()
        );
        std::fs::remove_dir_all(&p).unwrap();
    }

    #[test]
    fn released_ranges_keep_their_blocks_until_punched_as_merged_runs() {
        let p = temp_dir("release");
        let f = SpillDir::open(&p, false).unwrap().create().unwrap();
        f.reserve((8 * IO_ALIGN) as u64).unwrap();
        let page = Box::new(Blocks([9; 2 * IO_ALIGN]));
        for i in 0..4 {
            f.write_all_at(&PosixIo, &page.0, (i * 2 * IO_ALIGN) as u64)
                .unwrap();
        }
        let full = f.disk_bytes();
        // Out of order, one of them not a whole block: [0, 3 blocks) and [3, 5 blocks) meet.
        f.release(3 * IO_ALIGN as u64, 2 * IO_ALIGN);
        f.release(0, 3 * IO_ALIGN - 100);
        assert_eq!(
            f.disk_bytes(),
            full,
            "nothing punched before punch_released"
        );
        f.punch_released();
        // Where the data starts again, not the blocks allocated: an extent block may come with the hole.
        let data = rustix::fs::seek(f.fd(), rustix::fs::SeekFrom::Data(0)).unwrap();
        assert_eq!(data, 5 * IO_ALIGN as u64, "[0, 5 blocks) punched");
        assert!(f.disk_bytes() < full, "{} of {full}", f.disk_bytes());
        let mut out = Box::new(Blocks([0; 2 * IO_ALIGN]));
        f.read_exact_at(&PosixIo, &mut out.0, 6 * IO_ALIGN as u64)
            .unwrap();
        assert!(
            out.0.iter().all(|b| *b == 9),
            "the blocks not released hold their bytes"
        );
        std::fs::remove_dir_all(&p).unwrap();
    }

    #[test]
    fn a_reserved_file_holds_its_blocks_before_any_write() {
        let p = temp_dir("reserve");
        let f = SpillDir::open(&p, false).unwrap().create().unwrap();
        f.reserve(0).unwrap();
        assert_eq!(f.disk_bytes(), 0);
        f.reserve((64 * IO_ALIGN) as u64).unwrap();
        assert!(
            f.disk_bytes() >= (64 * IO_ALIGN) as u64,
            "{}",
            f.disk_bytes()
        );
        let page = Box::new(Blocks([5; 2 * IO_ALIGN]));
        f.write_all_at(&PosixIo, &page.0, 0).unwrap();
        f.punch(0, 64 * IO_ALIGN);
        assert!(
            f.disk_bytes() < (64 * IO_ALIGN) as u64,
            "punched: {}",
            f.disk_bytes()
        );
        std::fs::remove_dir_all(&p).unwrap();
    }

    #[test]
    fn bad_directories_and_too_little_space_are_refused_naming_the_path() {
        let p = temp_dir("bad");
        let missing = p.join("missing");
        let err = SpillDir::open(&missing, false).err().unwrap();
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains("missing")),
            "{err}"
        );
        let file = p.join("plain");
        std::fs::write(&file, b"x").unwrap();
        let err = SpillDir::open(&file, false).err().unwrap();
        assert!(err.to_string().contains("not a directory"), "{err}");
        let dir = SpillDir::open(&p, false).unwrap();
        assert!(dir.free_bytes().unwrap() > 0);
        let err = dir.check_space(u64::MAX).unwrap_err();
        assert!(
            matches!(&err, Error::OutOfMemory { what } if what.contains("spill directory")),
            "{err}"
        );
        std::fs::remove_dir_all(&p).unwrap();
    }

    #[test]
    fn faults_hit_the_nth_call_of_their_operation_once() {
        let p = temp_dir("faults");
        let f = SpillDir::open(&p, false).unwrap().create().unwrap();
        let io = Faults::new(PosixIo);
        let buf = &Box::new(Blocks([1; 2 * IO_ALIGN])).0;
        io.inject(true, 2, FaultKind::Eio).unwrap();
        assert!(f.write_all_at(&io, buf, 0).is_ok(), "first write passes");
        assert!(
            matches!(f.write_all_at(&io, buf, 0), Err(Error::InvalidState(m)) if m.contains("write"))
        );
        assert!(f.write_all_at(&io, buf, 0).is_ok(), "a fault fires once");
        io.inject(true, 1, FaultKind::NoSpace).unwrap();
        assert!(matches!(
            f.write_all_at(&io, buf, 0),
            Err(Error::OutOfMemory { .. })
        ));
        io.inject(true, 1, FaultKind::Short).unwrap();
        let err = f.write_all_at(&io, buf, 0).unwrap_err();
        assert!(
            err.to_string().contains("wrote 0 bytes"),
            "a short write then no progress: {err}"
        );
        io.inject(false, 1, FaultKind::Eio).unwrap();
        let out = &mut Box::new(Blocks([0; 2 * IO_ALIGN])).0;
        assert!(f.read_exact_at(&io, out, 0).is_err());
        io.clear();
        f.read_exact_at(&io, out, 0).unwrap();
        assert!(FaultKind::parse("disk-on-fire").is_err());
        std::fs::remove_dir_all(&p).unwrap();
    }
}
