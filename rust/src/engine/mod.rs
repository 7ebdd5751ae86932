//! Every allocation state transition: malloc, free, sleep, wake, discard, with their ordering and rollback.
//!
//! States: Awake{backing} --sleep/pause/discard--> Asleep --wake/resume--> Awake{new backing}; free from either.
//! The engine owns the lock and the transitions; the state lives in components, each owning its part:
//! the allocation records (`Registry`) and their placement (`AddressSpace`), the backup store (every host backup,
//! `crate::backups`), the wake groups (group.rs), the queue of releases to retry (pending.rs), the tag policies
//! (policy.rs), the error log and the counters. Per-tag policies choose the backup of a pause or an untargeted
//! sleep and the fill of a wake. Guarantees (each step below says how it keeps them):
//! - a failed malloc leaves nothing behind;
//! - a failed sleep leaves each allocation either awake with its data or asleep with a complete backup;
//! - a failed wake releases what it mapped, keeps every backup and leaves its allocations asleep;
//! - a driver release that fails after its unmap succeeded is queued in `pending` and retried by later calls, so
//!   nothing leaks once the fault is gone.
//!
//! One mutex guards the components: malloc/free issued while a sleep or wake runs wait until it has finished.
//! A panic that unwinds while that lock is held poisons the engine (see `Locked`): every later call that would
//! use or change the records fails with a clear error instead of trusting records a panic may have left half
//! updated (parking_lot's mutex does not poison by itself).

mod alloc;
mod compress;
mod config;
mod group;
mod host;
mod pause;
mod pending;
mod policy;
mod queries;
mod sleep;
mod types;
mod wake;

use std::collections::HashSet;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use crate::address_space::AddressSpace;
use crate::backups::{Backup, BackupStore};
use crate::driver::{self, DevPtr, Driver, PhysHandle};
use crate::error::{Error, Result};
use crate::error_log::ErrorLog;
use crate::fingerprint;
use crate::registry::{Registry, State};
use crate::tags;

pub use crate::backups::PinAheadStatus;
pub use config::{EngineConfig, COMPRESS_ENV};
use pending::PendingReleases;
use policy::Policies;
pub use policy::{BackupTier, Compress, TagPolicy, WakeFill};
pub use types::{AllocationInfo, Counters, Report, Stats, Status, TagStatus};

static NEXT_ENGINE_ID: AtomicU64 = AtomicU64::new(1);

/// Why a poisoned engine refuses a call.
const POISONED: &str = "the allocator is unusable: a call panicked (an internal error) while it held the \
    allocator's lock, so its records may be inconsistent; every later call is refused (errors() and stats() \
    still answer) and its memory is returned when the process exits";

/// Why every call of an engine fails in a process forked from the one that made it.
fn forked_error(parent: u32) -> Error {
    Error::InvalidState(format!(
        "CUDA state cannot be used after fork: this allocator belongs to process {parent}, and this process ({}) \
         is a fork of it; create the allocator in this process, or start it with the 'spawn' or 'forkserver' \
         method",
        std::process::id()
    ))
}

/// Whether the engine still takes calls.
#[derive(Debug, Default, Clone, Copy)]
struct Life {
    closed: bool,
    /// Set when a panic unwound while the lock was held; see `Locked`.
    poisoned: bool,
}

/// The engine's state, one component a field.
struct Inner {
    reg: Registry,
    /// Where allocations are placed: side by side in shared reservations (address_space.rs).
    vas: AddressSpace,
    backups: BackupStore,
    groups: group::Groups,
    pending: PendingReleases,
    policies: Policies,
    log: ErrorLog,
    counters: Counters,
    life: Life,
}

pub struct Engine {
    id: u64,
    /// The process that made the engine: a forked child (another pid) must not touch its driver state, its
    /// worker threads (which do not exist in the child) or its lock (which a parent thread may have held).
    pid: u32,
    driver: Arc<dyn Driver>,
    granularity: Vec<usize>,
    inner: Mutex<Inner>,
    /// False once closed or dropped: this engine's tag stacks on other threads may be dropped (tags.rs).
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
        if !std::thread::panicking() || self.was_panicking || self.guard.life.poisoned {
            return;
        }
        self.guard.life.poisoned = true;
        for d in 0..self.engine.device_count() {
            let _ = self.engine.driver.wait(d as i32);
        }
        self.guard.log.record(
            "internal error",
            &Error::InvalidState("a call panicked while it held the allocator's lock".into()),
        );
    }
}

impl Inner {
    fn new(driver: Arc<dyn Driver>, config: &EngineConfig) -> Inner {
        Inner {
            reg: Registry::default(),
            vas: AddressSpace::default(),
            backups: BackupStore::new(driver, config.store()),
            groups: group::Groups::new(config.wake_group_bytes),
            pending: PendingReleases::default(),
            policies: Policies::default(),
            log: ErrorLog::default(),
            counters: Counters::default(),
            life: Life::default(),
        }
    }
}

fn tag_set<S: AsRef<str>>(tags: &[S]) -> HashSet<&str> {
    tags.iter().map(AsRef::as_ref).collect()
}

impl Engine {
    /// An engine over `driver`, configured from the environment (`EngineConfig::from_env`).
    pub fn new(driver: Arc<dyn Driver>) -> Result<Engine> {
        Self::with_config(driver, EngineConfig::from_env())
    }

    pub fn with_config(driver: Arc<dyn Driver>, config: EngineConfig) -> Result<Engine> {
        let devices = driver.device_count()?;
        let granularity = (0..devices as i32)
            .map(|d| driver.granularity(d))
            .collect::<Result<Vec<_>>>()?;
        let inner = Inner::new(driver.clone(), &config);
        Ok(Engine {
            id: NEXT_ENGINE_ID.fetch_add(1, Ordering::Relaxed),
            pid: std::process::id(),
            driver,
            granularity,
            inner: Mutex::new(inner),
            alive: Arc::new(AtomicBool::new(true)),
        })
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
        tags::push_tag(self.id, &self.alive, Arc::from(tag));
        Ok(())
    }

    pub fn pop_tag(&self) -> Result<String> {
        drop(self.lock_open()?);
        tags::pop_tag(self.id)
            .map(|t| t.to_string())
            .ok_or_else(|| {
                Error::InvalidState("pop_tag without a matching push_tag on this thread".into())
            })
    }

    pub fn current_tag(&self) -> Result<String> {
        drop(self.lock_open()?);
        Ok(tags::current_tag(self.id).to_string())
    }

    // ----- byte access (tests and tools) ------------------------------------------------------------------

    pub fn read(&self, addr: DevPtr, len: usize) -> Result<Vec<u8>> {
        let inner = self.lock_open()?;
        let device = Self::awake_containing(&inner, addr, len)?;
        let mut out = vec![0u8; len];
        if len > 0 {
            self.driver.user_device_access(device, addr, len, false)?;
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
        let ranges: Vec<(DevPtr, usize)> =
            fingerprint::chunk_ranges(addr, len, inner.backups.fingerprint_chunk()).collect();
        self.driver.user_device_access(device, addr, len, false)?;
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
            self.driver
                .user_device_access(device, addr, data.len(), true)?;
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

    // ----- errors and closing -----------------------------------------------------------------------------

    pub fn errors(&self) -> Vec<String> {
        self.inner.lock().log.entries().to_vec()
    }

    /// Remember an error that could not be raised (a C-ABI free, a release after the point of no return).
    pub fn record_error(&self, context: &str, e: &Error) {
        self.inner.lock().log.record(context, e);
    }

    pub fn is_closed(&self) -> bool {
        self.inner.lock().life.closed
    }

    /// Free everything and return host memory. Later calls fail with `Error::Closed`. Idempotent. A poisoned
    /// engine refuses (its records cannot be trusted to free by).
    pub fn close(&self) -> Result<()> {
        let mut locked = self.lock_unpoisoned()?;
        let inner = &mut *locked;
        if inner.life.closed {
            return Ok(());
        }
        self.retry_pending(inner);
        let mut first_err = None;
        for addr in inner.reg.select(|_| true) {
            if let Err(e) = self.free_locked(inner, addr, false) {
                first_err.get_or_insert(e);
            }
        }
        inner.backups.stop_pin_ahead(&mut inner.log);
        if let Err(e) = inner.backups.trim(&mut inner.log) {
            first_err.get_or_insert(e);
        }
        if first_err.is_none() && !inner.pending.is_empty() {
            first_err = Some(Error::InvalidState(format!(
                "close could not finish: {} driver releases are still refused (queued; call close again)",
                inner.pending.len()
            )));
        }
        if first_err.is_none() {
            inner.life.closed = true;
            self.alive.store(false, Ordering::Relaxed);
            tags::forget_tags(self.id);
            // Closed means the disk blocks of its spill files are back too, not just handed to the reclaim thread.
            crate::backups::settle_spill_files();
        }
        first_err.map_or(Ok(()), Err)
    }

    // ----- the lock ---------------------------------------------------------------------------------------

    fn lock(&self) -> Locked<'_> {
        Locked {
            engine: self,
            was_panicking: std::thread::panicking(),
            guard: self.inner.lock(),
        }
    }

    /// True in a process forked from the one that made this engine: every call is refused there.
    pub fn forked(&self) -> bool {
        std::process::id() != self.pid
    }

    /// Err in a forked child (see `forked`).
    pub fn check_not_forked(&self) -> Result<()> {
        match self.forked() {
            true => Err(forked_error(self.pid)),
            false => Ok(()),
        }
    }

    /// The lock, unless a panic poisoned the engine or this is a forked child (checked before locking: a thread
    /// of the parent may have held the lock when it forked).
    fn lock_unpoisoned(&self) -> Result<Locked<'_>> {
        self.check_not_forked()?;
        let inner = self.lock();
        if inner.life.poisoned {
            return Err(Error::InvalidState(POISONED.into()));
        }
        Ok(inner)
    }

    /// The lock of an engine that is neither closed nor poisoned.
    fn lock_open(&self) -> Result<Locked<'_>> {
        let inner = self.lock_unpoisoned()?;
        if inner.life.closed {
            return Err(Error::Closed);
        }
        Ok(inner)
    }

    // ----- building blocks shared by the transitions ------------------------------------------------------

    /// The one place an allocation's state and its backup change together: asleep (with `backup`, if any).
    fn mark_asleep(inner: &mut Inner, addr: DevPtr, backup: Option<Backup>) {
        inner.reg.set_state(addr, State::Asleep);
        if let Some(b) = backup {
            inner.backups.keep(addr, b);
        }
    }

    fn note_peak(inner: &mut Inner) {
        let mapped = inner.reg.mapped_bytes(None);
        inner.counters.peak_mapped_bytes = inner.counters.peak_mapped_bytes.max(mapped);
    }

    /// create + map + set_access at `addr`, undoing its own steps on failure.
    fn map_new(
        &self,
        inner: &mut Inner,
        device: i32,
        addr: DevPtr,
        size: usize,
    ) -> Result<PhysHandle> {
        let Inner { pending, log, .. } = inner;
        map_new_in(&*self.driver, pending, log, device, addr, size)
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

    fn unmap_or_queue(&self, inner: &mut Inner, addr: DevPtr, size: usize) {
        (inner.pending).unmap_or_queue(&*self.driver, &mut inner.log, addr, size);
    }

    fn release_or_queue(&self, inner: &mut Inner, handle: PhysHandle) {
        (inner.pending).release_or_queue(&*self.driver, &mut inner.log, handle);
    }

    fn return_address(&self, inner: &mut Inner, addr: DevPtr, size: usize) {
        (inner.pending).return_address(&*self.driver, &mut inner.log, &mut inner.vas, addr, size);
    }

    fn retry_pending(&self, inner: &mut Inner) {
        (inner.pending).retry(&*self.driver, &mut inner.log, &mut inner.vas);
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

    /// Wait for the copy stream of these allocations' devices; the first error, or `result`'s.
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
}

impl Drop for Engine {
    fn drop(&mut self) {
        if self.forked() {
            // Nothing here is this process's to release: no driver call, no join of a worker thread that exists
            // only in the parent. The state is leaked (the child's copy of the parent's memory goes at its exit).
            let empty = Inner::new(self.driver.clone(), &EngineConfig::default());
            std::mem::forget(std::mem::replace(self.inner.get_mut(), empty));
            return;
        }
        // Nobody is left to report to; whatever could not be released is the driver's (or the OS's) at exit. A
        // panic must not escape a drop (during an unwind it would abort the process).
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.close()));
        self.alive.store(false, Ordering::Relaxed);
        tags::forget_tags(self.id);
    }
}

/// `Engine::map_new` on the parts of the engine state it uses, for a caller that holds another part (a wake
/// mapping allocations from inside the backup store's compressed restore).
fn map_new_in(
    driver: &dyn Driver,
    pending: &mut PendingReleases,
    log: &mut ErrorLog,
    device: i32,
    addr: DevPtr,
    size: usize,
) -> Result<PhysHandle> {
    let handle = driver.create(device, size)?;
    if let Err(e) = driver.map(addr, size, handle) {
        pending.release_or_queue(driver, log, handle);
        return Err(e);
    }
    if let Err(e) = driver.set_access(device, addr, size) {
        pending.unmap_or_queue(driver, log, addr, size);
        pending.release_or_queue(driver, log, handle);
        return Err(e);
    }
    Ok(handle)
}
