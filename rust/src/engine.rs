//! Every allocation state transition: malloc, free, sleep, wake, discard, with their ordering and rollback.
//!
//! States: Awake{handle} --sleep/discard--> Asleep{backup?} --wake--> Awake{new handle}; free from either.
//! Guarantees (each step below says how it keeps them):
//! - a failed malloc leaves nothing behind;
//! - a failed sleep leaves each allocation either awake with its data or asleep with a complete backup;
//! - a failed wake releases what it mapped, keeps every backup and leaves its allocations asleep;
//! - a driver release that fails after its unmap succeeded is queued in `pending` and retried by later calls, so
//!   nothing leaks once the fault is gone.
//!
//! One mutex guards the registry: malloc/free issued while a sleep or wake runs wait until it has finished.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use crate::driver::{DevPtr, Driver, HostPtr, PhysHandle};
use crate::error::{Error, Result};
use crate::host::{HostBuffer, HostPool};
use crate::registry::{self, Allocation, Backup, Registry, State};
use crate::transfer;

/// At most this many recorded errors are kept (oldest dropped first).
const MAX_RECORDED_ERRORS: usize = 1000;

/// Host arena cell pinned at a time during a cold sleep: large enough that per-call overheads vanish, small
/// enough that the first copies start early.
const PIN_CHUNK: usize = 512 << 20;

static NEXT_ENGINE_ID: AtomicU64 = AtomicU64::new(1);

/// What one sleep, wake or discard did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    pub allocations: usize,
    /// Bytes copied to host (sleep) or back to the device (wake).
    pub copied_bytes: usize,
    /// Bytes released without backup (sleep, discard) or woken without contents (wake).
    pub discarded_bytes: usize,
    pub seconds: f64,
}

/// One live allocation as seen from outside.
#[derive(Debug, Clone, PartialEq)]
pub struct AllocationInfo {
    pub addr: DevPtr,
    pub size: usize,
    pub requested: usize,
    pub device: i32,
    pub tag: String,
    pub asleep: bool,
    pub backed_up: bool,
}

#[derive(Debug, Clone, Default)]
pub struct Stats {
    pub live_allocations: usize,
    pub asleep_allocations: usize,
    pub mapped_bytes: usize,
    pub asleep_bytes: usize,
    pub peak_mapped_bytes: usize,
    pub host_backup_bytes: usize,
    pub host_cached_bytes: usize,
    pub mallocs: u64,
    pub frees: u64,
    pub sleeps: u64,
    pub wakes: u64,
    pub recorded_errors: u64,
    pub pending_releases: usize,
    pub last_sleep: Option<Report>,
    pub last_wake: Option<Report>,
}

/// A driver release that failed after the point of no return, retried by later calls.
#[derive(Debug, Clone, Copy)]
enum Pending {
    Unmap { addr: DevPtr, size: usize },
    Release(PhysHandle),
    FreeRange { addr: DevPtr, size: usize },
}

struct Inner {
    reg: Registry,
    host: HostPool,
    /// Host arenas that asleep allocations still point into.
    arenas: Vec<Arc<HostBuffer>>,
    pending: Vec<Pending>,
    errors: Vec<String>,
    stats: Stats,
    closed: bool,
    /// Cell size of pipelined pinning (PIN_CHUNK; smaller in tests to exercise cells that split allocations).
    pin_chunk: usize,
}

pub struct Engine {
    id: u64,
    driver: Arc<dyn Driver>,
    granularity: Vec<usize>,
    inner: Mutex<Inner>,
}

fn tag_set<S: AsRef<str>>(tags: &[S]) -> HashSet<&str> {
    tags.iter().map(AsRef::as_ref).collect()
}

impl Engine {
    pub fn new(driver: Arc<dyn Driver>) -> Result<Engine> {
        let devices = driver.device_count()?;
        let granularity = (0..devices as i32)
            .map(|d| driver.granularity(d))
            .collect::<Result<Vec<_>>>()?;
        let inner = Inner {
            reg: Registry::default(),
            host: HostPool::new(driver.clone()),
            arenas: Vec::new(),
            pending: Vec::new(),
            errors: Vec::new(),
            stats: Stats::default(),
            closed: false,
            pin_chunk: PIN_CHUNK,
        };
        Ok(Engine {
            id: NEXT_ENGINE_ID.fetch_add(1, Ordering::Relaxed),
            driver,
            granularity,
            inner: Mutex::new(inner),
        })
    }

    /// Cell size of pipelined pinning during a cold sleep, rounded up to whole pages.
    pub fn set_pin_chunk(&self, bytes: usize) {
        let page = rustix::param::page_size();
        self.inner.lock().pin_chunk = bytes.max(1).next_multiple_of(page);
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    pub fn device_count(&self) -> usize {
        self.granularity.len()
    }

    pub fn granularity(&self, device: i32) -> Result<usize> {
        usize::try_from(device)
            .ok()
            .and_then(|d| self.granularity.get(d).copied())
            .ok_or_else(|| {
                Error::invalid(format!(
                    "device {device} does not exist ({} devices)",
                    self.granularity.len()
                ))
            })
    }

    // ----- tags -------------------------------------------------------------------------------------------

    pub fn push_tag(&self, tag: &str) -> Result<()> {
        drop(self.lock_open()?);
        if tag.is_empty() {
            return Err(Error::invalid("tag must be a non-empty string"));
        }
        registry::push_tag(self.id, Arc::from(tag));
        Ok(())
    }

    pub fn pop_tag(&self) -> Result<String> {
        registry::pop_tag(self.id)
            .map(|t| t.to_string())
            .ok_or_else(|| {
                Error::InvalidState("pop_tag without a matching push_tag on this thread".into())
            })
    }

    pub fn current_tag(&self) -> String {
        registry::current_tag(self.id).to_string()
    }

    // ----- malloc / free ----------------------------------------------------------------------------------

    /// Allocate under this thread's current tag.
    pub fn malloc(&self, size: usize, device: i32, stream: u64) -> Result<DevPtr> {
        self.malloc_tagged(size, device, stream, registry::current_tag(self.id))
    }

    pub fn malloc_tagged(
        &self,
        size: usize,
        device: i32,
        stream: u64,
        tag: Arc<str>,
    ) -> Result<DevPtr> {
        let gran = self.granularity(device)?;
        if size == 0 {
            return Err(Error::invalid("size must be positive"));
        }
        let rounded = size
            .checked_next_multiple_of(gran)
            .filter(|r| *r <= isize::MAX as usize)
            .ok_or_else(|| Error::OutOfMemory {
                what: format!("malloc of {size} bytes"),
            })?;
        let mut inner = self.lock_open()?;
        self.retry_pending(&mut inner);
        let addr = self.driver.reserve(device, rounded)?;
        let handle = match self.map_new(&mut inner, device, addr, rounded) {
            Ok(h) => h,
            Err(e) => {
                self.free_range_or_queue(&mut inner, addr, rounded);
                return Err(e);
            }
        };
        inner.reg.insert(Allocation {
            addr,
            size: rounded,
            requested: size,
            device,
            tag,
            stream,
            state: State::Awake { handle },
        });
        inner.stats.mallocs += 1;
        Self::note_peak(&mut inner);
        Ok(addr)
    }

    /// Free a live allocation, awake or asleep. A release that fails after the unmap is queued and recorded, not
    /// raised: the allocation is gone either way.
    pub fn free(&self, addr: DevPtr) -> Result<()> {
        let mut inner = self.lock_open()?;
        self.retry_pending(&mut inner);
        self.free_locked(&mut inner, addr)
    }

    fn free_locked(&self, inner: &mut Inner, addr: DevPtr) -> Result<()> {
        let a = inner
            .reg
            .get(addr)
            .ok_or(Error::UnknownAddress(addr))?
            .clone();
        if let State::Awake { handle } = a.state {
            // The caller's work on this memory must be finished before it is unmapped (a no-op during capture).
            self.driver.synchronize(a.device, a.stream)?;
            self.unmap_release(inner, a.addr, a.size, handle)?;
        }
        inner.reg.remove(addr);
        self.free_range_or_queue(inner, a.addr, a.size);
        inner.stats.frees += 1;
        drop(a); // its backup reference, if asleep
        self.collect_unused_arenas(inner);
        Ok(())
    }

    // ----- sleep / wake / discard -------------------------------------------------------------------------

    /// Back up awake allocations whose tag is in `offload_tags`, then release the physical memory of every awake
    /// allocation. Allocations already asleep keep their state and backup.
    ///
    /// Order: synchronize; queue every backup copy (pinning a cold arena cell by cell meanwhile); release the
    /// allocations that need no backup while those copies run; then, cell by cell as the copies finish, release
    /// the backed-up allocations. An allocation is released only once its whole backup is known to be on the
    /// host, so after any failure each offloaded allocation is either awake with its data or asleep with a
    /// complete backup. Allocations of other tags are released without backup as asked, failure or not.
    pub fn sleep<S: AsRef<str>>(&self, offload_tags: &[S]) -> Result<Report> {
        let start = Instant::now();
        let offload = tag_set(offload_tags);
        let mut inner = self.lock_open()?;
        self.retry_pending(&mut inner);
        let targets = inner.reg.select(Allocation::is_awake);
        if targets.is_empty() {
            return Ok(Report::default());
        }
        self.synchronize_devices(&inner, &targets)?;
        let (backed, bare): (Vec<DevPtr>, Vec<DevPtr>) = targets
            .iter()
            .partition(|a| offload.contains(&*inner.reg.get(**a).expect("selected").tag));
        let mut report = Report::default();

        // 1. Queue the backup copies.
        let (jobs, total) = transfer::layout(backed.iter().map(|a| {
            let a = inner.reg.get(*a).expect("selected");
            (a.device, a.addr, a.size)
        }));
        let mut issued = Vec::new();
        let mut arena = None;
        let mut first_err = None;
        let mut cold = false;
        if total > 0 {
            let mut buf = match inner.host.take_cached(total) {
                Some(buf) => buf,
                None => {
                    cold = true;
                    inner.host.trim()?;
                    HostBuffer::map_unpinned(&self.driver, total)?
                }
            };
            let mut absorbed = Vec::new();
            let (cells, result) = transfer::issue_copy_out(
                &*self.driver,
                &mut buf,
                &jobs,
                inner.pin_chunk,
                &mut absorbed,
            );
            for e in absorbed {
                Self::record(
                    &mut inner,
                    "pinning host backup memory (copying through pageable memory)",
                    &e,
                );
            }
            if let Err(e) = result {
                first_err = Some(e);
            }
            issued = cells;
            let buf = Arc::new(buf);
            inner.arenas.push(buf.clone());
            arena = Some(buf);
        }

        // 2. While the copies run, release what needs no backup.
        for addr in bare {
            if let Err(e) = self.release_to_sleep(&mut inner, addr, None, &mut report) {
                first_err.get_or_insert(e);
            }
        }

        // 3. As cells finish, release the allocations whose backup is complete. `missing` counts each job's
        //    cells on the whole grid, so a job with a cell that was never queued (after an error) stays awake.
        let cell_size = inner.pin_chunk;
        let mut missing: Vec<usize> = jobs
            .iter()
            .map(|j| (j.offset + j.size - 1) / cell_size - j.offset / cell_size + 1)
            .collect();
        let mut copies_ok = true;
        for cell in issued {
            for (device, marker) in cell.markers {
                if let Err(e) = self.driver.wait_marker(device, marker) {
                    copies_ok = false; // release nothing more, but drain every marker
                    first_err.get_or_insert(e);
                }
            }
            for j in cell.jobs {
                missing[j] -= 1;
                if missing[j] == 0 && copies_ok {
                    let backup = Backup {
                        arena: arena.clone().expect("jobs imply an arena"),
                        offset: jobs[j].offset,
                    };
                    match self.release_to_sleep(&mut inner, jobs[j].addr, Some(backup), &mut report)
                    {
                        Ok(()) => report.copied_bytes += jobs[j].size,
                        Err(e) => {
                            first_err.get_or_insert(e);
                        }
                    }
                }
            }
        }
        drop(arena);
        self.collect_unused_arenas(&mut inner);
        report.seconds = start.elapsed().as_secs_f64();
        log::debug!(
            "engine sleep: {} allocations, {} bytes backed up ({}), {} bytes released without backup, {:.3} s",
            report.allocations,
            report.copied_bytes,
            if cold { "cold: arena pinned during the copies" } else { "steady: cached arena" },
            report.discarded_bytes,
            report.seconds
        );
        inner.stats.sleeps += 1;
        inner.stats.last_sleep = Some(report.clone());
        first_err.map_or(Ok(report), Err)
    }

    /// Unmap and release one awake allocation and mark it asleep with `backup`. A failed unmap leaves it awake.
    fn release_to_sleep(
        &self,
        inner: &mut Inner,
        addr: DevPtr,
        backup: Option<Backup>,
        report: &mut Report,
    ) -> Result<()> {
        let a = inner.reg.get(addr).expect("selected");
        let State::Awake { handle } = a.state else {
            unreachable!("selected awake")
        };
        let size = a.size;
        self.unmap_release(inner, addr, size, handle)?;
        if backup.is_none() {
            report.discarded_bytes += size;
        }
        report.allocations += 1;
        inner.reg.set_state(addr, State::Asleep { backup });
        Ok(())
    }

    /// Map new physical memory at the same addresses for asleep allocations whose tag is in `tags` (None: all),
    /// and copy their backups back. All or nothing.
    ///
    /// Order: map every backed-up allocation (all devices), queue all their copies (one stream per device, so
    /// devices copy in parallel), then map the allocations without backup while those copies run, and wait once
    /// per device. Interleaving maps with copies instead was measured to serialize two GPUs (0.61x of their
    /// aggregate copy bandwidth): maps on one device waited for the copies already queued.
    pub fn wake<S: AsRef<str>>(&self, tags: Option<&[S]>) -> Result<Report> {
        let start = Instant::now();
        let wanted = tags.map(tag_set);
        let mut inner = self.lock_open()?;
        self.retry_pending(&mut inner);
        let mut targets = inner
            .reg
            .select(|a| !a.is_awake() && wanted.as_ref().is_none_or(|w| w.contains(&*a.tag)));
        if targets.is_empty() {
            return Ok(Report::default());
        }
        targets.sort_by_key(|a| {
            !matches!(
                inner.reg.get(*a).expect("selected").state,
                State::Asleep { backup: Some(_) }
            )
        });

        let mut report = Report {
            allocations: targets.len(),
            ..Report::default()
        };
        let mut mapped: Vec<(DevPtr, PhysHandle)> = Vec::with_capacity(targets.len());
        let backed = targets
            .iter()
            .filter(|a| Self::backup_of(&inner, **a).is_some())
            .count();
        let result = (|| {
            for addr in &targets[..backed] {
                mapped.push((*addr, self.map_at(&mut inner, *addr)?));
            }
            for addr in &targets[..backed] {
                let a = inner.reg.get(*addr).expect("selected");
                let b = Self::backup_of(&inner, *addr).expect("sorted first");
                self.copy_back(a.device, a.addr, a.size, b)?;
                report.copied_bytes += a.size;
            }
            for addr in &targets[backed..] {
                mapped.push((*addr, self.map_at(&mut inner, *addr)?));
                report.discarded_bytes += inner.reg.get(*addr).expect("selected").size;
            }
            Ok(())
        })();
        // Wait even after a failure: no copy may still be writing when the rollback unmaps.
        let result = self.wait_devices(&inner, &targets, result);
        if let Err(e) = result {
            self.rollback_wake(&mut inner, &mapped);
            return Err(e);
        }
        for (addr, handle) in mapped {
            inner.reg.set_state(addr, State::Awake { handle });
        }
        self.collect_unused_arenas(&mut inner);
        Self::note_peak(&mut inner);
        report.seconds = start.elapsed().as_secs_f64();
        log::debug!(
            "engine wake: {} allocations, {} bytes restored, {} bytes mapped without contents, {:.3} s",
            report.allocations,
            report.copied_bytes,
            report.discarded_bytes,
            report.seconds
        );
        inner.stats.wakes += 1;
        inner.stats.last_wake = Some(report.clone());
        Ok(report)
    }

    fn backup_of(inner: &Inner, addr: DevPtr) -> Option<&Backup> {
        match &inner.reg.get(addr).expect("selected").state {
            State::Asleep { backup } => backup.as_ref(),
            State::Awake { .. } => None,
        }
    }

    /// Map new physical memory under one asleep allocation's range.
    fn map_at(&self, inner: &mut Inner, addr: DevPtr) -> Result<PhysHandle> {
        let a = inner.reg.get(addr).expect("selected");
        let (device, size) = (a.device, a.size);
        self.map_new(inner, device, addr, size)
    }

    /// Queue the copy of one backup to its allocation, split at the arena's pinned pieces.
    fn copy_back(&self, device: i32, addr: DevPtr, size: usize, b: &Backup) -> Result<()> {
        for (off, len) in b.arena.split_at_pieces(b.offset, size) {
            self.driver
                .copy_h2d(device, addr + (off - b.offset) as u64, b.arena.at(off), len)?;
        }
        Ok(())
    }

    /// Release awake allocations whose tag is in `tags`, without backup. Other tags are untouched.
    pub fn discard<S: AsRef<str>>(&self, tags: &[S]) -> Result<Report> {
        let start = Instant::now();
        let wanted = tag_set(tags);
        let mut inner = self.lock_open()?;
        self.retry_pending(&mut inner);
        let targets = inner
            .reg
            .select(|a| a.is_awake() && wanted.contains(&*a.tag));
        if targets.is_empty() {
            return Ok(Report::default());
        }
        self.synchronize_devices(&inner, &targets)?;
        let mut report = Report::default();
        let mut first_err = None;
        for addr in targets {
            let a = inner.reg.get(addr).expect("selected").clone();
            let State::Awake { handle } = a.state else {
                unreachable!("selected awake")
            };
            match self.unmap_release(&mut inner, a.addr, a.size, handle) {
                Ok(()) => {
                    inner.reg.set_state(addr, State::Asleep { backup: None });
                    report.allocations += 1;
                    report.discarded_bytes += a.size;
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        report.seconds = start.elapsed().as_secs_f64();
        first_err.map_or(Ok(report), Err)
    }

    // ----- byte access (tests and tools) ------------------------------------------------------------------

    pub fn read(&self, addr: DevPtr, len: usize) -> Result<Vec<u8>> {
        let inner = self.lock_open()?;
        let device = Self::awake_containing(&inner, addr, len)?;
        let mut out = vec![0u8; len];
        if len > 0 {
            self.driver.synchronize(device, 0)?;
            self.driver
                .copy_d2h(device, HostPtr(out.as_mut_ptr() as usize), addr, len)?;
            self.driver.wait(device)?;
        }
        Ok(out)
    }

    pub fn write(&self, addr: DevPtr, data: &[u8]) -> Result<()> {
        let inner = self.lock_open()?;
        let device = Self::awake_containing(&inner, addr, data.len())?;
        if !data.is_empty() {
            self.driver.synchronize(device, 0)?;
            self.driver
                .copy_h2d(device, addr, HostPtr(data.as_ptr() as usize), data.len())?;
            self.driver.wait(device)?;
        }
        Ok(())
    }

    fn awake_containing(inner: &Inner, addr: DevPtr, len: usize) -> Result<i32> {
        let a = inner.reg.containing(addr, len.max(1)).ok_or_else(|| {
            Error::invalid(format!(
                "[{addr:#x}, +{len}) is not inside one live allocation"
            ))
        })?;
        if !a.is_awake() {
            return Err(Error::InvalidState(format!(
                "allocation {:#x} (tag {:?}) is asleep; wake it before reading or writing",
                a.addr, a.tag
            )));
        }
        Ok(a.device)
    }

    // ----- queries and host memory ------------------------------------------------------------------------

    pub fn usage(&self, device: Option<i32>) -> Result<usize> {
        Ok(self.lock_open()?.reg.mapped_bytes(device))
    }

    pub fn allocations(&self) -> Result<Vec<AllocationInfo>> {
        let inner = self.lock_open()?;
        Ok(inner
            .reg
            .iter()
            .map(|a| AllocationInfo {
                addr: a.addr,
                size: a.size,
                requested: a.requested,
                device: a.device,
                tag: a.tag.to_string(),
                asleep: !a.is_awake(),
                backed_up: matches!(a.state, State::Asleep { backup: Some(_) }),
            })
            .collect())
    }

    pub fn stats(&self) -> Stats {
        let inner = self.inner.lock();
        let mut s = inner.stats.clone();
        s.live_allocations = inner.reg.len();
        s.asleep_allocations = inner.reg.iter().filter(|a| !a.is_awake()).count();
        s.mapped_bytes = inner.reg.mapped_bytes(None);
        s.asleep_bytes = inner
            .reg
            .iter()
            .filter(|a| !a.is_awake())
            .map(|a| a.size)
            .sum();
        s.host_backup_bytes = inner.arenas.iter().map(|a| a.len()).sum();
        s.host_cached_bytes = inner.host.cached_bytes();
        s.pending_releases = inner.pending.len();
        s
    }

    /// Host backup bytes held: arenas in use by asleep allocations plus cached ones.
    pub fn host_bytes(&self) -> usize {
        let inner = self.inner.lock();
        inner.arenas.iter().map(|a| a.len()).sum::<usize>() + inner.host.cached_bytes()
    }

    pub fn set_keep_host_memory(&self, keep: bool) -> Result<()> {
        let mut inner = self.lock_open()?;
        inner.host.keep = keep;
        if !keep {
            inner.host.trim()?;
        }
        Ok(())
    }

    pub fn reserve_host(&self, len: usize) -> Result<()> {
        if len == 0 {
            return Err(Error::invalid(
                "reserve_host needs a positive number of bytes",
            ));
        }
        let mut inner = self.lock_open()?;
        let r = inner.host.reserve(len);
        self.record_host_fallbacks(&mut inner);
        r
    }

    fn record_host_fallbacks(&self, inner: &mut Inner) {
        for e in std::mem::take(&mut inner.host.fallbacks) {
            Self::record(
                inner,
                "pinning host backup memory (served by the fallback allocation)",
                &e,
            );
        }
    }

    pub fn trim_host(&self) -> Result<usize> {
        let mut inner = self.inner.lock();
        self.retry_pending(&mut inner);
        inner.host.trim()
    }

    pub fn errors(&self) -> Vec<String> {
        self.inner.lock().errors.clone()
    }

    /// Remember an error that could not be raised (a C-ABI free, a release after the point of no return).
    pub fn record_error(&self, context: &str, e: &Error) {
        Self::record(&mut self.inner.lock(), context, e);
    }

    pub fn is_closed(&self) -> bool {
        self.inner.lock().closed
    }

    /// Free everything and return host memory. Later calls fail with `Error::Closed`. Idempotent.
    pub fn close(&self) -> Result<()> {
        let mut inner = self.inner.lock();
        if inner.closed {
            return Ok(());
        }
        self.retry_pending(&mut inner);
        let mut first_err = None;
        for addr in inner.reg.select(|_| true) {
            if let Err(e) = self.free_locked(&mut inner, addr) {
                first_err.get_or_insert(e);
            }
        }
        if let Err(e) = inner.host.trim() {
            first_err.get_or_insert(e);
        }
        if first_err.is_none() && !inner.pending.is_empty() {
            first_err = Some(Error::InvalidState(format!(
                "close could not finish: {} driver releases are still refused (queued; call close again)",
                inner.pending.len()
            )));
        }
        if first_err.is_none() {
            inner.closed = true;
        }
        first_err.map_or(Ok(()), Err)
    }

    // ----- building blocks --------------------------------------------------------------------------------

    fn lock_open(&self) -> Result<parking_lot::MutexGuard<'_, Inner>> {
        let inner = self.inner.lock();
        if inner.closed {
            return Err(Error::Closed);
        }
        Ok(inner)
    }

    fn record(inner: &mut Inner, context: &str, e: &Error) {
        if inner.errors.len() >= MAX_RECORDED_ERRORS {
            inner.errors.remove(0);
        }
        log::warn!("{context}: {e}");
        inner.errors.push(format!("{context}: {e}"));
        inner.stats.recorded_errors += 1;
    }

    fn note_peak(inner: &mut Inner) {
        let mapped = inner.reg.mapped_bytes(None);
        inner.stats.peak_mapped_bytes = inner.stats.peak_mapped_bytes.max(mapped);
    }

    /// create + map + set_access at `addr`, undoing its own steps on failure.
    fn map_new(
        &self,
        inner: &mut Inner,
        device: i32,
        addr: DevPtr,
        size: usize,
    ) -> Result<PhysHandle> {
        let handle = self.driver.create(device, size)?;
        if let Err(e) = self.driver.map(addr, size, handle) {
            self.release_or_queue(inner, handle);
            return Err(e);
        }
        if let Err(e) = self.driver.set_access(device, addr, size) {
            self.unmap_or_queue(inner, addr, size);
            self.release_or_queue(inner, handle);
            return Err(e);
        }
        Ok(handle)
    }

    /// unmap + release. A failed unmap changes nothing and is returned; a failed release is queued.
    fn unmap_release(
        &self,
        inner: &mut Inner,
        addr: DevPtr,
        size: usize,
        handle: PhysHandle,
    ) -> Result<()> {
        self.driver.unmap(addr, size)?;
        self.release_or_queue(inner, handle);
        Ok(())
    }

    fn rollback_wake(&self, inner: &mut Inner, mapped: &[(DevPtr, PhysHandle)]) {
        for &(addr, handle) in mapped {
            let size = inner.reg.get(addr).expect("selected").size;
            self.unmap_or_queue(inner, addr, size);
            self.release_or_queue(inner, handle);
        }
    }

    fn unmap_or_queue(&self, inner: &mut Inner, addr: DevPtr, size: usize) {
        if let Err(e) = self.driver.unmap(addr, size) {
            Self::record(inner, &format!("unmap {addr:#x} (queued for retry)"), &e);
            inner.pending.push(Pending::Unmap { addr, size });
        }
    }

    fn release_or_queue(&self, inner: &mut Inner, handle: PhysHandle) {
        if let Err(e) = self.driver.release(handle) {
            Self::record(inner, "release of a physical handle (queued for retry)", &e);
            inner.pending.push(Pending::Release(handle));
        }
    }

    fn free_range_or_queue(&self, inner: &mut Inner, addr: DevPtr, size: usize) {
        if let Err(e) = self.driver.free_range(addr, size) {
            Self::record(
                inner,
                &format!("address free {addr:#x} (queued for retry)"),
                &e,
            );
            inner.pending.push(Pending::FreeRange { addr, size });
        }
    }

    /// Retry queued releases in order (unmaps before releases before address frees); keep those that fail again.
    fn retry_pending(&self, inner: &mut Inner) {
        if inner.pending.is_empty() {
            return;
        }
        let mut queued = std::mem::take(&mut inner.pending);
        queued.sort_by_key(|p| match p {
            Pending::Unmap { .. } => 0,
            Pending::Release(_) => 1,
            Pending::FreeRange { .. } => 2,
        });
        for p in queued {
            let r = match p {
                Pending::Unmap { addr, size } => self.driver.unmap(addr, size),
                Pending::Release(h) => self.driver.release(h),
                Pending::FreeRange { addr, size } => self.driver.free_range(addr, size),
            };
            if r.is_err() {
                inner.pending.push(p);
            }
        }
    }

    /// Finish all work that may touch the memory of these allocations' devices.
    fn synchronize_devices(&self, inner: &Inner, addrs: &[DevPtr]) -> Result<()> {
        for device in Self::devices_of(inner, addrs) {
            self.driver.synchronize(device, 0)?;
        }
        Ok(())
    }

    fn devices_of(inner: &Inner, addrs: &[DevPtr]) -> Vec<i32> {
        let mut devices: Vec<i32> = addrs
            .iter()
            .map(|a| inner.reg.get(*a).expect("selected").device)
            .collect();
        devices.sort_unstable();
        devices.dedup();
        devices
    }

    fn wait_devices(&self, inner: &Inner, addrs: &[DevPtr], mut result: Result<()>) -> Result<()> {
        for device in Self::devices_of(inner, addrs) {
            if let Err(e) = self.driver.wait(device) {
                if result.is_ok() {
                    result = Err(e);
                }
            }
        }
        result
    }

    /// Arenas no asleep allocation points into any more go back to the host pool.
    fn collect_unused_arenas(&self, inner: &mut Inner) {
        for arena in std::mem::take(&mut inner.arenas) {
            match Arc::try_unwrap(arena) {
                Ok(buf) => {
                    if let Err(e) = inner.host.give_back(buf) {
                        Self::record(inner, "returning host backup memory", &e);
                    }
                }
                Err(still_used) => inner.arenas.push(still_used),
            }
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Nobody is left to report to; whatever could not be released is the driver's (or the OS's) at exit.
        let _ = self.close();
    }
}
