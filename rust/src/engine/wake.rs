//! Wake: map new physical memory at the same addresses and restore the backups; all or nothing.

use std::collections::HashMap;
use std::time::Instant;

use super::group::{map_run_in, Mapped};
use super::{tag_set, Engine, Inner, Report};
use crate::backups::{Backup, WakeCheck};
use crate::driver::DevPtr;
use crate::error::Result;
use crate::timing::Phases;

impl Engine {
    /// Map new physical memory at the same addresses for asleep allocations whose tag is in `tags` (None: all),
    /// and copy their backups back. All or nothing: a failed wake releases what it mapped, keeps every backup
    /// and leaves its allocations asleep.
    pub fn wake<S: AsRef<str>>(&self, tags: Option<&[S]>) -> Result<Report> {
        let start = Instant::now();
        let wanted = tags.map(tag_set);
        let mut locked = self.lock_open()?;
        let inner = &mut *locked;
        self.retry_pending(inner);
        let mut targets = inner
            .reg
            .select(|a| !a.is_awake() && wanted.as_ref().is_none_or(|w| w.contains(&*a.tag)));
        if targets.is_empty() {
            return Ok(Report::default());
        }
        // Backed-up allocations first (a stable sort keeps address order within each part).
        targets.sort_by_key(|a| inner.backups.backup_of(*a).is_none());
        let backed = targets
            .iter()
            .take_while(|a| inner.backups.backup_of(**a).is_some())
            .count();
        let mut report = Report {
            allocations: targets.len(),
            ..Report::default()
        };
        let mut mapped: Vec<Mapped> = Vec::new();
        let mut phases = Phases::new("engine wake");
        let mut check = WakeCheck::default();
        let result = self.map_and_restore(
            inner,
            &targets,
            backed,
            (&mut mapped, &mut check),
            &mut report,
            &mut phases,
        );
        // Wait even after a failure: no copy may still be writing when the rollback unmaps.
        let t = Instant::now();
        let result = self.wait_devices(inner, &targets, result);
        let t = phases.add("wait", t);
        // The verification's prints are taken whatever happened, and compared after a clean restore: a mismatch
        // fails the wake like a failed copy.
        let verified = (inner.backups).finish_wake_check(check, &inner.reg, result.is_ok());
        let result = result.and(verified).map(|n| report.verified_bytes = n);
        let t = phases.add("verify", t);
        if let Err(e) = result {
            self.rollback_wake(inner, &mapped);
            return Err(e);
        }
        let restored: Vec<(DevPtr, Backup)> = targets[..backed]
            .iter()
            .map(|a| (*a, inner.backups.take(*a).expect("backed up")))
            .collect();
        self.commit_mapped(inner, mapped);
        let release = Instant::now();
        inner.backups.bind_restored(restored);
        let t = phases.add("commit", t);
        inner.backups.collect_unused(&mut inner.log);
        phases.add("collect unused", t);
        phases.log();
        report.release_seconds = release.elapsed().as_secs_f64();
        Self::note_peak(inner);
        report.seconds = start.elapsed().as_secs_f64();
        log::debug!(
            "engine wake: {} allocations, {} bytes restored ({} verified), {} bytes mapped without contents, {:.3} s",
            report.allocations,
            report.copied_bytes,
            report.verified_bytes,
            report.discarded_bytes,
            report.seconds
        );
        inner.counters.wakes += 1;
        inner.counters.last_wake = Some(report.clone());
        Ok(report)
    }

    /// Map every target and queue the copies of the backed-up ones (`targets[..backed]`) back, then their
    /// verification, then the zero fills their tag policies ask for of the others; what was mapped goes into
    /// `mapped` (for the rollback), the verification queued into `check` (for the caller to finish after its wait,
    /// whatever happens).
    ///
    /// Order: map each backed-up allocation and queue its copy (on several devices: map them all, then queue all
    /// the copies, one stream per device), then map the allocations without backup while those copies run, queue
    /// the fingerprints of every restored chunk behind the copies (after the last map: a kernel in flight holds
    /// up maps), the zero fills, and let the caller wait once per device.
    fn map_and_restore(
        &self,
        inner: &mut Inner,
        targets: &[DevPtr],
        backed: usize,
        (mapped, check): (&mut Vec<Mapped>, &mut WakeCheck),
        report: &mut Report,
        phases: &mut Phases,
    ) -> Result<()> {
        let t = Instant::now();
        // Neighbours of one tag are mapped together on one handle (group.rs); backed-up and bare allocations
        // never share a run, so the copies can start before the bare ones are mapped.
        let backed_runs = Self::wake_runs(inner, &targets[..backed]);
        let bare_runs = Self::wake_runs(inner, &targets[backed..]);
        // Runs restored from compressed backups alone are mapped from inside the codec's restore, each just before
        // it is written, so that their maps run under the copies and kernels of the ones before (H200: 15 GiB of
        // weights took 20 ms of maps before the first blob moved).
        let (deferred, backed_runs): (Vec<Vec<DevPtr>>, Vec<Vec<DevPtr>>) = (backed_runs
            .into_iter())
        .partition(|run| run.iter().all(|a| inner.backups.has_packed_backup(*a)));
        if Self::devices_of(inner, &targets[..backed]).len() <= 1 {
            // Each run's copies are queued right after its map: the copies start after the first map instead of
            // the last, and the driver calls (which do not wait for copies in flight on their device) run under
            // them. Measured on an H200 with 1024 allocations of 12 MiB: the maps alone take 53 ms, a quarter of
            // the copy time.
            for run in &backed_runs {
                mapped.push(self.map_run(inner, run)?);
                report.copied_bytes += self.restore(inner, run)?;
            }
        } else {
            // Several devices: map every device first. Maps on one device wait for copies queued on another
            // (measured: interleaving serialized two GPUs, 0.61x of their aggregate copy bandwidth).
            for run in &backed_runs {
                mapped.push(self.map_run(inner, run)?);
            }
            for run in &backed_runs {
                report.copied_bytes += self.restore(inner, run)?;
            }
        }
        let t = phases.add("map and queue copies", t);
        // (device, addr) of each backed-up target, for the file tier and the compressed restore.
        let placed: Vec<(i32, DevPtr)> = (targets[..backed].iter())
            .map(|a| (inner.reg.get(*a).expect("selected").device, *a))
            .collect();
        // Backups in spill files: file -> staging ring -> device while the host copies above run (every copy of
        // the ring waited for inside; a read error fails the wake like a failed copy).
        let read = if inner.backups.file_bytes() == 0 {
            0 // no file tier in use: nothing to look for
        } else {
            let file_start = Instant::now();
            let restored = inner
                .backups
                .restore_files(&*self.driver, &placed, &mut inner.log)?;
            report.file_seconds += file_start.elapsed().as_secs_f64();
            report.file_read_wait_seconds += restored.times.read_wait_seconds;
            report.file_copy_seconds += restored.times.copy_seconds;
            report.raw_bytes += restored.compressed.0;
            report.stored_bytes += restored.compressed.1;
            report.copied_bytes += restored.raw;
            restored.bytes
        };
        report.read_bytes += read;
        let t = phases.add("files", t);
        // Compressed backups: decompressed into their allocations (the deferred runs mapped just before); a codec
        // error fails the wake like a failed copy.
        let run_of: HashMap<DevPtr, usize> = (deferred.iter().enumerate())
            .flat_map(|(r, run)| run.iter().map(move |a| (*a, r)))
            .collect();
        let mut is_mapped = vec![false; deferred.len()];
        let Inner {
            backups,
            reg,
            pending,
            log,
            ..
        } = &mut *inner;
        let driver = &*self.driver;
        let mut ready = |addr: DevPtr| -> Result<()> {
            match run_of.get(&addr) {
                Some(&r) if !is_mapped[r] => {
                    is_mapped[r] = true;
                    mapped.push(map_run_in(driver, reg, pending, log, &deferred[r])?);
                    Ok(())
                }
                _ => Ok(()),
            }
        };
        let (raw, stored) = backups.restore_packed(&placed, reg, &mut ready)?;
        // Every deferred run had its allocations restored, so it is mapped; should one not be, it is mapped now
        // (without contents a wake would leave it unmapped and awake).
        for (r, run) in deferred.iter().enumerate() {
            if !is_mapped[r] {
                mapped.push(self.map_run(inner, run)?);
            }
        }
        let t = phases.add("compressed", t);
        report.copied_bytes += raw;
        report.raw_bytes += raw;
        report.stored_bytes += stored;
        for run in &bare_runs {
            mapped.push(self.map_run(inner, run)?);
        }
        let t = phases.add("map bare", t);
        // Every restored chunk's print, queued behind the restore copies on each device's copy stream (verify.rs).
        let (queued, result) = inner.backups.queue_wake_check(&placed, &inner.reg);
        *check = queued;
        result?;
        let t = phases.add("queue verification", t);
        // Zero what its tag's policy asks for: queued on the copy stream after the restore copies and after every
        // map (a fill queued between maps would make later maps wait for it), covered by the caller's wait.
        for addr in &targets[backed..] {
            let a = inner.reg.get(*addr).expect("selected");
            report.discarded_bytes += a.size;
            if inner.policies.zero_on_wake(&a.tag) {
                self.driver.memset_zero(a.device, a.addr, a.size)?;
                report.zeroed_bytes += a.size;
            }
        }
        phases.add("zero", t);
        Ok(())
    }

    /// Queue the copies of a mapped run's backups back to it; the bytes.
    fn restore(&self, inner: &Inner, run: &[DevPtr]) -> Result<usize> {
        let placed: Vec<(i32, DevPtr)> = run
            .iter()
            .map(|a| (inner.reg.get(*a).expect("selected").device, *a))
            .collect();
        inner.backups.queue_restore(&placed)
    }

    fn rollback_wake(&self, inner: &mut Inner, mapped: &[Mapped]) {
        for m in mapped {
            self.unmap_or_queue(inner, m.addr, m.size);
            self.release_or_queue(inner, m.handle);
        }
    }
}
