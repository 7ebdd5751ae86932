//! Pinning a host buffer: touching its pages and registering them with the driver, whole or cell by cell.
//!
//! A cold sleep pins its arena cell by cell on a worker thread and copies into each cell as soon as it is pinned,
//! so the copies of the first cells run while the next ones are pinned. Every registered piece goes into the
//! buffer's `PinnedPieces` index, which the copies consult; a piece that would overlap one already registered is
//! refused before the driver is asked, as CUDA refuses it (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED), so the index
//! and the driver's registrations stay the same set.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::memory::touch_pages;
use super::threads::try_spawn;
use super::{HostBuffer, Origin};
use crate::driver::{HostPtr, Op};
use crate::error::{Error, Result};

/// What pinning one cell gave: the registration's result and a worker thread that could not start, if any.
type PinResult = (Result<()>, Option<Error>);

/// Cells pinned at once during a cold sleep. Measured on an H200 host (16 cores): eight workers each touching
/// and registering their own cells took 2.3 s for 15 GiB, while one worker whose cells are touched by all cores
/// took about 1 s (concurrent registrations and page faults contend in the kernel). So: one pinning worker, and
/// the parallelism goes into touching.
const MAX_PIN_WORKERS: usize = 1;

/// The error CUDA gives for registering memory that overlaps a registration.
fn already_pinned(offset: usize, len: usize) -> Error {
    Error::driver(
        Op::HostRegister.name(),
        712,
        format!(
            "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED (bytes {offset}..{} overlap a pinned piece)",
            offset + len
        ),
    )
}

impl HostBuffer {
    /// Touch (from several threads) and register bytes [offset, offset+len). On failure the piece stays
    /// pageable: copies into it are still correct, only slower.
    pub fn pin(&mut self, offset: usize, len: usize) -> Result<()> {
        assert!(offset + len <= self.len, "pin outside the buffer");
        let Origin::Mapped { pinned } = &mut self.origin else {
            return Ok(());
        };
        if pinned.overlaps(offset, len) {
            return Err(already_pinned(offset, len));
        }
        self.notes
            .extend(touch_pages(&*self.driver, self.ptr + offset, len));
        // SAFETY: [ptr+offset, +len) lies inside our live mapping (asserted above), which stays mapped until
        // `unpin` unregisters it.
        unsafe { self.driver.host_register(HostPtr(self.ptr + offset), len)? };
        pinned.insert(offset, len);
        Ok(())
    }

    /// Grow the buffer in place by `extra` bytes, pinned as one new piece after the last byte (within the room
    /// `map_growable` reserved). On failure the buffer keeps its length, and nothing new is pinned.
    pub fn grow(&mut self, extra: usize) -> Result<()> {
        if extra > self.room_to_grow() {
            return Err(Error::InvalidState(format!(
                "a host buffer of {} bytes cannot grow by {extra} in place ({} bytes of room)",
                self.len,
                self.room_to_grow()
            )));
        }
        let old = self.len;
        self.len += extra;
        if let Err(e) = self.pin(old, extra) {
            self.len = old;
            return Err(e);
        }
        Ok(())
    }

    /// End the buffer at its first unpinned byte: the bytes after it become room to grow in place (`grow`), and
    /// any page of them that was touched without being registered (a refused registration) goes back to the OS,
    /// so that they hold no memory. For a buffer pinned ahead in part that the host's room does not let a sleep
    /// finish pinning: what is pinned serves, and each growth is checked against the room first. False, nothing
    /// changed, when nothing is pinned from the start or a piece lies past the first unpinned byte.
    pub fn cut_unpinned_tail(&mut self) -> bool {
        let Origin::Mapped { pinned } = &self.origin else {
            return false;
        };
        let mut end = 0;
        while let Some((start, len)) = pinned.containing(end) {
            end = start + len;
        }
        if end == 0 || end >= self.len || pinned.bytes_below(self.len) != pinned.bytes_below(end) {
            return false;
        }
        // SAFETY: [ptr+end, ptr+len) lies inside our live mapping and is not registered (checked above); no copy
        // can be in flight into unpinned bytes of a cached buffer, and dropping their pages only zeroes them.
        let _ = unsafe {
            rustix::mm::madvise(
                (self.ptr + end) as *mut std::ffi::c_void,
                self.len - end,
                rustix::mm::Advice::LinuxDontNeed,
            )
        };
        self.len = end;
        true
    }

    /// Pin every byte not pinned yet, each gap between pieces as one registration (a buffer pinned ahead in part,
    /// taken by a sleep that copies into it without pinning cell by cell).
    pub fn pin_gaps(&mut self) -> Result<()> {
        let Origin::Mapped { pinned } = &self.origin else {
            return Ok(());
        };
        for (offset, len) in pinned.gaps(self.len) {
            self.pin(offset, len)?;
        }
        Ok(())
    }

    /// Pin the cells (offset, len) on worker thread(s) (MAX_PIN_WORKERS; each touches a cell's pages from all
    /// cores, then registers it), calling `on_ready(buffer, cell index, result)` on this thread as each cell
    /// finishes, in completion order. A cold sleep queues a cell's copies in `on_ready`, so copies of ready cells
    /// run on the copy engines while the workers pin the next ones.
    pub fn pin_cells(
        &mut self,
        cells: &[(usize, usize)],
        mut on_ready: impl FnMut(&HostBuffer, usize, Result<()>),
    ) {
        let Origin::Mapped { pinned } = &self.origin else {
            for i in 0..cells.len() {
                on_ready(self, i, Ok(()));
            }
            return;
        };
        for &(off, len) in cells {
            assert!(off + len <= self.len, "pin outside the buffer");
        }
        // Decided here, before any worker starts, so that no worker registers over a piece already pinned.
        let overlapping: Vec<bool> = (cells.iter())
            .map(|&(off, len)| pinned.overlaps(off, len))
            .collect();
        let workers = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(MAX_PIN_WORKERS)
            .min(cells.len());
        let next = AtomicUsize::new(0);
        let (tx, rx) = std::sync::mpsc::channel::<(usize, PinResult)>();
        let base = self.ptr;
        let driver = self.driver.clone();
        let pin_one = |i: usize| -> PinResult {
            let (off, len) = cells[i];
            if overlapping[i] {
                return (Err(already_pinned(off, len)), None);
            }
            let notes = touch_pages(&*driver, base + off, len);
            // SAFETY: cells lie inside this buffer's live mapping (asserted above), which stays mapped until `unpin`
            // (which needs `&mut self`, held by this call until every worker has finished).
            let r = unsafe { driver.host_register(HostPtr(base + off), len) };
            (r, notes)
        };
        let take = || {
            let i = next.fetch_add(1, Ordering::Relaxed);
            (i < cells.len()).then_some(i)
        };
        std::thread::scope(|s| {
            for _ in 0..workers {
                let tx = tx.clone();
                let (take, pin_one) = (&take, &pin_one);
                let started = try_spawn(s, &*self.driver, "cumem-pin", move || {
                    while let Some(i) = take() {
                        if tx.send((i, pin_one(i))).is_err() {
                            break;
                        }
                    }
                });
                if let Err(e) = started {
                    self.notes.push(e);
                }
            }
            drop(tx);
            let mut finish = |this: &mut HostBuffer, i: usize, (r, notes): PinResult| {
                this.notes.extend(notes);
                let r = r.and_then(|()| this.record_piece(cells[i]));
                on_ready(this, i, r);
            };
            for (i, r) in rx {
                finish(self, i, r);
            }
            // Cells no worker took: no worker could be started. Pin them here, one by one.
            while let Some(i) = take() {
                finish(self, i, pin_one(i));
            }
        });
    }

    /// Enter a piece a worker registered into the index. Two cells of one call that overlap each other are not
    /// caught before the workers start; the simulated driver accepts the second (CUDA refuses it), so it is
    /// unregistered again here and refused, keeping the index and the registrations the same set.
    fn record_piece(&mut self, (offset, len): (usize, usize)) -> Result<()> {
        let Origin::Mapped { pinned } = &mut self.origin else {
            return Ok(());
        };
        if pinned.insert(offset, len) {
            return Ok(());
        }
        // SAFETY: the registration a worker just made at this address; no copy has been queued into it yet (copies
        // are queued in `on_ready`, after this).
        unsafe { self.driver.host_unregister(HostPtr(self.ptr + offset))? };
        Err(already_pinned(offset, len))
    }
}
