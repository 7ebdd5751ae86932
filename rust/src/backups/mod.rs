//! The backup store: the one owner of every backup.
//!
//! Where an allocation's backed-up contents live (`Backup`: a piece of a shared pinned host arena, or of an
//! unlinked spill file), the arenas themselves and the cached one kept for the next sleep (`HostPool`), the bound
//! on the host memory they hold (bound.rs) and the host budget (budget.rs), backups kept bound to awake
//! allocations with their chunk fingerprints (retain.rs), the wake's check of every restored chunk against the
//! fingerprints its sleep took, at every tier (verify.rs), the background worker that pins the next sleep's arena
//! ahead of time (pin_ahead.rs), and the file tier (file_tier.rs and its wake pipeline file_wake.rs, compressed
//! file backups in file_packed.rs, over staging.rs, spill_file.rs and the I/O threads of io_workers.rs) all live
//! here.
//! The engine decides when an allocation sleeps or wakes; it asks this store which backups go to files and for an
//! arena to copy the others into, hands it the backups a sleep made (`keep`) and takes them back at wake
//! (`take`). A codec plugs in here too, behind `Backup`, not into the engine.
//!
//! Every method that cannot raise what went wrong (a fallback taken, a release refused) records it in the
//! caller's `ErrorLog`.

mod blob_reuse;
mod bound;
mod budget;
mod compressed;
mod file_packed;
mod file_tier;
mod file_wake;
mod incompressible;
mod io_workers;
mod pin_ahead;
mod placer;
mod retain;
mod slot_plan;
mod spill_file;
mod spill_names;
mod spill_reclaim;
mod verify;
mod view;

use std::collections::HashMap;
use std::sync::Arc;

use crate::driver::{DevPtr, Driver};
use crate::error::{Error, Result};
use crate::error_log::ErrorLog;
use crate::host::{HostBuffer, HostPool};

use crate::host::staging::StagingRing;
pub use crate::host::staging::DEFAULT_STAGING_BYTES;

/// What a sleep refused before any allocation was released says of itself (with ": every allocation stays awake"
/// or the reason after it). One phrase for every such refusal: a refusal after the codec already put some
/// allocations to sleep rewrites it (`Engine::refuse_after_codec`).
pub const NOTHING_RELEASED: &str = "refused before anything was released";
pub use bound::SleepArena;
pub use budget::BUDGET_ENV;
use compressed::Packed;
pub use compressed::{PackJob, PackedOne, PackedSleep};
pub use file_tier::{BackupTier, FileJob, FileRewrite, FileRewrites, FileSleep};
pub use file_wake::{FileRestore, FileRestored, FileWakeTimes};
use pin_ahead::HostRoom;
pub use pin_ahead::PinAheadStatus;
pub use retain::SleepPrints;
pub use spill_file::{FaultKind, SPILL_DIR_ENV};
use spill_file::{Faults, PosixIo, SpillDir, SpillFile};
pub use spill_names::unlink_named_files;
pub use verify::WakeCheck;
pub use view::HostView;

/// Host arena cell pinned at a time during a cold sleep: large enough that per-call overheads vanish, small
/// enough that the first copies start early.
pub const DEFAULT_PIN_CHUNK: usize = 512 << 20;

/// Wait until the disk blocks of the spill files closed and the ranges punched so far are back (the reclaim
/// thread gives them back after the call that dropped their backups returned: spill_reclaim.rs).
pub fn settle_spill_files() {
    spill_reclaim::settle();
}

/// Context of a recorded failure to start a worker thread.
pub const THREAD_REFUSED: &str = "starting a worker thread (its work ran on the calling thread)";

/// Where one allocation's backed-up contents are: `len` bytes at `offset` of a shared host arena, or of an
/// unlinked spill file (file_tier.rs), or compressed: a blob per chunk in host arenas (compressed.rs). `len` is
/// always the raw length; `stored_len` the host or file bytes it takes.
#[derive(Clone)]
pub struct Backup {
    place: Place,
    len: usize,
}

#[derive(Clone)]
enum Place {
    Arena {
        arena: Arc<HostBuffer>,
        offset: usize,
    },
    File(Arc<FileRegion>),
    /// Compressed chunks in host arenas; shared by the clones (the asleep set's, a retained one's).
    Packed(Arc<Packed>),
    /// Compressed chunks in a spill file (file_packed.rs).
    FilePacked(Arc<file_packed::FilePacked>),
}

/// A backup's bytes in a spill file. Shared by the clones of its `Backup` (the asleep set's, a retained one's, a
/// pipeline's); when the last goes (woken without retention, freed, its retained backup dropped) the disk blocks
/// are handed back at the end of that call (a punched hole, `BackupStore::punch_released`, on the reclaim thread:
/// spill_reclaim.rs), not when the last backup in the file goes.
struct FileRegion {
    file: Arc<SpillFile>,
    offset: u64,
    len: usize,
}

impl Drop for FileRegion {
    fn drop(&mut self) {
        self.file.release(self.offset, self.len);
    }
}

impl Backup {
    /// The piece [offset, offset+len) of `arena`.
    pub fn in_arena(arena: &Arc<HostBuffer>, offset: usize, len: usize) -> Backup {
        Backup {
            place: Place::Arena {
                arena: arena.clone(),
                offset,
            },
            len,
        }
    }

    /// The piece [offset, offset+len) of spill file `file`.
    pub(crate) fn in_file(file: &Arc<SpillFile>, offset: u64, len: usize) -> Backup {
        Backup {
            place: Place::File(Arc::new(FileRegion {
                file: file.clone(),
                offset,
                len,
            })),
            len,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether it lies in host memory (else in a spill file).
    pub fn in_host(&self) -> bool {
        !matches!(self.place, Place::File(_) | Place::FilePacked(_))
    }

    /// Whether it is compressed (compressed.rs, or in a file: file_packed.rs).
    pub fn is_compressed(&self) -> bool {
        self.packed().is_some() || self.file_packed().is_some()
    }

    /// Bytes it takes where it lies: its blobs' (in host memory, or of its file) when compressed, else `len`.
    pub fn stored_len(&self) -> usize {
        match &self.place {
            Place::Packed(p) => p.stored_bytes(),
            Place::FilePacked(p) => p.disk_bytes(),
            Place::Arena { .. } | Place::File(_) => self.len,
        }
    }

    /// The blobs of a compressed file backup.
    fn file_packed(&self) -> Option<&Arc<file_packed::FilePacked>> {
        match &self.place {
            Place::FilePacked(p) => Some(p),
            _ => None,
        }
    }

    /// (arena, offset) of a raw host backup.
    fn arena(&self) -> Option<(&Arc<HostBuffer>, usize)> {
        match &self.place {
            Place::Arena { arena, offset } => Some((arena, *offset)),
            Place::File(_) | Place::Packed(_) | Place::FilePacked(_) => None,
        }
    }

    /// The chunks of a compressed backup.
    fn packed(&self) -> Option<&Arc<Packed>> {
        match &self.place {
            Place::Packed(p) => Some(p),
            Place::Arena { .. } | Place::File(_) | Place::FilePacked(_) => None,
        }
    }

    /// (file, offset) of a raw file backup.
    fn file(&self) -> Option<(&Arc<SpillFile>, u64)> {
        match &self.place {
            Place::File(r) => Some((&r.file, r.offset)),
            Place::Arena { .. } | Place::Packed(_) | Place::FilePacked(_) => None,
        }
    }

    /// `out.len()` bytes from `at` bytes into the backup.
    pub fn read_at(&self, at: usize, out: &mut [u8]) -> Result<()> {
        assert!(at + out.len() <= self.len, "read past the backup's end");
        match &self.place {
            Place::Arena { arena, offset } => {
                arena.read_at(offset + at, out);
                Ok(())
            }
            Place::Packed(p) => p.read_at(self.len, at, out),
            Place::FilePacked(p) => p.read_at(at, out),
            Place::File(r) => read_file_at(&r.file, r.offset + at as u64, out),
        }
    }

    /// Whether `next` lies right behind this backup in the same arena (one copy can restore both).
    fn continued_by(&self, next: &Backup) -> bool {
        match (self.arena(), next.arena()) {
            (Some((a, off)), Some((b, next_off))) => {
                Arc::ptr_eq(a, b) && off + self.len == next_off
            }
            _ => false,
        }
    }

    /// Queue the copy of `len` bytes of the device range at `addr` into the (host) backup, `at` bytes into it.
    pub fn queue_from_device(
        &self,
        device: i32,
        addr: DevPtr,
        at: usize,
        len: usize,
    ) -> Result<usize> {
        let (arena, offset) = self
            .arena()
            .expect("host backups only (file ones: FileRewrites)");
        arena.queue_from_device(device, addr, offset + at, len)
    }
}

/// `out.len()` bytes of `file` from `from`, block by block into aligned buffers: the file may be open with
/// O_DIRECT (a diagnostics path).
fn read_file_at(file: &SpillFile, from: u64, out: &mut [u8]) -> Result<()> {
    const B: u64 = spill_file::IO_ALIGN as u64;
    let to = from + out.len() as u64;
    let mut block = Box::new(Block([0; spill_file::IO_ALIGN]));
    let mut start = from / B * B;
    while start < to {
        file.read_exact_at(&PosixIo, &mut block.0, start)?;
        let (lo, hi) = (from.max(start), to.min(start + B));
        out[(lo - from) as usize..(hi - from) as usize]
            .copy_from_slice(&block.0[(lo - start) as usize..(hi - start) as usize]);
        start += B;
    }
    Ok(())
}

/// One I/O block, aligned as O_DIRECT wants.
#[repr(C, align(4096))]
struct Block([u8; spill_file::IO_ALIGN]);

/// A restore copy being extended: (first backup's arena and offset, device, device start, length).
type Span<'a> = ((&'a Arc<HostBuffer>, usize), i32, DevPtr, usize);

/// The policy knobs of the store, from the engine's configuration.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Keep backups bound to their allocations across wake (retain.rs).
    pub retain: bool,
    /// Bytes per fingerprinted chunk.
    pub fingerprint_chunk: usize,
    /// Cell size of pipelined pinning.
    pub pin_chunk: usize,
    /// A cap on the host memory held for backups, besides what the host can give (`CUMEM_RS_HOST_MEMORY_LIMIT`).
    pub host_limit: Option<usize>,
    /// Bytes of the host's room kept for the process itself (`CUMEM_RS_HOST_MARGIN`).
    pub host_margin: usize,
    /// A cap on the host memory held for backups at any time (budget.rs).
    pub host_budget: Option<usize>,
    /// The spill directory of the file tier (file_tier.rs), if any.
    pub spill_dir: Option<std::path::PathBuf>,
    /// Compress host backups where the driver has a codec (compressed.rs).
    pub compress: bool,
    /// Compare what every wake restores with the prints its sleep took (verify.rs).
    pub verify_wake: bool,
}

pub struct BackupStore {
    driver: Arc<dyn Driver>,
    host: HostPool,
    /// Host arenas that backups still point into.
    arenas: Vec<Arc<HostBuffer>>,
    /// The backups of asleep allocations.
    asleep: HashMap<DevPtr, Backup>,
    asleep_bytes: usize,
    /// The largest backup one sleep made (or `reserve_host` asked for): the spare host memory allowed beside the
    /// backups still needed (see bound.rs).
    largest: usize,
    /// Cell size of pipelined pinning (smaller in tests to exercise cells that split allocations).
    pin_chunk: usize,
    pin_ahead: Option<pin_ahead::Worker>,
    retention: retain::Retention,
    /// What may still be pinned: the driver's answer and the configured cap.
    room: HostRoom,
    /// The host budget (budget.rs).
    budget: Option<usize>,
    /// The file tier (file_tier.rs): its directory, staging ring and size, file I/O, bytes of asleep backups.
    spill: Option<Arc<SpillDir>>,
    ring: Option<Arc<StagingRing>>,
    staging_bytes: usize,
    io: Arc<Faults<PosixIo>>,
    file_bytes: usize,
    /// Bytes of the file blocks the asleep file backups take (less than `file_bytes` where compressed).
    file_stored: usize,
    /// The spill files backups may still lie in, for `punch_released` (file_tier.rs).
    files: Vec<std::sync::Weak<SpillFile>>,
    /// Compression (compressed.rs): on, and the stored/raw ratio the last compressed sleep measured.
    compress: bool,
    ratio_guess: f64,
    /// Raw bytes of the asleep backups in host memory (`asleep_bytes` counts the bytes they take).
    asleep_raw: usize,
    /// Views of host backups handed out (view.rs).
    views: view::Views,
    /// Allocations whose last compressed backup was all raw chunks (incompressible.rs).
    incompressible: incompressible::Incompressible,
    /// The prints of asleep raw backups and what wakes found wrong (verify.rs).
    verify: verify::Verification,
    /// Blob ranges a compressed sleep placed or keeps and has not handed over to kept backups yet: in use for the
    /// holes (bound.rs) until the sleep's `collect_unused` (blob_reuse.rs).
    placed: Vec<(Arc<HostBuffer>, usize, usize)>,
}

/// Record what pinning absorbed: registrations the driver's own allocation served, and worker threads that could
/// not start (their work ran on the calling thread).
fn record_pinning(log: &mut ErrorLog, fallbacks: Vec<Error>, refused_threads: Vec<Error>) {
    for e in fallbacks {
        log.record(
            "pinning host backup memory (served by the fallback allocation)",
            &e,
        );
    }
    for e in refused_threads {
        log.record(THREAD_REFUSED, &e);
    }
}

impl BackupStore {
    /// A store; a spill directory in `config` that cannot be used is left unset, with a warning.
    pub fn new(driver: Arc<dyn Driver>, config: StoreConfig) -> BackupStore {
        let spill = config
            .spill_dir
            .as_deref()
            .and_then(|p| match SpillDir::open(p, false) {
                Ok(d) => Some(Arc::new(d)),
                Err(e) => {
                    log::warn!("{SPILL_DIR_ENV}: {e}; no file tier");
                    None
                }
            });
        let mut host = HostPool::new(driver.clone());
        // Large buffers no longer wanted go back to the OS on the reclaim thread, off the sleep's or wake's path.
        host.defer = Some(spill_reclaim::defer_boxed);
        let returning = host.returning.clone();
        BackupStore {
            spill,
            ring: None,
            staging_bytes: DEFAULT_STAGING_BYTES,
            io: Arc::new(Faults::new(PosixIo)),
            file_bytes: 0,
            file_stored: 0,
            files: Vec::new(),
            host,
            arenas: Vec::new(),
            asleep: HashMap::new(),
            asleep_bytes: 0,
            largest: 0,
            pin_chunk: config.pin_chunk,
            pin_ahead: None,
            retention: retain::Retention::new(config.retain, config.fingerprint_chunk),
            room: HostRoom {
                driver: driver.clone(),
                cap: config.host_limit,
                margin: config.host_margin,
                reading: crate::host_guard::available,
                returning,
            },
            budget: config.host_budget,
            compress: config.compress,
            ratio_guess: compressed::FIRST_RATIO_GUESS,
            asleep_raw: 0,
            views: view::Views::default(),
            incompressible: Default::default(),
            verify: verify::Verification::new(config.verify_wake),
            placed: Vec::new(),
            driver,
        }
    }

    // ----- the backups of asleep allocations ---------------------------------------------------------------

    /// `addr` went to sleep with `backup` (the sleep's prints of it follow: `keep_sleep_prints`).
    pub fn keep(&mut self, addr: DevPtr, backup: Backup) {
        self.verify.asleep.remove(&addr);
        self.count(&backup, true);
        if let Some(old) = self.asleep.insert(addr, backup) {
            self.count(&old, false);
        }
    }

    /// Add (`add`) or remove `b` from the bytes asleep in its tier (host: the bytes it takes, and its raw bytes).
    /// File backups: the bytes of the file tier, and their file blocks.
    fn count(&mut self, b: &Backup, add: bool) {
        let (raw, stored) = if b.in_host() {
            (&mut self.asleep_raw, &mut self.asleep_bytes)
        } else {
            (&mut self.file_bytes, &mut self.file_stored)
        };
        if add {
            *raw += b.len;
            *stored += b.stored_len();
        } else {
            *raw -= b.len;
            *stored -= b.stored_len();
        }
    }

    /// The backup of asleep `addr`, if it has one.
    pub fn backup_of(&self, addr: DevPtr) -> Option<&Backup> {
        self.asleep.get(&addr)
    }

    /// `addr` woke: its backup leaves the asleep set (retain.rs may bind it to the awake allocation).
    pub fn take(&mut self, addr: DevPtr) -> Option<Backup> {
        let b = self.asleep.remove(&addr)?;
        self.count(&b, false);
        // A file backup's disk blocks go back when its last holder drops it (`FileRegion`): at once unless a
        // wake binds it to the allocation as a retained backup.
        Some(b)
    }

    /// `addr` was freed: its backup, retained backup and prints are dropped; arenas nothing uses go back.
    pub fn forget(&mut self, addrs: &[DevPtr], log: &mut ErrorLog) {
        for a in addrs {
            self.take(*a);
        }
        self.retention.drop(addrs);
        self.verify.forget(addrs);
        self.views.forget(addrs);
        self.incompressible.forget(addrs);
        self.collect_unused(log);
    }

    /// Queue the copies of the backups of `run` (asleep allocations, each `(device, addr)`, contiguous on the
    /// device in this order) back to the device. Backups that lie back to back in one arena go back as one copy:
    /// at thousands of small allocations the driver's per-copy cost would otherwise show. Returns the bytes.
    pub fn queue_restore(&self, run: &[(i32, DevPtr)]) -> Result<usize> {
        let mut span: Option<Span> = None;
        let mut last: Option<&Backup> = None;
        let mut bytes = 0;
        for &(device, addr) in run {
            let b = self
                .asleep
                .get(&addr)
                .expect("restored allocations have a backup");
            let Some(piece) = b.arena() else {
                last = None; // restored from its file by `restore_files`
                continue;
            };
            bytes += b.len;
            if let (Some((_, _, _, len)), Some(prev)) = (&mut span, last) {
                if prev.continued_by(b) {
                    *len += b.len;
                    last = Some(b);
                    continue;
                }
            }
            if let Some(((arena, offset), device, start, len)) = span.take() {
                arena.queue_to_device(device, start, offset, len)?;
            }
            span = Some((piece, device, addr, b.len));
            last = Some(b);
        }
        if let Some(((arena, offset), device, start, len)) = span {
            arena.queue_to_device(device, start, offset, len)?;
        }
        Ok(bytes)
    }

    // ----- arenas ------------------------------------------------------------------------------------------

    /// The arena a sleep backs `total` bytes up into: the cached one (pinned ahead whole or in part) when it is
    /// large enough, else a new unpinned one (the cold path pins it cell by cell during the copies). Refused with
    /// an out-of-memory error, changing nothing, when what is still to pin does not fit in what the host can give.
    /// The last step of a sleep that may fail with nothing queued.
    pub fn arena_for_sleep(&mut self, total: usize, log: &mut ErrorLog) -> Result<HostBuffer> {
        self.largest = self.largest.max(total);
        // A buffer pinned ahead (whole or in part) is cached from here on.
        self.stop_pin_ahead(log);
        let cached = self.host.take_cached(total);
        if cached.is_none() {
            self.host.trim()?;
        }
        // Within the host budget: a cached arena larger than the budget allows goes back, and a fresh one of
        // exactly `total` bytes is checked instead.
        let refused = format!("sleep ({NOTHING_RELEASED}: every allocation stays awake)");
        let cached = match cached {
            Some(b) if self.check_budget(b.len(), &refused).is_err() => {
                let _ = self.host.cache(b);
                self.host.trim()?;
                None
            }
            other => other,
        };
        if cached.is_none() {
            self.check_budget(total, &refused)?;
        }
        let to_pin = cached.as_ref().map_or(total, |b| b.unpinned_below(total));
        let held = self.resident()
            + cached
                .as_ref()
                .map_or(0, |b| b.len() - b.unpinned_below(b.len()));
        if let Err(e) = self.room.check(to_pin, held, &refused) {
            if let Some(b) = cached {
                let _ = self.host.cache(b); // as it was; a refused unpin keeps it cached anyway
            }
            return Err(e);
        }
        match cached {
            Some(buf) => Ok(buf),
            None => HostBuffer::map_unpinned(&self.driver, total),
        }
    }

    /// Hold `arena` for the backups about to be made in it.
    pub fn adopt(&mut self, arena: HostBuffer, log: &mut ErrorLog) -> Arc<HostBuffer> {
        let mut arena = arena;
        for e in std::mem::take(&mut arena.notes) {
            log.record(THREAD_REFUSED, &e);
        }
        let arena = Arc::new(arena);
        self.arenas.push(arena.clone());
        arena
    }

    /// Arenas no backup points into any more go back to the host pool; then the host memory held is brought
    /// back within its bound (bound.rs).
    pub fn collect_unused(&mut self, log: &mut ErrorLog) {
        self.placed.clear(); // the sleep that placed them is over: its backups are kept or dropped
        self.punch_released();
        self.give_back_unused(log);
        self.bound(log);
    }

    fn give_back_unused(&mut self, log: &mut ErrorLog) {
        for arena in std::mem::take(&mut self.arenas) {
            match Arc::try_unwrap(arena) {
                Ok(buf) => {
                    if let Err(e) = self.host.give_back(buf) {
                        log.record("returning host backup memory", &e);
                    }
                }
                // Held by views only: theirs from now on, unmapped when the last goes (view.rs).
                Err(still_used) if self.views.only_viewed(&still_used) => {}
                Err(still_used) => self.arenas.push(still_used),
            }
        }
    }

    /// Record what the host pool absorbed (a registration the fallback served, a thread that could not start).
    fn record_host_fallbacks(&mut self, log: &mut ErrorLog) {
        let fallbacks = std::mem::take(&mut self.host.fallbacks);
        record_pinning(log, fallbacks, std::mem::take(&mut self.host.notes));
    }

    // ----- host memory -------------------------------------------------------------------------------------

    /// Host bytes held: arenas in use, cached ones, and the one the pin-ahead worker is pinning (it is cached
    /// when the worker is stopped, so the bound counts it from the start).
    pub fn held(&self) -> usize {
        self.arena_bytes() + self.host.cached_bytes() + self.pin_ahead_bytes()
    }

    /// Host bytes the store holds in memory now, what a memory cgroup charges it for: arenas in use, the pinned
    /// part of the cached ones and of the one being pinned ahead, the staging ring. The host guard's cap
    /// (`CUMEM_RS_HOST_MEMORY_LIMIT`) bounds it.
    pub(super) fn resident(&self) -> usize {
        self.arena_bytes()
            + self.host.cached_pinned_bytes()
            + self.pin_ahead_pinned()
            + self.staging_held()
    }

    /// Host bytes of the arenas backups point into.
    pub fn arena_bytes(&self) -> usize {
        self.arenas.iter().map(|a| a.len()).sum()
    }

    pub fn cached_bytes(&self) -> usize {
        self.host.cached_bytes()
    }

    /// Host bytes the backups of asleep allocations take (compressed ones: their blobs).
    pub fn asleep_bytes(&self) -> usize {
        self.asleep_bytes
    }

    /// Raw bytes of the backups of asleep allocations in host memory.
    pub fn asleep_raw_bytes(&self) -> usize {
        self.asleep_raw
    }

    /// Whether cached host memory is kept after a wake.
    pub fn keeps_host_memory(&self) -> bool {
        self.host.keep
    }

    /// Keep cached host memory after wakes (fast next sleep), or give it back (low host RAM: also stops pinning
    /// ahead and drops every retained backup).
    pub fn set_keep_host_memory(&mut self, keep: bool, log: &mut ErrorLog) -> Result<()> {
        self.host.keep = keep;
        if !keep {
            self.ring = None;
            self.stop_pin_ahead(log);
            self.drop_all_retained(log);
            self.host.trim_now()?;
        }
        Ok(())
    }

    /// Return the cached host memory (and every retained backup's, after stopping the pin-ahead worker) to the
    /// OS; the bytes freed.
    pub fn trim(&mut self, log: &mut ErrorLog) -> Result<usize> {
        self.stop_pin_ahead(log);
        self.drop_all_retained(log);
        let ring = self.ring.take().map_or(0, |r| r.bytes());
        Ok(self.host.trim_now()? + ring)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::sim::{SimConfig, SimDriver};

    const GRAN: usize = 64 << 10;

    fn store() -> (Arc<SimDriver>, BackupStore) {
        let sim = Arc::new(
            SimDriver::new(SimConfig {
                granularity: GRAN,
                ..SimConfig::default()
            })
            .unwrap(),
        );
        let config = StoreConfig {
            retain: true,
            fingerprint_chunk: GRAN,
            pin_chunk: GRAN,
            host_limit: None,
            host_margin: crate::host_guard::DEFAULT_MARGIN,
            host_budget: None,
            spill_dir: None,
            compress: false,
            verify_wake: true,
        };
        (sim.clone(), BackupStore::new(sim, config))
    }

    #[test]
    fn backups_are_kept_counted_taken_and_their_arena_returned_when_unused() {
        let (_sim, mut s) = store();
        let mut log = ErrorLog::default();
        let arena = s.arena_for_sleep(3 * GRAN, &mut log).unwrap();
        let arena = s.adopt(arena, &mut log);
        for i in 0..3 {
            s.keep(
                0x1000_0000 + (i * GRAN) as u64,
                Backup::in_arena(&arena, i * GRAN, GRAN),
            );
        }
        drop(arena);
        assert_eq!((s.asleep_bytes(), s.arena_bytes()), (3 * GRAN, 3 * GRAN));
        let b = s.take(0x1000_0000).unwrap();
        assert_eq!(b.len(), GRAN);
        assert!(s.take(0x1000_0000).is_none(), "taken once");
        drop(b);
        s.forget(
            &[0x1000_0000 + GRAN as u64, 0x1000_0000 + 2 * GRAN as u64],
            &mut log,
        );
        assert_eq!(s.asleep_bytes(), 0);
        assert_eq!(
            s.arena_bytes(),
            0,
            "no backup points into the arena: given back"
        );
        assert_eq!(s.cached_bytes(), 3 * GRAN, "kept for the next sleep");
        assert_eq!(log.recorded(), 0);
    }

    #[test]
    fn backups_back_to_back_in_one_arena_are_told_apart_from_others() {
        let (_sim, mut s) = store();
        let mut log = ErrorLog::default();
        let arena = s.arena_for_sleep(2 * GRAN, &mut log).unwrap();
        let arena = s.adopt(arena, &mut log);
        let (a, b) = (
            Backup::in_arena(&arena, 0, GRAN),
            Backup::in_arena(&arena, GRAN, GRAN),
        );
        assert!(a.continued_by(&b));
        assert!(!b.continued_by(&a));
        let other = s.arena_for_sleep(GRAN, &mut log).unwrap();
        let other = s.adopt(other, &mut log);
        assert!(!a.continued_by(&Backup::in_arena(&other, GRAN, 0)));
    }
}
