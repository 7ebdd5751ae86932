//! Moving bytes into and out of a host buffer: device copies queued on the driver's copy stream, and host reads.
//!
//! CUDA refuses an async copy whose host side spans two registrations (CUDA_ERROR_INVALID_VALUE), so a device copy
//! is queued as one copy per pinned piece it crosses; the piece index answers which in O(log pieces + parts), so the
//! cost of a sleep stays linear in its copies however small the pin chunk.
//!
//! Crate-internal contract (why the queuing functions are not `unsafe fn`): the engine waits for every copy it
//! queued before the buffer is released or dropped (`transfer::InFlight` does so on every path, panics included).

use super::{HostBuffer, Origin};
use crate::driver::DevPtr;
use crate::error::Result;

impl HostBuffer {
    /// Split bytes [offset, offset+len) at the boundaries of pinned pieces, so that each copy stays inside one.
    fn split_at_pieces(&self, offset: usize, len: usize) -> Vec<(usize, usize)> {
        match &self.origin {
            Origin::Mapped { pinned } => pinned.split(offset, len),
            Origin::DriverAlloc => vec![(offset, len)],
        }
    }

    /// Copy bytes [offset, offset + out.len()) of the buffer into `out` (reading a backup on the host).
    pub fn read_at(&self, offset: usize, out: &mut [u8]) {
        self.check_range(offset, out.len());
        // SAFETY: the range lies inside our live mapping (checked above) and `out` is a distinct Rust buffer; the
        // engine reads only complete backups (of asleep allocations), which no copy writes to any more.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (self.ptr + offset) as *const u8,
                out.as_mut_ptr(),
                out.len(),
            )
        };
    }

    /// Queue the copy of `len` device bytes at `src` into bytes [offset, offset+len) of this buffer, one copy per
    /// pinned piece it crosses; returns how many copies were queued (contract in the module comment).
    pub(crate) fn queue_from_device(
        &self,
        device: i32,
        src: DevPtr,
        offset: usize,
        len: usize,
    ) -> Result<usize> {
        self.check_range(offset, len);
        let pieces = self.split_at_pieces(offset, len);
        for &(off, l) in &pieces {
            // SAFETY: [off, off+l) lies inside this live buffer (checked above), which outlives the copy by the
            // contract above; only this copy writes to that range until it is waited for.
            unsafe {
                self.driver
                    .copy_d2h(device, self.at(off), src + (off - offset) as u64, l)?
            };
        }
        Ok(pieces.len())
    }

    /// Queue the copy of bytes [offset, offset+len) of this buffer to `dst` on `device`, one copy per pinned piece
    /// (same contract).
    pub(crate) fn queue_to_device(
        &self,
        device: i32,
        dst: DevPtr,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        self.check_range(offset, len);
        for (off, l) in self.split_at_pieces(offset, len) {
            // SAFETY: as in queue_from_device; the range is only read.
            unsafe {
                self.driver
                    .copy_h2d(device, dst + (off - offset) as u64, self.at(off), l)?
            };
        }
        Ok(())
    }

    /// Copy `len` bytes at `src_offset` of `src` to `offset` of this buffer, on the host. No device copy may be
    /// queued into or out of either range (the engine calls this only with every copy waited for).
    pub(crate) fn copy_from(
        &mut self,
        offset: usize,
        src: &HostBuffer,
        src_offset: usize,
        len: usize,
    ) {
        self.check_range(offset, len);
        src.check_range(src_offset, len);
        // SAFETY: both ranges lie inside live buffers (checked above); `self` is borrowed mutably, so it is not
        // `src`, and no device copy touches either range (contract above).
        unsafe {
            std::ptr::copy_nonoverlapping(
                (src.ptr + src_offset) as *const u8,
                (self.ptr + offset) as *mut u8,
                len,
            )
        };
    }
}
