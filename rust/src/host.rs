//! Host backup memory: page-locked buffers that sleep copies into and wake copies out of.
//!
//! Acquired the fast way: anonymous mmap, `MADV_HUGEPAGE`, first touch from several threads, then
//! `host_register` (cuMemHostRegister). Pinning memory with `cuMemHostAlloc`/`cudaHostAlloc` takes about nine
//! times longer for large sizes, so it is only the fallback when registering fails.
//! `HostPool` keeps a buffer for the next sleep (policy `keep`) so that steady sleeps pin nothing.
//!
//! Helper threads (first touch, pinning) are started with `std::thread::Builder`, never `Scope::spawn`, which
//! panics when the OS refuses a thread (a container's process limit): when no thread can be started the work
//! runs on the calling thread, slower but the same, and the refusal is kept in `HostBuffer::notes`.

use std::ffi::c_void;
use std::sync::Arc;
use std::thread::Scope;

use rustix::mm::{madvise, mmap_anonymous, munmap, Advice, MapFlags, ProtFlags};

use crate::driver::{DevPtr, Driver, HostPtr};
use crate::error::{Error, Result};

/// Below this size one thread touches the pages; above it, the work is split across threads.
const PARALLEL_TOUCH_MIN: usize = 64 << 20;
const MAX_TOUCH_THREADS: usize = 16;
/// What pinning one cell gave: the registration's result and a worker thread that could not start, if any.
type PinResult = (Result<()>, Option<Error>);

/// Cells pinned at once during a cold sleep. Measured on an H200 host (16 cores): eight workers each touching
/// and registering their own cells took 2.3 s for 15 GiB, while one worker whose cells are touched by all cores
/// took about 1 s (concurrent registrations and page faults contend in the kernel). So: one pinning worker, and
/// the parallelism goes into touching.
const MAX_PIN_WORKERS: usize = 1;

enum Origin {
    /// Our own mmap; `pinned` lists the (address, length) pieces registered with the driver so far.
    Mapped { pinned: Vec<(usize, usize)> },
    /// Pinned by the driver itself (fallback).
    DriverAlloc,
}

/// One host buffer, pinned whole (`acquire`) or piece by piece (`map_unpinned` + `pin`, so that a cold sleep
/// can copy into the first pieces while it pins the next). Dropping it unpins and unmaps it.
pub struct HostBuffer {
    ptr: usize,
    len: usize,
    origin: Origin,
    /// False once `release` gave the memory back, so Drop has nothing left to do.
    live: bool,
    driver: Arc<dyn Driver>,
    /// Failures absorbed while pinning (a worker thread that could not start), for the engine to record.
    pub notes: Vec<Error>,
}

/// Start `f` on a scoped thread named `name`. Err when no thread could be started (the driver's test hook or
/// the OS refused); the caller then does the work itself. Never panics, unlike `Scope::spawn`.
fn try_spawn<'scope, F>(
    s: &'scope Scope<'scope, '_>,
    driver: &dyn Driver,
    name: &str,
    f: F,
) -> Result<()>
where
    F: FnOnce() + Send + 'scope,
{
    driver.thread_spawn()?;
    std::thread::Builder::new()
        .name(name.into())
        .spawn_scoped(s, f)
        .map(drop)
        .map_err(|e| Error::InvalidState(format!("thread_spawn: the OS refused a new thread: {e}")))
}

impl HostBuffer {
    /// Map `len` bytes of host memory, asking for huge pages, without touching or pinning them yet.
    pub fn map_unpinned(driver: &Arc<dyn Driver>, len: usize) -> Result<HostBuffer> {
        if len == 0 {
            return Err(Error::invalid("host buffer of 0 bytes"));
        }
        // SAFETY: a fresh private anonymous read-write mapping at an address the kernel chooses.
        let mapped = unsafe {
            mmap_anonymous(
                std::ptr::null_mut(),
                len,
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
        // SAFETY: [ptr, ptr+len) is the mapping made above. Huge pages are a hint; failure only costs speed.
        let _ = unsafe { madvise(ptr as *mut c_void, len, Advice::LinuxHugepage) };
        Ok(HostBuffer {
            ptr,
            len,
            origin: Origin::Mapped { pinned: Vec::new() },
            live: true,
            driver: driver.clone(),
            notes: Vec::new(),
        })
    }

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

    /// Acquire `len` bytes of pinned host memory. When registering failed and the fallback served, the
    /// registration error comes back beside the buffer, for the caller to record.
    pub fn acquire(driver: &Arc<dyn Driver>, len: usize) -> Result<(HostBuffer, Option<Error>)> {
        let mut buf = HostBuffer::map_unpinned(driver, len)?;
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
            origin: Origin::DriverAlloc,
            live: true,
            driver: driver.clone(),
            notes,
        };
        Ok((buf, Some(register_err)))
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True when byte `offset` lies in a pinned piece. Pieces are the whole buffer or cells of one fixed grid,
    /// so a grid cell is either pinned whole or not at all.
    pub fn is_pinned_at(&self, offset: usize) -> bool {
        let addr = self.ptr + offset;
        match &self.origin {
            Origin::Mapped { pinned } => pinned.iter().any(|&(p, l)| p <= addr && addr < p + l),
            Origin::DriverAlloc => true,
        }
    }

    /// Bytes of [0, len) not in a pinned piece: what pinning the buffer up to `len` still takes.
    pub fn unpinned_below(&self, len: usize) -> usize {
        let Origin::Mapped { pinned } = &self.origin else {
            return 0;
        };
        let pinned: usize = (pinned.iter())
            .map(|&(p, l)| (p - self.ptr).min(len)..(p - self.ptr + l).min(len))
            .map(|r| r.len())
            .sum();
        len.saturating_sub(pinned)
    }

    /// Split bytes [offset, offset+len) at the boundaries of pinned pieces: CUDA refuses an async copy whose
    /// host side spans two registrations (CUDA_ERROR_INVALID_VALUE), so each copy must stay inside one.
    fn split_at_pieces(&self, offset: usize, len: usize) -> Vec<(usize, usize)> {
        let end = offset + len;
        let mut cuts: Vec<usize> = match &self.origin {
            Origin::Mapped { pinned } => pinned
                .iter()
                .flat_map(|&(p, l)| [p - self.ptr, p - self.ptr + l])
                .filter(|c| *c > offset && *c < end)
                .collect(),
            Origin::DriverAlloc => Vec::new(),
        };
        cuts.sort_unstable();
        cuts.dedup();
        let mut out = Vec::with_capacity(cuts.len() + 1);
        let mut start = offset;
        for c in cuts {
            out.push((start, c - start));
            start = c;
        }
        out.push((start, end - start));
        out
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
    /// pinned piece it crosses; returns how many copies were queued.
    ///
    /// Crate-internal contract (why this is not an `unsafe fn`): the engine waits for every copy it queued
    /// before the buffer is released or dropped (`transfer::InFlight` does so on every path, panics included).
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

    fn check_range(&self, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "[{offset}, +{len}) outside host buffer of {} bytes",
            self.len
        );
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
                while let Some(&(p, _)) = pinned.last() {
                    // SAFETY: a piece we registered; no copy is in flight (the engine waits for every copy
                    // before a buffer goes back).
                    unsafe { self.driver.host_unregister(HostPtr(p))? };
                    pinned.pop();
                }
                // SAFETY: our own mapping, no longer registered; no copy is in flight, since the engine waits for
                // every copy before a buffer goes back.
                let _ = unsafe { munmap(self.ptr as *mut c_void, self.len) };
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
fn touch_pages(driver: &dyn Driver, ptr: usize, len: usize) -> Option<Error> {
    let page = rustix::param::page_size();
    let touch = |start: usize, end: usize| touch_range(start, end - start);
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(MAX_TOUCH_THREADS);
    if len < PARALLEL_TOUCH_MIN || threads < 2 {
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

/// The host buffer cached for the next sleep: one at most (the largest offered), since a second one would only
/// hold RAM twice; more only while the driver refuses to unpin one (kept for a later trim rather than leaked).
pub struct HostPool {
    driver: Arc<dyn Driver>,
    cached: Vec<HostBuffer>,
    /// Registration failures that the fallback absorbed, for the engine to record.
    pub fallbacks: Vec<Error>,
    /// Helper threads that could not start while pinning (the work ran on the calling thread).
    pub notes: Vec<Error>,
    /// Keep buffers after wake (fast next sleep) or give them back to the OS (low host RAM).
    pub keep: bool,
}

impl HostPool {
    pub fn new(driver: Arc<dyn Driver>) -> Self {
        HostPool {
            driver,
            cached: Vec::new(),
            fallbacks: Vec::new(),
            notes: Vec::new(),
            keep: true,
        }
    }

    /// A buffer of at least `len` bytes: the smallest cached one that fits, else a new one of exactly `len`
    /// bytes (cached buffers too small for it are returned to the OS first, so RAM is not held twice).
    pub fn acquire(&mut self, len: usize) -> Result<HostBuffer> {
        if let Some(buf) = self.take_cached(len) {
            return Ok(buf);
        }
        self.trim()?;
        let (mut buf, fallback) = HostBuffer::acquire(&self.driver, len)?;
        self.fallbacks.extend(fallback);
        self.notes.append(&mut buf.notes);
        Ok(buf)
    }

    /// The smallest cached buffer of at least `len` bytes, if any.
    pub fn take_cached(&mut self, len: usize) -> Option<HostBuffer> {
        let best = self
            .cached
            .iter()
            .enumerate()
            .filter(|(_, b)| b.len() >= len)
            .min_by_key(|(_, b)| b.len());
        best.map(|(i, _)| i).map(|i| self.cached.swap_remove(i))
    }

    /// Take back a buffer no allocation uses any more: cached if it is the largest one offered (policy `keep`),
    /// else returned to the OS.
    pub fn give_back(&mut self, buf: HostBuffer) -> Result<()> {
        if !self.keep {
            return self.release_or_keep(buf);
        }
        self.cache(buf)
    }

    /// Cache `buf` for the next sleep if it is the largest one offered, else return it to the OS (whatever the
    /// `keep` policy: a buffer reserved or pinned ahead for the next sleep).
    pub fn cache(&mut self, buf: HostBuffer) -> Result<()> {
        let largest = self.cached.iter().map(HostBuffer::len).max().unwrap_or(0);
        if buf.len() <= largest {
            return self.release_or_keep(buf);
        }
        let smaller = std::mem::replace(&mut self.cached, vec![buf]);
        let mut first_err = Ok(());
        for old in smaller {
            if let Err(e) = self.release_or_keep(old) {
                first_err = first_err.and(Err(e));
            }
        }
        first_err
    }

    fn release_or_keep(&mut self, buf: HostBuffer) -> Result<()> {
        buf.release().map_err(|(buf, e)| {
            // Keep it for the next trim rather than leak the registration.
            self.cached.push(*buf);
            e
        })
    }

    /// Make sure at least `len` bytes are cached (reserve ahead of the first sleep).
    pub fn reserve(&mut self, len: usize) -> Result<()> {
        if self.cached.iter().any(|b| b.len() >= len) {
            return Ok(());
        }
        // `acquire` returned the cached buffers to the OS first (none was large enough), so this is the only one.
        let buf = self.acquire(len)?;
        self.cached.push(buf);
        Ok(())
    }

    pub fn cached_bytes(&self) -> usize {
        self.cached.iter().map(HostBuffer::len).sum()
    }

    /// Return every cached buffer to the OS; the first error is reported after all were tried, and buffers the
    /// driver refused stay cached for a later trim.
    pub fn trim(&mut self) -> Result<usize> {
        let mut freed = 0;
        let mut first_err = None;
        let mut kept = Vec::new();
        for buf in self.cached.drain(..) {
            let len = buf.len();
            match buf.release() {
                Ok(()) => freed += len,
                Err((buf, e)) => {
                    kept.push(*buf);
                    first_err.get_or_insert(e);
                }
            }
        }
        self.cached = kept;
        first_err.map_or(Ok(freed), Err)
    }
}
