//! The file tier's wake pipeline: file backups come back file -> staging ring -> device, with the reads of
//! several slots in flight while the copies of earlier slots run.
//!
//! Steps and what each waits for (one coordinating thread, `IO_THREADS` reader threads):
//! - every free slot gets a read at once (the readers take them in order; a slot is one read of the file, of
//!   one or several backups back to back there: slot_plan.rs);
//! - the coordinator waits for whichever read finishes first; before the first copy into an allocation it calls
//!   the caller's `before_copy` (the engine maps the allocation there, so that its maps run while the readers
//!   read instead of ahead of every read), then queues the slot's copy to the device and a marker behind it,
//!   and goes back to waiting for reads: the copy of slot k never waits for the read of slot k+1;
//! - only when every slot is reading or copying does it wait for the oldest copy's marker, and that slot takes
//!   the next read (a slot is never read into while a copy out of it may run).
//!
//! A read error, a failed copy or a failed `before_copy` stops new work; every read and copy in flight is waited
//! for, and the failure is returned (the engine's wake then releases what it mapped and keeps the backups).
//! `FileWakeTimes` says where the coordinator's time went, for the wake's report.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use super::file_packed::{restore_packed_files, FilePacked};
use super::io_workers::{Workers, IO_THREADS};
use super::slot_plan;
use super::spill_file::SpillIo;
use super::{Backup, BackupStore};
use crate::driver::{DevPtr, Driver};
use crate::error::{Error, Result};
use crate::error_log::ErrorLog;
use crate::host::staging::{SlotMem, StagingRing};

/// Where a wake's file pipeline spent its time (seconds of the coordinating thread; they add up to about the
/// pipeline's `file_seconds`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FileWakeTimes {
    /// Waiting for a file read to finish with nothing else to do: the disk's share (high = read-bound).
    pub read_wait_seconds: f64,
    /// Queueing the ring -> device copies and waiting for them before their slot could take the next read (high
    /// = copy-bound; on the simulated driver, whose copies are done as they are queued, the copies themselves).
    /// Compressed file backups (file_packed.rs): the codec's restores out of the ring and their verification.
    pub copy_seconds: f64,
    /// In the caller's `before_copy` (the engine's maps), while the reads in flight went on.
    pub before_copy_seconds: f64,
}

/// What `BackupStore::restore_files` did: the bytes read from files, the raw bytes restored (more than those read
/// where backups were compressed: file_packed.rs), of which compressed, and where the time went.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FileRestored {
    pub bytes: usize,
    pub raw: usize,
    /// (raw bytes, bytes read) of the compressed backups.
    pub compressed: (usize, usize),
    pub times: FileWakeTimes,
}

/// A wake's file restores, planned: the backups to read (shared with the asleep set, which keeps them until the
/// wake commits), the ring and the I/O. Owned, so that the caller can map allocations from `before_copy` while
/// the pipeline runs.
pub struct FileRestore {
    ring: Arc<StagingRing>,
    io: Arc<dyn SpillIo>,
    items: Vec<(i32, DevPtr, Backup)>,
}

impl BackupStore {
    /// The file restores of `targets` ((device, addr) of asleep allocations; those whose backup is not in a file
    /// are left out), with the staging ring had; None when there are none.
    pub fn plan_file_restore(
        &mut self,
        targets: &[(i32, DevPtr)],
        log: &mut ErrorLog,
    ) -> Result<Option<FileRestore>> {
        let items: Vec<(i32, DevPtr, Backup)> = (targets.iter())
            .filter_map(|&(d, a)| self.asleep.get(&a).map(|b| (d, a, b)))
            .filter(|(_, _, b)| b.file().is_some())
            .map(|(d, a, b)| (d, a, b.clone()))
            .collect();
        if items.is_empty() {
            return Ok(None);
        }
        let ring = self.ring(log)?;
        Ok(Some(FileRestore {
            ring,
            io: self.io.clone(),
            items,
        }))
    }

    /// Restore the file backups of `targets` ((device, addr) of mapped, asleep allocations; those with a host
    /// backup are skipped) file -> ring -> device, the raw ones first, then the compressed ones (file_packed.rs,
    /// verified against their sleep's prints). Every copy it queued is waited for before it returns, failure or
    /// not. Ok: the bytes read and restored, and where the time went.
    pub fn restore_files(
        &mut self,
        driver: &dyn Driver,
        targets: &[(i32, DevPtr)],
        log: &mut ErrorLog,
    ) -> Result<FileRestored> {
        let mut out = FileRestored::default();
        if let Some(restore) = self.plan_file_restore(targets, log)? {
            let mut refused = None;
            let read = restore.run(driver, &mut refused, &mut out.times, |_| Ok(()));
            if let Some(e) = refused {
                log.record(super::THREAD_REFUSED, &e);
            }
            out.bytes = read?;
            out.raw = out.bytes;
        }
        let packed: Vec<(i32, DevPtr, Arc<FilePacked>)> = (targets.iter())
            .filter_map(|&(d, a)| {
                let p = self.asleep.get(&a).and_then(Backup::file_packed)?;
                Some((d, a, p.clone()))
            })
            .collect();
        if !packed.is_empty() {
            let ring = self.ring(log)?;
            let items: Vec<(i32, DevPtr, &FilePacked)> =
                packed.iter().map(|(d, a, p)| (*d, *a, &**p)).collect();
            let mut refused = None;
            let read = restore_packed_files(driver, (&ring, &*self.io), &items, &mut refused);
            if let Some(e) = refused {
                log.record(super::THREAD_REFUSED, &e);
            }
            let read = read?;
            out.times.read_wait_seconds += read.read_wait_seconds;
            out.times.copy_seconds += read.codec_seconds;
            out.bytes += read.disk;
            out.raw += read.raw;
            out.compressed = (read.raw, read.disk);
        }
        Ok(out)
    }
}

impl FileRestore {
    /// The allocations restored, in the order the pipeline reaches them.
    pub fn addrs(&self) -> impl Iterator<Item = DevPtr> + '_ {
        self.items.iter().map(|i| i.1)
    }

    /// Run the pipeline (see the module comment). `before_copy(addr)` is called once per allocation, before the
    /// first copy into it is queued (and never after a failure); its error fails the pipeline like a read error.
    /// Every copy queued is waited for before it returns, failure or not. A reader thread that could not start
    /// goes to `refused` (its work ran on the others, or on this thread); `times` gets where the time went.
    /// Ok: the bytes read.
    pub fn run(
        &self,
        driver: &dyn Driver,
        refused: &mut Option<Error>,
        times: &mut FileWakeTimes,
        mut before_copy: impl FnMut(DevPtr) -> Result<()>,
    ) -> Result<usize> {
        let (ring, io, items) = (&*self.ring, &*self.io, &self.items);
        let placed: Vec<slot_plan::Item> = (items.iter())
            .map(|(device, _, b)| {
                let (file, offset) = b.file().expect("file backups only");
                slot_plan::Item::in_file(file, *device, offset, b.len())
            })
            .collect();
        let chunks = slot_plan::plan(&placed, ring.slot_size());
        let work = |(slot, mut mem, c): (usize, SlotMem, usize)| {
            let s = &chunks[c];
            let (file, _) = items[s.item()].2.file().expect("file backups only");
            let r = file.read_exact_at(io, mem.bytes_mut(s.len), s.offset);
            (slot, c, r)
        };
        let mut reached = vec![false; items.len()];
        let since = |t: Instant| t.elapsed().as_secs_f64();
        std::thread::scope(|s| {
            let mut workers = Workers::start(s, IO_THREADS.min(ring.slots()), &work, driver);
            *refused = workers.refused.take();
            let mut free: Vec<usize> = (0..ring.slots()).rev().collect();
            let mut copying: VecDeque<(usize, i32, u64)> = VecDeque::new();
            let (mut next, mut pending, mut read) = (0, 0, 0);
            let mut failed: Option<Error> = None;
            loop {
                let t = Instant::now();
                while failed.is_none() && next < chunks.len() {
                    let Some(slot) = free.pop() else { break };
                    workers.submit((slot, ring.slot_mem(slot), next), &work);
                    pending += 1;
                    next += 1;
                }
                times.read_wait_seconds += since(t); // a read done here when no reader thread started
                let starved = free.is_empty() && next < chunks.len() && failed.is_none();
                if starved || pending == 0 {
                    if let Some((slot, device, marker)) = copying.pop_front() {
                        let t = Instant::now();
                        if let Err(e) = driver.wait_marker(device, marker) {
                            failed.get_or_insert(e);
                        }
                        times.copy_seconds += since(t);
                        free.push(slot);
                        continue;
                    }
                }
                if pending == 0 {
                    break;
                }
                let t = Instant::now();
                let (slot, c, r) = workers.next(true).expect("a read in flight");
                times.read_wait_seconds += since(t);
                pending -= 1;
                if let Err(e) = r {
                    failed.get_or_insert(e);
                }
                let s = &chunks[c];
                for g in &s.segments {
                    if failed.is_none() && !reached[g.item] {
                        reached[g.item] = true;
                        let t = Instant::now();
                        if let Err(e) = before_copy(items[g.item].1) {
                            failed = Some(e);
                        }
                        times.before_copy_seconds += since(t);
                    }
                }
                if failed.is_some() {
                    free.push(slot);
                    continue;
                }
                let t = Instant::now();
                let queued = s.segments.iter().try_for_each(|g| {
                    let addr = items[g.item].1 + g.at as u64;
                    ring.queue_to_device(slot, g.slot_off, s.device, addr, g.len)
                });
                let marked = queued.and_then(|()| driver.record_marker(s.device));
                times.copy_seconds += since(t);
                match marked {
                    Ok(m) => {
                        read += s.segments.iter().map(|g| g.len).sum::<usize>();
                        copying.push_back((slot, s.device, m));
                    }
                    Err(e) => {
                        let _ = driver.wait(s.device); // a copy queued without a marker behind it
                        free.push(slot);
                        failed.get_or_insert(e);
                    }
                }
            }
            drop(workers);
            failed.map_or(Ok(read), Err)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backups::{BackupTier, StoreConfig};
    use crate::driver::sim::{SimConfig, SimDriver};
    use crate::driver::PhysHandle;

    const GRAN: usize = 64 << 10;

    struct Setup {
        sim: Arc<SimDriver>,
        store: BackupStore,
        addrs: Vec<DevPtr>,
        dir: std::path::PathBuf,
    }

    /// Three one-granule allocations backed up to a spill file (several ring slots each) and unmapped, as a sleep
    /// leaves them.
    fn asleep_in_a_file(name: &str) -> Setup {
        let dir = std::env::temp_dir().join(format!("cumem-rs-wake-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let sim = Arc::new(
            SimDriver::new(SimConfig {
                granularity: GRAN,
                ..SimConfig::default()
            })
            .unwrap(),
        );
        let config = StoreConfig {
            retain: false,
            fingerprint_chunk: GRAN,
            pin_chunk: GRAN,
            host_limit: None,
            host_margin: crate::host_guard::DEFAULT_MARGIN,
            host_budget: Some(0),
            spill_dir: Some(dir.clone()),
            compress: false,
            verify_wake: true,
        };
        let mut store = BackupStore::new(sim.clone(), config);
        store.set_staging_bytes(8 * 4096).unwrap();
        let mut log = ErrorLog::default();
        let mut mapped: Vec<(DevPtr, PhysHandle)> = Vec::new();
        for _ in 0..3 {
            let addr = sim.reserve(0, GRAN).unwrap();
            let h = sim.create(0, GRAN).unwrap();
            sim.map(addr, GRAN, h).unwrap();
            sim.set_access(0, addr, GRAN).unwrap();
            mapped.push((addr, h));
        }
        let wanted: Vec<_> = (mapped.iter())
            .map(|&(a, _)| (a, 0, GRAN, BackupTier::File))
            .collect();
        let (host, plan) = store.plan_tiers(&wanted, &mut log).unwrap();
        assert!(host.is_empty());
        let mut refused = None;
        let written = plan
            .unwrap()
            .write_out(&*sim, &mut refused, &mut None, |job, b| {
                store.keep(job.addr, b)
            })
            .unwrap();
        assert_eq!(written, 3 * GRAN);
        for &(addr, h) in &mapped {
            sim.unmap(addr, GRAN).unwrap();
            sim.release(h).unwrap();
        }
        let addrs = mapped.iter().map(|m| m.0).collect();
        Setup {
            sim,
            store,
            addrs,
            dir,
        }
    }

    impl Setup {
        /// Map `addr` again (what an engine does from `before_copy`); the handle goes to `handles`.
        fn map(&self, addr: DevPtr, handles: &mut Vec<(DevPtr, PhysHandle)>) -> Result<()> {
            let h = self.sim.create(0, GRAN)?;
            self.sim.map(addr, GRAN, h)?;
            self.sim.set_access(0, addr, GRAN)?;
            handles.push((addr, h));
            Ok(())
        }

        fn finish(self, handles: Vec<(DevPtr, PhysHandle)>) {
            for (addr, h) in handles {
                self.sim.unmap(addr, GRAN).unwrap();
                self.sim.release(h).unwrap();
            }
            for &a in &self.addrs {
                self.sim.free_range(a, GRAN).unwrap();
            }
            drop(self.store);
            assert_eq!(self.sim.counts().markers, 0, "every marker waited for");
            std::fs::remove_dir_all(&self.dir).unwrap();
        }
    }

    #[test]
    fn each_allocation_is_handed_to_before_copy_once_before_any_copy_into_it() {
        let mut s = asleep_in_a_file("hook");
        let targets: Vec<(i32, DevPtr)> = s.addrs.iter().map(|a| (0, *a)).collect();
        let mut log = ErrorLog::default();
        let restore = s
            .store
            .plan_file_restore(&targets, &mut log)
            .unwrap()
            .unwrap();
        assert_eq!(restore.addrs().collect::<Vec<_>>(), s.addrs);
        let (mut refused, mut times) = (None, FileWakeTimes::default());
        let mut handles = Vec::new();
        // Unmapped until the hook maps them: a copy queued into one before its hook would fail in the sim.
        let read = restore.run(&*s.sim, &mut refused, &mut times, |a| {
            s.map(a, &mut handles)
        });
        assert_eq!(read.unwrap(), 3 * GRAN);
        let (mut seen, mut all): (Vec<DevPtr>, Vec<DevPtr>) =
            (handles.iter().map(|h| h.0).collect(), s.addrs.clone());
        seen.sort_unstable();
        all.sort_unstable();
        assert_eq!(seen, all, "once each");
        assert!(times.before_copy_seconds > 0.0 && times.read_wait_seconds > 0.0);
        drop(restore);
        s.finish(handles);
    }

    #[test]
    fn a_failed_before_copy_fails_the_pipeline_after_every_copy_in_flight() {
        let mut s = asleep_in_a_file("hook-fails");
        let targets: Vec<(i32, DevPtr)> = s.addrs.iter().map(|a| (0, *a)).collect();
        let mut log = ErrorLog::default();
        let restore = s
            .store
            .plan_file_restore(&targets, &mut log)
            .unwrap()
            .unwrap();
        let (mut refused, mut times) = (None, FileWakeTimes::default());
        let (mut handles, mut calls) = (Vec::new(), 0);
        let read = restore.run(&*s.sim, &mut refused, &mut times, |a| {
            calls += 1;
            if calls == 2 {
                return Err(Error::InvalidState("no memory for the second one".into()));
            }
            s.map(a, &mut handles)
        });
        let err = read.unwrap_err();
        assert!(err.to_string().contains("second one"), "{err}");
        assert_eq!(calls, 2, "never called after the failure");
        assert_eq!(
            s.sim.counts().markers,
            0,
            "every copy queued was waited for"
        );
        drop(restore);
        assert_eq!(s.store.file_bytes(), 3 * GRAN, "the backups stay");
        s.finish(handles);
    }
}
