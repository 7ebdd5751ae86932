//! Verified wakes: every chunk a wake restores is compared with the fingerprint its sleep took, at every tier (raw
//! host, compressed host, raw file, compressed file), in one pass. Data at rest (host RAM, files a user can reach)
//! is never trusted blindly.
//!
//! Prints: a sleep fingerprints every allocation it backs up, on the device and before its backup is made (one
//! batch per device, queued ahead of the copies: retain.rs), and the prints of each allocation that went to sleep
//! with a raw backup are kept here until the wake that restores it (`SleepPrinted`); compressed backups carry
//! their own, taken before the codec ran (compressed.rs, file_packed.rs). Retention reads the same prints: a wake
//! that binds a backup to its allocation hands them over (retain.rs).
//!
//! Wake: once every restore is issued (host copies, the file pipeline, the codec) and every allocation is mapped,
//! `queue_wake_check` queues one fingerprint batch per device over the restored chunks, on the copy stream behind
//! the restore copies: on CUDA the kernel (~1.2 TB/s) starts as the last copy lands, and the wake's one wait per
//! device covers it. It is queued after the last map, not between them: a kernel in flight holds up maps (retain.rs
//! measured 145 ms on an H200). `finish_wake_check` takes the prints (always, failure or not: one batch per device
//! at a time) and compares them; a mismatch fails the wake like a failed copy, naming the allocations, and the
//! engine releases what the wake mapped, the backups stay. An allocation found wrong is never retained again: the
//! wake that later restores it does not bind its backup, so its next sleep writes it whole.
//!
//! Not verified (and not counted in `verified_bytes`): backups without prints (their sleep's fingerprints failed,
//! or the kernel cannot run here), those a writable view was handed out for since their sleep (view.rs: a write
//! through it is the caller's to make, restored as written), and every backup while `CUMEM_RS_VERIFY_WAKE=0`.

use std::collections::{HashMap, HashSet};

use super::{Backup, BackupStore};
use crate::driver::DevPtr;
use crate::error::{Error, Result};
use crate::fingerprint::{self, Fingerprint};
use crate::registry::Registry;

/// Allocations named one by one in a mismatch's message; the others are counted.
const NAMED: usize = 8;

/// The prints a sleep took of an allocation it put to sleep with a raw backup.
pub(super) struct SleepPrinted {
    /// Bytes per chunk when they were taken.
    pub(super) chunk: usize,
    pub(super) prints: Vec<Fingerprint>,
    /// Whether a wake may bind the backup with them as a retained one (false once every retained backup was
    /// dropped since: trim, retention off, a new chunk size); verification uses them either way.
    pub(super) retainable: bool,
}

/// The store's verification state.
pub(super) struct Verification {
    /// Wakes verify (`CUMEM_RS_VERIFY_WAKE`, on by default).
    pub(super) on: bool,
    /// The prints of the raw backups of asleep allocations.
    pub(super) asleep: HashMap<DevPtr, SleepPrinted>,
    /// Allocations whose backup a wake found wrong: never bound as retained (`take_suspect`).
    suspect: HashSet<DevPtr>,
}

impl Verification {
    pub(super) fn new(on: bool) -> Verification {
        Verification {
            on,
            asleep: HashMap::new(),
            suspect: HashSet::new(),
        }
    }

    /// Whether `addr`'s backup was found wrong since it went to sleep (and forget that).
    pub(super) fn take_suspect(&mut self, addr: DevPtr) -> bool {
        self.suspect.remove(&addr)
    }

    /// `addrs` were freed.
    pub(super) fn forget(&mut self, addrs: &[DevPtr]) {
        for a in addrs {
            self.asleep.remove(a);
            self.suspect.remove(a);
        }
    }
}

/// One restored allocation a wake compares: its chunks and the prints its sleep took of them.
struct Expected {
    addr: DevPtr,
    size: usize,
    chunk: usize,
    prints: Vec<Fingerprint>,
    /// The kind of backup it was restored from, for the message.
    from: &'static str,
}

/// A wake's verification, queued (`queue_wake_check`): per device, the allocations of its batch in order, and
/// whether the batch is queued. Hand it to `finish_wake_check` whatever happens next.
#[derive(Default)]
pub struct WakeCheck {
    batches: Vec<(i32, Vec<Expected>, bool)>,
}

impl Backup {
    /// What kind of backup this is, as a mismatch names it.
    fn kind_name(&self) -> &'static str {
        match (self.in_host(), self.is_compressed()) {
            (true, false) => "raw host backup",
            (true, true) => "compressed host backup",
            (false, false) => "raw file backup",
            (false, true) => "compressed file backup",
        }
    }

    /// The prints its sleep took, as (chunk, prints), when it carries them (compressed ones do).
    fn own_prints(&self) -> Option<(usize, &[Fingerprint])> {
        if let Some(p) = self.packed() {
            return Some((p.chunk, &p.prints));
        }
        self.file_packed().map(|p| p.sleep_prints())
    }
}

impl BackupStore {
    /// Whether wakes compare what they restored with the sleep's prints.
    pub fn verifies_wakes(&self) -> bool {
        self.verify.on
    }

    /// Verification on or off from the next wake on (and whether sleeps take prints for it).
    pub fn set_verify_wakes(&mut self, on: bool) {
        self.verify.on = on;
    }

    /// Wake, once every restore is issued and every allocation of `placed` ((device, addr), asleep with a backup)
    /// is mapped: queue the fingerprints of their chunks, one batch per device, on the copy stream behind the
    /// restore copies (see the module comment). The check comes back whatever the result (a device whose batch
    /// could not be queued is marked so); nothing is queued while verification is off.
    pub fn queue_wake_check(
        &self,
        placed: &[(i32, DevPtr)],
        reg: &Registry,
    ) -> (WakeCheck, Result<()>) {
        let mut check = WakeCheck::default();
        if !self.verify.on {
            return (check, Ok(()));
        }
        let mut per_device: Vec<(i32, Vec<Expected>)> = Vec::new();
        for &(device, addr) in placed {
            let Some(backup) = self.asleep.get(&addr) else {
                continue;
            };
            if self.views.touched(addr) {
                continue; // written through a view, maybe: restored as written (view.rs)
            }
            let size = reg.get(addr).expect("selected").size;
            let printed = (backup.own_prints())
                .or_else(|| (self.verify.asleep.get(&addr)).map(|p| (p.chunk, &p.prints[..])));
            let Some((chunk, prints)) = printed.filter(|(c, p)| p.len() == size.div_ceil(*c))
            else {
                continue; // no prints to compare with
            };
            let expected = Expected {
                addr,
                size,
                chunk,
                prints: prints.to_vec(),
                from: backup.kind_name(),
            };
            match per_device.iter_mut().find(|(d, _)| *d == device) {
                Some((_, list)) => list.push(expected),
                None => per_device.push((device, vec![expected])),
            }
        }
        let mut result = Ok(());
        for (device, list) in per_device {
            let ranges: Vec<(DevPtr, usize)> = (list.iter())
                .flat_map(|e| fingerprint::chunk_ranges(e.addr, e.size, e.chunk))
                .collect();
            let queued = result.is_ok() && {
                let r = self.driver.queue_fingerprints(device, &ranges);
                let ok = r.is_ok();
                result = r;
                ok
            };
            check.batches.push((device, list, queued));
        }
        (check, result)
    }

    /// After the wake's wait: take every batch `check` queued (also when `compare` is false: the wake failed or
    /// its wait did), then, with `compare`, compare each allocation's prints with its sleep's. Ok: the bytes
    /// verified. A mismatch marks the allocations found wrong (never retained again) and fails with an error
    /// naming them.
    pub fn finish_wake_check(
        &mut self,
        check: WakeCheck,
        reg: &Registry,
        compare: bool,
    ) -> Result<usize> {
        let mut result = Ok(());
        let mut wrong: Vec<(DevPtr, &'static str, usize)> = Vec::new();
        let mut verified = 0;
        for (device, list, queued) in check.batches {
            if !queued {
                continue;
            }
            let taken = self.driver.take_fingerprints(device);
            if !compare || result.is_err() {
                continue;
            }
            let got = match taken {
                Ok(got) => got,
                Err(e) => {
                    result = Err(e);
                    continue;
                }
            };
            let mut rest = got.as_slice();
            for e in list {
                let n = e.prints.len();
                let Some((mine, tail)) = rest.split_at_checked(n) else {
                    result = Err(Error::InvalidState(format!(
                        "wake: the fingerprint pass on device {device} returned fewer prints than chunks"
                    )));
                    break;
                };
                rest = tail;
                match fingerprint::first_mismatch(&e.prints, mine) {
                    Some(i) => wrong.push((e.addr, e.from, i * e.chunk)),
                    None => verified += e.size,
                }
            }
        }
        result?;
        if wrong.is_empty() {
            return Ok(verified);
        }
        self.verify.suspect.extend(wrong.iter().map(|w| w.0));
        Err(mismatch(&wrong, reg))
    }
}

/// The error of a wake whose restored bytes differ from the sleep's prints: (addr, backup kind, chunk offset) of
/// each allocation found wrong.
fn mismatch(wrong: &[(DevPtr, &'static str, usize)], reg: &Registry) -> Error {
    let named: Vec<String> = (wrong.iter().take(NAMED))
        .map(|&(addr, from, at)| {
            let tag = reg.get(addr).map_or("?", |a| &a.tag);
            format!("{addr:#x} (tag {tag:?}, {from}, chunk at +{at:#x})")
        })
        .collect();
    let more = match wrong.len().saturating_sub(NAMED) {
        0 => String::new(),
        n => format!(" and {n} more"),
    };
    let (what, them) = match wrong.len() {
        1 => ("allocation", "its"),
        _ => ("allocations", "their"),
    };
    Error::InvalidState(format!(
        "wake: {what} {}{more} did not restore intact: the restored bytes differ from the fingerprints {them} sleep \
         took (the backup was changed or damaged where it lay, or a copy went wrong); every allocation stays asleep \
         with its backup",
        named.join(", ")
    ))
}
