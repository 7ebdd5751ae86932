//! The staging ring of the backup store's file tier: a bounded piece of pinned host memory (default 256 MiB, never a full-size
//! copy of what goes to files) cut into slots. A slot holds one chunk on its way device -> slot -> file at sleep
//! and file -> slot -> device at wake; the pipelines of `backups/file_tier.rs` hand each slot to one party at a time
//! (the copy engine, one writer or reader thread), which is what makes the byte views below sound. It lives with
//! the host memory it is made of, so that its `unsafe` stays in the host-memory modules.
//!
//! Slots are page-aligned and a multiple of `IO_ALIGN` long, as `O_DIRECT` wants.

use std::sync::Arc;

use super::HostBuffer;
use crate::driver::{DevPtr, Driver};
use crate::error::{Error, Result};

/// Slot alignment and length unit: the largest logical block size `O_DIRECT` asks of the file systems in use.
pub const IO_ALIGN: usize = 4096;

/// The ring's default size.
pub const DEFAULT_STAGING_BYTES: usize = 256 << 20;
/// Slots a ring is cut into (fewer when it is small): copies and file writes of several slots are in flight.
const SLOTS: usize = 8;

pub struct StagingRing {
    buf: HostBuffer,
    slot: usize,
    slots: usize,
}

/// Exclusive use of one slot's memory, handed from the pipeline to the thread doing its I/O and back.
pub struct SlotMem {
    ptr: usize,
    len: usize,
}

impl StagingRing {
    /// A pinned ring of about `bytes` (at least one `IO_ALIGN` slot). The registration's fallback error, if the
    /// driver's own allocation served, comes back beside it.
    pub fn new(driver: &Arc<dyn Driver>, bytes: usize) -> Result<(StagingRing, Option<Error>)> {
        let (slot, slots) = Self::shape(bytes);
        let (buf, fallback) = HostBuffer::acquire(driver, slot * slots)?;
        Ok((StagingRing { buf, slot, slots }, fallback))
    }

    /// (slot size, slot count) of a ring of about `bytes`.
    pub fn shape(bytes: usize) -> (usize, usize) {
        let slot = (bytes / SLOTS / IO_ALIGN * IO_ALIGN).max(IO_ALIGN);
        (slot, (bytes / slot).clamp(1, SLOTS))
    }

    /// Bytes of pinned host memory the ring holds.
    pub fn bytes(&self) -> usize {
        self.buf.len()
    }

    pub fn slot_size(&self) -> usize {
        self.slot
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Queue the copy of `len` device bytes at `src` into slot `i`, `at` bytes into it.
    pub fn queue_from_device(
        &self,
        i: usize,
        at: usize,
        device: i32,
        src: DevPtr,
        len: usize,
    ) -> Result<()> {
        assert!(at + len <= self.slot, "chunk past the slot's end");
        self.buf
            .queue_from_device(device, src, i * self.slot + at, len)
            .map(drop)
    }

    /// Queue the copy of `len` bytes of slot `i`, from `at` bytes into it, to `dst` on `device`.
    pub fn queue_to_device(
        &self,
        i: usize,
        at: usize,
        device: i32,
        dst: DevPtr,
        len: usize,
    ) -> Result<()> {
        assert!(at + len <= self.slot, "chunk past the slot's end");
        self.buf
            .queue_to_device(device, dst, i * self.slot + at, len)
    }

    /// Host address of slot `i` (pinned, `slot_size` bytes): where a codec writes a slot's blobs at sleep and
    /// reads them at wake, the pipeline holding the slot meanwhile.
    pub fn slot_ptr(&self, i: usize) -> crate::driver::HostPtr {
        assert!(i < self.slots, "slot {i} of {}", self.slots);
        self.buf.at(i * self.slot)
    }

    /// The memory of slot `i`, for the one party that owns the slot now (see the module comment): no copy may be
    /// queued into or out of it until the `SlotMem` is dropped.
    pub fn slot_mem(&self, i: usize) -> SlotMem {
        assert!(i < self.slots, "slot {i} of {}", self.slots);
        SlotMem {
            ptr: self.buf.at(i * self.slot).0,
            len: self.slot,
        }
    }
}

impl SlotMem {
    /// The first `len` bytes of the slot.
    pub fn bytes(&self, len: usize) -> &[u8] {
        assert!(len <= self.len);
        // SAFETY: [ptr, ptr+len) lies inside the ring's live pinned mapping (the ring outlives every pipeline that
        // holds a SlotMem of it), and the pipeline gives a slot to one holder at a time with every copy into it
        // waited for, so nothing writes to it while this view lives.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, len) }
    }

    /// The first `len` bytes of the slot, to fill.
    pub fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        assert!(len <= self.len);
        // SAFETY: as in `bytes`; `&mut self` and the one-holder rule make this the only view of the slot, and no
        // copy out of it is queued until the holder hands it back.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, len) }
    }
}
