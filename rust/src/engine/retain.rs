//! Retained backups: a backup that a wake restored from stays bound to its allocation, so that the next sleep
//! copies only the chunks that changed since.
//!
//! What changed is told by 128-bit fingerprints of fixed chunks, computed on the device at every sleep, in one
//! kernel pass over the offloaded allocations queued ahead of their copies. The prints taken at a sleep describe
//! the backup it made, hence the device contents right after the wake that restores it; the next sleep compares
//! its own prints with them. (Fingerprinting at wake instead, behind the restore copies, was measured to hold up
//! the wake by ~145 ms on an H200 with 48 GiB mapped under the copies: a kernel in flight serializes with maps.)
//!
//! Safety rules (stale data is never an outcome):
//! - prints and retained backups are dropped by free, discard, a sleep that does not offload the tag, a wake
//!   without retention, trim_host, set_keep_host_memory(False), set_retain_backups(False), a chunk size change;
//! - any failure in this path (prints that cannot be queued or read) counts every chunk as changed, and an
//!   allocation whose new prints are missing keeps none;
//! - a sleep that fails leaves the allocation awake and drops its retained backup, whose host bytes may be half
//!   overwritten; copies into it are always waited for before that.

use std::collections::HashMap;
use std::time::Instant;

use super::{Engine, Inner, Report};
use crate::driver::DevPtr;
use crate::error::{Error, Result};
use crate::fingerprint::{self, Fingerprint};
use crate::registry::{Backup, State};

/// The fingerprints of an allocation's chunks (of the current chunk size: a change of size drops them all), as
/// its backup holds them.
pub(super) type Prints = Vec<Fingerprint>;

/// Per device: the allocations of one fingerprint batch, in batch order.
type Batches = HashMap<i32, Vec<DevPtr>>;

/// A device and the marker after some of its stream's work (None: wait for the whole stream instead).
type StreamPoint = (i32, Option<u64>);

/// The fingerprint part of one sleep, in three steps: `begin_sleep_prints` (queue), `issue_changed_chunks`
/// (compare, queue the copies of changed chunks), `finish_sleep_prints` (wait, release, keep the new prints).
pub(super) struct SleepPrints {
    batches: Batches,
    /// Markers after the fingerprint batches (None: no marker could be recorded, wait for the whole stream).
    markers: Vec<StreamPoint>,
    /// Offloaded allocations with a retained backup.
    retained: Vec<DevPtr>,
    /// Every offloaded allocation of this sleep.
    backed: Vec<DevPtr>,
    /// Retained allocations whose changed chunks are queued, with their backup and, when something was copied,
    /// the device and the marker after their copies (None: wait for the whole stream), in queue order.
    queued: Vec<(DevPtr, Backup, Option<StreamPoint>)>,
    /// The prints taken now, per allocation.
    now: HashMap<DevPtr, Vec<Fingerprint>>,
    queue_seconds: f64,
}

impl Engine {
    /// Whether sleeps take prints and wakes keep backups: the policy, kept host memory, a kernel that loads.
    pub(super) fn retaining(inner: &Inner) -> bool {
        inner.retain && inner.host.keep && !inner.fingerprints_unavailable
    }

    /// Host bytes of the backups bound to awake allocations.
    pub(super) fn retained_bytes(inner: &Inner) -> usize {
        (inner.retained.keys())
            .filter_map(|a| inner.reg.get(*a))
            .map(|a| a.size)
            .sum()
    }

    /// Forget the prints and retained backups of `addrs`.
    pub(super) fn drop_retained(inner: &mut Inner, addrs: &[DevPtr]) {
        if inner.prints.is_empty() && inner.retained.is_empty() {
            return;
        }
        for a in addrs {
            inner.prints.remove(a);
            inner.retained.remove(a);
        }
    }

    /// Forget every print and retained backup; arenas nothing points into go back to the host pool.
    pub(super) fn drop_all_retained(&self, inner: &mut Inner) {
        inner.prints.clear();
        inner.retained.clear();
        self.collect_unused_arenas(inner);
    }

    /// A fingerprint failure: recorded; a kernel that does not load turns retention off for good (one warning).
    fn fingerprints_failed(&self, inner: &mut Inner, e: &Error) {
        let unloadable = matches!(e, Error::Driver { op, .. } if op.starts_with("cuModule"));
        if unloadable {
            // Retained backups already in use stay valid: their chunks now count as changed, and the next wake
            // binds none.
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

    // ----- wake --------------------------------------------------------------------------------------------

    /// Wake succeeded: bind each restored allocation's backup to it when its prints describe that backup;
    /// otherwise forget the prints. `restored` are the backups the wake restored from.
    pub(super) fn keep_restored_backups(&self, inner: &mut Inner, restored: Vec<(DevPtr, Backup)>) {
        let keep = Self::retaining(inner);
        for (addr, backup) in restored {
            if keep && inner.prints.contains_key(&addr) {
                inner.retained.insert(addr, backup);
            } else {
                inner.prints.remove(&addr);
            }
        }
    }

    // ----- sleep -------------------------------------------------------------------------------------------

    /// Sleep, before anything is queued: split the offloaded allocations into those with a retained backup
    /// (returned; their changed chunks go into it) and the others (left in `backed`).
    pub(super) fn split_retained(inner: &Inner, backed: &mut Vec<DevPtr>) -> Vec<DevPtr> {
        let (retained, fresh): (Vec<DevPtr>, Vec<DevPtr>) = backed
            .iter()
            .partition(|a| inner.retained.contains_key(a) && inner.prints.contains_key(a));
        *backed = fresh;
        retained
    }

    /// Sleep, first on the copy streams: queue the prints of every offloaded allocation (`retained` and
    /// `fresh`), one batch and a marker per device. Nothing is queued when retention is off.
    pub(super) fn begin_sleep_prints(
        &self,
        inner: &mut Inner,
        retained: Vec<DevPtr>,
        fresh: &[DevPtr],
    ) -> SleepPrints {
        let started = Instant::now();
        let mut sp = SleepPrints {
            batches: Batches::new(),
            markers: Vec::new(),
            backed: retained.iter().chain(fresh).copied().collect(),
            retained,
            queued: Vec::new(),
            now: HashMap::new(),
            queue_seconds: 0.0,
        };
        if !Self::retaining(inner) {
            return sp;
        }
        let chunk = inner.fingerprint_chunk;
        let mut per_device: Batches = HashMap::new();
        for &a in &sp.backed {
            let dev = inner.reg.get(a).expect("selected").device;
            per_device.entry(dev).or_default().push(a);
        }
        for (dev, allocs) in per_device {
            let ranges: Vec<(DevPtr, usize)> = allocs
                .iter()
                .flat_map(|&a| {
                    let size = inner.reg.get(a).expect("selected").size;
                    fingerprint::chunks(size, chunk).map(move |(off, len)| (a + off as u64, len))
                })
                .collect();
            if let Err(e) = self.driver.queue_fingerprints(dev, &ranges) {
                self.fingerprints_failed(inner, &e);
                continue;
            }
            sp.batches.insert(dev, allocs);
            match self.driver.record_marker(dev) {
                Ok(m) => sp.markers.push((dev, Some(m))),
                Err(e) => {
                    Self::record(
                        inner,
                        "marker after fingerprints (waiting for the stream instead)",
                        &e,
                    );
                    sp.markers.push((dev, None));
                }
            }
        }
        sp.queue_seconds = started.elapsed().as_secs_f64();
        sp
    }

    /// Sleep, once the other backups' copies are queued: wait for the prints, then queue the copies of the
    /// changed chunks of retained allocations (all chunks where prints are missing) into their backups, with a
    /// marker per device.
    pub(super) fn issue_changed_chunks(
        &self,
        inner: &mut Inner,
        sp: &mut SleepPrints,
        report: &mut Report,
    ) -> Result<()> {
        let started = Instant::now();
        let mut stream_ok = true;
        for (dev, m) in std::mem::take(&mut sp.markers) {
            if let Err(e) = self.wait_marker_or_stream(dev, m) {
                stream_ok = false;
                Self::record(inner, "waiting for fingerprints", &e);
            }
        }
        for (dev, allocs) in std::mem::take(&mut sp.batches) {
            match self.driver.take_fingerprints(dev) {
                Ok(fps) if stream_ok => {
                    let mut rest = fps.as_slice();
                    for a in allocs {
                        let n = inner
                            .reg
                            .get(a)
                            .expect("selected")
                            .size
                            .div_ceil(inner.fingerprint_chunk);
                        let Some((mine, tail)) = rest.split_at_checked(n) else {
                            break;
                        };
                        sp.now.insert(a, mine.to_vec());
                        rest = tail;
                    }
                }
                Ok(_) => {}
                Err(e) => self.fingerprints_failed(inner, &e),
            }
        }
        let mut result = Ok(());
        for &addr in &sp.retained {
            let a = inner.reg.get(addr).expect("selected");
            let (device, size) = (a.device, a.size);
            let backup = inner.retained.get(&addr).expect("split on it").clone();
            let before = inner.prints.get(&addr).expect("split on it");
            let after = sp.now.get(&addr);
            // Runs of changed chunks, each copied with as few calls as the arena's pinned pieces allow.
            let mut runs: Vec<(usize, usize)> = Vec::new();
            for (i, (off, len)) in fingerprint::chunks(size, inner.fingerprint_chunk).enumerate() {
                report.chunks_checked += 1;
                if after.is_some_and(|f| f.get(i) == before.get(i)) {
                    report.skipped_bytes += len;
                } else if let Some(run) = runs.last_mut().filter(|r| r.0 + r.1 == off) {
                    run.1 += len;
                } else {
                    runs.push((off, len));
                }
            }
            let copied = !runs.is_empty();
            for (off, len) in runs {
                let queued = backup.arena.queue_from_device(
                    device,
                    addr + off as u64,
                    backup.offset + off,
                    len,
                );
                if let Err(e) = queued {
                    result = Err(e);
                    break;
                }
                report.copied_bytes += len;
            }
            // A marker per allocation, so that each is released as soon as its own copies are done.
            let marker = copied.then(|| match self.driver.record_marker(device) {
                Ok(m) => (device, Some(m)),
                Err(e) => {
                    if result.is_ok() {
                        result = Err(e);
                    }
                    (device, None)
                }
            });
            sp.queued.push((addr, backup, marker));
            if result.is_err() {
                break;
            }
        }
        report.fingerprint_seconds = sp.queue_seconds + started.elapsed().as_secs_f64();
        result
    }

    fn wait_marker_or_stream(&self, device: i32, marker: Option<u64>) -> Result<()> {
        match marker {
            Some(m) => self.driver.wait_marker(device, m),
            None => self.driver.wait(device),
        }
    }

    /// Sleep, last step (after the other backups were released): wait for the changed-chunk copies (always,
    /// failure or not), release the retained allocations whose backup is complete (`copies_ok`: everything was
    /// queued), then keep the new prints of every allocation now asleep with a backup. Retained allocations not
    /// released stay awake and lose their retained backup.
    pub(super) fn finish_sleep_prints(
        &self,
        inner: &mut Inner,
        sp: SleepPrints,
        copies_ok: bool,
        report: &mut Report,
        first_err: &mut Option<Error>,
    ) {
        // After a failure release nothing more, but wait for every marker.
        let mut ok = copies_ok;
        for (dev, m) in sp.markers {
            // Fingerprint markers `issue_changed_chunks` did not get to (none in the usual order).
            if let Err(e) = self.wait_marker_or_stream(dev, m) {
                ok = false;
                first_err.get_or_insert(e);
            }
        }
        for (addr, backup, marker) in sp.queued {
            if let Some((dev, m)) = marker {
                if let Err(e) = self.wait_marker_or_stream(dev, m) {
                    ok = false;
                    first_err.get_or_insert(e);
                }
            }
            if ok {
                if let Err(e) = self.release_to_sleep(inner, addr, Some(backup), report) {
                    first_err.get_or_insert(e);
                }
            }
        }
        Self::drop_retained(inner, &sp.backed);
        let mut now = sp.now;
        for addr in sp.backed {
            let asleep_with_backup = matches!(
                inner.reg.get(addr).map(|a| &a.state),
                Some(State::Asleep { backup: Some(_) })
            );
            if let (true, Some(prints)) = (asleep_with_backup, now.remove(&addr)) {
                inner.prints.insert(addr, prints);
            }
        }
    }
}
