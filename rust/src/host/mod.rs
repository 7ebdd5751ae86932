//! Host backup memory: page-locked buffers that sleep copies into and wake copies out of.
//!
//! One concept per file:
//! - `memory`: the buffer's life as OS memory: anonymous mmap with huge pages, the driver-allocated fallback,
//!   first touch of its pages, and giving it all back (unpin, unmap).
//! - `pinning`: registering a buffer with the driver, whole or cell by cell on a worker thread while a cold sleep
//!   copies into the cells already pinned.
//! - `pieces`: the index of registered pieces that pinning fills and every copy consults.
//! - `copies`: queuing device copies into and out of a buffer (one per pinned piece it crosses), and host reads.
//! - `threads`: starting helper threads without panicking when the OS refuses one.
//! - `pool`: `HostPool`, the buffer kept for the next sleep (policy `keep`) so that steady sleeps pin nothing.
//! - `returning`: large buffers no longer wanted, returned to the OS off the caller's thread.
//!
//! `unsafe` stays inside these files (raw host memory and the driver's host calls), each block with its reason.

mod copies;
mod memory;
mod pieces;
mod pinning;
mod pool;
pub mod returning;
pub mod staging;
mod threads;

use std::sync::Arc;

use crate::driver::{Driver, HostPtr};
use crate::error::Error;

pub use pool::HostPool;

use pieces::PinnedPieces;

enum Origin {
    /// Our own mmap; `pinned` holds the pieces registered with the driver so far (offsets in the buffer).
    Mapped { pinned: PinnedPieces },
    /// Pinned by the driver itself (fallback).
    DriverAlloc,
}

/// One host buffer, pinned whole (`acquire`) or piece by piece (`map_unpinned` + `pin`, so that a cold sleep
/// can copy into the first pieces while it pins the next), possibly with room to grow in place (`map_growable`,
/// `grow`). Dropping it unpins and unmaps it.
pub struct HostBuffer {
    ptr: usize,
    len: usize,
    /// Bytes of the mapping, `len` or more: a buffer mapped with room to grow (`map_growable`) pins further
    /// bytes in place (`grow`) instead of a second buffer being pinned beside it. The room is address space only,
    /// never touched nor pinned, so it holds no memory.
    reserved: usize,
    origin: Origin,
    /// False once `release` gave the memory back, so Drop has nothing left to do.
    live: bool,
    driver: Arc<dyn Driver>,
    /// Failures absorbed while pinning (a worker thread that could not start), for the engine to record.
    pub notes: Vec<Error>,
}

impl HostBuffer {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes `grow` can still add in place (0 for a buffer the driver allocated).
    pub fn room_to_grow(&self) -> usize {
        match self.origin {
            Origin::Mapped { .. } => self.reserved - self.len,
            Origin::DriverAlloc => 0,
        }
    }

    /// True when byte `offset` lies in a pinned piece. Pieces are the whole buffer or cells of one fixed grid,
    /// so a grid cell is either pinned whole or not at all. O(log pieces).
    pub fn is_pinned_at(&self, offset: usize) -> bool {
        match &self.origin {
            Origin::Mapped { pinned } => pinned.containing(offset).is_some(),
            Origin::DriverAlloc => true,
        }
    }

    /// The registered piece (start, end) that holds byte `offset`; None when `offset` is not pinned. A buffer the
    /// driver allocated is one piece. An async copy must stay inside one piece (CUDA refuses one whose host side
    /// spans two registrations), which is what placing blobs by pieces is for. O(log pieces).
    pub fn piece_at(&self, offset: usize) -> Option<(usize, usize)> {
        match &self.origin {
            Origin::Mapped { pinned } => pinned.containing(offset).map(|(s, l)| (s, s + l)),
            Origin::DriverAlloc => (offset < self.len).then_some((0, self.len)),
        }
    }

    /// Bytes of [0, len) not in a pinned piece: what pinning the buffer up to `len` still takes.
    pub fn unpinned_below(&self, len: usize) -> usize {
        match &self.origin {
            Origin::Mapped { pinned } => len.saturating_sub(pinned.bytes_below(len)),
            Origin::DriverAlloc => 0,
        }
    }

    /// Address of byte `offset`, for copies of at most `len - offset` bytes.
    pub fn at(&self, offset: usize) -> HostPtr {
        assert!(
            offset <= self.len,
            "offset {offset} outside host buffer of {} bytes",
            self.len
        );
        HostPtr(self.ptr + offset)
    }

    fn check_range(&self, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "[{offset}, +{len}) outside host buffer of {} bytes",
            self.len
        );
    }

    /// Entries of the pinned-piece index looked at so far, so that tests can bound the lookups per copy.
    #[cfg(test)]
    pub(crate) fn pieces_visited(&self) -> usize {
        match &self.origin {
            Origin::Mapped { pinned } => pinned.visited(),
            Origin::DriverAlloc => 0,
        }
    }
}
