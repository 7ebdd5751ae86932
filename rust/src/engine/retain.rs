//! Retained backups: a backup that a wake restored from stays bound to its allocation, with a fingerprint of
//! every chunk taken on the device right after the restore. The next sleep fingerprints the chunks again and
//! copies only those that changed into their place in the retained backup; unchanged chunks are not copied.
//!
//! Safety rules (stale data is never an outcome):
//! - a retained backup is dropped by free, discard, a sleep that does not offload its tag, trim_host,
//!   set_keep_host_memory(False), set_retain_backups(False) and a change of chunk size;
//! - any failure in this path (a fingerprint that cannot be queued or read) counts every chunk as changed;
//! - a sleep that fails leaves the allocation awake and drops its retained backup, whose host bytes may be half
//!   overwritten; copies into it are always waited for before that.

use std::collections::HashMap;
use std::time::Instant;

use super::{Engine, Inner, Report};
use crate::driver::DevPtr;
use crate::error::{Error, Result};
use crate::fingerprint::{self, Fingerprint};
use crate::registry::Backup;

/// A backup kept bound to an awake allocation, and the fingerprints of its chunks as the wake left them.
pub(super) struct Retained {
    pub backup: Backup,
    pub chunk: usize,
    pub fingerprints: Vec<Fingerprint>,
}

/// Per device: the allocations of one fingerprint batch, in batch order.
pub(super) type Batches = HashMap<i32, Vec<DevPtr>>;

/// The retained-backup part of one sleep, in three steps: `begin` (queue fingerprints), `issue_changed` (compare,
/// queue the copies of changed chunks), `finish` (wait, release).
pub(super) struct RetainedSleep {
    batches: Batches,
    /// Device -> marker after its fingerprint batch, then after its changed-chunk copies (None: no marker could
    /// be recorded, wait for the whole stream).
    markers: Vec<(i32, Option<u64>)>,
    /// Allocations whose changed chunks are queued, with their backup.
    queued: Vec<(DevPtr, Backup)>,
    /// Allocations of this sleep with a retained backup (all of them, whatever happens).
    all: Vec<DevPtr>,
    started: Instant,
}

impl Engine {
    /// Whether wakes keep backups now: the policy, kept host memory, and a kernel that loads.
    pub(super) fn retaining(inner: &Inner) -> bool {
        inner.retain && inner.host.keep && !inner.fingerprints_unavailable
    }

    /// Drop the retained backups of `addrs` (the arenas go back to the host pool at the next collection).
    pub(super) fn drop_retained(inner: &mut Inner, addrs: &[DevPtr]) {
        if inner.retained.is_empty() {
            return;
        }
        for a in addrs {
            inner.retained.remove(a);
        }
    }

    /// Drop every retained backup and give the arenas nothing points into back.
    pub(super) fn drop_all_retained(&self, inner: &mut Inner) {
        inner.retained.clear();
        self.collect_unused_arenas(inner);
    }

    /// Queue one fingerprint batch per device over the chunks of `addrs` (awake, mapped), behind the copies
    /// already queued. Devices whose batch could not be queued are left out (and the failure recorded).
    fn queue_fingerprint_batches(&self, inner: &mut Inner, addrs: &[DevPtr]) -> Batches {
        let chunk = inner.fingerprint_chunk;
        let mut per_device: Batches = HashMap::new();
        for &a in addrs {
            let dev = inner.reg.get(a).expect("selected").device;
            per_device.entry(dev).or_default().push(a);
        }
        let mut batches = HashMap::new();
        for (dev, allocs) in per_device {
            let ranges: Vec<(DevPtr, usize)> = allocs
                .iter()
                .flat_map(|&a| {
                    let size = inner.reg.get(a).expect("selected").size;
                    fingerprint::chunks(size, chunk).map(move |(off, len)| (a + off as u64, len))
                })
                .collect();
            match self.driver.queue_fingerprints(dev, &ranges) {
                Ok(()) => {
                    batches.insert(dev, allocs);
                }
                Err(e) => self.fingerprints_failed(inner, &e),
            }
        }
        batches
    }

    /// A fingerprint failure: recorded; a kernel that does not load turns retention off for good (one warning).
    fn fingerprints_failed(&self, inner: &mut Inner, e: &Error) {
        let unloadable = matches!(e, Error::Driver { op, .. } if op.starts_with("cuModule"));
        if unloadable {
            inner.fingerprints_unavailable = true;
            Self::record(
                inner,
                "fingerprint kernel unavailable: retained backups are off, every sleep copies everything",
                e,
            );
        } else {
            Self::record(inner, "fingerprints (these chunks count as changed)", e);
        }
    }

    /// Read the batches back (their streams have passed them) and split per allocation.
    fn take_fingerprint_batches(
        &self,
        inner: &mut Inner,
        batches: &Batches,
    ) -> HashMap<DevPtr, Vec<Fingerprint>> {
        let chunk = inner.fingerprint_chunk;
        let mut out = HashMap::new();
        for (&dev, allocs) in batches {
            match self.driver.take_fingerprints(dev) {
                Ok(fps) => {
                    let mut rest = fps.as_slice();
                    for &a in allocs {
                        let n = inner.reg.get(a).expect("selected").size.div_ceil(chunk);
                        if rest.len() < n {
                            break;
                        }
                        out.insert(a, rest[..n].to_vec());
                        rest = &rest[n..];
                    }
                }
                Err(e) => self.fingerprints_failed(inner, &e),
            }
        }
        out
    }

    /// Forget batches whose results are not wanted (after a failure); the streams were waited for.
    fn forget_fingerprint_batches(&self, batches: &Batches) {
        for &dev in batches.keys() {
            let _ = self.driver.take_fingerprints(dev);
        }
    }

    // ----- wake --------------------------------------------------------------------------------------------

    /// Wake, after queueing the restore copies of `restored`: queue their fingerprints behind the copies.
    pub(super) fn queue_wake_fingerprints(
        &self,
        inner: &mut Inner,
        restored: &[DevPtr],
    ) -> Batches {
        if !Self::retaining(inner) || restored.is_empty() {
            return Batches::new();
        }
        self.queue_fingerprint_batches(inner, restored)
    }

    /// Wake succeeded (streams waited for): bind each restored allocation's backup to it with its fingerprints.
    /// `backups` are the backups the wake restored from.
    pub(super) fn keep_restored_backups(
        &self,
        inner: &mut Inner,
        batches: Batches,
        backups: HashMap<DevPtr, Backup>,
    ) {
        let chunk = inner.fingerprint_chunk;
        let mut fps = self.take_fingerprint_batches(inner, &batches);
        for (addr, backup) in backups {
            if let Some(fingerprints) = fps.remove(&addr) {
                inner.retained.insert(
                    addr,
                    Retained {
                        backup,
                        chunk,
                        fingerprints,
                    },
                );
            }
        }
    }

    /// Wake failed: the batches' results are useless.
    pub(super) fn abandon_wake_fingerprints(&self, batches: &Batches) {
        self.forget_fingerprint_batches(batches);
    }

    // ----- sleep -------------------------------------------------------------------------------------------

    /// Sleep, before its copies: move the offloaded allocations that have a retained backup out of `backed`.
    pub(super) fn split_retained(inner: &Inner, backed: &mut Vec<DevPtr>) -> Vec<DevPtr> {
        let chunk = inner.fingerprint_chunk;
        let (retained, fresh): (Vec<DevPtr>, Vec<DevPtr>) = backed
            .iter()
            .partition(|a| inner.retained.get(a).is_some_and(|r| r.chunk == chunk));
        *backed = fresh;
        retained
    }

    /// Sleep, step 1 (after the other backups' copies are queued): queue the fingerprints of `all` (from
    /// `split_retained`) with a marker behind each device's batch.
    pub(super) fn begin_retained_sleep(
        &self,
        inner: &mut Inner,
        all: Vec<DevPtr>,
    ) -> RetainedSleep {
        let started = Instant::now();
        let batches = if all.is_empty() {
            Batches::new()
        } else {
            self.queue_fingerprint_batches(inner, &all)
        };
        let mut markers = Vec::new();
        for &dev in batches.keys() {
            match self.driver.record_marker(dev) {
                Ok(m) => markers.push((dev, Some(m))),
                Err(e) => {
                    Self::record(
                        inner,
                        "marker after fingerprints (waiting for the stream instead)",
                        &e,
                    );
                    markers.push((dev, None));
                }
            }
        }
        RetainedSleep {
            batches,
            markers,
            queued: Vec::new(),
            all,
            started,
        }
    }

    /// Sleep, step 2: wait for the fingerprints, then queue the copies of changed chunks (all chunks of an
    /// allocation whose fingerprints are missing) into the retained backups, with a marker per device.
    pub(super) fn issue_changed_chunks(
        &self,
        inner: &mut Inner,
        rs: &mut RetainedSleep,
        report: &mut Report,
    ) -> Result<()> {
        if rs.all.is_empty() {
            return Ok(());
        }
        let mut stream_ok = true;
        for (dev, m) in std::mem::take(&mut rs.markers) {
            if let Err(e) = self.wait_marker_or_stream(dev, m) {
                stream_ok = false;
                Self::record(inner, "waiting for fingerprints", &e);
            }
        }
        let batches = std::mem::take(&mut rs.batches);
        let mut now = if stream_ok {
            self.take_fingerprint_batches(inner, &batches)
        } else {
            self.forget_fingerprint_batches(&batches);
            HashMap::new()
        };
        report.fingerprint_seconds = rs.started.elapsed().as_secs_f64();
        let mut devices = Vec::new();
        let mut result = Ok(());
        for &addr in &rs.all {
            let a = inner.reg.get(addr).expect("selected");
            let (device, size) = (a.device, a.size);
            let r = inner.retained.get(&addr).expect("partitioned on it");
            let before = &r.fingerprints;
            let after = now.remove(&addr);
            let backup = r.backup.clone();
            for (i, (off, len)) in fingerprint::chunks(size, r.chunk).enumerate() {
                report.chunks_checked += 1;
                let unchanged = after.as_ref().is_some_and(|f| f.get(i) == before.get(i));
                if unchanged {
                    report.skipped_bytes += len;
                    continue;
                }
                if let Err(e) = self.copy_out_to(device, addr + off as u64, &backup, off, len) {
                    result = Err(e);
                    break;
                }
                report.copied_bytes += len;
            }
            if !devices.contains(&device) {
                devices.push(device);
            }
            rs.queued.push((addr, backup));
            if result.is_err() {
                break;
            }
        }
        for dev in devices {
            match self.driver.record_marker(dev) {
                Ok(m) => rs.markers.push((dev, Some(m))),
                Err(e) => {
                    // No marker: `finish` waits for the whole stream of this device instead.
                    result = result.and(Err(e));
                    rs.markers.push((dev, None));
                }
            }
        }
        result
    }

    fn wait_marker_or_stream(&self, device: i32, marker: Option<u64>) -> Result<()> {
        match marker {
            Some(m) => self.driver.wait_marker(device, m),
            None => self.driver.wait(device),
        }
    }

    /// Queue the device-to-host copy of `len` bytes at `src` into `backup` at `offset` of the allocation, split
    /// at the arena's pinned pieces.
    fn copy_out_to(
        &self,
        device: i32,
        src: DevPtr,
        backup: &Backup,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        let start = backup.offset + offset;
        for (off, l) in backup.arena.split_at_pieces(start, len) {
            self.driver
                .copy_d2h(device, backup.arena.at(off), src + (off - start) as u64, l)?;
        }
        Ok(())
    }

    /// Sleep, last step: wait for the changed-chunk copies (always, failure or not), then release the
    /// allocations whose backup is complete. Those not released stay awake and lose their retained backup.
    pub(super) fn finish_retained_sleep(
        &self,
        inner: &mut Inner,
        rs: RetainedSleep,
        copies_ok: bool,
        report: &mut Report,
        first_err: &mut Option<Error>,
    ) {
        let mut ok = copies_ok;
        for (dev, m) in rs.markers {
            if let Err(e) = self.wait_marker_or_stream(dev, m) {
                ok = false;
                first_err.get_or_insert(e);
            }
        }
        if ok {
            for (addr, backup) in rs.queued {
                if let Err(e) = self.release_to_sleep(inner, addr, Some(backup), report) {
                    first_err.get_or_insert(e);
                }
            }
        }
        // Released ones now hold their backup in their asleep state; the rest stay awake without one.
        Self::drop_retained(inner, &rs.all);
    }
}
