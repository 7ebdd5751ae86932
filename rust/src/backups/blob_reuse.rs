//! The host bytes a compressed sleep reuses before it pins anything: the blobs of the changed chunks of retained
//! compressed backups (retain.rs).
//!
//! A retained compressed backup keeps its blobs while its allocation is awake, so that the next sleep keeps the
//! blobs of unchanged chunks in place. The blob of a chunk whose print changed is dead the moment the sleep has
//! taken the prints: the device holds other bytes now. Its bytes take this sleep's new blobs first, back to back
//! in arena and address order (a tensor rewritten in its first fraction frees one run per tensor, which its new
//! blobs refill), so that an RL loop that rewrites every weight between wake and sleep reuses the arena it holds
//! instead of pinning a second one beside it (H200, issue 35: 1.32x the raw bytes held, and the old arena unpinned
//! inside the sleep). The sleep then consumes those retained backups (dropped once placed: their dead blobs are
//! overwritten, so they must never be trusted again, whatever becomes of the sleep).
//!
//! The runs are the holes of the arenas in use (bound.rs) once those retained backups are dropped and the blobs of
//! their unchanged chunks are marked in use (`BackupStore::placed`): the dead blobs, merged with the bytes earlier
//! sleeps left unused beside them (a blob a little larger than the one before it takes the next place, and the gap
//! it leaves is a run the next sleep refills). A blob another backup points to, and what live views show, are not
//! in any hole. The blobs a sleep places stay marked in use until the sleep is over (`placed`), so that no raw
//! backup of the same sleep is put into a hole over them.

use std::collections::HashMap;
use std::sync::Arc;

use crate::host::HostBuffer;

/// Runs of dead blob bytes, and where the next blob goes.
#[derive(Default)]
pub(super) struct Reuse {
    /// The arenas the runs lie in (indexed by the runs), before any the sleep pins.
    pub arenas: Vec<Arc<HostBuffer>>,
    /// (arena index, next free offset, end), in arena and offset order.
    runs: Vec<(usize, usize, usize)>,
    /// The first run that may still take a blob.
    next: usize,
}

/// Runs a blob is tried in before it goes to a new arena: blobs are of about one size, so a run that cannot take
/// one is passed over for good, and a short window keeps placing a blob cheap.
const WINDOW: usize = 8;

fn key(a: &Arc<HostBuffer>) -> usize {
    Arc::as_ptr(a) as usize
}

impl Reuse {
    /// Runs from `holes` ((arena, offset, length) in arena and offset order: `BackupStore::holes`, once the
    /// retained backups the sleep compresses again no longer count and the blobs of their unchanged chunks do).
    pub(super) fn of<'a>(
        holes: impl Iterator<Item = (&'a Arc<HostBuffer>, usize, usize)>,
    ) -> Reuse {
        let mut out = Reuse::default();
        let mut index: HashMap<usize, usize> = HashMap::new();
        for (arena, offset, len) in holes.filter(|h| h.2 > 0) {
            let a = *index.entry(key(arena)).or_insert_with(|| {
                out.arenas.push(arena.clone());
                out.arenas.len() - 1
            });
            out.runs.push((a, offset, offset + len));
        }
        out
    }

    /// Dead bytes not yet taken.
    pub(super) fn left(&self) -> usize {
        self.runs[self.next..].iter().map(|r| r.2 - r.1).sum()
    }

    /// A place for a blob of `len` bytes in a dead run, inside one pinned piece: (arena index, offset).
    pub(super) fn place(&mut self, len: usize) -> Option<(usize, usize)> {
        let mut i = self.next;
        while i < self.runs.len() && i < self.next + WINDOW {
            let (a, from, end) = self.runs[i];
            if let Some(at) = fit(&self.arenas[a], from, end, len) {
                // With its room, as a fresh blob has (placer.rs), where the run has it.
                self.runs[i].1 = (at + padded(len)).min(end);
                return Some((a, at));
            }
            if i == self.next {
                self.next += 1; // too short for blobs of this size: passed over
            }
            i += 1;
        }
        None
    }
}

/// Where in [from, end) of `arena` a blob of `len` bytes fits inside one pinned piece, if anywhere.
fn fit(arena: &HostBuffer, from: usize, end: usize, len: usize) -> Option<usize> {
    let mut at = from;
    while at + len <= end {
        let (_, piece_end) = arena.piece_at(at)?;
        if at + len <= piece_end {
            return Some(at);
        }
        at = piece_end;
    }
    None
}

/// The room each blob is given past its bytes, a hundredth (the arena's `ESTIMATE_SLACK`, spread over its blobs
/// instead of left at its end): when the chunk changes, its next blob, of about the same size, takes the place of
/// this one even when it is a little larger, instead of going to a new arena.
pub(super) fn padded(len: usize) -> usize {
    len + (len / 100).next_multiple_of(64)
}
