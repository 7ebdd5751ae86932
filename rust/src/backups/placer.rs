//! The placer of a compressed sleep's blobs: back to back in host arenas it takes as needed, each blob inside
//! one pinned piece (the codec's copies must not span two registrations).
//!
//! A sleep's first arena is sized from the estimate of the ratio (the last sleep's) and found in the host cache
//! when the last sleep of the same weights left it there; it is mapped with address space for all the raw bytes,
//! so that data compressing worse than the estimate grows it in place (one more pinned piece) instead of a
//! second arena being pinned beside it: the host cache keeps one buffer, so a second arena would be returned at
//! every wake and pinned again at every sleep. Every arena and growth is checked against the host budget and
//! what the host can still pin first. `finish` moves a small last arena that is mostly unused into one of its
//! exact size.

use std::sync::Arc;

use super::blob_reuse::{padded, Reuse};
use super::BackupStore;
use crate::driver::HostPtr;
use crate::error::{Error, Result};
use crate::error_log::ErrorLog;
use crate::host::HostBuffer;

/// Largest range the codec is given (`DeviceCodec::compress_to_host`'s promise): no blob is larger.
pub const MAX_RANGE: usize = 2 << 20;

/// Smallest first arena mapped with room to grow in place. Below it a sleep that needs more takes a second arena,
/// which costs little at that size, and no piece end is left unused inside one arena (the host bound's spare
/// stays within the largest sleep's bytes, where a piece end would be a large share of a small arena).
const GROW_MIN_ARENA: usize = 8 << 20;

/// Smallest arena taken for blobs: a few pages, so that a small backup does not hold more than its raw size.
const MIN_ARENA: usize = 64 << 10;

/// Largest arena taken for blobs after a sleep's first one (which takes the whole estimate: see `Placer::place`),
/// and largest tail `finish` moves into an arena of its exact size (a host copy of at most this much).
const MAX_ARENA: usize = 256 << 20;

/// Room over the estimate for a sleep's first arena: the last sleep's ratio is close for weights that changed
/// little, and data that compresses worse grows the arena in place (`grow_last`: pinning the few percent more
/// costs milliseconds). Kept small because the arena outlives the sleep: the next ones reuse it as it is, so its
/// slack is host memory held at every cycle (H200, bf16 weights: 3% over the first guess held 0.711x of the raw
/// bytes for blobs of about 0.67x). Two hundredths: one for the room each blob is given (`padded`), one for the
/// estimate.
const ESTIMATE_SLACK: f64 = 1.02;

/// Address space a sleep's first arena reserves beyond the raw bytes it may hold: each growth in place starts a
/// new pinned piece, and the blob that did not fit the end of the last one leaves up to a range unused there.
const GROW_SLACK: usize = 4 * MAX_RANGE;

/// A cached arena is taken when it is at most this much larger than what the placer asks for; a larger one is
/// returned to the OS first (holding it beside a new arena would double the RAM, using it would hold its size).
const CACHED_SLACK: f64 = 1.06;

/// Context of a failure to pin the buffer a sleep's last blob arena was to move into (it stayed as it was).
const FINISH_KEPT: &str = "moving a blob arena into one of its used size (it was kept as it is)";

/// Hands out blob places back to back in arenas it takes as needed (see the module notes).
pub(super) struct Placer<'s> {
    pub(super) store: &'s mut BackupStore,
    pub(super) arenas: Vec<HostBuffer>,
    /// Bytes used in the last arena.
    used: usize,
    /// Bytes of the arenas taken so far, cached ones included (counted against the budget before the next).
    taken: usize,
    ratio: f64,
    /// Raw and stored bytes of the blobs placed so far, for `rest_ratio`.
    placed_raw: usize,
    placed_stored: usize,
    /// Bytes left unused at the ends of pinned pieces (a blob lies inside one piece).
    pub(super) skipped: usize,
    /// Failures to grow an arena in place (a new arena took the rest), for the sleep to record.
    pub(super) grow_failures: Vec<Error>,
    /// Raw bytes the same sleep copies raw after the blobs (allocations that do not compress): a cached buffer
    /// of that size is left to those copies instead of being returned to the OS.
    for_raw: usize,
    /// The dead blob bytes of retained backups, which take blobs before any arena is taken (blob_reuse.rs). Their
    /// arenas come first in the index `place` answers; the arenas taken here after them.
    reuse: Reuse,
}

impl<'s> Placer<'s> {
    /// A placer for one sleep's blobs, sizing arenas by `ratio` (stored of raw bytes) until its blobs say worse.
    pub(super) fn new(
        store: &'s mut BackupStore,
        ratio: f64,
        for_raw: usize,
        reuse: Reuse,
    ) -> Placer<'s> {
        Placer {
            store,
            arenas: Vec::new(),
            used: 0,
            taken: 0,
            ratio,
            placed_raw: 0,
            placed_stored: 0,
            skipped: 0,
            grow_failures: Vec::new(),
            for_raw,
            reuse,
        }
    }
}

impl Placer<'_> {
    /// Address of byte `offset` of arena `a` of the index `place` answers.
    pub(super) fn at(&self, a: usize, offset: usize) -> HostPtr {
        match a.checked_sub(self.reuse.arenas.len()) {
            None => self.reuse.arenas[a].at(offset),
            Some(k) => self.arenas[k].at(offset),
        }
    }

    /// A place for a blob of `len` bytes of a range of `raw` bytes; `rest_raw` raw bytes (this one's included)
    /// are still to be placed. (arena index, offset): the arenas of dead blobs first, then those taken here.
    pub(super) fn place(
        &mut self,
        len: usize,
        raw: usize,
        rest_raw: usize,
    ) -> Result<(usize, usize)> {
        if let Some(at) = self.reuse.place(len) {
            self.placed_raw += raw;
            self.placed_stored += len;
            return Ok(at);
        }
        let (arenas_before, used_before) = (self.arenas.len(), self.used);
        let at = match self.fit(len).or_else(|| self.grow_last(len, rest_raw)) {
            Some(at) => at,
            None => {
                let buf = self.take_arena(len, rest_raw)?;
                self.taken += buf.len();
                self.arenas.push(buf);
                self.used = 0;
                self.fit(len).ok_or_else(|| {
                    Error::InvalidState(format!(
                        "a blob of {len} bytes fits no pinned piece of a new host arena"
                    ))
                })?
            }
        };
        if self.arenas.len() == arenas_before {
            self.skipped += at - used_before; // the end of a piece too short for this blob
        }
        // The next blob starts after this one's room, where it is in the arena (the last one's may be cut short).
        self.used = (at + padded(len)).min(self.arenas.last().map_or(0, |a| a.len()));
        self.placed_raw += raw;
        self.placed_stored += len;
        Ok((self.reuse.arenas.len() + self.arenas.len() - 1, at))
    }

    /// The ratio to size what is still to be placed by: the guess, or what this sleep's blobs so far show when
    /// they compress worse (the estimate fell short).
    fn rest_ratio(&self) -> f64 {
        match self.placed_raw {
            0 => self.ratio,
            raw => self.ratio.max(self.placed_stored as f64 / raw as f64),
        }
    }

    /// Host bytes the blobs of `rest_raw` raw bytes are estimated to take, with the slack: never more than the raw
    /// bytes (no blob is larger than its range: one that would not shrink is stored raw), less the dead blob bytes
    /// still to take them.
    fn estimate(&self, rest_raw: usize) -> usize {
        let all = ((rest_raw as f64 * self.rest_ratio() * ESTIMATE_SLACK) as usize).min(rest_raw);
        all.saturating_sub(self.reuse.left())
    }

    /// Bytes the host budget leaves for further arenas or growth (unbounded without a budget).
    fn budget_left(&self) -> usize {
        (self.store.budget_room()).map_or(usize::MAX, |room| room.saturating_sub(self.taken))
    }

    /// Host bytes held now: the store's, and the arenas this placer took (not the store's until the sleep adopts
    /// them).
    fn resident(&self) -> usize {
        let mine: usize = (self.arenas.iter())
            .map(|a| a.len() - a.unpinned_below(a.len()))
            .sum();
        self.store.resident() + mine
    }

    /// Bytes the host RAM guard lets this sleep pin now (unbounded when the host's room cannot be read).
    fn room_left(&self) -> usize {
        (self.store.room)
            .available(self.resident())
            .unwrap_or(usize::MAX)
    }

    /// Grow the last arena in place for the rest of the blobs, the first of which takes `len` (data compressing
    /// worse than the estimate): one arena stays one arena, so the next sleep finds it whole in the host cache.
    /// A second arena beside it would be returned at the wake (the cache keeps one buffer) and pinned again at
    /// every sleep; an arena of the new size pinned afresh would hold both at once (H200, random bytes after
    /// bf16: 16 GB pinned in 2.5 s beside the 11.5 GB cached one). None when it cannot grow, the budget or the
    /// host's room refuses, or pinning fails: the caller takes a new arena.
    fn grow_last(&mut self, len: usize, rest_raw: usize) -> Option<usize> {
        let last = self.arenas.last()?;
        let room = last.room_to_grow();
        let wanted = self.estimate(rest_raw).max(len).max(MIN_ARENA.min(room));
        // Within the host's room, read again at each growth: the estimate may have been short of what the data
        // takes, and what fits is decided by what the host can give now, not by the guess made before.
        let extra = wanted
            .min(room)
            .min(self.budget_left())
            .min(self.room_left());
        if extra < len {
            return None;
        }
        let t = std::time::Instant::now();
        if let Err(e) = self.arenas.last_mut()?.grow(extra) {
            self.grow_failures.push(e);
            return None;
        }
        self.taken += extra;
        log::debug!(
            "compressed sleep: grew the blob arena by {extra} bytes in place in {:.1} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
        self.fit(len)
    }

    /// A new arena for the blobs of `rest_raw` raw bytes, the first of which takes `len`: the cached one when it
    /// is about that size (or can grow to it in place), else a new one within the budget and the host's
    /// room. A sleep's first arena is mapped with room to grow to `rest_raw` (address space only).
    fn take_arena(&mut self, len: usize, rest_raw: usize) -> Result<HostBuffer> {
        const REFUSED: &str = "compressed backup (this sleep copies it raw instead)";
        // Never more than the raw bytes left (`estimate`): the host bound's spare is no larger than the largest
        // backup a sleep made.
        let estimate = self.estimate(rest_raw);
        let first = self.arenas.is_empty();
        // The first arena holds the whole estimate, as the raw path's one arena does: the next sleep of the same
        // weights finds it in the host cache (where the wake left it) and pins nothing. Arenas of 256 MiB pinned
        // afresh each sleep and unpinned at each wake cost more than the copies (H200: a compressed sleep of
        // 15 GiB at 0.38x of the link).
        let size = if first {
            estimate.max(MIN_ARENA)
        } else {
            estimate.clamp(MIN_ARENA, MAX_ARENA)
        }
        .max(len);
        match self.store.host.take_cached_or_growable(size) {
            Some(mut b) if b.len() <= cached_fits(size) && holds_blobs(&b) => {
                // Pinned ahead in part (in cells): the rest is pinned now, each gap as one piece, where the host's
                // room allows it; where not, the buffer ends at its pinned cells and grows (checked) as needed. A
                // little short of the estimate (the ratio moved): `grow_last` grows it in place once its bytes are
                // used, as it grows any first arena.
                let unpinned = b.unpinned_below(b.len());
                let held = self.resident() + (b.len() - unpinned);
                if let Err(e) = self.store.room.check(unpinned, held, REFUSED) {
                    if !b.cut_unpinned_tail() {
                        let _ = self.store.host.cache(b);
                        return Err(e);
                    }
                }
                if let Err(e) = b.pin_gaps() {
                    let _ = self.store.host.cache(b);
                    return Err(e);
                }
                return Ok(b);
            }
            Some(b) if self.for_raw > 0 && b.len() >= self.for_raw => {
                // Too large for the blobs, but this sleep's raw copies take it (the pool hands them the smallest
                // cached buffer that holds them): returning it would have them pin it all again (H200: random
                // bytes beside a few compressible allocations, 380 ms to unpin 16 GB, then 810 ms to pin it).
                let _ = self.store.host.cache(b);
            }
            Some(b) => {
                // Too large to hold for this: back to the OS before a new one is pinned (the pool's own `acquire`
                // does the same with cached buffers too small).
                if let Err((b, e)) = b.release() {
                    let _ = self.store.host.cache(*b);
                    return Err(e);
                }
            }
            None => {
                // No cached buffer holds the blobs, nor can grow to: those too small go back to the OS before a
                // new arena is pinned, unless this sleep's raw copies take them (the wake after the last sleep
                // left its exact-size arena cached, a little short of this sleep's estimate: kept, it was held
                // beside the new arena, 1.4x the raw bytes of 1024 small bf16 allocations on the sim).
                let for_raw = self.for_raw;
                self.store
                    .host
                    .trim_unless(|b| for_raw > 0 && b.len() >= for_raw)?;
            }
        }
        // Under a budget, no more than the room it leaves (a minimum-size arena for a few small blobs must not
        // refuse what fits).
        // Within the host's room too: data that compresses better than the guess then fits where the guess would
        // not, and data that compresses worse grows the arena only after the room is checked again.
        let size = size.min(self.budget_left()).min(self.room_left()).max(len);
        self.store.check_budget(self.taken + size, REFUSED)?;
        self.store.room.check(size, self.resident(), REFUSED)?;
        let t = std::time::Instant::now();
        let buf = match first {
            true if size >= GROW_MIN_ARENA => {
                (self.store.host).pin_new_growable(size, rest_raw.max(size) + GROW_SLACK)?
            }
            _ => self.store.host.pin_new(size)?,
        };
        log::debug!(
            "compressed sleep: pinned a blob arena of {size} bytes in {:.1} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
        Ok(buf)
    }

    /// Where in the last arena a blob of `len` bytes goes (from `used` on, inside one pinned piece: the codec's
    /// copies of it must not span two registrations), if it fits.
    fn fit(&self, len: usize) -> Option<usize> {
        let a = self.arenas.last()?;
        let mut at = self.used;
        while at + len <= a.len() {
            let (_, end) = a.piece_at(at)?;
            if at + len <= end {
                return Some(at);
            }
            at = end;
        }
        None
    }
}

/// The largest cached arena taken for `size` bytes of blobs: a few percent more, plus what the pieces of an arena
/// grown in place leave unused at their ends (an arena grown once in the last sleep is as large as its blobs
/// plus that).
fn cached_fits(size: usize) -> usize {
    (size as f64 * CACHED_SLACK) as usize + GROW_SLACK
}

/// Whether the pinned pieces of a cached buffer (cells of the pin chunk, from its start) are large enough for
/// blobs, which each lie inside one piece: a small pin chunk (`set_pin_chunk`) would leave most of it unused.
fn holds_blobs(b: &HostBuffer) -> bool {
    const ROOM: usize = 2 * MAX_RANGE;
    b.piece_at(0)
        .is_none_or(|(_, end)| end >= ROOM.min(b.len()))
}

impl Placer<'_> {
    /// The arenas, the last one moved into a buffer of the bytes it uses when more than an eighth of it is
    /// unused (host bytes held = stored bytes, within that slack). A failure to pin that buffer keeps the arena
    /// as it is, and a failure to return the old one leaves it to the pool; both are recorded in `log`.
    /// First: the arenas of dead blobs that took new ones (as they are).
    pub(super) fn finish(mut self, log: &mut ErrorLog) -> (Vec<Arc<HostBuffer>>, Vec<HostBuffer>) {
        let reused = std::mem::take(&mut self.reuse.arenas);
        (reused, self.finish_new(log))
    }

    fn finish_new(mut self, log: &mut ErrorLog) -> Vec<HostBuffer> {
        let Some(last) = self.arenas.last() else {
            return self.arenas;
        };
        let (len, used) = (last.len(), self.used);
        // A large first arena keeps its slack: moving gigabytes would cost more than the bytes it frees, and the
        // next sleep's estimate (this sleep's ratio) sizes it closely. A small one is moved whatever its size: a
        // minimum-size arena holding a few small blobs would otherwise keep its whole size out of a tight budget
        // (two of them filled a budget of two granules, and the next sleep of those allocations fell back to raw
        // copies).
        if used == 0 || used > MAX_ARENA || len - used <= len / 8 {
            return self.arenas;
        }
        // The exact buffer is pinned beside the old one for the move: only where the host's room allows it.
        if let Err(e) = self.store.room.check(used, self.resident(), FINISH_KEPT) {
            log::debug!("compressed sleep: {e}");
            return self.arenas;
        }
        let mut exact = match self.store.host.pin_new(used) {
            Ok(b) => b,
            Err(e) => {
                log.record(FINISH_KEPT, &e);
                return self.arenas;
            }
        };
        let old = self.arenas.pop().expect("checked");
        exact.copy_from(0, &old, 0, used); // no device copy touches either: the codec has returned
        if let Err(e) = self.store.host.give_back(old) {
            log.record("returning host backup memory", &e);
        }
        self.arenas.push(exact);
        self.arenas
    }
}
