//! The handful of driver operations the allocator needs, behind one trait so that the engine runs unchanged on
//! the real CUDA driver (`cuda.rs`) and on the host emulation (`sim.rs`). Fault injection is an adaptor around
//! any driver (`fault_injection.rs`); the trait knows nothing of it, nor of the emulation.
//!
//! Imports inside this folder go one way: `cuda` -> `cuda_fingerprint` -> `cuda_check`, `cuda` -> `cuda_check`,
//! `cuda` -> `cuda_codec` (the nvCOMP staging ring, with its `blob`, `sleep` and `wake` submodules) -> `nvcomp`,
//! `codec_round_trip` (a diagnostic over any driver's codec), `sim` -> `fault_injection`, `sim` -> `sim/codec`
//! (the emulator's codec), and every one of them -> this module; `codec` (the compression trait) and `nvcomp`
//! (the nvCOMP library, opened at run time) are leaves next to this module.
//!
//! Addresses are `u64` device virtual addresses. Physical memory is an opaque `PhysHandle`. Host memory given
//! to the copy functions is described by `HostPtr`s that point into buffers owned by `host/`; the engine keeps
//! those buffers alive until the matching `wait` returned.
//!
//! The methods that read or write host memory through a `HostPtr` (copies, pinning, freeing pinned memory) are
//! `unsafe fn`: a `HostPtr` is only an address, and nothing in the type proves that the memory behind it lives
//! long enough. Their callers are `host/` (arenas) and the two slice copies at the end of this file, which
//! wait for their copy before the borrowed slice goes away. So safe code cannot make the driver write through a
//! made-up address; this does not compile:
//!
//! ```compile_fail,E0133
//! use cumem_rs::driver::{Driver, HostPtr};
//! let sim = cumem_rs::SimDriver::new(cumem_rs::SimConfig::default()).unwrap();
//! let a = sim.reserve(0, 2 << 20).unwrap();
//! sim.copy_d2h(0, HostPtr(0x10), a, 2 << 20).unwrap();
//! ```
//!
//! while the same call inside `unsafe`, where the caller answers for the address, does:
//!
//! ```no_run
//! use cumem_rs::driver::{Driver, HostPtr};
//! let sim = cumem_rs::SimDriver::new(cumem_rs::SimConfig::default()).unwrap();
//! let a = sim.reserve(0, 2 << 20).unwrap();
//! // SAFETY: none; this example is not run.
//! unsafe { sim.copy_d2h(0, HostPtr(0x10), a, 2 << 20) }.unwrap();
//! ```

pub mod codec;
pub mod codec_round_trip;
pub mod cuda;
mod cuda_check;
mod cuda_codec;
mod cuda_fingerprint;
pub mod fault_injection;
pub mod nvcomp;
pub mod sim;
pub mod sim_codec;

use crate::error::Result;
use crate::fingerprint::Fingerprint;

/// The `op` of the error every fingerprint batch fails with where the kernel could not be set up on a device
/// (module, buffer or first launch refused): the engine then turns retained backups off for good.
pub const FINGERPRINTS_UNAVAILABLE: &str = "fingerprint kernel set-up";

pub type DevPtr = u64;

/// Opaque physical allocation handle (CUmemGenericAllocationHandle on CUDA).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PhysHandle(pub u64);

/// Raw host address handed to copies and pinning. Only an address: the driver methods that use one are `unsafe`,
/// and their callers (`host/`, the slice copies below) answer for the memory behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostPtr(pub usize);

/// What a driver can tell about one of its devices (printed by `info()`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device's marketing name ("NVIDIA H200"), or "simulated device".
    pub name: String,
    /// Minimum granularity of physical allocations, as `Driver::granularity`.
    pub granularity: usize,
    /// Whether physical memory is created GPUDirect-RDMA capable (NICs can register it).
    pub rdma_with_vmm: bool,
    /// The CUDA driver's version (`cuDriverGetVersion`, e.g. 12080); None on the simulated driver.
    pub driver_version: Option<i32>,
}

/// The operations of a driver, named as fault-injection targets use them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    Reserve,
    FreeRange,
    Create,
    Release,
    Map,
    Unmap,
    SetAccess,
    CopyD2H,
    CopyH2D,
    Wait,
    Record,
    Synchronize,
    HostRegister,
    HostUnregister,
    HostAlloc,
    MemsetZero,
    Fingerprint,
    /// Not a driver call: the allocator starting a worker thread (see `Driver::thread_spawn`).
    ThreadSpawn,
    /// The codec's calls (`codec::DeviceCodec`): a sleep's compression, a wake's decompression, and a
    /// decompression that succeeds with wrong bytes (fault injection only: what the wake's verify must catch).
    Compress,
    /// A blob the codec finished within a sleep's compression (counted by fault injection only, to fail a
    /// compression part way).
    CompressBlob,
    Decompress,
    CorruptDecompress,
    /// A host -> device copy that succeeds with wrong bytes (fault injection only, like `CorruptDecompress`: a
    /// backup damaged where it lay, which the wake's verification must catch).
    CorruptCopyH2D,
}

impl Op {
    pub const ALL: [Op; 23] = [
        Op::Reserve,
        Op::FreeRange,
        Op::Create,
        Op::Release,
        Op::Map,
        Op::Unmap,
        Op::SetAccess,
        Op::CopyD2H,
        Op::CopyH2D,
        Op::Wait,
        Op::Record,
        Op::Synchronize,
        Op::HostRegister,
        Op::HostUnregister,
        Op::HostAlloc,
        Op::MemsetZero,
        Op::Fingerprint,
        Op::ThreadSpawn,
        Op::Compress,
        Op::CompressBlob,
        Op::Decompress,
        Op::CorruptDecompress,
        Op::CorruptCopyH2D,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::Reserve => "reserve",
            Op::FreeRange => "free_range",
            Op::Create => "create",
            Op::Release => "release",
            Op::Map => "map",
            Op::Unmap => "unmap",
            Op::SetAccess => "set_access",
            Op::CopyD2H => "copy_d2h",
            Op::CopyH2D => "copy_h2d",
            Op::Wait => "wait",
            Op::Record => "record_marker",
            Op::Synchronize => "synchronize",
            Op::HostRegister => "host_register",
            Op::HostUnregister => "host_unregister",
            Op::HostAlloc => "host_alloc",
            Op::MemsetZero => "memset_zero",
            Op::Fingerprint => "fingerprint",
            Op::ThreadSpawn => "thread_spawn",
            Op::Compress => "compress",
            Op::CompressBlob => "compress_blob",
            Op::Decompress => "decompress",
            Op::CorruptDecompress => "decompress_corrupt",
            Op::CorruptCopyH2D => "copy_h2d_corrupt",
        }
    }

    /// Whether an injected fault makes the call fail (all but `CorruptDecompress` and `CorruptCopyH2D`, which let
    /// their call succeed with wrong bytes: what the wake's verification must catch, not an error of the driver's).
    pub fn fails_its_call(self) -> bool {
        !matches!(self, Op::CorruptDecompress | Op::CorruptCopyH2D)
    }

    pub fn parse(name: &str) -> Option<Op> {
        Op::ALL.iter().copied().find(|op| op.name() == name)
    }
}

/// Everything the engine asks of a driver. Implementations are thread-safe.
pub trait Driver: Send + Sync {
    /// "cuda" or "sim".
    fn backend(&self) -> &'static str;
    fn device_count(&self) -> Result<usize>;
    /// Minimum granularity of physical allocations on `device` (sizes are rounded up to it).
    fn granularity(&self, device: i32) -> Result<usize>;
    /// (free, total) physical bytes on `device`.
    fn mem_info(&self, device: i32) -> Result<(usize, usize)>;
    /// Facts about `device` for diagnostics; the simulated driver answers with its configuration.
    fn device_info(&self, device: i32) -> Result<DeviceInfo>;

    /// Reserve `size` bytes of virtual address space (no physical memory).
    fn reserve(&self, device: i32, size: usize) -> Result<DevPtr>;
    /// Give a reserved range back. It must have no mappings left.
    fn free_range(&self, addr: DevPtr, size: usize) -> Result<()>;
    /// Create `size` bytes of physical memory on `device`.
    fn create(&self, device: i32, size: usize) -> Result<PhysHandle>;
    /// Release a physical handle (its memory is freed once it is unmapped everywhere).
    fn release(&self, handle: PhysHandle) -> Result<()>;
    /// Map `handle` at `addr` (whole handle, offset 0).
    fn map(&self, addr: DevPtr, size: usize, handle: PhysHandle) -> Result<()>;
    fn unmap(&self, addr: DevPtr, size: usize) -> Result<()>;
    /// Make a mapped range readable and writable from `device`.
    fn set_access(&self, device: i32, addr: DevPtr, size: usize) -> Result<()>;

    /// Queue a device-to-host copy on the engine's copy stream of `device`.
    ///
    /// # Safety
    /// `[dst, dst+size)` must be host memory that is valid for writes and that nothing else reads or writes
    /// until the copy is finished (a later `wait` of `device`, or `wait_marker` of a marker recorded after it,
    /// returned). The memory must not be freed or unpinned before then.
    unsafe fn copy_d2h(&self, device: i32, dst: HostPtr, src: DevPtr, size: usize) -> Result<()>;
    /// Queue a host-to-device copy on the engine's copy stream of `device`.
    ///
    /// # Safety
    /// `[src, src+size)` must be host memory that is valid for reads and not written, freed or unpinned until
    /// the copy is finished (as for `copy_d2h`).
    unsafe fn copy_h2d(&self, device: i32, dst: DevPtr, src: HostPtr, size: usize) -> Result<()>;
    /// Queue a fill of `size` bytes at `addr` with zeros on the copy stream of `device`, after the copies queued
    /// so far (`wait` covers it). The range must be mapped and accessible.
    fn memset_zero(&self, device: i32, addr: DevPtr, size: usize) -> Result<()>;
    /// Wait until every copy queued on the copy stream of `device` has finished.
    fn wait(&self, device: i32) -> Result<()>;
    /// Record a marker on the copy stream of `device` after the copies queued so far.
    fn record_marker(&self, device: i32) -> Result<u64>;
    /// Wait until the copies queued before `marker` have finished, then forget the marker (also on failure).
    fn wait_marker(&self, device: i32, marker: u64) -> Result<()>;
    /// Finish all work on `device` that may still touch its memory. `stream` is the caller's stream (0 = none);
    /// when that stream is being captured into a CUDA graph, this must not synchronize (and returns Ok).
    fn synchronize(&self, device: i32, stream: u64) -> Result<()>;

    /// Said before the caller touches `[addr, addr+len)` of `device` outside the copy stream (the engine's read,
    /// write and prints for users and tests), after which it synchronizes the device. CUDA has nothing to check;
    /// the simulated driver, which knows its stream, fails it (as a data race) when queued work still writes the
    /// range, or reads it and `write` is set: a call that returned before its copies finished.
    fn user_device_access(
        &self,
        _device: i32,
        _addr: DevPtr,
        _len: usize,
        _write: bool,
    ) -> Result<()> {
        Ok(())
    }

    /// As `user_device_access`, for host memory the caller hands the user to read (or `write`) outside the copy
    /// streams: a view of a backup. The simulated driver fails it when queued work still writes the range, or
    /// reads it and `write` is set.
    fn user_host_access(&self, _ptr: HostPtr, _len: usize, _write: bool) -> Result<()> {
        Ok(())
    }

    /// Queue on the copy stream of `device`, behind the copies queued so far, the fingerprints
    /// (`crate::fingerprint`) of the device ranges `chunks` ((addr, len), len a multiple of 16). One batch per
    /// device at a time: read it with `take_fingerprints` once the stream has passed it (after `wait`, or a
    /// marker recorded later), before queueing the next one.
    fn queue_fingerprints(&self, device: i32, chunks: &[(DevPtr, usize)]) -> Result<()>;
    /// The fingerprints of the batch queued on `device`, in order. Forgets the batch, also on failure; with no
    /// batch queued it fails.
    fn take_fingerprints(&self, device: i32) -> Result<Vec<Fingerprint>>;

    /// Device memory on `device` the driver took for the allocator itself (kernels, their buffers), taken when
    /// the device was first used, before its first allocation; 0 while it was not used yet.
    fn own_device_bytes(&self, _device: i32) -> usize {
        0
    }

    /// The codec this driver compresses backups with (`codec.rs`), None where it has none (nvCOMP missing,
    /// compression switched off). The backup store asks once per sleep and per wake.
    fn codec(&self) -> Option<&dyn codec::DeviceCodec> {
        None
    }

    /// Page-lock (pin) host memory for fast async copies.
    ///
    /// # Safety
    /// `[ptr, ptr+size)` must be a live mapping of the caller's that stays mapped until `host_unregister`.
    unsafe fn host_register(&self, ptr: HostPtr, size: usize) -> Result<()>;
    /// Undo `host_register`.
    ///
    /// # Safety
    /// `ptr` was registered by the caller, and no copy queued into or out of it is still unfinished.
    unsafe fn host_unregister(&self, ptr: HostPtr) -> Result<()>;
    /// Fallback pinned allocation when registering fails. Freed with `host_free`.
    fn host_alloc(&self, size: usize) -> Result<HostPtr>;
    /// Free memory from `host_alloc`.
    ///
    /// # Safety
    /// `ptr` came from `host_alloc` of this driver, is freed once, and no copy using it is still unfinished; it
    /// must not be used afterwards.
    unsafe fn host_free(&self, ptr: HostPtr) -> Result<()>;

    /// Not a driver call but a fault-injection point: asked before the allocator starts a worker thread
    /// (pinning, first touch of host pages). Drivers allow it; `fault_injection::FaultInjector` counts it as
    /// `Op::ThreadSpawn` and fails it when a fault is armed, so that tests reach the path where no thread could
    /// be started and the work runs on the calling thread.
    fn thread_spawn(&self) -> Result<()> {
        Ok(())
    }

    /// Bytes of host memory a simulated machine can still pin (its configured host budget), or None: a real
    /// machine, whose room is a fact of the host, not of the driver, so the backup store reads the host itself
    /// (`crate::host_guard`) and keeps a margin for the process out of it.
    fn host_available(&self) -> Option<usize> {
        None
    }
}

/// Copy `out.len()` bytes at `src` on `device` into `out`, and wait for the copy: the slice is borrowed for the
/// whole call, so no copy into it outlives the borrow.
pub fn copy_to_slice(driver: &dyn Driver, device: i32, src: DevPtr, out: &mut [u8]) -> Result<()> {
    if out.is_empty() {
        return Ok(());
    }
    // SAFETY: `out` is valid for writes of its length and exclusively borrowed until this function returns,
    // which is after the copy finished (waited for below, also when it reports an error).
    unsafe { driver.copy_d2h(device, HostPtr(out.as_mut_ptr() as usize), src, out.len())? };
    driver.wait(device)
}

/// Copy `data` to `dst` on `device`, and wait for the copy (see `copy_to_slice`).
pub fn copy_from_slice(driver: &dyn Driver, device: i32, dst: DevPtr, data: &[u8]) -> Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    // SAFETY: `data` is valid for reads of its length and borrowed until this function returns, after the copy.
    unsafe { driver.copy_h2d(device, dst, HostPtr(data.as_ptr() as usize), data.len())? };
    driver.wait(device)
}
