//! Physical memory of the simulated driver: slices of one memfd per device, not a memfd per handle, so that the
//! number of live allocations is bounded by the device's capacity and not by the process's file-descriptor limit
//! (`ulimit -n` is often 1024).
//!
//! The memfd is sparse and grows as needed: a slice is taken first-fit from the free extents below the file's
//! end, else from a new extent at the end (the file doubles, which costs nothing until pages are written). So
//! fragmentation never refuses memory that the capacity accounting (in `sim.rs`) allows, exactly as with a
//! memfd per handle. A returned slice gets a hole punched into it (`fallocate(PUNCH_HOLE)`), which gives its
//! pages back to the OS at once: RSS and the host's memory follow the live handles.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;

use rustix::fs::{fallocate, ftruncate, memfd_create, FallocateFlags, MemfdFlags};

/// The first length of a device's memfd; it doubles from there when a slice does not fit.
const FIRST_LEN: u64 = 64 << 20;

/// The slices of one device.
#[derive(Default)]
pub(super) struct Slices {
    /// Created on the first slice, so that a device that is never used holds no descriptor.
    fd: Option<OwnedFd>,
    /// The memfd's length: every slice and free extent lies below it.
    len: u64,
    /// Free extents below `len`, by offset (offset -> length), never adjacent (merged on return).
    free: BTreeMap<u64, u64>,
}

impl Slices {
    /// The memfd the slices live in; None before the first `take`.
    pub(super) fn fd(&self) -> Option<&OwnedFd> {
        self.fd.as_ref()
    }

    /// Bytes of free extents below the file's end (for tests of the bookkeeping).
    #[cfg(test)]
    fn free_bytes(&self) -> u64 {
        self.free.values().sum()
    }

    /// Take a slice of `size` bytes (a positive multiple of the page size); its offset.
    pub(super) fn take(&mut self, size: usize) -> rustix::io::Result<u64> {
        let size = size as u64;
        let fit = self
            .free
            .iter()
            .find(|(_, &len)| len >= size)
            .map(|(&off, _)| off);
        let offset = match fit {
            Some(off) => off,
            None => self.grow(size)?,
        };
        let len = self.free.remove(&offset).expect("a free extent");
        if len > size {
            self.free.insert(offset + size, len - size);
        }
        Ok(offset)
    }

    /// Lengthen the memfd (creating it first) so that a free extent of at least `size` bytes ends at its end;
    /// that extent's offset.
    fn grow(&mut self, size: u64) -> rustix::io::Result<u64> {
        if self.fd.is_none() {
            self.fd = Some(memfd_create("cumem-sim", MemfdFlags::CLOEXEC)?);
        }
        // A free extent that already ends at the file's end is extended rather than left behind.
        let tail = self
            .free
            .last_key_value()
            .filter(|(&off, &len)| off + len == self.len)
            .map(|(&off, &len)| (off, len));
        let (start, have) = tail.unwrap_or((self.len, 0));
        let needed = start + size;
        let new_len = needed.max(self.len.saturating_mul(2)).max(FIRST_LEN);
        ftruncate(self.fd.as_ref().expect("created above"), new_len)?;
        self.free.insert(start, have + (new_len - self.len));
        self.len = new_len;
        Ok(start)
    }

    /// Give the slice at `offset` of `size` bytes back: its pages go back to the OS, the extent to the free list.
    pub(super) fn give_back(&mut self, offset: u64, size: usize) {
        let size = size as u64;
        if let Some(fd) = &self.fd {
            // Punching can only fail on a file system without hole support, which memfds are not; a slice that
            // kept its pages is still correct (a new handle is poisoned at its first map), only not returned.
            let _ = fallocate(
                fd,
                FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
                offset,
                size,
            );
        }
        let (mut start, mut len) = (offset, size);
        if let Some((&prev, &prev_len)) = self.free.range(..offset).next_back() {
            if prev + prev_len == offset {
                self.free.remove(&prev);
                (start, len) = (prev, prev_len + len);
            }
        }
        if let Some(next_len) = self.free.remove(&(offset + size)) {
            len += next_len;
        }
        self.free.insert(start, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: usize = 4096;

    #[test]
    fn first_fit_reuses_freed_extents_and_merges_neighbours() {
        let mut s = Slices::default();
        let a = s.take(PAGE).unwrap();
        let b = s.take(2 * PAGE).unwrap();
        let c = s.take(PAGE).unwrap();
        assert_eq!((a, b, c), (0, PAGE as u64, 3 * PAGE as u64));
        s.give_back(b, 2 * PAGE);
        assert_eq!(s.take(PAGE).unwrap(), b, "first fit: the hole left by b");
        s.give_back(a, PAGE);
        s.give_back(b, PAGE);
        // a and b merged with the rest of b's old extent: a 3-page hole at 0.
        assert_eq!(s.take(3 * PAGE).unwrap(), 0);
        s.give_back(0, 3 * PAGE);
        s.give_back(c, PAGE);
        assert_eq!(s.free.len(), 1, "everything merged: {:?}", s.free);
        assert_eq!(s.free_bytes(), s.len);
    }

    #[test]
    fn a_slice_that_fits_nowhere_grows_the_file_instead_of_failing() {
        let mut s = Slices::default();
        let mut offsets = Vec::new();
        for _ in 0..(FIRST_LEN as usize / PAGE) {
            offsets.push(s.take(PAGE).unwrap());
        }
        assert_eq!(s.len, FIRST_LEN);
        // Every other page free: plenty of free bytes, none of them two pages in a row.
        for off in offsets.iter().step_by(2) {
            s.give_back(*off, PAGE);
        }
        let big = s.take(2 * PAGE).unwrap();
        assert_eq!(big, FIRST_LEN, "placed at the old end");
        assert_eq!(s.len, 2 * FIRST_LEN, "the file doubled");
        // A slice larger than the doubled file still fits, at the end, extending the free tail.
        let huge = s.take(4 * FIRST_LEN as usize).unwrap();
        assert_eq!(huge, FIRST_LEN + 2 * PAGE as u64);
        assert_eq!(s.len, huge + 4 * FIRST_LEN);
    }

    #[test]
    fn given_back_slices_lose_their_contents() {
        let mut s = Slices::default();
        let off = s.take(PAGE).unwrap();
        let fd = s.fd().unwrap();
        rustix::io::pwrite(fd, &[7u8; 16], off).unwrap();
        assert!(
            rustix::fs::fstat(fd).unwrap().st_blocks > 0,
            "the write took memory"
        );
        s.give_back(off, PAGE);
        let fd = s.fd().unwrap();
        assert_eq!(
            rustix::fs::fstat(fd).unwrap().st_blocks,
            0,
            "its pages went back to the OS"
        );
        let mut back = [1u8; 16];
        rustix::io::pread(fd, &mut back, off).unwrap();
        assert_eq!(back, [0u8; 16], "the hole reads as zeros");
    }
}
