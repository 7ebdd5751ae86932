//! The file tier: backups past the host budget (or of tags whose policy says "file") go to an unlinked file in
//! the spill directory through the bounded staging ring (staging.rs), never through a full-size pinned copy. In
//! named mode (spill_file.rs) each backup goes to a named file of its own instead, through the same pipelines.
//! Allocations of tags that compress go through the codec on their way (file_packed.rs): the file then holds
//! the blobs.
//!
//! Which tier ("auto", the default): host memory while the budget (and the host RAM guard, pin_ahead.rs) has
//! room, in the order the sleep walks the allocations (address order), and files for the rest. Host first
//! because a host backup restores at the copy link's rate, while a file backup costs the disk's rate at every
//! wake (both kinds are retained: a sleep copies or writes only changed chunks); so the budget is spent first,
//! and only what does not fit pays for the disk.
//! Without a budget, "auto" is the host tier as far as the host can pin; without a spill directory, nothing goes
//! to files (a sleep past the budget or the guard is refused, as before).
//!
//! Sleep: each file-tier allocation is cut into chunks of at most one slot; a slot is filled by a device copy,
//! its marker waited for, then written by one of a few writer threads while the copies of the next slots run.
//! An allocation is released only once all its chunks are written, so after any failure (a copy, a short write,
//! ENOSPC, EIO) each allocation is awake with its data or asleep with a complete backup. Wake (file_wake.rs):
//! chunks are read into slots by reader threads and copied from there to the device; every copy is waited for
//! before the ring is used again, and a read error fails the wake (which releases what it mapped and keeps the
//! backups).
//!
//! Retained file backups (retain.rs): a file backup a wake restored from stays bound to its allocation (its disk
//! blocks kept), and the next sleep writes only the chunks whose prints changed, device -> ring -> file at their
//! offsets (`FileRewrites`), each allocation released once its changed chunks are written; after a failure the
//! others stay awake and their retained backups, possibly half rewritten, are dropped.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::file_packed::{write_packed, FileCodec, PackedJob};
use super::io_workers::{io_len, Workers, IO_THREADS};
use super::spill_file::{FaultKind, SpillDir, SpillFile, SpillIo, IO_ALIGN};
use super::{slot_plan, spill_reclaim};
use super::{Backup, BackupStore, NOTHING_RELEASED};
use crate::driver::codec::DataKind;
use crate::driver::{DevPtr, Driver};
use crate::error::{Error, Result};
use crate::error_log::ErrorLog;
use crate::host::staging::{SlotMem, StagingRing};

/// Where a tag's backups go.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BackupTier {
    /// Pinned host memory (refused past the host budget).
    Host,
    /// A file in the spill directory.
    File,
    /// Host memory up to the budget, files for the rest (see the module comment).
    #[default]
    Auto,
}

impl BackupTier {
    pub const NAMES: [&'static str; 3] = ["host", "file", "auto"];

    pub fn name(self) -> &'static str {
        match self {
            BackupTier::Host => "host",
            BackupTier::File => "file",
            BackupTier::Auto => "auto",
        }
    }

    pub fn parse(name: &str) -> Result<BackupTier> {
        match name {
            "host" => Ok(BackupTier::Host),
            "file" => Ok(BackupTier::File),
            "auto" => Ok(BackupTier::Auto),
            _ => Err(Error::invalid(format!(
                "backup_tier must be one of {:?}, got {name:?}",
                BackupTier::NAMES
            ))),
        }
    }
}

/// One allocation going to a file: `size` bytes at `addr` on `device`, to `offset` of its file.
#[derive(Debug, Clone, Copy)]
pub struct FileJob {
    pub device: i32,
    pub addr: DevPtr,
    pub size: usize,
    pub offset: u64,
    /// Compressed as this kind of data (file_packed.rs), where the sleep's codec allows it (`FileSleep::compresses`);
    /// None: raw bytes. The engine sets it from the tag's policy.
    pub kind: Option<DataKind>,
}

/// A sleep's file-tier work, planned (space checked, file created, ring pinned) before anything is released.
pub struct FileSleep {
    /// The file of each job: one shared by all (unlinked), or one each (named mode).
    files: Vec<Arc<SpillFile>>,
    ring: Arc<StagingRing>,
    io: Arc<dyn SpillIo>,
    pub jobs: Vec<FileJob>,
    /// The codec of compressed jobs: None when the store does not compress (no codec, compression off, a
    /// fingerprint chunk the codec or a staging slot cannot take).
    codec: Option<FileCodec>,
}

impl FileSleep {
    /// Job `j`'s raw write.
    fn piece(&self, j: usize) -> Piece<'_> {
        let job = &self.jobs[j];
        Piece {
            file: &self.files[j],
            device: job.device,
            addr: job.addr,
            size: job.size,
            offset: job.offset,
        }
    }

    /// Write the jobs `which` raw (`write_pieces`), marking each in `handed` as `done` gets it with its backup.
    fn write_raw(
        &self,
        driver: &dyn Driver,
        which: &[usize],
        refused: &mut Option<Error>,
        handed: &mut [bool],
        done: &mut impl FnMut(&FileJob, Backup),
    ) -> Result<usize> {
        let pieces: Vec<Piece> = which.iter().map(|&j| self.piece(j)).collect();
        write_pieces(driver, &self.ring, &*self.io, &pieces, refused, |p| {
            let j = which[p];
            handed[j] = true;
            let job = &self.jobs[j];
            done(job, Backup::in_file(&self.files[j], job.offset, job.size))
        })
    }

    /// Whether jobs given a `kind` are compressed (else every job is written raw, whatever its kind).
    pub fn compresses(&self) -> bool {
        self.codec.is_some()
    }

    /// Copy every job device -> ring -> file (compressed ones through the codec: file_packed.rs). `done` gets each
    /// job whose bytes are all written, with its backup (the caller releases the allocation); after the first
    /// failure nothing more is handed to `done`, every copy and write in flight is waited for, the blocks already
    /// written for the jobs not handed over are given back (their allocations stay awake), and the failure is
    /// returned. Ok: the bytes written. A writer thread that could not start goes to `refused` (its work ran on
    /// the others, or on this thread). A failure of the codec (or of its prints) is no failure of the sleep: the
    /// compressed jobs not yet handed over are written raw, and the codec's error goes to `fell_back`.
    pub fn write_out(
        &self,
        driver: &dyn Driver,
        refused: &mut Option<Error>,
        fell_back: &mut Option<Error>,
        mut done: impl FnMut(&FileJob, Backup),
    ) -> Result<usize> {
        let packed_of = |j: &FileJob| j.kind.filter(|_| self.codec.is_some());
        let (raw, packed): (Vec<usize>, Vec<usize>) =
            (0..self.jobs.len()).partition(|&j| packed_of(&self.jobs[j]).is_none());
        let mut handed = vec![false; self.jobs.len()];
        let mut written = self.write_raw(driver, &raw, refused, &mut handed, &mut done);
        if let (Ok(raw_written), Some(codec)) =
            (&written, self.codec.filter(|_| !packed.is_empty()))
        {
            let jobs: Vec<PackedJob> = (packed.iter())
                .map(|&j| {
                    let job = &self.jobs[j];
                    PackedJob {
                        file: &self.files[j],
                        device: job.device,
                        addr: job.addr,
                        size: job.size,
                        offset: job.offset,
                        kind: packed_of(job).expect("partitioned on it"),
                    }
                })
                .collect();
            let (mut also_refused, mut codec_failed) = (None, false);
            let raw_written = *raw_written;
            let packed_written = write_packed(
                driver,
                (&self.ring, &*self.io),
                &jobs,
                codec,
                &mut also_refused,
                &mut codec_failed,
                |p, b| {
                    let j = packed[p];
                    handed[j] = true;
                    done(&self.jobs[j], b)
                },
            );
            if refused.is_none() {
                *refused = also_refused;
            }
            written = match packed_written {
                Ok(n) => Ok(raw_written + n),
                Err(e) if codec_failed => {
                    // Their reserved blocks take the raw bytes (the compressed frames written there are
                    // overwritten).
                    *fell_back = Some(e);
                    let rest: Vec<usize> = packed.iter().copied().filter(|&j| !handed[j]).collect();
                    self.write_raw(driver, &rest, &mut None, &mut handed, &mut done)
                        .map(|n| raw_written + n)
                }
                Err(e) => Err(e),
            };
        }
        // No backup (`FileRegion`) holds the blocks of a job not handed over, and no write is in flight any more:
        // released (punched at the end of the sleep), or they would stay on disk as long as a backup that did go
        // to sleep keeps the file open. (A named file of its own goes, name and all, when this plan drops.)
        for ((job, file), _) in (self.jobs.iter().zip(&self.files))
            .zip(&handed)
            .filter(|(_, h)| !**h)
        {
            file.release(job.offset, job.size);
        }
        written
    }
}

/// A retained file backup whose allocation sleeps again: the runs (offset, length in the allocation) whose chunk
/// prints changed, widened to whole I/O blocks (`align_runs`), go device -> ring -> file at their offsets in it.
pub struct FileRewrite {
    pub addr: DevPtr,
    pub device: i32,
    pub backup: Backup,
    pub runs: Vec<(usize, usize)>,
}

/// A sleep's rewrites of retained file backups, with the ring had (see `BackupStore::plan_rewrites`).
pub struct FileRewrites {
    ring: Arc<StagingRing>,
    io: Arc<dyn SpillIo>,
    items: Vec<FileRewrite>,
}

impl FileRewrites {
    /// Write the changed runs of every item, then hand `done` each allocation with its backup (the caller
    /// releases it): those with no changed runs always (their backup is complete as it is), the others only when
    /// every write succeeded. After a failure every copy and write in flight is waited for and the failure is
    /// returned; the allocations not handed over stay awake and the caller drops their retained backups, which
    /// may be half rewritten. Ok: the bytes written.
    pub fn write_out(
        self,
        driver: &dyn Driver,
        refused: &mut Option<Error>,
        mut done: impl FnMut(DevPtr, Backup),
    ) -> Result<usize> {
        let items = self.items;
        let mut pieces = Vec::new();
        // Those without changed runs (a compressed one among them, file_packed.rs) are kept as they are.
        for it in items.iter().filter(|it| !it.runs.is_empty()) {
            let (file, base) = it.backup.file().expect("raw file backups only (retain.rs)");
            for &(off, len) in &it.runs {
                pieces.push(Piece {
                    file,
                    device: it.device,
                    addr: it.addr + off as u64,
                    size: len,
                    offset: base + off as u64,
                });
            }
        }
        let result = write_pieces(driver, &self.ring, &*self.io, &pieces, refused, |_| {});
        // The pieces borrow the items' files. Handed over: unchanged ones (nothing written), and all the others
        // only after a pipeline without failure.
        drop(pieces);
        for it in items {
            if it.runs.is_empty() || result.is_ok() {
                done(it.addr, it.backup);
            }
        }
        result
    }
}

/// `runs` (offset, length; sorted, disjoint) inside an allocation of `size` bytes, widened to whole I/O blocks
/// (O_DIRECT writes whole aligned blocks, and a write of part of a block would take the rest of the slot's
/// stale bytes with it) and merged where they meet. A widened run copies the device's current bytes around the
/// changed ones: equal to the backup's where nothing changed. Its end is clamped to `size` (the file's block
/// padding past it belongs to this backup).
pub fn align_runs(runs: &[(usize, usize)], size: usize) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for &(off, len) in runs {
        let lo = off / IO_ALIGN * IO_ALIGN;
        let hi = (off + len).next_multiple_of(IO_ALIGN).min(size);
        match out.last_mut() {
            Some(last) if last.0 + last.1 >= lo => last.1 = hi.max(last.0 + last.1) - last.0,
            _ => out.push((lo, hi - lo)),
        }
    }
    out
}

/// One piece of a write pipeline: `size` device bytes at `addr` on `device`, to `offset` of `file`.
struct Piece<'a> {
    file: &'a SpillFile,
    device: i32,
    addr: DevPtr,
    size: usize,
    offset: u64,
}

/// The sleep pipeline (see the module comment): every piece device -> ring -> file, slot by slot (slot_plan.rs:
/// pieces back to back in a file share a slot's write); `done(i)` once all of piece `i` is written, never after
/// the first failure (every copy and write in flight is still waited for, and the failure returned). Ok: the
/// bytes written.
fn write_pieces(
    driver: &dyn Driver,
    ring: &StagingRing,
    io: &dyn SpillIo,
    pieces: &[Piece],
    refused: &mut Option<Error>,
    mut done: impl FnMut(usize),
) -> Result<usize> {
    let items: Vec<slot_plan::Item> = (pieces.iter())
        .map(|p| slot_plan::Item::in_file(p.file, p.device, p.offset, p.size))
        .collect();
    let slots = slot_plan::plan(&items, ring.slot_size());
    let mut remaining = slot_plan::segments_per_item(&slots, pieces.len());
    let work = |(slot, mem, c): (usize, SlotMem, usize)| {
        let s = &slots[c];
        let r = pieces[s.item()]
            .file
            .write_all_at(io, mem.bytes(s.len), s.offset);
        (slot, c, r)
    };
    std::thread::scope(|scope| {
        let mut workers = Workers::start(scope, IO_THREADS.min(ring.slots()), &work, driver);
        *refused = workers.refused.take();
        let mut free: Vec<usize> = (0..ring.slots()).rev().collect();
        let mut copying: VecDeque<(usize, usize, i32, u64)> = VecDeque::new();
        let (mut next, mut pending, mut written) = (0, 0, 0);
        let mut failed: Option<Error> = None;
        let mut finish = |(slot, c, r): (usize, usize, Result<()>),
                          free: &mut Vec<usize>,
                          failed: &mut Option<Error>| {
            free.push(slot);
            match r {
                Err(e) => {
                    failed.get_or_insert(e);
                }
                Ok(()) => {
                    for seg in &slots[c].segments {
                        written += seg.len;
                        remaining[seg.item] -= 1;
                        if remaining[seg.item] == 0 && failed.is_none() {
                            done(seg.item);
                        }
                    }
                }
            }
        };
        loop {
            while failed.is_none() && next < slots.len() {
                let Some(slot) = free.pop() else { break };
                let s = &slots[next];
                let queued = s.segments.iter().try_for_each(|g| {
                    let p = &pieces[g.item];
                    ring.queue_from_device(slot, g.slot_off, s.device, p.addr + g.at as u64, g.len)
                });
                match queued.and_then(|()| driver.record_marker(s.device)) {
                    Ok(m) => {
                        copying.push_back((slot, next, s.device, m));
                        next += 1;
                    }
                    Err(e) => {
                        let _ = driver.wait(s.device); // copies queued without a marker behind them
                        free.push(slot);
                        failed = Some(e);
                    }
                }
            }
            if let Some((slot, c, device, marker)) = copying.pop_front() {
                if let Err(e) = driver.wait_marker(device, marker) {
                    failed.get_or_insert(e);
                }
                if failed.is_some() {
                    free.push(slot);
                } else {
                    workers.submit((slot, ring.slot_mem(slot), c), &work);
                    pending += 1;
                }
                while let Some(r) = workers.next(false) {
                    pending -= 1;
                    finish(r, &mut free, &mut failed);
                }
                continue;
            }
            if pending > 0 {
                let r = workers.next(true).expect("a write in flight");
                pending -= 1;
                finish(r, &mut free, &mut failed);
                continue;
            }
            break;
        }
        drop(workers);
        failed.map_or(Ok(written), Err)
    })
}

impl BackupStore {
    // ----- configuration ---------------------------------------------------------------------------------

    /// Set (or with None remove) the spill directory, in named mode or not (spill_file.rs). Backups already in
    /// files stay where they are.
    pub fn set_spill_dir(&mut self, path: Option<&Path>, named: bool) -> Result<()> {
        self.spill = (path.map(|p| SpillDir::open(p, named)))
            .transpose()?
            .map(Arc::new);
        Ok(())
    }

    pub fn spill_dir(&self) -> Option<PathBuf> {
        self.spill.as_ref().map(|d| d.path().to_path_buf())
    }

    /// Whether the spill directory is in named mode (false without one).
    pub fn spill_named(&self) -> bool {
        self.spill.as_ref().is_some_and(|d| d.named())
    }

    /// The staging ring's size (at least one I/O block); the ring is pinned anew at its next use.
    pub fn set_staging_bytes(&mut self, bytes: usize) -> Result<()> {
        if bytes < IO_ALIGN {
            return Err(Error::invalid(format!(
                "the staging ring needs at least {IO_ALIGN} bytes, got {bytes}"
            )));
        }
        self.staging_bytes = bytes;
        self.ring = None;
        Ok(())
    }

    pub fn staging_bytes(&self) -> usize {
        self.staging_bytes
    }

    /// Pinned bytes of the staging ring now (0 until the file tier is first used, and after `trim`).
    pub fn staging_held(&self) -> usize {
        self.ring.as_ref().map_or(0, |r| r.bytes())
    }

    /// Bytes of the backups of asleep allocations that are in files.
    pub fn file_bytes(&self) -> usize {
        self.file_bytes
    }

    /// Bytes of the file blocks those backups take (less where they are compressed: file_packed.rs).
    pub fn file_stored_bytes(&self) -> usize {
        self.file_stored
    }

    /// Punch the ranges of spill files that no backup holds any more (see `SpillFile::release`), on the reclaim
    /// thread (spill_reclaim.rs: the file system frees the blocks as it punches, as slowly as at a close); forget
    /// the files that closed.
    pub(super) fn punch_released(&mut self) {
        let mut punch = Vec::new();
        self.files.retain(|f| match f.upgrade() {
            Some(file) => {
                if file.has_released() {
                    punch.push(file);
                }
                true
            }
            None => false,
        });
        if !punch.is_empty() {
            spill_reclaim::defer(move || punch.iter().for_each(|f| f.punch_released()));
        }
    }

    /// Test hook: the `nth` next spill-file write (`write`) or read fails with `kind`.
    pub fn inject_spill_fault(&self, write: bool, nth: u64, kind: FaultKind) -> Result<()> {
        self.io.inject(write, nth, kind)
    }

    pub fn clear_spill_faults(&self) {
        self.io.clear();
    }

    pub(super) fn ring(&mut self, log: &mut ErrorLog) -> Result<Arc<StagingRing>> {
        if let Some(r) = &self.ring {
            return Ok(r.clone());
        }
        let (slot, slots) = StagingRing::shape(self.staging_bytes);
        (self.room).check(
            slot * slots,
            self.resident(),
            "the file tier's staging ring, refused,",
        )?;
        let (ring, fallback) = StagingRing::new(&self.driver, self.staging_bytes)?;
        if let Some(e) = fallback {
            log.record(
                "pinning the staging ring (served by the fallback allocation)",
                &e,
            );
        }
        let ring = Arc::new(ring);
        self.ring = Some(ring.clone());
        Ok(ring)
    }

    // ----- sleep -----------------------------------------------------------------------------------------

    /// Whether the retained backup of `addr` lies in the other tier than `tier` asks for: in a file for "host",
    /// in host memory for "file". The sleep then drops it and makes a fresh backup where the policy says.
    pub fn retained_in_other_tier(&self, addr: DevPtr, tier: BackupTier) -> bool {
        match tier {
            BackupTier::Host => self.is_retained_in_file(addr),
            BackupTier::File => self.is_retained(addr) && !self.is_retained_in_file(addr),
            BackupTier::Auto => false,
        }
    }

    /// Sleep, before anything is released: split `wanted` ((addr, device, size, tier) of the allocations to back
    /// up now, in the sleep's order) into those backed up in host memory (returned) and a planned file sleep for
    /// the rest: space checked, file created and its blocks allocated, ring pinned. Refused, changing nothing,
    /// when a tag asks for files and no spill directory is set, or the directory has too little space.
    pub fn plan_tiers(
        &mut self,
        wanted: &[(DevPtr, i32, usize, BackupTier)],
        log: &mut ErrorLog,
    ) -> Result<(Vec<DevPtr>, Option<FileSleep>)> {
        if self.spill.is_some() && wanted.iter().any(|w| w.3 == BackupTier::Auto) {
            // A buffer being pinned ahead is this sleep's to take (`arena_for_sleep` would stop the worker too):
            // stopped now, its pinned cells count as host room the sleep has, not as memory the host lost.
            self.stop_pin_ahead(log);
        }
        // Arenas that retained backups dropped by this sleep left unused no longer count against the budget.
        self.give_back_unused(log);
        // First without the staging ring, which is pinned only when something goes to a file: with the ring's
        // room set aside from the start, a sleep that fits in host memory would spill the ring's size for nothing.
        let (mut host, mut to_file) = self.split_tiers(wanted, self.host_room(0));
        if !to_file.is_empty() && self.ring.is_none() {
            let (slot, slots) = StagingRing::shape(self.staging_bytes);
            (host, to_file) = self.split_tiers(wanted, self.host_room(slot * slots));
        }
        if to_file.is_empty() {
            return Ok((host, None));
        }
        let Some(dir) = self.spill.clone() else {
            return Err(Error::InvalidState(format!(
                "sleep {NOTHING_RELEASED}: a tag's policy asks for backup_tier=\"file\" but no spill directory is \
                 set (set_spill_dir)"
            )));
        };
        // Unlinked: the jobs back to back in one file. Named: each at the start of a file of its own.
        let mut offset = 0u64;
        let jobs: Vec<FileJob> = (to_file.iter())
            .map(|&(addr, device, size)| {
                let j = FileJob {
                    device,
                    addr,
                    size,
                    offset: if dir.named() { 0 } else { offset },
                    kind: None,
                };
                offset += io_len(size) as u64;
                j
            })
            .collect();
        dir.check_space(offset)?;
        let files = if dir.named() {
            // Made (and their blocks allocated) before anything is released; a refusal drops those made, names
            // and all.
            let mut files = Vec::with_capacity(jobs.len());
            for j in &jobs {
                let file = Arc::new(dir.create()?);
                file.reserve(io_len(j.size) as u64)?;
                files.push(file);
            }
            files
        } else {
            let file = Arc::new(dir.create()?);
            file.reserve(offset)?;
            self.files.push(Arc::downgrade(&file));
            vec![file; jobs.len()]
        };
        let ring = self.ring(log)?;
        let chunk = self.retention.chunk;
        let codec = (self.compressing() && chunk <= ring.slot_size()).then(|| FileCodec {
            chunk,
            host_decode: self.host_decode(),
        });
        Ok((
            host,
            Some(FileSleep {
                files,
                ring,
                io: self.io.clone(),
                jobs,
                codec,
            }),
        ))
    }

    /// Host bytes "auto" may give this sleep's backups, `ring` bytes set aside for a staging ring still to pin:
    /// the budget's room beside the arenas in use and, with a spill directory, what the host RAM guard lets us
    /// pin (the cached arena's pinned cells are had already), so that "auto" parks more than host RAM instead of
    /// being refused; or, under a budget, the largest hole of an arena in use (bound.rs), if that is more.
    fn host_room(&self, ring: usize) -> usize {
        let guard = (self.spill.is_some())
            .then(|| self.room.available(self.resident()))
            .flatten()
            .map(|a| {
                a.saturating_add(self.host.cached_pinned_bytes())
                    .saturating_sub(ring)
            });
        let fresh = [self.budget_room(), guard]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(usize::MAX);
        let hole = if self.budget.is_some() {
            self.largest_hole()
        } else {
            0
        };
        fresh.max(hole)
    }

    /// `wanted` split into host-tier allocations and (addr, device, size) of file-tier ones, "auto" ones taking
    /// host memory in order while `room` lasts.
    fn split_tiers(
        &self,
        wanted: &[(DevPtr, i32, usize, BackupTier)],
        room: usize,
    ) -> (Vec<DevPtr>, Vec<(DevPtr, i32, usize)>) {
        // Host-tier allocations take their room first: they have no other place.
        let forced: usize = (wanted.iter())
            .filter(|w| {
                w.3 == BackupTier::Host || (w.3 == BackupTier::Auto && self.spill.is_none())
            })
            .map(|w| w.2)
            .sum();
        let mut room = room.saturating_sub(forced);
        let (mut host, mut to_file) = (Vec::new(), Vec::new());
        for &(addr, device, size, tier) in wanted {
            let file = match tier {
                BackupTier::Host => false,
                BackupTier::File => true,
                BackupTier::Auto if self.spill.is_none() => false,
                BackupTier::Auto if size <= room => {
                    room -= size;
                    false
                }
                BackupTier::Auto => true,
            };
            if file {
                to_file.push((addr, device, size));
            } else {
                host.push(addr);
            }
        }
        (host, to_file)
    }

    /// Sleep, once the prints are compared: the rewrites of retained file backups (retain.rs), with the staging
    /// ring had. None when there are none.
    pub fn plan_rewrites(
        &mut self,
        items: Vec<FileRewrite>,
        log: &mut ErrorLog,
    ) -> Result<Option<FileRewrites>> {
        if items.is_empty() {
            return Ok(None);
        }
        let ring = self.ring(log)?;
        Ok(Some(FileRewrites {
            ring,
            io: self.io.clone(),
            items,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: usize = IO_ALIGN;

    #[test]
    fn changed_runs_widen_to_whole_blocks_merge_and_stop_at_the_allocation_end() {
        // Aligned runs stay as they are.
        assert_eq!(
            align_runs(&[(0, B), (4 * B, 2 * B)], 8 * B),
            [(0, B), (4 * B, 2 * B)]
        );
        // 16-byte chunks inside one block become that block; neighbours in the same block merge.
        assert_eq!(align_runs(&[(16, 16), (48, 16)], 8 * B), [(0, B)]);
        // Runs that meet once widened merge into one.
        assert_eq!(align_runs(&[(B - 16, 16), (B, 16)], 8 * B), [(0, 2 * B)]);
        // The last run ends at the allocation's end, not past it.
        assert_eq!(align_runs(&[(B + 100, 8)], B + 200), [(B, 200)]);
        assert!(align_runs(&[], B).is_empty());
    }
}
