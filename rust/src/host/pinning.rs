//! Pinning a host buffer: touching its pages and registering them with the driver, whole or cell by cell.
//!
//! A cold sleep pins its arena cell by cell on a worker thread and copies into each cell as soon as it is pinned,
//! so the copies of the first cells run while the next ones are pinned. Every registered piece is recorded in the
//! buffer, which the copies consult.

use super::memory::touch_pages;
use super::threads::try_spawn;
use super::{HostBuffer, Origin};
use crate::driver::HostPtr;
use crate::error::{Error, Result};

/// What pinning one cell gave: the registration's result and a worker thread that could not start, if any.
type PinResult = (Result<()>, Option<Error>);

/// Cells pinned at once during a cold sleep. Measured on an H200 host (16 cores): eight workers each touching
/// and registering their own cells took 2.3 s for 15 GiB, while one worker whose cells are touched by all cores
/// took about 1 s (concurrent registrations and page faults contend in the kernel). So: one pinning worker, and
/// the parallelism goes into touching.
const MAX_PIN_WORKERS: usize = 1;

impl HostBuffer {
    /// Touch (from several threads) and register bytes [offset, offset+len). On failure the piece stays
    /// pageable: copies into it are still correct, only slower.
    pub fn pin(&mut self, offset: usize, len: usize) -> Result<()> {
        assert!(offset + len <= self.len, "pin outside the buffer");
        let Origin::Mapped { pinned } = &mut self.origin else {
            return Ok(());
        };
        self.notes
            .extend(touch_pages(&*self.driver, self.ptr + offset, len));
        // SAFETY: [ptr+offset, +len) lies inside our live mapping (asserted above), which stays mapped until
        // `unpin` unregisters it.
        unsafe { self.driver.host_register(HostPtr(self.ptr + offset), len)? };
        pinned.push((self.ptr + offset, len));
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
        if !matches!(self.origin, Origin::Mapped { .. }) {
            for i in 0..cells.len() {
                on_ready(self, i, Ok(()));
            }
            return;
        }
        let workers = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(MAX_PIN_WORKERS)
            .min(cells.len());
        let next = std::sync::atomic::AtomicUsize::new(0);
        let (tx, rx) = std::sync::mpsc::channel::<(usize, PinResult)>();
        let base = self.ptr;
        let driver = self.driver.clone();
        let pin_one = |i: usize| -> PinResult {
            let (off, len) = cells[i];
            let notes = touch_pages(&*driver, base + off, len);
            // SAFETY: cells lie inside this buffer's live mapping, which stays mapped until `unpin` (which needs
            // `&mut self`, held by this call until every worker has finished).
            let r = unsafe { driver.host_register(HostPtr(base + off), len) };
            (r, notes)
        };
        let take = || {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
                if r.is_ok() {
                    if let Origin::Mapped { pinned } = &mut this.origin {
                        pinned.push((base + cells[i].0, cells[i].1));
                    }
                }
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
}
