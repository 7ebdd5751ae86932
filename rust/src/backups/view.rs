//! Views: the raw bytes of a host backup handed out where they lie (`BackupStore::view`), for a zero-copy read
//! (torch_memory_saver's `get_cpu_backup(zero_copy=True)`).
//!
//! A view holds a reference to the arena it points into, so its bytes stay mapped as long as the view lives,
//! whatever happens to the backup meanwhile: woken without retention, freed, moved by compaction, the allocator
//! closed. The store keeps the rules that make that safe:
//! - bytes a live view shows are never reused for another backup (holes, bound.rs, count them as used);
//! - an arena that only views still hold leaves the store (`give_back_unused`): it is not cached for the next
//!   sleep, and is unpinned and unmapped when its last view goes. Until then its host memory is the views',
//!   outside the store's bound and budget;
//! - a view is writable (torch has no read-only CPU tensors), and a write into a retained backup would change what
//!   the next wake restores behind the fingerprints' back: so an allocation viewed since its last sleep (or with a
//!   view alive) counts every chunk as changed at its next sleep (retain.rs), which copies it whole into the same
//!   bytes. Stale data is never an outcome; the cost is the copy torch_memory_saver makes at every pause anyway.
//!
//! While the backup stays where it is, every view of it shows the same address; a retained backup is updated in
//! place by the next sleep (its changed chunks, or all of them, copied into the same bytes), so a view of it shows
//! the new contents. Once the backup is gone or moved, a view shows the bytes as they were then.

use std::collections::HashSet;
use std::sync::{Arc, Weak};

use super::BackupStore;
use crate::driver::DevPtr;
use crate::host::HostBuffer;

/// What a view holds: the arena its bytes lie in, which range of it (for the hole rule), of which allocation.
struct ViewPin {
    arena: Arc<HostBuffer>,
    addr: DevPtr,
    offset: usize,
    len: usize,
}

/// `len` bytes of raw host backup memory at `address`, valid (mapped, readable and writable) as long as this
/// value lives. Send it anywhere; dropping it may unpin and unmap the arena (when it was the last holder).
pub struct HostView {
    pin: Arc<ViewPin>,
    /// The process that made it: a forked child must not unpin (a driver call) what belongs to its parent.
    pid: u32,
}

impl HostView {
    /// Address of the first byte.
    pub fn address(&self) -> usize {
        self.pin.arena.at(self.pin.offset).0
    }

    pub fn len(&self) -> usize {
        self.pin.len
    }

    pub fn is_empty(&self) -> bool {
        self.pin.len == 0
    }
}

impl Drop for HostView {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // A fork's copy: the arena is the parent's (its pinning a driver state of the parent's); leak the
            // child's reference, so no driver call is made here. The child's copy of the memory goes at its exit.
            std::mem::forget(self.pin.clone());
        }
    }
}

/// The store's record of the views handed out.
#[derive(Default)]
pub(super) struct Views {
    live: Vec<Weak<ViewPin>>,
    /// Allocations viewed since their last sleep, or with a view alive: their next sleep copies them whole.
    touched: HashSet<DevPtr>,
}

impl Views {
    fn prune(&mut self) {
        self.live.retain(|w| w.strong_count() > 0);
    }

    /// Views alive now, as (arena, offset, length).
    pub(super) fn ranges(&self) -> impl Iterator<Item = (Arc<HostBuffer>, usize, usize)> + '_ {
        (self.live.iter().filter_map(Weak::upgrade)).map(|p| (p.arena.clone(), p.offset, p.len))
    }

    /// Whether only views (no backup, no other holder) still hold `arena`, the store's own reference aside.
    pub(super) fn only_viewed(&self, arena: &Arc<HostBuffer>) -> bool {
        let views = (self.live.iter().filter_map(Weak::upgrade))
            .filter(|p| Arc::ptr_eq(&p.arena, arena))
            .count();
        // A view dropped on another thread right now may still count in `strong_count` and no longer here: the
        // arena then looks held by something else and stays, until the next call looks again.
        views > 0 && Arc::strong_count(arena) == 1 + views
    }

    /// Whether the next sleep of `addr` must copy it whole (see the module comment).
    pub(super) fn touched(&self, addr: DevPtr) -> bool {
        self.touched.contains(&addr)
    }

    /// After a sleep of `addrs`: those without a live view are untouched from now on.
    pub(super) fn slept(&mut self, addrs: &[DevPtr]) {
        self.prune();
        let viewed: HashSet<DevPtr> = (self.live.iter().filter_map(Weak::upgrade))
            .map(|p| p.addr)
            .collect();
        for a in addrs {
            if !viewed.contains(a) {
                self.touched.remove(a);
            }
        }
    }

    /// `addrs` were freed: a new allocation at the same address starts untouched.
    pub(super) fn forget(&mut self, addrs: &[DevPtr]) {
        for a in addrs {
            self.touched.remove(a);
        }
    }
}

impl BackupStore {
    /// A view of bytes [at, at+len) of the backup of `addr` (asleep, or awake with a retained backup), when that
    /// backup is raw bytes in host memory; None when it has none, or it is compressed or in a file. `writable`:
    /// the caller may write through it (the next sleep of `addr` then copies it whole); false is a promise to read
    /// only (a copy taken from it).
    pub fn view(
        &mut self,
        addr: DevPtr,
        at: usize,
        len: usize,
        writable: bool,
    ) -> Option<HostView> {
        let backup = (self.asleep.get(&addr)).or_else(|| self.retention.retained.get(&addr))?;
        assert!(at + len <= backup.len, "view past the backup's end");
        let (arena, offset) = backup.arena()?;
        let pin = Arc::new(ViewPin {
            arena: arena.clone(),
            addr,
            offset: offset + at,
            len,
        });
        self.views.prune();
        self.views.live.push(Arc::downgrade(&pin));
        if writable {
            self.views.touched.insert(addr);
        }
        Some(HostView {
            pin,
            pid: std::process::id(),
        })
    }
}
