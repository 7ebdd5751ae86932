//! A host buffer's life as OS memory: mapped, faulted in, and given back.
//!
//! Acquired the fast way: anonymous mmap, `MADV_HUGEPAGE`, first touch from several threads, then `host_register`
//! (cuMemHostRegister, see `pinning`). Pinning memory with `cuMemHostAlloc`/`cudaHostAlloc` takes about nine times
//! longer for large sizes, so it is only the fallback when registering fails. Giving a buffer back unregisters every
//! piece before the unmap, since unmapping registered memory would leave the driver pointing at pages that no
//! longer exist.

use std::ffi::c_void;
use std::sync::Arc;

use rustix::mm::{madvise, mmap_anonymous, munmap, Advice, MapFlags, ProtFlags};

use super::threads::try_spawn;
use super::{HostBuffer, Origin, PinnedPieces};
use crate::driver::{Driver, HostPtr};
use crate::error::{Error, Result};

/// Below this size one thread touches the pages; above it, the work is split across threads.
const PARALLEL_TOUCH_MIN: usize = 64 << 20;
const MAX_TOUCH_THREADS: usize = 16;

impl HostBuffer {
    /// Map `len` bytes of host memory, asking for huge pages, without touching or pinning them yet.
    pub fn map_unpinned(driver: &Arc<dyn Driver>, len: usize) -> Result<HostBuffer> {
        HostBuffer::map_growable(driver, len, len)
    }

    /// Map `len` bytes as `map_unpinned` does, with address space for `reserve` bytes in all: `grow` can later
    /// pin up to `reserve - len` more bytes right after them (a compressed sleep's blob arena, whose needs are an
    /// estimate until the codec has run).
    pub fn map_growable(
        driver: &Arc<dyn Driver>,
        len: usize,
        reserve: usize,
    ) -> Result<HostBuffer> {
        if len == 0 {
            return Err(Error::invalid("host buffer of 0 bytes"));
        }
        let reserve = reserve.max(len);
        // SAFETY: a fresh private anonymous read-write mapping at an address the kernel chooses.
        let mapped = unsafe {
            mmap_anonymous(
                std::ptr::null_mut(),
                reserve,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        };
        let ptr = match mapped {
            Ok(p) => p as usize,
            Err(e) => {
                return Err(Error::OutOfMemory {
                    what: format!("host backup of {len} bytes: {e}"),
                })
            }
        };
        // SAFETY: [ptr, ptr+reserve) is the mapping made above. Huge pages are a hint; failure only costs speed.
        let _ = unsafe { madvise(ptr as *mut c_void, reserve, Advice::LinuxHugepage) };
        Ok(HostBuffer {
            ptr,
            len,
            reserved: reserve,
            origin: Origin::Mapped {
                pinned: PinnedPieces::default(),
            },
            live: true,
            driver: driver.clone(),
            notes: Vec::new(),
        })
    }

    /// Acquire `len` bytes of pinned host memory. When registering failed and the fallback served, the
    /// registration error comes back beside the buffer, for the caller to record.
    pub fn acquire(driver: &Arc<dyn Driver>, len: usize) -> Result<(HostBuffer, Option<Error>)> {
        HostBuffer::acquire_growable(driver, len, len)
    }

    /// `acquire` with room to grow to `reserve` bytes in place (the fallback, driver-allocated, has none).
    pub fn acquire_growable(
        driver: &Arc<dyn Driver>,
        len: usize,
        reserve: usize,
    ) -> Result<(HostBuffer, Option<Error>)> {
        let mut buf = HostBuffer::map_growable(driver, len, reserve)?;
        let Err(register_err) = buf.pin(0, len) else {
            return Ok((buf, None));
        };
        let notes = std::mem::take(&mut buf.notes);
        drop(buf);
        let p = driver.host_alloc(len).map_err(|e| match e {
            Error::Driver { .. } | Error::OutOfMemory { .. } => Error::OutOfMemory {
                what: format!("host backup of {len} bytes: {register_err}; then {e}"),
            },
            other => other,
        })?;
        let buf = HostBuffer {
            ptr: p.0,
            len,
            reserved: len,
            origin: Origin::DriverAlloc,
            live: true,
            driver: driver.clone(),
            notes,
        };
        Ok((buf, Some(register_err)))
    }

    /// Unpin and unmap now. When the driver refuses, the buffer comes back with the error, still mapped (and
    /// partly pinned), so that the caller can try again later instead of leaking a registration.
    pub fn release(mut self) -> std::result::Result<(), (Box<HostBuffer>, Error)> {
        match self.unpin() {
            Ok(()) => Ok(()),
            Err(e) => Err((Box::new(self), e)),
        }
    }

    fn unpin(&mut self) -> Result<()> {
        if !self.live {
            return Ok(());
        }
        match &mut self.origin {
            Origin::Mapped { pinned } => {
                while let Some((offset, _)) = pinned.last() {
                    // SAFETY: a piece we registered; no copy is in flight (the engine waits for every copy
                    // before a buffer goes back).
                    unsafe { self.driver.host_unregister(HostPtr(self.ptr + offset))? };
                    pinned.remove(offset);
                }
                // SAFETY: our own mapping (all `reserved` bytes of it), no longer registered; no copy is in flight,
                // since the engine waits for every copy before a buffer goes back.
                let _ = unsafe { munmap(self.ptr as *mut c_void, self.reserved) };
            }
            // SAFETY: our host_alloc memory, freed once (`live` turns false below); no copy is in flight.
            Origin::DriverAlloc => unsafe { self.driver.host_free(HostPtr(self.ptr))? },
        }
        self.live = false;
        Ok(())
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // Last resort (normal paths use `release`): a buffer the driver will not unpin stays mapped, since unmapping
        // registered memory would leave the driver pointing at pages that no longer exist. No logging here: this
        // can run under the engine lock, where taking the GIL to log could deadlock with a thread in my_malloc.
        let _ = self.unpin();
    }
}

/// Fault in every page once, from several threads for large buffers, so pinning later does not pay for page
/// faults one by one and the kernel can back the range with huge pages. Returns the failure to start a thread,
/// if any (that thread's share was touched by this one).
pub(super) fn touch_pages(driver: &dyn Driver, ptr: usize, len: usize) -> Option<Error> {
    let page = rustix::param::page_size();
    let touch = |start: usize, end: usize| touch_range(start, end - start);
    // Small ranges first: `available_parallelism` reads cgroup files on every call, which a cold sleep in page-sized
    // cells would otherwise pay once per cell.
    if len < PARALLEL_TOUCH_MIN {
        touch(ptr, ptr + len);
        return None;
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(MAX_TOUCH_THREADS);
    if threads < 2 {
        touch(ptr, ptr + len);
        return None;
    }
    let chunk = len.div_ceil(threads).next_multiple_of(page);
    let mut refused = None;
    std::thread::scope(|s| {
        for i in 0..threads {
            let start = ptr + i * chunk;
            let end = (start + chunk).min(ptr + len);
            if start < end {
                if let Err(e) = try_spawn(s, driver, "cumem-touch", move || touch(start, end)) {
                    touch(start, end);
                    refused.get_or_insert(e);
                }
            }
        }
    });
    refused
}

/// Fault in the pages of [ptr, ptr+len) from this thread.
fn touch_range(ptr: usize, len: usize) {
    let page = rustix::param::page_size();
    let mut p = ptr;
    while p < ptr + len {
        // SAFETY: p lies inside a live read-write mapping of a HostBuffer that outlives this call; only the
        // worker that owns this range writes to it, and only to fault the page in.
        unsafe { std::ptr::write_volatile(p as *mut u8, 0) };
        p += page;
    }
}
