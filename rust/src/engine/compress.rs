//! The engine's side of compressed backups (`crate::backups` compresses; this chooses what and releases).
//!
//! At a sleep, the host-tier allocations of tags whose policy compresses are handed to the store's `pack` before
//! any raw arena is taken: their backups are complete when it returns, so they are released with the
//! allocations that need no backup. A failure of `pack` (prints, codec, host memory) changes nothing: it is
//! recorded and those allocations are copied raw by the same sleep. The tier plan counted the fresh ones at
//! their raw size, but not those with a retained compressed backup (split off before it): once those are to be
//! copied raw, the caller plans the tiers again with them.

use super::{Engine, Inner, Report};
use crate::backups::{PackJob, PackedSleep, SleepPrints};
use crate::driver::DevPtr;
use crate::error::Error;

/// Context of a sleep's compression that failed (its allocations were copied raw).
pub const COMPRESS_FELL_BACK: &str = "compressing backups (this sleep copied them raw instead)";

impl Engine {
    /// Split the host-tier allocations `backed` into those the sleep compresses and the rest (returned), and
    /// compress the first with `retained` (allocations with a retained compressed backup). On failure everything
    /// goes back to the raw path. Third: the allocations of `retained` that are now to be copied raw (their
    /// retained backup dropped), which the tier plan has not counted.
    pub(super) fn pack_backups(
        &self,
        inner: &mut Inner,
        backed: Vec<DevPtr>,
        retained: Vec<DevPtr>,
    ) -> (Vec<DevPtr>, PackedSleep, Vec<DevPtr>) {
        let on = inner.backups.compressing();
        let kind_of = |inner: &Inner, addr: DevPtr| {
            let a = inner.reg.get(addr).expect("selected");
            inner.policies.compress_kind(&a.tag).filter(|_| on)
        };
        let (mut raw, mut jobs) = (Vec::new(), Vec::new());
        for addr in backed {
            // An allocation the codec could not shrink last time is copied raw (counted: it is tried again later).
            match kind_of(inner, addr).filter(|_| !inner.backups.skips_codec(addr)) {
                Some(kind) => {
                    let a = inner.reg.get(addr).expect("selected");
                    jobs.push(PackJob {
                        addr,
                        device: a.device,
                        size: a.size,
                        kind,
                    });
                }
                None => raw.push(addr),
            }
        }
        // A retained compressed backup of a tag that no longer compresses is dropped: copied raw.
        let (retained, uncompressed): (Vec<DevPtr>, Vec<DevPtr>) = retained
            .into_iter()
            .partition(|a| kind_of(inner, *a).is_some());
        let mut unplanned = uncompressed;
        inner.backups.drop_retained(&unplanned);
        raw.sort_unstable();
        if jobs.is_empty() && retained.is_empty() {
            return (raw, PackedSleep::default(), unplanned);
        }
        // What the same sleep then copies raw: the placer leaves it a cached buffer of that size.
        let raw_after = (raw.iter())
            .map(|a| inner.reg.get(*a).map_or(0, |a| a.size))
            .sum();
        match inner
            .backups
            .pack(&inner.reg, &jobs, &retained, raw_after, &mut inner.log)
        {
            Ok(packed) => (raw, packed, unplanned),
            Err(e) => {
                inner.log.record(COMPRESS_FELL_BACK, &e);
                inner.backups.drop_retained(&retained);
                raw.extend(jobs.iter().map(|j| j.addr));
                raw.sort_unstable();
                unplanned.extend(retained);
                (raw, PackedSleep::default(), unplanned)
            }
        }
    }

    /// Release the allocations whose compressed backup `pack` made, their prints kept with the sleep's.
    pub(super) fn release_packed(
        &self,
        inner: &mut Inner,
        packed: PackedSleep,
        prints: &mut SleepPrints,
        report: &mut Report,
        first_err: &mut Option<Error>,
    ) {
        let retaining = inner.backups.retaining();
        report.chunks_checked += packed.chunks_checked;
        report.skipped_bytes += packed.skipped_bytes;
        let mut copied = 0;
        for (addr, backup, fps) in packed.backups {
            let (size, stored) = (backup.len(), backup.stored_len());
            prints.add_packed(addr, fps, retaining);
            match self.release_to_sleep(inner, addr, Some(backup), report) {
                Ok(()) => {
                    copied += size;
                    report.raw_bytes += size;
                    report.stored_bytes += stored;
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        // Unchanged chunks of retained backups were neither compressed nor copied.
        report.copied_bytes += copied.saturating_sub(packed.skipped_bytes);
    }
}
