//! The file tier: backups past the host budget (or of tags whose policy says "file") go to an unlinked file in
//! the spill directory through the bounded staging ring (staging.rs), never through a full-size pinned copy.
//!
//! Which tier ("auto", the default): host memory while the budget (and the host RAM guard, pin_ahead.rs) has
//! room, in the order the sleep walks the allocations (address order), and files for the rest. Host first because a host backup restores at the copy
//! link's rate and can be retained across wakes (unchanged chunks are not copied again), while a file backup
//! costs the disk's rate both ways; so the budget is spent first, and only what does not fit pays for the disk.
//! Without a budget, "auto" is the host tier as far as the host can pin; without a spill directory, nothing goes
//! to files (a sleep past the budget or the guard is refused, as before).
//!
//! Sleep: each file-tier allocation is cut into chunks of at most one slot; a slot is filled by a device copy,
//! its marker waited for, then written by one of a few writer threads while the copies of the next slots run.
//! An allocation is released only once all its chunks are written, so after any failure (a copy, a short write,
//! ENOSPC, EIO) each allocation is awake with its data or asleep with a complete backup. Wake: chunks are read
//! into slots by reader threads and copied from there to the device; every copy is waited for before the ring
//! is used again, and a read error fails the wake (which releases what it mapped and keeps the backups).
//!
//! File backups are not retained: the next sleep writes them again (a later step may rewrite changed chunks only).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::Scope;

use super::spill_file::{FaultKind, SpillDir, SpillFile, SpillIo, IO_ALIGN};
use super::{Backup, BackupStore};
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

/// One allocation going to a file: `size` bytes at `addr` on `device`, to `offset` of the file.
#[derive(Debug, Clone, Copy)]
pub struct FileJob {
    pub device: i32,
    pub addr: DevPtr,
    pub size: usize,
    pub offset: u64,
}

/// A sleep's file-tier work, planned (space checked, file created, ring pinned) before anything is released.
pub struct FileSleep {
    file: Arc<SpillFile>,
    ring: Arc<StagingRing>,
    io: Arc<dyn SpillIo>,
    pub jobs: Vec<FileJob>,
}

/// Writer or reader threads doing a pipeline's file I/O; on the calling thread when none can be started.
struct Workers<T, R> {
    tx: Option<Sender<T>>,
    rx: Receiver<R>,
    threads: usize,
    /// Why fewer threads than asked for started (the work then runs on fewer, or on the calling thread).
    refused: Option<Error>,
    /// Results of work done on the calling thread.
    ready: VecDeque<R>,
}

impl<T: Send, R: Send> Workers<T, R> {
    fn start<'s, 'e: 's, W>(
        s: &'s Scope<'s, 'e>,
        n: usize,
        work: &'e W,
        driver: &dyn Driver,
    ) -> Self
    where
        W: Fn(T) -> R + Sync,
        T: 's,
        R: 's,
    {
        let (tx, task_rx) = channel::<T>();
        let (res_tx, rx) = channel::<R>();
        let task_rx = Arc::new(Mutex::new(task_rx));
        let (mut threads, mut refused) = (0, None);
        for i in 0..n {
            if let Err(e) = driver.thread_spawn() {
                refused = Some(e);
                break;
            }
            let (task_rx, res_tx) = (task_rx.clone(), res_tx.clone());
            let body = move || loop {
                let task = task_rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                let Ok(task) = task else { break };
                if res_tx.send(work(task)).is_err() {
                    break;
                }
            };
            match std::thread::Builder::new()
                .name(format!("cumem-spill-io-{i}"))
                .spawn_scoped(s, body)
            {
                Ok(_) => threads += 1,
                Err(e) => {
                    refused = Some(Error::InvalidState(format!(
                        "thread_spawn: the OS refused a new thread: {e}"
                    )));
                    break;
                }
            }
        }
        Workers {
            tx: Some(tx),
            rx,
            threads,
            refused,
            ready: VecDeque::new(),
        }
    }

    fn submit(&mut self, task: T, work: &impl Fn(T) -> R) {
        if self.threads == 0 {
            self.ready.push_back(work(task));
        } else if let Err(e) = self.tx.as_ref().expect("open").send(task) {
            self.ready.push_back(work(e.0)); // no worker left: do it here
        }
    }

    /// A finished task's result: waiting for one when `block`.
    fn next(&mut self, block: bool) -> Option<R> {
        if let Some(r) = self.ready.pop_front() {
            return Some(r);
        }
        if self.threads == 0 {
            return None;
        }
        if block {
            self.rx.recv().ok()
        } else {
            self.rx.try_recv().ok()
        }
    }
}

impl<T, R> Drop for Workers<T, R> {
    fn drop(&mut self) {
        self.tx.take(); // the workers' channel closes: they return and the scope joins them
    }
}

/// I/O threads per pipeline.
const IO_THREADS: usize = 4;

fn io_len(len: usize) -> usize {
    len.next_multiple_of(IO_ALIGN)
}

/// (job, offset in the job, length) of every chunk of `sizes`, at most `slot` bytes each.
fn chunks(sizes: impl Iterator<Item = usize>, slot: usize) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    for (j, size) in sizes.enumerate() {
        let mut at = 0;
        while at < size {
            let len = slot.min(size - at);
            out.push((j, at, len));
            at += len;
        }
    }
    out
}

impl FileSleep {
    /// Copy every job device -> ring -> file. `done` gets each job whose bytes are all written, with its backup
    /// (the caller releases the allocation); after the first failure nothing more is handed to `done`, every copy
    /// and write in flight is waited for, and the failure is returned. Ok: the bytes written. A writer thread
    /// that could not start goes to `refused` (its work ran on the others, or on this thread).
    pub fn write_out(
        &self,
        driver: &dyn Driver,
        refused: &mut Option<Error>,
        mut done: impl FnMut(&FileJob, Backup),
    ) -> Result<usize> {
        let (ring, file, io) = (&*self.ring, &*self.file, &*self.io);
        let chunks = chunks(self.jobs.iter().map(|j| j.size), ring.slot_size());
        let mut remaining = vec![0usize; self.jobs.len()];
        for c in &chunks {
            remaining[c.0] += 1;
        }
        let jobs = &self.jobs;
        let work = |(slot, mem, c): (usize, SlotMem, usize)| {
            let (j, at, len) = chunks[c];
            let r = file.write_all_at(io, mem.bytes(io_len(len)), jobs[j].offset + at as u64);
            (slot, c, r)
        };
        std::thread::scope(|s| {
            let mut workers = Workers::start(s, IO_THREADS.min(ring.slots()), &work, driver);
            *refused = workers.refused.take();
            let mut free: Vec<usize> = (0..ring.slots()).rev().collect();
            let mut copying: VecDeque<(usize, usize, i32, u64)> = VecDeque::new();
            let (mut next, mut pending, mut written) = (0, 0, 0);
            let mut failed: Option<Error> = None;
            let mut finish = |(slot, c, r): (usize, usize, Result<()>),
                              free: &mut Vec<usize>,
                              failed: &mut Option<Error>| {
                free.push(slot);
                let (j, _, len) = chunks[c];
                match r {
                    Err(e) => {
                        failed.get_or_insert(e);
                    }
                    Ok(()) => {
                        written += len;
                        remaining[j] -= 1;
                        if remaining[j] == 0 && failed.is_none() {
                            let job = &jobs[j];
                            done(job, Backup::in_file(&self.file, job.offset, job.size));
                        }
                    }
                }
            };
            loop {
                while failed.is_none() && next < chunks.len() {
                    let Some(slot) = free.pop() else { break };
                    let (j, at, len) = chunks[next];
                    let job = &jobs[j];
                    let queued =
                        ring.queue_from_device(slot, job.device, job.addr + at as u64, len);
                    match queued.and_then(|()| driver.record_marker(job.device)) {
                        Ok(m) => {
                            copying.push_back((slot, next, job.device, m));
                            next += 1;
                        }
                        Err(e) => {
                            let _ = driver.wait(job.device); // a copy queued without a marker behind it
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
}

impl BackupStore {
    // ----- configuration ---------------------------------------------------------------------------------

    /// Set (or with None remove) the spill directory. Backups already in files stay where they are.
    pub fn set_spill_dir(&mut self, path: Option<&Path>) -> Result<()> {
        self.spill = path.map(SpillDir::open).transpose()?.map(Arc::new);
        Ok(())
    }

    pub fn spill_dir(&self) -> Option<PathBuf> {
        self.spill.as_ref().map(|d| d.path().to_path_buf())
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

    /// Test hook: the `nth` next spill-file write (`write`) or read fails with `kind`.
    pub fn inject_spill_fault(&self, write: bool, nth: u64, kind: FaultKind) -> Result<()> {
        self.io.inject(write, nth, kind)
    }

    pub fn clear_spill_faults(&self) {
        self.io.clear();
    }

    fn ring(&mut self, log: &mut ErrorLog) -> Result<Arc<StagingRing>> {
        if let Some(r) = &self.ring {
            return Ok(r.clone());
        }
        let (slot, slots) = StagingRing::shape(self.staging_bytes);
        self.room
            .check(slot * slots, "the file tier's staging ring, refused,")?;
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

    /// Sleep, before anything is released: split `wanted` ((addr, device, size, tier) of the allocations to back
    /// up now, in the sleep's order) into those backed up in host memory (returned) and a planned file sleep for
    /// the rest: space checked, file created, ring pinned. Refused, changing nothing, when a tag asks for files
    /// and no spill directory is set, or the directory has too little space.
    pub fn plan_tiers(
        &mut self,
        wanted: &[(DevPtr, i32, usize, BackupTier)],
        log: &mut ErrorLog,
    ) -> Result<(Vec<DevPtr>, Option<FileSleep>)> {
        // Host room: the budget's, and with a spill directory also what the host RAM guard lets us pin (the
        // cached arena is pinned already; the staging ring, if not yet, is to be), so that "auto" parks more than
        // host RAM instead of being refused.
        let ring = match self.ring {
            Some(_) => 0,
            None => {
                let (slot, slots) = StagingRing::shape(self.staging_bytes);
                slot * slots
            }
        };
        let guard = (self.spill.is_some())
            .then(|| self.room.available())
            .flatten()
            .map(|a| {
                a.saturating_add(self.host.cached_bytes())
                    .saturating_sub(ring)
            });
        let mut room = [self.budget_room(), guard]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(usize::MAX);
        // Host-tier allocations take their room first: they have no other place.
        let forced: usize = (wanted.iter())
            .filter(|w| {
                w.3 == BackupTier::Host || (w.3 == BackupTier::Auto && self.spill.is_none())
            })
            .map(|w| w.2)
            .sum();
        room = room.saturating_sub(forced);
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
        if to_file.is_empty() {
            return Ok((host, None));
        }
        let Some(dir) = self.spill.clone() else {
            return Err(Error::InvalidState(
                "sleep refused before anything was released: a tag's policy asks for backup_tier=\"file\" but no \
                 spill directory is set (set_spill_dir)"
                    .into(),
            ));
        };
        let mut offset = 0u64;
        let jobs: Vec<FileJob> = (to_file.iter())
            .map(|&(addr, device, size)| {
                let j = FileJob {
                    device,
                    addr,
                    size,
                    offset,
                };
                offset += io_len(size) as u64;
                j
            })
            .collect();
        dir.check_space(offset)?;
        let file = Arc::new(dir.create()?);
        let ring = self.ring(log)?;
        Ok((
            host,
            Some(FileSleep {
                file,
                ring,
                io: self.io.clone(),
                jobs,
            }),
        ))
    }

    // ----- wake ------------------------------------------------------------------------------------------

    /// Restore the file backups of `targets` ((device, addr) of mapped, asleep allocations; those with a host
    /// backup are skipped) file -> ring -> device. Every copy it queued is waited for before it returns, failure
    /// or not. Ok: the bytes read.
    pub fn restore_files(
        &mut self,
        driver: &dyn Driver,
        targets: &[(i32, DevPtr)],
        log: &mut ErrorLog,
    ) -> Result<usize> {
        let items: Vec<(i32, DevPtr, &Backup)> = (targets.iter())
            .filter_map(|&(d, a)| self.asleep.get(&a).map(|b| (d, a, b)))
            .filter(|(_, _, b)| b.file().is_some())
            .collect();
        if items.is_empty() {
            return Ok(0);
        }
        let items: Vec<(i32, DevPtr, Backup)> = items
            .into_iter()
            .map(|(d, a, b)| (d, a, b.clone()))
            .collect();
        let ring = self.ring(log)?;
        let io = self.io.clone();
        let mut refused = None;
        let read = read_in(driver, &ring, &*io, &items, &mut refused);
        if let Some(e) = refused {
            log.record(super::THREAD_REFUSED, &e);
        }
        read
    }
}

/// The wake pipeline (see the module comment).
fn read_in(
    driver: &dyn Driver,
    ring: &StagingRing,
    io: &dyn SpillIo,
    items: &[(i32, DevPtr, Backup)],
    refused: &mut Option<Error>,
) -> Result<usize> {
    let chunks = chunks(items.iter().map(|i| i.2.len()), ring.slot_size());
    let work = |(slot, mut mem, c): (usize, SlotMem, usize)| {
        let (j, at, len) = chunks[c];
        let (file, offset) = items[j].2.file().expect("file backups only");
        let r = file.read_exact_at(io, mem.bytes_mut(io_len(len)), offset + at as u64);
        (slot, c, r)
    };
    std::thread::scope(|s| {
        let mut workers = Workers::start(s, IO_THREADS.min(ring.slots()), &work, driver);
        *refused = workers.refused.take();
        let mut free: Vec<usize> = (0..ring.slots()).rev().collect();
        let mut copying: VecDeque<(usize, i32, u64)> = VecDeque::new();
        let (mut next, mut pending, mut read) = (0, 0, 0);
        let mut failed: Option<Error> = None;
        loop {
            while failed.is_none() && next < chunks.len() {
                let Some(slot) = free.pop() else { break };
                workers.submit((slot, ring.slot_mem(slot), next), &work);
                pending += 1;
                next += 1;
            }
            let starved = free.is_empty() && next < chunks.len() && failed.is_none();
            if starved || pending == 0 {
                if let Some((slot, device, marker)) = copying.pop_front() {
                    if let Err(e) = driver.wait_marker(device, marker) {
                        failed.get_or_insert(e);
                    }
                    free.push(slot);
                    continue;
                }
            }
            if pending > 0 {
                let (slot, c, r) = workers.next(true).expect("a read in flight");
                pending -= 1;
                if let Err(e) = r {
                    failed.get_or_insert(e);
                }
                if failed.is_some() {
                    free.push(slot);
                    continue;
                }
                let (j, at, len) = chunks[c];
                let (device, addr, _) = items[j];
                let queued = ring.queue_to_device(slot, device, addr + at as u64, len);
                match queued.and_then(|()| driver.record_marker(device)) {
                    Ok(m) => {
                        read += len;
                        copying.push_back((slot, device, m));
                    }
                    Err(e) => {
                        let _ = driver.wait(device); // a copy queued without a marker behind it
                        free.push(slot);
                        failed.get_or_insert(e);
                    }
                }
                continue;
            }
            break;
        }
        drop(workers);
        failed.map_or(Ok(read), Err)
    })
}
