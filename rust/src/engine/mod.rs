//! Every allocation state transition: malloc, free, sleep, wake, discard, with their ordering and rollback.
//!
//! States: Awake{handle} --sleep/pause/discard--> Asleep{backup?} --wake/resume--> Awake{new handle}; free from
//! either. Per-tag policies (policy.rs) choose the backup of a pause or an untargeted sleep and the fill of a wake.
//! Guarantees (each step below says how it keeps them):
//! - a failed malloc leaves nothing behind;
//! - a failed sleep leaves each allocation either awake with its data or asleep with a complete backup;
//! - a failed wake releases what it mapped, keeps every backup and leaves its allocations asleep;
//! - a driver release that fails after its unmap succeeded is queued in `pending` and retried by later calls, so
//!   nothing leaks once the fault is gone.
//!
//! One mutex guards the registry: malloc/free issued while a sleep or wake runs wait until it has finished.
//! A panic that unwinds while that lock is held poisons the engine (see `Locked`): every later call that would
//! use or change the records fails with a clear error instead of trusting records a panic may have left half
//! updated (parking_lot's mutex does not poison by itself).

mod group;
mod hostmem;
mod pause;
mod pin_ahead;
mod policy;
mod release;
mod retain;
mod sleep;
mod types;
mod wake;

use std::collections::{HashMap, HashSet};
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use crate::address_space::AddressSpace;
use crate::driver::{self, DevPtr, Driver, PhysHandle};
use crate::error::{Error, Result};
use crate::fingerprint;
use crate::host::{HostBuffer, HostPool};
use crate::registry::{self, Allocation, Backing, Registry, State};

pub use pin_ahead::PinAheadStatus;
use policy::Policies;
pub use policy::{Status, TagPolicy, TagStatus, WakeFill};
use release::Pending;
use retain::Prints;
pub use types::{AllocationInfo, Report, Stats};

/// At most this many recorded errors are kept (oldest dropped first).
const MAX_RECORDED_ERRORS: usize = 1000;

/// Host arena cell pinned at a time during a cold sleep: large enough that per-call overheads vanish, small
/// enough that the first copies start early.
const PIN_CHUNK: usize = 512 << 20;

static NEXT_ENGINE_ID: AtomicU64 = AtomicU64::new(1);

/// Context of a recorded failure to start a worker thread.
const THREAD_REFUSED: &str = "starting a worker thread (its work ran on the calling thread)";

/// Why a poisoned engine refuses a call.
const POISONED: &str = "the allocator is unusable: a call panicked (an internal error) while it held the \
    allocator's lock, so its records may be inconsistent; every later call is refused (errors() and stats() \
    still answer) and its memory is returned when the process exits";

struct Inner {
    reg: Registry,
    /// Where allocations are placed: side by side in shared reservations (address_space.rs).
    vas: AddressSpace,
    host: HostPool,
    /// Host arenas that asleep allocations still point into.
    arenas: Vec<Arc<HostBuffer>>,
    pending: Vec<Pending>,
    errors: Vec<String>,
    stats: Stats,
    closed: bool,
    /// Cell size of pipelined pinning (PIN_CHUNK; smaller in tests to exercise cells that split allocations).
    pin_chunk: usize,
    /// Per-tag backup and wake-fill policies (policy.rs).
    policies: Policies,
    /// The largest backup one sleep made (or `reserve_host` asked for): the spare host memory allowed beside the
    /// backups still needed (see `hostmem.rs`).
    largest_backup: usize,
    /// Set when a panic unwound while the lock was held; see `Locked`.
    poisoned: bool,
    /// Backups kept bound to awake allocations after the wake that restored them (see `retain.rs`).
    retained: HashMap<DevPtr, registry::Backup>,
    /// Chunk fingerprints of backups (of asleep allocations, and of retained ones).
    prints: HashMap<DevPtr, Prints>,
    /// Policy: keep backups across wake (`set_retain_backups`, env CUMEM_RS_RETAIN_BACKUPS=0 turns it off).
    retain: bool,
    /// Set when the fingerprint kernel cannot run here: retention stays off.
    fingerprints_unavailable: bool,
    /// Bytes per fingerprinted chunk.
    fingerprint_chunk: usize,
    /// Wake groups: runs of small neighbours sharing one handle (group.rs), and their size limit.
    groups: group::Groups,
    group_bytes: usize,
    /// The background worker pinning host memory for the next sleep, if any (pin_ahead.rs).
    pin_ahead: Option<pin_ahead::Worker>,
}

pub struct Engine {
    id: u64,
    driver: Arc<dyn Driver>,
    granularity: Vec<usize>,
    inner: Mutex<Inner>,
    /// False once closed or dropped: this engine's tag stacks on other threads may be dropped (registry.rs).
    alive: Arc<AtomicBool>,
}

/// The engine lock, held. If a panic unwinds while it is held (and was not already unwinding when it was
/// taken), the engine is poisoned and every device's copy stream is waited for, so that no copy queued before
/// the panic still runs when host memory is given back later.
struct Locked<'a> {
    engine: &'a Engine,
    guard: MutexGuard<'a, Inner>,
    was_panicking: bool,
}

impl Deref for Locked<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.guard
    }
}

impl DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        &mut self.guard
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() || self.was_panicking || self.guard.poisoned {
            return;
        }
        self.guard.poisoned = true;
        for d in 0..self.engine.device_count() {
            let _ = self.engine.driver.wait(d as i32);
        }
        Engine::record(
            &mut self.guard,
            "internal error",
            &Error::InvalidState("a call panicked while it held the allocator's lock".into()),
        );
    }
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
            vas: AddressSpace::default(),
            host: HostPool::new(driver.clone()),
            arenas: Vec::new(),
            pending: Vec::new(),
            errors: Vec::new(),
            stats: Stats::default(),
            closed: false,
            pin_chunk: PIN_CHUNK,
            pin_ahead: None,
            groups: group::Groups::default(),
            group_bytes: group::initial_group_bytes(),
            policies: Policies::default(),
            largest_backup: 0,
            poisoned: false,
            retained: HashMap::new(),
            prints: HashMap::new(),
            retain: std::env::var("CUMEM_RS_RETAIN_BACKUPS").map_or(true, |v| v != "0"),
            fingerprints_unavailable: false,
            fingerprint_chunk: fingerprint::DEFAULT_CHUNK,
        };
        Ok(Engine {
            id: NEXT_ENGINE_ID.fetch_add(1, Ordering::Relaxed),
            driver,
            granularity,
            inner: Mutex::new(inner),
            alive: Arc::new(AtomicBool::new(true)),
        })
    }

    /// Cell size of pipelined pinning during a cold sleep, rounded up to whole pages. Zero, or a size that
    /// cannot be rounded up to a page within `isize::MAX`, is refused.
    pub fn set_pin_chunk(&self, bytes: usize) -> Result<()> {
        let page = rustix::param::page_size();
        let chunk = Some(bytes)
            .filter(|b| *b > 0)
            .and_then(|b| b.checked_next_multiple_of(page))
            .filter(|c| *c <= isize::MAX as usize)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "pin chunk must be between 1 and {} bytes, got {bytes}",
                    isize::MAX as usize / page * page
                ))
            })?;
        let mut inner = self.lock_open()?;
        // A buffer pinned ahead in cells of the old size would not match the next sleep's cells.
        self.stop_pin_ahead(&mut inner);
        inner.pin_chunk = chunk;
        Ok(())
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
        registry::push_tag(self.id, &self.alive, Arc::from(tag));
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
        let addr = inner.vas.alloc(&*self.driver, device, rounded, gran)?;
        let handle = match self.map_new(&mut inner, device, addr, rounded) {
            Ok(h) => h,
            Err(e) => {
                self.return_address(&mut inner, addr, rounded);
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
            state: State::Awake {
                backing: Backing::Own(handle),
            },
        });
        inner.stats.mallocs += 1;
        Self::note_peak(&mut inner);
        Ok(addr)
    }

    /// Free a live allocation, awake or asleep. A release that fails after the unmap is queued and recorded, not
    /// raised: the allocation is gone either way. A failed synchronize or unmap is raised with the allocation
    /// still live (the caller may try again).
    pub fn free(&self, addr: DevPtr) -> Result<()> {
        let mut inner = self.lock_open()?;
        self.retry_pending(&mut inner);
        self.free_locked(&mut inner, addr, false)
    }

    /// Free for a caller that forgets the pointer whatever happens (torch, through `my_free`). Where `free` would
    /// raise with the allocation still live, this records the failure in `errors()` and queues the unmap,
    /// release and address free for retry by later calls: the allocation is gone either way, so it is never
    /// backed up again, and nothing leaks once the driver recovers. Fails only when nothing was done (unknown
    /// address, closed or poisoned allocator).
    pub fn free_or_queue(&self, addr: DevPtr) -> Result<()> {
        let mut inner = self.lock_open()?;
        self.retry_pending(&mut inner);
        self.free_locked(&mut inner, addr, true)
    }

    fn free_locked(&self, inner: &mut Inner, addr: DevPtr, queue_failures: bool) -> Result<()> {
        let a = inner
            .reg
            .get(addr)
            .ok_or(Error::UnknownAddress(addr))?
            .clone();
        // Asleep: nothing is mapped. A group member's addresses go back with its group.
        let mut return_address = true;
        if let State::Awake { backing } = a.state {
            // The caller's work on this memory must be finished before it is unmapped (a no-op during capture).
            let done = self
                .driver
                .synchronize(a.device, a.stream)
                .and_then(|()| match backing {
                    Backing::Own(_) => self.driver.unmap(a.addr, a.size),
                    Backing::Group(id) => self.free_member(inner, id, a.addr, a.size),
                });
            return_address = matches!((&done, backing), (Ok(()), Backing::Own(_)));
            match (done, backing) {
                (Ok(()), Backing::Own(handle)) => self.release_or_queue(inner, handle),
                (Ok(()), Backing::Group(_)) => {}
                (Err(e), _) if !queue_failures => return Err(e),
                (Err(e), Backing::Own(handle)) => {
                    Self::record(
                        inner,
                        &format!("free {addr:#x} (its unmap, release and address free are queued for retry)"),
                        &e,
                    );
                    self.queue_release(inner, a.addr, a.size, handle);
                }
                (Err(e), Backing::Group(id)) => {
                    self.drop_member_queued(inner, id, a.addr, a.size, &e)
                }
            }
        }
        inner.reg.remove(addr);
        Self::drop_retained(inner, &[addr]);
        if return_address {
            self.return_address(inner, a.addr, a.size);
        }
        inner.stats.frees += 1;
        drop(a); // its backup reference, if asleep
        self.collect_unused_arenas(inner);
        Ok(())
    }

    // ----- byte access (tests and tools) ------------------------------------------------------------------

    pub fn read(&self, addr: DevPtr, len: usize) -> Result<Vec<u8>> {
        let inner = self.lock_open()?;
        let device = Self::awake_containing(&inner, addr, len)?;
        let mut out = vec![0u8; len];
        if len > 0 {
            self.driver.synchronize(device, 0)?;
            driver::copy_to_slice(&*self.driver, device, addr, &mut out)?;
        }
        Ok(out)
    }

    /// Fingerprints computed by the driver (the GPU kernel on CUDA) of [addr, addr+len) in chunks of the
    /// fingerprint chunk size; `len` a multiple of 16, inside one awake allocation.
    pub fn fingerprints(&self, addr: DevPtr, len: usize) -> Result<Vec<fingerprint::Fingerprint>> {
        let inner = self.lock_open()?;
        let device = Self::awake_containing(&inner, addr, len)?;
        if len == 0 || !len.is_multiple_of(fingerprint::WORD) || !addr.is_multiple_of(16) {
            return Err(Error::invalid(format!(
                "fingerprints need a 16-byte aligned address and a positive multiple of 16 bytes, got {addr:#x}+{len}"
            )));
        }
        let ranges: Vec<(DevPtr, usize)> = fingerprint::chunks(len, inner.fingerprint_chunk)
            .map(|(off, l)| (addr + off as u64, l))
            .collect();
        self.driver.synchronize(device, 0)?;
        self.driver.queue_fingerprints(device, &ranges)?;
        let waited = self.driver.wait(device);
        let taken = self.driver.take_fingerprints(device);
        waited?;
        taken
    }

    pub fn write(&self, addr: DevPtr, data: &[u8]) -> Result<()> {
        let inner = self.lock_open()?;
        let device = Self::awake_containing(&inner, addr, data.len())?;
        if !data.is_empty() {
            self.driver.synchronize(device, 0)?;
            driver::copy_from_slice(&*self.driver, device, addr, data)?;
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
        let mut inner = self.inner.lock();
        self.collect_finished_pin_ahead(&mut inner);
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
        s.host_retained_bytes = Self::retained_bytes(&inner);
        s.retained_allocations = inner.retained.len();
        s.pending_releases = inner.pending.len();
        s.wake_groups = inner.groups.len();
        s.unreturned_bytes = inner.groups.unreturned();
        s
    }

    /// Host backup bytes held: arenas in use by asleep allocations plus cached ones.
    pub fn host_bytes(&self) -> usize {
        let mut inner = self.inner.lock();
        self.collect_finished_pin_ahead(&mut inner);
        Self::host_held(&inner)
    }

    pub fn set_keep_host_memory(&self, keep: bool) -> Result<()> {
        let mut inner = self.lock_open()?;
        inner.host.keep = keep;
        if !keep {
            self.stop_pin_ahead(&mut inner);
            self.drop_all_retained(&mut inner);
            inner.host.trim()?;
        }
        Ok(())
    }

    /// Keep backups bound to their allocations across wake, so that a sleep copies only the chunks that
    /// changed (on by default where the fingerprint kernel runs). Off drops every retained backup.
    pub fn set_retain_backups(&self, on: bool) -> Result<()> {
        let mut inner = self.lock_open()?;
        inner.retain = on;
        if !on {
            self.drop_all_retained(&mut inner);
        }
        Ok(())
    }

    /// Whether wakes keep backups now (policy on, host memory kept, fingerprint kernel available).
    pub fn retains_backups(&self) -> bool {
        Self::retaining(&self.inner.lock())
    }

    /// Bytes per fingerprinted chunk: a positive multiple of 16. A change drops every retained backup.
    pub fn set_fingerprint_chunk(&self, bytes: usize) -> Result<()> {
        if bytes == 0 || !bytes.is_multiple_of(fingerprint::WORD) || bytes > 1 << 40 {
            return Err(Error::invalid(format!(
                "fingerprint chunk must be a positive multiple of {} bytes up to 1 TiB, got {bytes}",
                fingerprint::WORD
            )));
        }
        let mut inner = self.lock_open()?;
        if inner.fingerprint_chunk != bytes {
            inner.fingerprint_chunk = bytes;
            self.drop_all_retained(&mut inner);
        }
        Ok(())
    }

    /// Make sure `len` bytes of pinned host memory are cached for the next sleep: now, or (`background`) on a
    /// worker thread that the next sleep stops and takes over (pin_ahead.rs). Refused with an out-of-memory error
    /// when the host cannot give that much (a background worker stops at the limit instead, recording it).
    pub fn reserve_host(&self, len: usize, background: bool) -> Result<()> {
        if len == 0 {
            return Err(Error::invalid(
                "reserve_host needs a positive number of bytes",
            ));
        }
        let mut inner = self.lock_open()?;
        if background {
            return self.start_pin_ahead(&mut inner, len);
        }
        let r = self.reserve_now(&mut inner, len);
        if r.is_ok() {
            inner.largest_backup = inner.largest_backup.max(len);
        }
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
        for e in std::mem::take(&mut inner.host.notes) {
            Self::record(inner, THREAD_REFUSED, &e);
        }
    }

    pub fn trim_host(&self) -> Result<usize> {
        let mut inner = self.lock_unpoisoned()?;
        self.retry_pending(&mut inner);
        self.stop_pin_ahead(&mut inner);
        self.drop_all_retained(&mut inner);
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

    /// Free everything and return host memory. Later calls fail with `Error::Closed`. Idempotent. A poisoned
    /// engine refuses (its records cannot be trusted to free by).
    pub fn close(&self) -> Result<()> {
        let mut inner = self.lock_unpoisoned()?;
        if inner.closed {
            return Ok(());
        }
        self.retry_pending(&mut inner);
        let mut first_err = None;
        for addr in inner.reg.select(|_| true) {
            if let Err(e) = self.free_locked(&mut inner, addr, false) {
                first_err.get_or_insert(e);
            }
        }
        self.stop_pin_ahead(&mut inner);
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
            self.alive.store(false, Ordering::Relaxed);
            registry::forget_tags(self.id);
        }
        first_err.map_or(Ok(()), Err)
    }

    // ----- building blocks --------------------------------------------------------------------------------

    fn lock(&self) -> Locked<'_> {
        Locked {
            engine: self,
            was_panicking: std::thread::panicking(),
            guard: self.inner.lock(),
        }
    }

    /// The lock, unless a panic poisoned the engine.
    fn lock_unpoisoned(&self) -> Result<Locked<'_>> {
        let inner = self.lock();
        if inner.poisoned {
            return Err(Error::InvalidState(POISONED.into()));
        }
        Ok(inner)
    }

    /// The lock of an engine that is neither closed nor poisoned.
    fn lock_open(&self) -> Result<Locked<'_>> {
        let inner = self.lock_unpoisoned()?;
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
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Nobody is left to report to; whatever could not be released is the driver's (or the OS's) at exit. A
        // panic must not escape a drop (during an unwind it would abort the process).
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.close()));
        self.alive.store(false, Ordering::Relaxed);
        registry::forget_tags(self.id);
    }
}
