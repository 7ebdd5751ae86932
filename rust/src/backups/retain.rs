//! Retained backups: a backup that a wake restored from stays bound to its allocation, so that the next sleep
//! copies only the chunks that changed since: into its host arena, or (a file backup) through the staging ring
//! into its spill file at their offsets (file_tier.rs).
//!
//! What changed is told by 128-bit fingerprints of fixed chunks, computed on the device at every sleep, in one
//! kernel pass over the offloaded allocations queued ahead of their copies. The prints taken at a sleep describe
//! the backup it made, hence the device contents right after the wake that restores it; the next sleep compares
//! its own prints with them. (Fingerprinting at wake instead, behind the restore copies, was measured to hold up
//! the wake by ~145 ms on an H200 with 48 GiB mapped under the copies: a kernel in flight serializes with maps.
//! The wake's verification, verify.rs, fingerprints what it restored only once every allocation is mapped.)
//!
//! Safety rules (stale data is never an outcome):
//! - prints and retained backups are dropped by free, discard, a sleep that does not offload the tag, a wake
//!   without retention, trim_host, set_keep_host_memory(False), set_retain_backups(False), a chunk size change
//!   (by the last four, the backups of asleep allocations are left unprinted: still bound by a wake that retains);
//! - any failure in this path (prints that cannot be queued or read) counts every chunk as changed, and an
//!   allocation whose new prints are missing keeps none; a wake that retains binds a backup whose sleep took no
//!   prints because wakes did not retain then, and its next sleep copies it whole, into the same bytes;
//! - a sleep that fails leaves the allocation awake and drops its retained backup, whose host bytes may be half
//!   overwritten; copies into it are always waited for before that.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use super::file_tier::{align_runs, FileRewrite};
use super::{Backup, BackupStore};
use crate::driver::{DevPtr, Driver, FINGERPRINTS_UNAVAILABLE};
use crate::error::{Error, Result};
use crate::error_log::ErrorLog;
use crate::fingerprint::{self, Fingerprint};
use crate::registry::Registry;

/// The fingerprints of an allocation's chunks (of the current chunk size: a change of size drops them all), as
/// its backup holds them.
type Prints = Vec<Fingerprint>;

/// Per device: the allocations of one fingerprint batch, in batch order.
type Batches = HashMap<i32, Vec<DevPtr>>;

/// A device and the marker after some of its stream's work (None: wait for the whole stream instead).
type StreamPoint = (i32, Option<u64>);

/// The retained backups, the prints of every backup, and the knobs that decide whether wakes retain.
pub(super) struct Retention {
    /// Backups kept bound to awake allocations after the wake that restored them.
    pub(super) retained: HashMap<DevPtr, Backup>,
    /// Chunk fingerprints of retained backups (those of asleep allocations are the store's, verify.rs, until the
    /// wake that binds them).
    prints: HashMap<DevPtr, Prints>,
    /// Asleep allocations whose sleep took no prints because wakes did not retain then (not because prints
    /// failed): a wake that retains binds their backup all the same (see `bind_restored`).
    unprinted: HashSet<DevPtr>,
    /// Policy: keep backups across wake (`set_retain_backups`).
    on: bool,
    /// Set when the fingerprint kernel cannot run here: retention stays off.
    pub(super) unavailable: bool,
    /// Bytes per fingerprinted chunk.
    pub(super) chunk: usize,
}

impl Retention {
    pub(super) fn new(on: bool, chunk: usize) -> Retention {
        Retention {
            retained: HashMap::new(),
            prints: HashMap::new(),
            unprinted: HashSet::new(),
            on,
            unavailable: false,
            chunk,
        }
    }

    /// Host bytes of retained backups (those in files hold disk, not host memory).
    pub(super) fn retained_bytes(&self) -> usize {
        (self.retained.values())
            .filter(|b| b.in_host())
            .map(Backup::stored_len)
            .sum()
    }

    pub(super) fn backups(&self) -> impl Iterator<Item = (DevPtr, &Backup)> {
        self.retained.iter().map(|(a, b)| (*a, b))
    }

    /// A retained backup moved (compaction): same bytes, same prints.
    pub(super) fn rebind(&mut self, addr: DevPtr, backup: Backup) {
        self.retained.insert(addr, backup);
    }

    pub(super) fn drop(&mut self, addrs: &[DevPtr]) {
        if self.prints.is_empty() && self.retained.is_empty() && self.unprinted.is_empty() {
            return;
        }
        for a in addrs {
            self.prints.remove(a);
            self.retained.remove(a);
            self.unprinted.remove(a);
        }
    }

    /// Forget every print and retained backup. The backups of asleep allocations stay what a wake restores:
    /// those with prints become unprinted, so that a wake that retains by then (keep_host_memory or retention
    /// turned on again while they sleep) binds them all the same, and their next sleep copies them whole.
    fn clear(&mut self) {
        let asleep: Vec<DevPtr> = (self.prints.keys())
            .filter(|a| !self.retained.contains_key(a))
            .copied()
            .collect();
        self.unprinted.extend(asleep);
        self.prints.clear();
        self.retained.clear();
    }
}

/// The fingerprint part of one sleep, in three steps: `begin_sleep_prints` (queue), `issue_changed_chunks`
/// (compare, queue the copies of changed chunks), then the engine releases each retained allocation as
/// `next_changed` reports its copies done, and `keep_sleep_prints` keeps the new prints. Dropped before the end
/// (a sleep unwinding from a panic), it still waits for every marker it recorded and forgets its batches.
pub struct SleepPrints {
    driver: Arc<dyn Driver>,
    /// Whether wakes retained when this sleep began (else it takes no prints).
    retaining: bool,
    batches: Batches,
    /// Markers after the fingerprint batches (None: no marker could be recorded, wait for the whole stream).
    markers: Vec<StreamPoint>,
    /// Offloaded allocations with a retained backup.
    retained: Vec<DevPtr>,
    /// Every offloaded allocation of this sleep.
    backed: Vec<DevPtr>,
    /// Retained allocations whose changed chunks are queued, with their backup and, when something was copied,
    /// the device and the marker after their copies (None: wait for the whole stream), in queue order.
    queued: std::collections::VecDeque<(DevPtr, Backup, Option<StreamPoint>)>,
    /// The prints taken now, per allocation.
    now: HashMap<DevPtr, Vec<Fingerprint>>,
    /// Retained allocations whose backup is in a file: their changed runs, written by the engine through
    /// `BackupStore::plan_rewrites` once the host copies are done.
    file_rewrites: Vec<FileRewrite>,
    queue_seconds: f64,
    /// Chunks of retained backups compared, bytes not copied (unchanged), bytes copied (changed).
    pub chunks_checked: usize,
    pub skipped_bytes: usize,
    pub copied_bytes: usize,
    /// Seconds spent on fingerprints: queueing, waiting, comparing, queueing the changed chunks' copies.
    pub seconds: f64,
}

fn wait_marker_or_stream(driver: &dyn Driver, device: i32, marker: Option<u64>) -> Result<()> {
    match marker {
        Some(m) => driver.wait_marker(device, m),
        None => driver.wait(device),
    }
}

impl Drop for SleepPrints {
    fn drop(&mut self) {
        // Nothing left in the usual order: `read_sleep_prints` took the markers and batches, the engine drained
        // `queued`. After a panic, no marker may stay unwaited, nor a batch block the device's next one.
        for (dev, m) in std::mem::take(&mut self.markers) {
            let _ = wait_marker_or_stream(&*self.driver, dev, m);
        }
        for (_, _, point) in std::mem::take(&mut self.queued) {
            if let Some((dev, m)) = point {
                let _ = wait_marker_or_stream(&*self.driver, dev, m);
            }
        }
        for (dev, _) in std::mem::take(&mut self.batches) {
            let _ = self.driver.take_fingerprints(dev);
        }
    }
}

impl SleepPrints {
    /// An allocation that sleeps with a compressed backup (compressed.rs, which took its prints `prints`): its
    /// retained backup is dropped and its prints kept like the others' (`retaining`: only while wakes retain).
    pub fn add_packed(&mut self, addr: DevPtr, prints: Vec<Fingerprint>, retaining: bool) {
        self.backed.push(addr);
        if retaining {
            self.now.insert(addr, prints);
        }
    }

    /// Wait for the fingerprint markers `issue_changed_chunks` did not get to (none in the usual order).
    pub fn wait_leftover_markers(&mut self, driver: &dyn Driver) -> Result<()> {
        let mut result = Ok(());
        for (dev, m) in std::mem::take(&mut self.markers) {
            if let Err(e) = wait_marker_or_stream(driver, dev, m) {
                result = result.and(Err(e));
            }
        }
        result
    }

    /// The retained allocations with a file backup and their changed runs (see `file_tier::FileRewrites`).
    pub fn take_file_rewrites(&mut self) -> Vec<FileRewrite> {
        std::mem::take(&mut self.file_rewrites)
    }

    /// The next retained allocation whose changed chunks were queued, its backup, and the result of waiting for
    /// its copies (every marker is waited for, failure or not).
    pub fn next_changed(&mut self, driver: &dyn Driver) -> Option<(DevPtr, Backup, Result<()>)> {
        let (addr, backup, marker) = self.queued.pop_front()?;
        let waited = marker.map_or(Ok(()), |(dev, m)| wait_marker_or_stream(driver, dev, m));
        Some((addr, backup, waited))
    }
}

impl BackupStore {
    /// Whether sleeps take prints and wakes keep backups: the policy, kept host memory, a kernel that loads.
    pub fn retaining(&self) -> bool {
        self.retention.on && self.host.keep && !self.retention.unavailable
    }

    pub fn retained_bytes(&self) -> usize {
        self.retention.retained_bytes()
    }

    pub fn retained_count(&self) -> usize {
        self.retention.retained.len()
    }

    pub fn is_retained(&self, addr: DevPtr) -> bool {
        self.retention.retained.contains_key(&addr)
    }

    /// Whether `addr` has a retained backup in a spill file.
    pub fn is_retained_in_file(&self, addr: DevPtr) -> bool {
        (self.retention.retained.get(&addr)).is_some_and(|b| !b.in_host())
    }

    pub fn fingerprint_chunk(&self) -> usize {
        self.retention.chunk
    }

    /// Keep backups bound to their allocations across wake; off drops every retained backup.
    pub fn set_retain(&mut self, on: bool, log: &mut ErrorLog) {
        self.retention.on = on;
        if !on {
            self.drop_all_retained(log);
        }
    }

    /// A new chunk size drops every retained backup (their prints are of the old size).
    pub fn set_fingerprint_chunk(&mut self, bytes: usize, log: &mut ErrorLog) {
        if self.retention.chunk != bytes {
            self.retention.chunk = bytes;
            self.drop_all_retained(log);
        }
    }

    /// Forget the prints and retained backups of `addrs`.
    pub fn drop_retained(&mut self, addrs: &[DevPtr]) {
        self.retention.drop(addrs);
    }

    /// Forget every print and retained backup; arenas nothing points into go back to the host pool. The prints of
    /// asleep backups stay for their wake's verification, but no wake binds a backup with them any more.
    pub fn drop_all_retained(&mut self, log: &mut ErrorLog) {
        self.retention.clear();
        // Their backups stay what a wake restores: unprinted for retention (a wake that retains by then binds them
        // all the same, and their next sleep copies them whole), still printed for verification. (Found when the
        // memory saver's state machine, written before the prints of asleep backups moved to verify.rs, met them.)
        for (addr, p) in self.verify.asleep.iter_mut() {
            if p.retainable {
                p.retainable = false;
                self.retention.unprinted.insert(*addr);
            }
        }
        self.collect_unused(log);
    }

    /// A fingerprint failure: recorded; a kernel that does not load turns retention off for good (one warning).
    fn fingerprints_failed(&mut self, e: &Error, log: &mut ErrorLog) {
        let unloadable = matches!(e, Error::Driver { op, .. } if *op == FINGERPRINTS_UNAVAILABLE);
        if unloadable {
            // Retained backups already in use stay valid: their chunks now count as changed, and the next wake
            // binds none.
            self.retention.unavailable = true;
            log.record(
                "fingerprint kernel unavailable: retained backups are off, every sleep copies everything",
                e,
            );
        } else {
            log.record("fingerprints (these chunks count as changed)", e);
        }
    }

    // ----- wake --------------------------------------------------------------------------------------------

    /// Wake succeeded: bind each restored allocation's backup to it while wakes retain (with the prints that
    /// describe it, when its sleep took them); otherwise forget the prints. `restored` are the backups the wake
    /// restored from (taken with `take`). A backup a wake found wrong before (verify.rs) is never bound: the next
    /// sleep writes it whole.
    pub fn bind_restored(&mut self, restored: Vec<(DevPtr, Backup)>) {
        let keep = self.retaining();
        let chunk = self.retention.chunk;
        for (addr, backup) in restored {
            let printed = (self.verify.asleep.remove(&addr))
                .filter(|p| p.retainable && p.chunk == chunk)
                .map(|p| p.prints);
            let suspect = self.verify.take_suspect(addr);
            let r = &mut self.retention;
            // A file backup too: it keeps its disk blocks, and the next sleep rewrites its changed chunks only.
            // Without prints because its sleep did not retain (torch_memory_saver's retain_cpu_backup set while
            // paused) it is bound too, at the same host bytes: its next sleep counts every chunk as changed and
            // copies it whole there. Prints that failed bind nothing (see the module comment).
            let unprinted = r.unprinted.remove(&addr);
            r.prints.remove(&addr);
            if !keep || suspect {
                continue;
            }
            match printed {
                Some(prints) => {
                    r.prints.insert(addr, prints);
                    r.retained.insert(addr, backup);
                }
                None if unprinted => {
                    r.retained.insert(addr, backup);
                }
                None => {}
            }
        }
    }

    // ----- sleep -------------------------------------------------------------------------------------------

    /// Sleep, before the tiers are planned: the allocations of `retained` whose retained backup is compressed in a
    /// file (file_packed.rs) and whose contents changed since its sleep, or that have no prints to tell, leave
    /// `retained` and lose that backup (returned: the sleep backs them up afresh, planned with the others), since
    /// blobs cannot be rewritten in place. One fingerprint pass per device over those allocations; a failed pass
    /// counts them all as changed.
    pub fn split_changed_file_packed(
        &mut self,
        reg: &Registry,
        retained: &mut Vec<DevPtr>,
        log: &mut ErrorLog,
    ) -> Vec<DevPtr> {
        let r = &self.retention;
        let candidates: Vec<(DevPtr, i32, usize, usize)> = (retained.iter())
            .filter(|a| (r.retained.get(a)).is_some_and(|b| b.file_packed().is_some()))
            .map(|a| {
                let alloc = reg.get(*a).expect("selected");
                (*a, alloc.device, alloc.size, r.chunk)
            })
            .collect();
        if candidates.is_empty() {
            return Vec::new();
        }
        let changed: Vec<DevPtr> = match super::compressed::prints_of(&*self.driver, &candidates) {
            Ok(now) => (candidates.iter().zip(now))
                .filter(|((a, ..), now)| r.prints.get(a) != Some(now))
                .map(|((a, ..), _)| *a)
                .collect(),
            Err(e) => {
                log.record(
                    "fingerprinting compressed file backups (backed up afresh)",
                    &e,
                );
                candidates.iter().map(|c| c.0).collect()
            }
        };
        let gone: HashSet<DevPtr> = changed.iter().copied().collect();
        retained.retain(|a| !gone.contains(a));
        self.retention.drop(&changed);
        changed
    }

    /// Sleep, before anything is queued: split the offloaded allocations into those with a retained backup
    /// (returned; their changed chunks go into it) and the others (left in `backed`).
    pub fn split_retained(&self, backed: &mut Vec<DevPtr>) -> Vec<DevPtr> {
        let r = &self.retention;
        let (retained, fresh): (Vec<DevPtr>, Vec<DevPtr>) =
            backed.iter().partition(|a| r.retained.contains_key(a));
        *backed = fresh;
        retained
    }

    /// Sleep, first on the copy streams: queue the prints of every offloaded allocation (`retained` and
    /// `fresh`), one batch and a marker per device: for the retained ones' changed chunks, for the next sleep to
    /// skip, and for the wake's verification (verify.rs). Nothing is queued when neither retention nor
    /// verification is on, or when the kernel cannot run here.
    pub fn begin_sleep_prints(
        &mut self,
        reg: &Registry,
        retained: Vec<DevPtr>,
        fresh: &[DevPtr],
        log: &mut ErrorLog,
    ) -> SleepPrints {
        let started = Instant::now();
        let mut sp = SleepPrints {
            driver: self.driver.clone(),
            retaining: self.retaining(),
            batches: Batches::new(),
            markers: Vec::new(),
            backed: retained.iter().chain(fresh).copied().collect(),
            retained,
            queued: Default::default(),
            now: HashMap::new(),
            file_rewrites: Vec::new(),
            queue_seconds: 0.0,
            chunks_checked: 0,
            skipped_bytes: 0,
            copied_bytes: 0,
            seconds: 0.0,
        };
        if !(sp.retaining || self.verify.on) || self.retention.unavailable {
            return sp;
        }
        let chunk = self.retention.chunk;
        let mut per_device: Batches = HashMap::new();
        for &a in &sp.backed {
            let dev = reg.get(a).expect("selected").device;
            per_device.entry(dev).or_default().push(a);
        }
        for (dev, allocs) in per_device {
            let ranges: Vec<(DevPtr, usize)> = allocs
                .iter()
                .flat_map(|&a| {
                    fingerprint::chunk_ranges(a, reg.get(a).expect("selected").size, chunk)
                })
                .collect();
            if let Err(e) = self.driver.queue_fingerprints(dev, &ranges) {
                self.fingerprints_failed(&e, log);
                continue;
            }
            sp.batches.insert(dev, allocs);
            match self.driver.record_marker(dev) {
                Ok(m) => sp.markers.push((dev, Some(m))),
                Err(e) => {
                    log.record(
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
    /// marker per allocation.
    pub fn issue_changed_chunks(
        &mut self,
        reg: &Registry,
        sp: &mut SleepPrints,
        log: &mut ErrorLog,
    ) -> Result<()> {
        let started = Instant::now();
        self.read_sleep_prints(reg, sp, log);
        let chunk = self.retention.chunk;
        let mut result = Ok(());
        for &addr in &sp.retained {
            let a = reg.get(addr).expect("selected");
            let (device, size) = (a.device, a.size);
            let backup = self
                .retention
                .retained
                .get(&addr)
                .expect("split on it")
                .clone();
            // No prints of the backup (bound without them, see `bind_restored`): every chunk counts as changed. So
            // does every chunk of a backup handed out as a writable view since its last sleep (view.rs).
            let before = self.retention.prints.get(&addr);
            let after = sp.now.get(&addr).filter(|_| !self.views.touched(addr));
            // Runs of changed chunks, each copied with as few calls as the arena's pinned pieces allow.
            let mut runs: Vec<(usize, usize)> = Vec::new();
            for (i, (off, len)) in fingerprint::chunks(size, chunk).enumerate() {
                sp.chunks_checked += 1;
                if after.is_some_and(|f| before.is_some_and(|b| f.get(i) == b.get(i))) {
                    sp.skipped_bytes += len;
                } else if let Some(run) = runs.last_mut().filter(|r| r.0 + r.1 == off) {
                    run.1 += len;
                } else {
                    runs.push((off, len));
                }
            }
            if backup.file_packed().is_some() && !runs.is_empty() {
                // Checked unchanged before the tiers were planned (`split_changed_file_packed`): its blobs cannot
                // be rewritten in place, so it stays awake.
                result = Err(Error::InvalidState(format!(
                    "allocation {addr:#x} changed while its sleep ran; it stays awake"
                )));
                break;
            }
            if !backup.in_host() {
                // Written through the staging ring later (file_tier.rs), in whole I/O blocks.
                // Copied: the changed chunks, as for host backups (the report's written_bytes counts the whole
                // blocks written).
                sp.copied_bytes += runs.iter().map(|r| r.1).sum::<usize>();
                let runs = align_runs(&runs, size);
                sp.file_rewrites.push(FileRewrite {
                    addr,
                    device,
                    backup,
                    runs,
                });
                continue;
            }
            let copied = !runs.is_empty();
            for (off, len) in runs {
                if let Err(e) = backup.queue_from_device(device, addr + off as u64, off, len) {
                    result = Err(e);
                    break;
                }
                sp.copied_bytes += len;
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
            sp.queued.push_back((addr, backup, marker));
            if result.is_err() {
                break;
            }
        }
        sp.seconds = sp.queue_seconds + started.elapsed().as_secs_f64();
        result
    }

    /// Wait for the fingerprint batches and read them into `sp.now` (none after a failed wait).
    fn read_sleep_prints(&mut self, reg: &Registry, sp: &mut SleepPrints, log: &mut ErrorLog) {
        let mut stream_ok = true;
        for (dev, m) in std::mem::take(&mut sp.markers) {
            if let Err(e) = wait_marker_or_stream(&*self.driver, dev, m) {
                stream_ok = false;
                log.record("waiting for fingerprints", &e);
            }
        }
        for (dev, allocs) in std::mem::take(&mut sp.batches) {
            match self.driver.take_fingerprints(dev) {
                Ok(fps) if stream_ok => {
                    let mut rest = fps.as_slice();
                    for a in allocs {
                        let n = reg
                            .get(a)
                            .expect("selected")
                            .size
                            .div_ceil(self.retention.chunk);
                        let Some((mine, tail)) = rest.split_at_checked(n) else {
                            break;
                        };
                        sp.now.insert(a, mine.to_vec());
                        rest = tail;
                    }
                }
                Ok(_) => {}
                Err(e) => self.fingerprints_failed(&e, log),
            }
        }
    }

    /// Sleep, last step (every retained allocation released or left awake): the retained backups of this sleep's
    /// allocations are gone (released ones are asleep with them now; the others stay awake without one), and
    /// every allocation now asleep with a backup keeps the prints taken now (verify.rs holds them until its wake).
    pub fn keep_sleep_prints(&mut self, mut sp: SleepPrints) {
        self.retention.drop(&sp.backed);
        self.views.slept(&sp.backed);
        let mut now = std::mem::take(&mut sp.now);
        if !sp.retaining {
            let asleep = sp.backed.iter().filter(|a| self.asleep.contains_key(a));
            self.retention.unprinted.extend(asleep);
        }
        let chunk = self.retention.chunk;
        for addr in std::mem::take(&mut sp.backed) {
            if let (true, Some(prints)) = (self.asleep.contains_key(&addr), now.remove(&addr)) {
                // Taken only for the wake's verification (wakes did not retain): no wake binds with them, as
                // before verification took them (see `unprinted`).
                let printed = super::verify::SleepPrinted {
                    chunk,
                    prints,
                    retainable: sp.retaining,
                };
                self.verify.asleep.insert(addr, printed);
            }
        }
    }
}
