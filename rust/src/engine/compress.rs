//! The engine's side of compressed backups (`crate::backups` compresses; this chooses what and releases).
//!
//! At a sleep, the host-tier allocations of tags whose policy compresses are handed to the store's `pack` before
//! any raw arena is taken. Each is unmapped and released as soon as the store says its backup is complete, while
//! the codec goes on with the others (a sleep of compressed backups is bound by the link; its releases, 28 ms for
//! 1024 allocations of 12 MiB on the H200, ran after it), and marked asleep once `pack` returns. A failure of
//! `pack` (prints, codec, host memory) is recorded and the allocations it did not finish are copied raw by the
//! same sleep. The tier plan counted the fresh ones at their raw size, but not those with a retained compressed
//! backup (split off before it): once those are to be copied raw, the caller plans the tiers again with them.

use std::collections::HashMap;

use super::{Engine, Inner, Report};
use crate::backups::{PackJob, PackedOne, PackedSleep};
use crate::driver::{DevPtr, PhysHandle};
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::registry::{Backing, Registry, State};

use super::group::Groups;

/// Context of a sleep's compression that failed (its allocations were copied raw).
pub const COMPRESS_FELL_BACK: &str = "compressing backups (this sleep copied them raw instead)";

/// The prints of the allocations a sleep put to sleep with a compressed backup, for the sleep's `SleepPrints`.
pub(super) type PackedPrints = Vec<(DevPtr, Vec<Fingerprint>)>;

/// A sleep's compressed backups after `pack_backups`: those released while the codec ran, already asleep (their
/// prints), and the others, made and not yet released (`finish_packed` releases them with the allocations that
/// need no backup; a sleep refused before drops them, and they stay awake with their data). The others are what a
/// host budget keeps out of the codec's releases, and wake-group members whose group was not complete with them
/// (a member copied raw releases the group later).
#[derive(Default)]
pub(super) struct PackedBackups {
    pub asleep: PackedPrints,
    made: Vec<PackedOne>,
}

/// What became of an allocation released while `pack` ran: unmapped (its handle released, or the release's
/// failure to queue), or its unmap failed (it stays awake with its data).
enum Early {
    Unmapped(PhysHandle, Option<Error>),
    UnmapFailed(Error),
}

/// The releases done while `pack` runs: allocations on their own handle as each is complete, wake groups (one
/// handle under a run of allocations) once every live member is.
#[derive(Default)]
pub(super) struct EarlyReleases {
    own: HashMap<DevPtr, Early>,
    /// Members complete so far, per group.
    members_done: HashMap<u64, usize>,
    /// The groups unmapped, with what came of releasing their handle, or whose unmap failed.
    groups: HashMap<u64, Result<Option<Result<()>>>>,
}

impl Engine {
    /// Split the host-tier allocations `backed` into those the sleep compresses and the rest (returned), compress
    /// the first with `retained` (allocations with a retained compressed backup). Without a host budget each is
    /// released as soon as its backup is complete and what the codec did not finish goes back to the raw path;
    /// under one, the codec's backups are all or nothing (what a failure leaves to the raw path must fit the
    /// budget the tier plan checked: the blobs made before it would hold part of it) and released later. Second:
    /// those backups. Third: the allocations of `retained` that are now to be copied raw (their retained backup
    /// dropped), which the tier plan has not counted.
    pub(super) fn pack_backups(
        &self,
        inner: &mut Inner,
        backed: Vec<DevPtr>,
        retained: Vec<DevPtr>,
        report: &mut Report,
        first_err: &mut Option<Error>,
    ) -> (Vec<DevPtr>, PackedBackups, Vec<DevPtr>) {
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
            return (raw, PackedBackups::default(), unplanned);
        }
        // What the same sleep then copies raw: the placer leaves it a cached buffer of that size.
        let raw_after = (raw.iter())
            .map(|a| inner.reg.get(*a).map_or(0, |a| a.size))
            .sum();
        // Released under the codec only where no refusal can come after a release: no budget, and the worst
        // the sleep may pin fits the host's room (`may_release_while_packing`).
        let raw_packed: usize = (jobs.iter().map(|j| j.size))
            .chain(
                retained
                    .iter()
                    .map(|a| inner.reg.get(*a).map_or(0, |a| a.size)),
            )
            .sum();
        let may_release = inner.backups.host_budget().is_none()
            && (inner.backups).may_release_while_packing(raw_packed + raw_after);
        let mut early = EarlyReleases::default();
        let t = std::time::Instant::now();
        let mut in_hook = std::time::Duration::ZERO;
        let mut release = |addr| {
            let t = std::time::Instant::now();
            self.release_early(&inner.reg, &inner.groups, &mut early, addr);
            in_hook += t.elapsed();
        };
        let hook = match may_release {
            true => Some(&mut release as &mut dyn FnMut(DevPtr)),
            false => None,
        };
        let packed = (inner.backups).pack(
            &inner.reg,
            &jobs,
            &retained,
            raw_after,
            &mut inner.log,
            hook,
        );
        let pack_ms = t.elapsed().as_secs_f64() * 1e3;
        let mut packed = match packed {
            Ok(packed) => packed,
            Err(e) => {
                debug_assert!(
                    early.own.is_empty() && early.members_done.is_empty(),
                    "pack fails whole only before a backup is complete"
                );
                PackedSleep {
                    failed: Some(e),
                    unpacked: (jobs.iter().map(|j| j.addr))
                        .chain(retained.iter().copied())
                        .collect(),
                    ..PackedSleep::default()
                }
            }
        };
        if let Some(e) = packed.failed.take() {
            inner.log.record(COMPRESS_FELL_BACK, &e);
            let retained: std::collections::HashSet<DevPtr> = retained.into_iter().collect();
            let (lost, fresh): (Vec<DevPtr>, Vec<DevPtr>) =
                (packed.unpacked.drain(..)).partition(|a| retained.contains(a));
            inner.backups.drop_retained(&lost);
            raw.extend(fresh);
            raw.sort_unstable();
            unplanned.extend(lost);
        }
        // Those released under the codec go to sleep now, before anything else may refuse the sleep.
        let (released, made): (Vec<PackedOne>, Vec<PackedOne>) = (packed.backups.into_iter())
            .partition(|one| match group_of(&inner.reg, one.addr) {
                Some(id) => early.groups.contains_key(&id),
                None => early.own.contains_key(&one.addr),
            });
        let (n_own, n_groups) = (early.own.len(), early.groups.len());
        let t = std::time::Instant::now();
        let asleep = self.put_packed_to_sleep(inner, released, early, report, first_err);
        if n_own + n_groups > 0 {
            log::debug!(
                "compressed sleep: released while compressing: {n_own} allocations and {n_groups} wake groups \
                 ({:.1} ms of {pack_ms:.1} ms); marked asleep after: {:.1} ms",
                in_hook.as_secs_f64() * 1e3,
                t.elapsed().as_secs_f64() * 1e3
            );
        }
        (raw, PackedBackups { asleep, made }, unplanned)
    }

    /// The sleep's compressed backups asleep (those not released yet released now); their prints.
    pub(super) fn finish_packed(
        &self,
        inner: &mut Inner,
        packed: PackedBackups,
        report: &mut Report,
        first_err: &mut Option<Error>,
    ) -> PackedPrints {
        let mut prints = packed.asleep;
        let early = EarlyReleases::default();
        prints.extend(self.put_packed_to_sleep(inner, packed.made, early, report, first_err));
        prints
    }

    /// An allocation whose compressed backup `pack` just completed (the codec still running on others): unmapped
    /// and released, or for a wake-group member, its group unmapped once every live member is complete.
    fn release_early(
        &self,
        reg: &Registry,
        groups: &Groups,
        early: &mut EarlyReleases,
        addr: DevPtr,
    ) {
        let Some(a) = reg.get(addr) else { return };
        let State::Awake { backing } = a.state else {
            return;
        };
        match backing {
            Backing::Own(handle) => {
                let released = match self.driver.unmap(addr, a.size) {
                    Ok(()) => Early::Unmapped(handle, self.driver.release(handle).err()),
                    Err(e) => Early::UnmapFailed(e),
                };
                early.own.insert(addr, released);
            }
            Backing::Group(id) => {
                let Some(g) = groups.get(id) else { return };
                let done = early.members_done.entry(id).or_default();
                *done += 1;
                if *done == g.live {
                    let released = (self.driver.unmap(g.addr, g.size))
                        .map(|()| Some(self.driver.release(g.handle)));
                    early.groups.insert(id, released);
                }
            }
        }
    }

    /// Mark asleep the allocations whose compressed backup `pack` made: those released early as they are, the
    /// others released now. An allocation whose unmap failed stays awake with its data.
    fn put_packed_to_sleep(
        &self,
        inner: &mut Inner,
        backups: Vec<PackedOne>,
        mut early: EarlyReleases,
        report: &mut Report,
        first_err: &mut Option<Error>,
    ) -> PackedPrints {
        let (mut done, mut prints) = (Vec::new(), Vec::with_capacity(backups.len()));
        for one in backups {
            let PackedOne {
                addr,
                backup,
                prints: fps,
                chunks_checked,
                skipped_bytes,
            } = one;
            let (size, stored) = (backup.len(), backup.stored_len());
            let group = group_of(&inner.reg, addr);
            let released: Result<()> = match early.own.remove(&addr) {
                Some(Early::Unmapped(handle, release_failed)) => {
                    if let Some(e) = release_failed {
                        (inner.pending).retry_release(&mut inner.log, handle, &e);
                    }
                    report.allocations += 1;
                    Self::mark_asleep(inner, addr, Some(backup));
                    Ok(())
                }
                Some(Early::UnmapFailed(e)) => Err(e),
                None => match group.and_then(|id| early.groups.get_mut(&id).map(|r| (id, r))) {
                    // Its group was unmapped under the codec: the last member passes that result on.
                    Some((id, unmapped)) => {
                        let unmapped = unmapped.clone(); // used by the last member only
                        self.release_member_with(inner, id, addr, Some(backup), report, |_| {
                            unmapped
                        })
                    }
                    None => self.release_to_sleep(inner, addr, Some(backup), report),
                },
            };
            match released {
                Ok(()) => done.push((addr, fps, size, stored, chunks_checked, skipped_bytes)),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        // Counted once every backup was handed over: a wake-group member's release only marks it ready, and its
        // group's unmap (at the last member) may still fail and keep them all awake.
        for (addr, fps, size, stored, chunks_checked, skipped_bytes) in done {
            if !asleep_or_ready(inner, addr) {
                continue;
            }
            // Unchanged chunks of a retained backup were neither compressed nor copied.
            report.copied_bytes += size - skipped_bytes;
            report.skipped_bytes += skipped_bytes;
            report.chunks_checked += chunks_checked;
            report.raw_bytes += size;
            report.stored_bytes += stored;
            prints.push((addr, fps));
        }
        prints
    }
}

/// Asleep, or a wake-group member marked released, its group waiting for another member (released with it).
fn asleep_or_ready(inner: &Inner, addr: DevPtr) -> bool {
    match inner.reg.get(addr).map(|a| &a.state) {
        Some(State::Awake {
            backing: Backing::Group(id),
        }) => (inner.groups.get(*id)).is_some_and(|g| g.ready.iter().any(|(a, _)| *a == addr)),
        Some(State::Awake { .. }) | None => false,
        Some(_) => true,
    }
}

/// The wake group an awake allocation is a member of, if any.
fn group_of(reg: &Registry, addr: DevPtr) -> Option<u64> {
    match reg.get(addr).map(|a| &a.state) {
        Some(State::Awake {
            backing: Backing::Group(id),
        }) => Some(*id),
        _ => None,
    }
}
