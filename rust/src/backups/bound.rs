//! The bound on host backup memory: what the store holds (arenas that backups point into, plus the cached one)
//! stays within the bytes of the backups still referenced (of allocations asleep with a backup, and the retained
//! ones of awake allocations, see retain.rs) plus one spare arena no larger than the largest backup a sleep made
//! (or `reserve_host` asked for).
//!
//! Why it needs enforcing: a wake of some tags leaves holes in the arena the others still use, and the next
//! sleep needs a new arena for what it backs up, so rounds of sleep and partial wake would multiply the memory
//! held. After every call that can free a backup or make an arena (sleep, wake, free), when the bound is
//! passed, the cached arena is returned first; if that is not enough, the backups still referenced from arenas
//! with holes are moved (a host memcpy, with no device copy in flight) into one arena of exactly their size, and
//! the old arenas are given back. A moved retained backup keeps its fingerprints: same bytes.
//!
//! Under a host budget that move is refused (the new arena would sit beside the old ones, past the budget), so
//! holes are reused instead: a sleep whose host backups do not fit the budget beside the arenas in use (or not
//! the host RAM guard) puts them all into one hole of an arena in use, wholly pinned, that takes them (the
//! smallest such), rather than refusing them or sending them to files. The usual case is exactly the one that
//! makes holes: a partial wake of some tags, then a sleep of the same tags again.

use std::collections::HashMap;
use std::sync::Arc;

use super::{Backup, BackupStore};
use crate::driver::DevPtr;
use crate::error::Result;
use crate::error_log::ErrorLog;
use crate::host::HostBuffer;

/// The host arena a sleep copies its host backups into (`BackupStore::sleep_arena`).
pub enum SleepArena {
    /// A new or cached buffer (`BackupStore::arena_for_sleep`), for the sleep to adopt.
    Own(HostBuffer),
    /// The bytes from `offset` of an arena in use that no backup uses (a hole that wakes left), wholly pinned:
    /// the sleep's backups are laid out from there.
    Hole {
        arena: Arc<HostBuffer>,
        offset: usize,
    },
}

impl SleepArena {
    /// Bytes of the first `len` that are still to pin (a hole: none).
    pub fn unpinned_below(&self, len: usize) -> usize {
        match self {
            SleepArena::Own(buf) => buf.unpinned_below(len),
            SleepArena::Hole { .. } => 0,
        }
    }
}

impl BackupStore {
    /// The arena a sleep backs `total` bytes up into: `arena_for_sleep`'s, or, when that is refused under a host
    /// budget, the smallest hole of an arena in use that takes all `total` bytes (see the module comment).
    /// Refused, changing nothing, when there is neither.
    pub fn sleep_arena(&mut self, total: usize, log: &mut ErrorLog) -> Result<SleepArena> {
        match self.arena_for_sleep(total, log) {
            Ok(buf) => Ok(SleepArena::Own(buf)),
            Err(e) => match self.budget.and_then(|_| self.find_hole(total)) {
                Some((arena, offset)) => {
                    log::debug!(
                        "backup store: {total} bytes of host backups go into a hole at {offset} of an arena of \
                         {} bytes (the host budget allows no new arena)",
                        arena.len()
                    );
                    Ok(SleepArena::Hole { arena, offset })
                }
                None => Err(e),
            },
        }
    }

    /// The longest run of unused, pinned bytes in one arena in use (0 without any).
    pub(super) fn largest_hole(&self) -> usize {
        self.holes().map(|(_, _, len)| len).max().unwrap_or(0)
    }

    /// The smallest hole of at least `len` bytes, as (arena, offset).
    fn find_hole(&self, len: usize) -> Option<(Arc<HostBuffer>, usize)> {
        (self.holes())
            .filter(|h| h.2 >= len)
            .min_by_key(|h| h.2)
            .map(|(arena, offset, _)| (arena.clone(), offset))
    }

    /// Every maximal run of bytes of an arena in use that no backup (asleep or retained) or live view lies in and that is
    /// pinned whole, as (arena, offset, length). The blobs of compressed backups lie in arenas too: their bytes
    /// are in use like a raw backup's. Copies into an arena are waited for before the call that queued them
    /// returns, so no copy is in flight into a hole.
    pub(super) fn holes(&self) -> impl Iterator<Item = (&Arc<HostBuffer>, usize, usize)> {
        let mut used: HashMap<usize, Vec<(usize, usize)>> = HashMap::new();
        let backups = (self.asleep.values()).chain(self.retention.backups().map(|(_, b)| b));
        for b in backups {
            if let Some((arena, offset)) = b.arena() {
                let ranges = used.entry(Arc::as_ptr(arena) as usize).or_default();
                ranges.push((offset, b.len));
            }
            for (arena, offset, len) in b.packed().into_iter().flat_map(|p| p.blob_ranges()) {
                let ranges = used.entry(Arc::as_ptr(arena) as usize).or_default();
                ranges.push((offset, len));
            }
        }
        // Blobs a sleep placed and has not handed over yet (compressed.rs), and those it keeps.
        for (arena, offset, len) in &self.placed {
            let ranges = used.entry(Arc::as_ptr(arena) as usize).or_default();
            ranges.push((*offset, *len));
        }
        // Bytes that live views show stay as they are (view.rs).
        for (arena, offset, len) in self.views.ranges() {
            let ranges = used.entry(Arc::as_ptr(&arena) as usize).or_default();
            ranges.push((offset, len));
        }
        self.arenas.iter().flat_map(move |arena| {
            let mut ranges = used
                .remove(&(Arc::as_ptr(arena) as usize))
                .unwrap_or_default();
            ranges.sort_unstable();
            ranges.push((arena.len(), 0)); // the tail
            let mut gaps = Vec::new();
            let mut at = 0;
            for (offset, len) in ranges {
                if offset > at {
                    gaps.push((arena, at, offset - at));
                }
                at = at.max(offset + len);
            }
            // Pinned whole: nothing unpinned between its start and its end.
            gaps.retain(|&(arena, offset, len)| {
                arena.unpinned_below(offset + len) == arena.unpinned_below(offset)
            });
            gaps
        })
    }

    /// Bring the host memory held back within its bound (see the module comment). Failures are recorded: the
    /// backups stay where they are, correct, and the next call tries again.
    pub(super) fn bound(&mut self, log: &mut ErrorLog) {
        if self.within_bound() {
            return;
        }
        if let Err(e) = self.host.trim() {
            log.record("returning cached host backup memory", &e);
        }
        if self.within_bound() {
            return;
        }
        self.compact_holes(
            "compacting host backups (host memory stays above its bound until a later call)",
            log,
        );
        if !self.within_bound() {
            if let Err(e) = self.host.trim() {
                log.record("returning cached host backup memory", &e);
            }
        }
    }

    /// Before a spare of `len` bytes is reserved (`reserve_host`, pinning ahead): when holding it beside what is
    /// held now would pass the bound, the backups in arenas with holes are compacted first, so that the arena
    /// they leave is the one the reservation reuses instead of a second one beside it.
    pub(super) fn make_room_for_spare(&mut self, len: usize, log: &mut ErrorLog) {
        // The pool caches one buffer (the largest offered), which the reservation reuses when large enough.
        let wanted = len.saturating_sub(self.host.cached_bytes());
        if self.held().saturating_add(wanted) <= self.allowed_with_spare(len) {
            return;
        }
        self.compact_holes(
            "compacting host backups before a reservation (host memory may stay above its bound)",
            log,
        );
    }

    /// Compact (a failure is recorded under `context`: the backups stay where they are), then give back the
    /// arenas left unused.
    fn compact_holes(&mut self, context: &str, log: &mut ErrorLog) {
        if let Err(e) = self.compact(log) {
            log.record(context, &e);
        }
        // Compressed backups' blob arenas too (compressed.rs).
        if let Err(e) = self.compact_packed(log) {
            log.record(context, &e);
        }
        self.give_back_unused(log);
    }

    /// The most host memory the bound allows now with a spare of `spare` bytes (`reserve_host`).
    pub(super) fn allowed_with_spare(&self, spare: usize) -> usize {
        self.referenced_bytes()
            .saturating_add(self.largest.max(spare))
    }

    fn referenced_bytes(&self) -> usize {
        self.asleep_bytes + self.retention.retained_bytes()
    }

    fn within_bound(&self) -> bool {
        let held = self.held();
        // Cheap first: with nothing asleep or retained this is all a free needs to look at.
        held <= self.largest || held <= self.allowed_with_spare(0)
    }

    /// Move the backups in arenas with unused bytes into one new arena of exactly their size.
    fn compact(&mut self, log: &mut ErrorLog) -> Result<()> {
        // (allocation, its arena and offset, length, retained by an awake allocation); file backups stay put.
        let mut moves: Vec<(DevPtr, Arc<HostBuffer>, usize, usize, bool)> = (self.asleep.iter())
            .map(|(a, b)| (*a, b, false))
            .chain(self.retention.backups().map(|(a, b)| (a, b, true)))
            .filter_map(|(a, b, r)| {
                b.arena()
                    .map(|(arena, off)| (a, arena.clone(), off, b.len, r))
            })
            .collect();
        // In address order (asleep ones first): neighbours on the device then lie back to back in the new arena,
        // so a wake restores each run of them in one copy (`queue_restore`).
        moves.sort_by_key(|(addr, .., retained)| (*retained, *addr));
        let mut used: HashMap<usize, usize> = HashMap::new(); // arena address -> bytes of backups in it
        for (_, arena, _, len, _) in &moves {
            *used.entry(Arc::as_ptr(arena) as usize).or_default() += len;
        }
        moves.retain(|(_, arena, ..)| used[&(Arc::as_ptr(arena) as usize)] < arena.len());
        let total: usize = moves.iter().map(|m| m.3).sum();
        if total == 0 {
            return Ok(());
        }
        // The new arena sits beside the old ones until the move is done: not past the host budget, nor past what
        // the host can give (the old ones are freed only after it).
        if let Err(e) = (self.check_budget(total, "compacting host backups")).and_then(|()| {
            self.room
                .check(total, self.resident(), "compacting host backups")
        }) {
            log::debug!("backup store: not compacting {total} bytes of host backups: {e}");
            return Ok(());
        }
        // A new buffer of exactly their size: a cached spare taken for it would become an arena with a hole of
        // its own, and the next reservation would need a spare beside it.
        let (mut buf, fallback) = HostBuffer::acquire(&self.driver, total)?;
        let refused_threads = std::mem::take(&mut buf.notes);
        super::record_pinning(log, fallback.into_iter().collect(), refused_threads);
        let mut offset = 0;
        let mut placed = Vec::with_capacity(moves.len());
        for (addr, arena, from, len, retained) in moves {
            buf.copy_from(offset, &arena, from, len);
            placed.push((addr, offset, len, retained));
            offset += len;
        }
        let arena = Arc::new(buf);
        for (addr, offset, len, retained) in placed {
            let backup = Backup::in_arena(&arena, offset, len);
            if retained {
                self.retention.rebind(addr, backup);
            } else {
                self.asleep.insert(addr, backup);
            }
        }
        self.arenas.push(arena);
        log::debug!("backup store: moved {total} bytes of host backups out of arenas with holes");
        Ok(())
    }
}
