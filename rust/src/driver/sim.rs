//! Host emulation of the CUDA virtual-memory API, with the same semantics the engine relies on.
//!
//! - a virtual range is an `mmap(PROT_NONE)` reservation, so its address is real and stays fixed;
//! - a physical handle is a slice of the device's memfd (`sim/slices.rs`), counted against a per-device
//!   capacity;
//! - map = `mmap(MAP_FIXED | MAP_SHARED)` of the slice over the range, still inaccessible until `set_access`
//!   (as on CUDA, where mapped memory faults until cuMemSetAccess); unmap = `PROT_NONE` reservation again;
//! - copies, fills and fingerprint batches are checked when queued (the device side mapped and accessible, as
//!   CUDA checks them) and run in order when their stream is waited for (`sim/stream.rs`): memory released
//!   under queued work is CUDA's sticky illegal address here too;
//! - fresh physical memory is filled with `POISON`, so discarded data never silently reads as zero or as the
//!   old contents (only an explicit `memset_zero`, asked for by a tag's wake-fill policy, zeroes it);
//! - errors carry the codes CUDA gives (`crate::error::cuda_code`).
//!
//! `Emulator` is the emulation; `SimDriver`, what users and tests get, is the emulation inside the fault
//! injector (`driver/fault_injection.rs`): the n-th next call of an operation fails with a chosen CUDA error code
//! (or, to test that panics are contained, panics inside the call).
//!
//! This is shipped code, not a test double: users run their sleep/wake logic on it in CPU-only CI.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::atomic::Ordering::Relaxed;

use parking_lot::{Mutex, MutexGuard};
use rustix::mm::{mmap, mmap_anonymous, mprotect, munmap, MapFlags, MprotectFlags, ProtFlags};

use super::codec::DeviceCodec;
use super::fault_injection::FaultInjector;
use super::sim_codec::SimCodecCounts;
use super::{DevPtr, DeviceInfo, Driver, HostPtr, Op, PhysHandle};
use crate::error::{cuda_code, Error, Result};
use crate::fingerprint::{self, Fingerprint};
use stream::{Batch, Until, Work};

mod codec;
mod host_pins;
mod mapped;
mod slices;
mod stream;
#[cfg(test)]
mod tests;

pub use super::fault_injection::FAULT_ERRORS;
use host_pins::HostPins;
use slices::Slices;

/// More simulated devices than any machine has GPUs is a mistake, not a configuration.
pub const MAX_SIM_DEVICES: usize = 1024;

/// Byte that fills freshly created physical memory.
pub const POISON: u8 = 0xA5;

#[derive(Debug, Clone, Copy)]
pub struct SimConfig {
    pub devices: usize,
    /// Physical bytes per device.
    pub capacity: usize,
    pub granularity: usize,
    /// Host memory the simulated machine lets the allocator pin (registered plus `host_alloc` bytes); past it
    /// `host_register` and `host_alloc` fail with CUDA_ERROR_OUT_OF_MEMORY. None: the real host's (`host_guard`).
    pub host_memory: Option<usize>,
    /// Time each `host_register` takes (spent outside the driver's lock), so that tests can race a sleep
    /// against background pinning at a chosen stage.
    pub host_register_delay: std::time::Duration,
    /// Offer the host codec (`sim_codec.rs`) for compressed backups; off: every backup is raw, as on a machine
    /// without nvCOMP.
    pub compress: bool,
    /// Run copies, fills and fingerprint batches when their stream is waited for, as CUDA does (`sim/stream.rs`);
    /// off: each runs as it is queued, which hides work released before it was waited for.
    pub stream_order: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            devices: 1,
            capacity: 1 << 30,
            granularity: 2 << 20,
            host_memory: None,
            host_register_delay: std::time::Duration::ZERO,
            compress: true,
            stream_order: true,
        }
    }
}

struct Mapping {
    size: usize,
    handle: u64,
    accessible: bool,
}

struct Range {
    size: usize,
    /// Mappings by start address.
    maps: BTreeMap<u64, Mapping>,
}

struct Handle {
    device: i32,
    size: usize,
    /// Where its slice starts in the device's memfd.
    offset: u64,
    released: bool,
    map_count: usize,
    /// Not yet poisoned: the first map fills it.
    fresh: bool,
}

#[derive(Default)]
struct State {
    ranges: BTreeMap<u64, Range>,
    handles: HashMap<u64, Handle>,
    next_handle: u64,
    used: Vec<usize>,
    /// Physical memory of each device.
    slices: Vec<Slices>,
    host: HostPins,
    /// Markers recorded and not yet waited for, with their device (leak check: CUDA events must be destroyed).
    markers: HashMap<u64, usize>,
    next_marker: u64,
    /// Fingerprint batches queued and not yet taken, per device.
    fingerprints: HashMap<i32, Batch>,
    /// Each device's copy stream: work queued and not yet run.
    streams: Vec<VecDeque<Work>>,
    /// The first illegal access, once there was one: the context is dead (CUDA's sticky error).
    sticky: Option<String>,
}

/// Live resources and call counts, for leak checks and for sizing fault-injection walks.
#[derive(Debug, Clone, Default)]
pub struct SimCounts {
    pub ranges: usize,
    pub handles: usize,
    pub mapped_bytes: usize,
    pub used_bytes: Vec<usize>,
    pub host_registered: usize,
    pub host_allocated: usize,
    /// Host bytes pinned now (registered plus allocated), and the most pinned at once so far.
    pub host_pinned: (usize, usize),
    pub markers: usize,
    /// Fingerprint batches queued and not taken (each must be taken, like markers waited for).
    pub fingerprint_batches: usize,
    /// Work queued on the copy streams and not yet run (markers included).
    pub queued: usize,
    /// What the host codec did (`sim_codec::SimCodecCounts`): ranges compressed, of them stored raw, restored.
    pub codec_compressed: u64,
    pub codec_stored_raw: u64,
    pub codec_decompressed: u64,
    /// Calls per operation (every `Op`), as the fault injector counted them; empty from `Emulator::counts`.
    pub calls: Vec<(&'static str, u64)>,
}

/// The host emulation of the driver (see the module notes), without fault injection.
pub struct Emulator {
    config: SimConfig,
    state: Mutex<State>,
    codec_counts: SimCodecCounts,
}

/// The simulated driver: the emulation inside the fault injector.
pub type SimDriver = FaultInjector<Emulator>;

impl FaultInjector<Emulator> {
    pub fn new(config: SimConfig) -> Result<SimDriver> {
        Ok(FaultInjector::around(Emulator::new(config)?))
    }

    /// Live resources of the emulation, with the calls the injector counted.
    pub fn counts(&self) -> SimCounts {
        SimCounts {
            calls: self.calls(),
            ..self.inner().counts()
        }
    }
}

/// A failed call of `op` with a CUDA error code, its name and why (`what`, may be empty).
fn cuda_err(op: Op, code: i32, what: &str) -> Error {
    let name = cuda_code::name(code);
    if what.is_empty() {
        Error::driver(op.name(), code, name)
    } else {
        Error::driver(op.name(), code, format!("{name} ({what})"))
    }
}

fn os_err(op: Op, e: rustix::io::Errno) -> Error {
    // The host running out of address space or memory is what CUDA reports as CUDA_ERROR_OUT_OF_MEMORY.
    let code = if e == rustix::io::Errno::NOMEM {
        cuda_code::OUT_OF_MEMORY
    } else {
        cuda_code::UNKNOWN
    };
    Error::driver(op.name(), code, format!("host emulation: {e}"))
}

impl Emulator {
    pub fn new(config: SimConfig) -> Result<Self> {
        if config.devices == 0 || config.devices > MAX_SIM_DEVICES {
            return Err(Error::invalid(format!(
                "devices must be between 1 and {MAX_SIM_DEVICES}, got {}",
                config.devices
            )));
        }
        let page = rustix::param::page_size();
        if config.granularity == 0 || !config.granularity.is_multiple_of(page) {
            return Err(Error::invalid(format!(
                "granularity {} must be a positive multiple of the page size {page}",
                config.granularity
            )));
        }
        let state = State {
            used: vec![0; config.devices],
            slices: (0..config.devices).map(|_| Slices::default()).collect(),
            streams: (0..config.devices).map(|_| VecDeque::new()).collect(),
            next_handle: 1,
            ..State::default()
        };
        Ok(Emulator {
            config,
            state: Mutex::new(state),
            codec_counts: SimCodecCounts::default(),
        })
    }

    /// What the host codec did so far.
    pub fn codec_counts(&self) -> &SimCodecCounts {
        &self.codec_counts
    }

    /// Live resources (`calls` is left empty: the fault injector counts calls).
    pub fn counts(&self) -> SimCounts {
        let st = self.state.lock();
        let (host_registered, host_allocated) = st.host.counts();
        SimCounts {
            ranges: st.ranges.len(),
            handles: st.handles.len(),
            mapped_bytes: st
                .ranges
                .values()
                .flat_map(|r| r.maps.values())
                .map(|m| m.size)
                .sum(),
            used_bytes: st.used.clone(),
            host_registered,
            host_allocated,
            host_pinned: (st.host.pinned(), st.host.peak()),
            markers: st.markers.len(),
            fingerprint_batches: st.fingerprints.len(),
            queued: st.queued(),
            codec_compressed: self.codec_counts.compressed.load(Relaxed),
            codec_stored_raw: self.codec_counts.stored_raw.load(Relaxed),
            codec_decompressed: self.codec_counts.decompressed.load(Relaxed),
            calls: Vec::new(),
        }
    }

    /// The state, for a call of `op`, unless the context is poisoned.
    fn lock_live(&self, op: Op) -> Result<MutexGuard<'_, State>> {
        let st = self.state.lock();
        st.live(op)?;
        Ok(st)
    }

    /// The first illegal access, if the emulated context is poisoned (`sim/stream.rs`).
    pub fn sticky_error(&self) -> Option<String> {
        self.state.lock().sticky.clone()
    }

    fn check_device(&self, device: i32) -> Result<usize> {
        usize::try_from(device)
            .ok()
            .filter(|d| *d < self.config.devices)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "device {device} does not exist ({} devices)",
                    self.config.devices
                ))
            })
    }
}

impl Driver for Emulator {
    fn backend(&self) -> &'static str {
        "sim"
    }

    fn device_count(&self) -> Result<usize> {
        Ok(self.config.devices)
    }

    fn granularity(&self, device: i32) -> Result<usize> {
        self.check_device(device)?;
        Ok(self.config.granularity)
    }

    fn mem_info(&self, device: i32) -> Result<(usize, usize)> {
        let d = self.check_device(device)?;
        let used = self.state.lock().used[d];
        Ok((
            self.config.capacity.saturating_sub(used),
            self.config.capacity,
        ))
    }

    fn device_info(&self, device: i32) -> Result<DeviceInfo> {
        self.check_device(device)?;
        Ok(DeviceInfo {
            name: "simulated device".into(),
            granularity: self.config.granularity,
            rdma_with_vmm: false,
            driver_version: None,
        })
    }

    fn reserve(&self, device: i32, size: usize) -> Result<DevPtr> {
        self.check_device(device)?;
        let mut st = self.lock_live(Op::Reserve)?;
        if size == 0 || !size.is_multiple_of(self.config.granularity) {
            return Err(cuda_err(Op::Reserve, cuda_code::INVALID_VALUE, ""));
        }
        // Reserve one granule more than asked and trim, so that the range is aligned to the granularity as CUDA's
        // reservations are (callers may rely on it, e.g. for large-page mappings).
        let gran = self.config.granularity;
        let padded = size
            .checked_add(gran)
            .ok_or_else(|| cuda_err(Op::Reserve, cuda_code::OUT_OF_MEMORY, ""))?;
        // SAFETY: a fresh anonymous PROT_NONE mapping at an address the kernel chooses touches no existing memory.
        let raw = unsafe {
            mmap_anonymous(
                std::ptr::null_mut(),
                padded,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::NORESERVE,
            )
        }
        .map_err(|e| os_err(Op::Reserve, e))? as usize;
        let ptr = raw.next_multiple_of(gran);
        let (head, tail) = (ptr - raw, raw + padded - (ptr + size));
        // SAFETY: head and tail are the parts of the mapping just made that lie outside [ptr, ptr+size).
        unsafe {
            if head > 0 {
                let _ = munmap(raw as *mut c_void, head);
            }
            if tail > 0 {
                let _ = munmap((ptr + size) as *mut c_void, tail);
            }
        }
        let addr = ptr as u64;
        st.ranges.insert(
            addr,
            Range {
                size,
                maps: BTreeMap::new(),
            },
        );
        Ok(addr)
    }

    fn free_range(&self, addr: DevPtr, size: usize) -> Result<()> {
        let mut st = self.lock_live(Op::FreeRange)?;
        match st.ranges.get(&addr) {
            Some(r) if r.size == size && r.maps.is_empty() => {}
            Some(r) if !r.maps.is_empty() => {
                return Err(cuda_err(
                    Op::FreeRange,
                    cuda_code::INVALID_VALUE,
                    "range still mapped",
                ))
            }
            _ => {
                return Err(cuda_err(
                    Op::FreeRange,
                    cuda_code::INVALID_VALUE,
                    "not a reserved range",
                ))
            }
        }
        // SAFETY: [addr, addr+size) is a reservation this driver made and nothing is mapped in it any more.
        unsafe { munmap(addr as *mut c_void, size) }.map_err(|e| os_err(Op::FreeRange, e))?;
        st.ranges.remove(&addr);
        Ok(())
    }

    fn create(&self, device: i32, size: usize) -> Result<PhysHandle> {
        let d = self.check_device(device)?;
        let mut st = self.lock_live(Op::Create)?;
        if size == 0 || !size.is_multiple_of(self.config.granularity) {
            return Err(cuda_err(Op::Create, cuda_code::INVALID_VALUE, ""));
        }
        if st.used[d].saturating_add(size) > self.config.capacity {
            return Err(cuda_err(Op::Create, cuda_code::OUT_OF_MEMORY, ""));
        }
        let offset = st.slices[d].take(size).map_err(|e| os_err(Op::Create, e))?;
        let id = st.next_handle;
        st.next_handle += 1;
        st.used[d] += size;
        st.handles.insert(
            id,
            Handle {
                device,
                size,
                offset,
                released: false,
                map_count: 0,
                fresh: true,
            },
        );
        Ok(PhysHandle(id))
    }

    fn release(&self, handle: PhysHandle) -> Result<()> {
        let mut st = self.lock_live(Op::Release)?;
        match st.handles.get_mut(&handle.0) {
            Some(h) if !h.released => h.released = true,
            _ => {
                return Err(cuda_err(
                    Op::Release,
                    cuda_code::INVALID_VALUE,
                    "unknown handle",
                ))
            }
        }
        st.drop_handle_if_done(handle.0);
        Ok(())
    }

    fn map(&self, addr: DevPtr, size: usize, handle: PhysHandle) -> Result<()> {
        let mut st = self.lock_live(Op::Map)?;
        let invalid = |why: &str| cuda_err(Op::Map, cuda_code::INVALID_VALUE, why);
        let (start, range) = st
            .range_of(addr, size)
            .ok_or_else(|| invalid("not inside a reserved range"))?;
        let end = addr + size as u64;
        let overlaps = range
            .maps
            .range(..end)
            .next_back()
            .is_some_and(|(&s, m)| s + m.size as u64 > addr);
        if overlaps {
            return Err(invalid("already mapped"));
        }
        let h = st
            .handles
            .get(&handle.0)
            .ok_or_else(|| invalid("unknown handle"))?;
        if h.released || h.size != size {
            return Err(invalid("handle released or of another size"));
        }
        let (fresh, offset) = (h.fresh, h.offset);
        let fd = st.slices[h.device as usize]
            .fd()
            .expect("a live handle's device has its memfd");
        // SAFETY: [addr, addr+size) lies inside a reservation of ours with no mapping in it (checked above), so
        // MAP_FIXED replaces only our own PROT_NONE placeholder pages; [offset, offset+size) is the handle's own
        // slice of the memfd, inside the file.
        unsafe {
            mmap(
                addr as *mut c_void,
                size,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | MapFlags::FIXED,
                fd,
                offset,
            )
        }
        .map_err(|e| os_err(Op::Map, e))?;
        if fresh {
            // SAFETY: the pages were just mapped read-write above and belong to this mapping alone.
            unsafe { std::ptr::write_bytes(addr as *mut u8, POISON, size) };
        }
        // SAFETY: same pages; until set_access they must fault, as on CUDA.
        unsafe { mprotect(addr as *mut c_void, size, MprotectFlags::empty()) }
            .map_err(|e| os_err(Op::Map, e))?;
        let h = st.handles.get_mut(&handle.0).expect("checked above");
        h.fresh = false;
        h.map_count += 1;
        let range = st.ranges.get_mut(&start).expect("found above");
        range.maps.insert(
            addr,
            Mapping {
                size,
                handle: handle.0,
                accessible: false,
            },
        );
        Ok(())
    }

    fn unmap(&self, addr: DevPtr, size: usize) -> Result<()> {
        let mut st = self.lock_live(Op::Unmap)?;
        let (start, range) = st
            .range_of(addr, size)
            .ok_or_else(|| cuda_err(Op::Unmap, cuda_code::INVALID_VALUE, "not reserved"))?;
        match range.maps.get(&addr) {
            Some(m) if m.size == size => {}
            _ => {
                return Err(cuda_err(
                    Op::Unmap,
                    cuda_code::INVALID_VALUE,
                    "not a mapping",
                ))
            }
        }
        // Queued work would run on whatever is mapped here next, or fault: caught here, where it is early.
        st.nothing_queued_on_device(Op::Unmap, addr, size)?;
        // SAFETY: [addr, addr+size) is exactly one mapping of ours; it becomes a PROT_NONE placeholder again, so the
        // reservation keeps the address range.
        unsafe {
            mmap_anonymous(
                addr as *mut c_void,
                size,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::FIXED | MapFlags::NORESERVE,
            )
        }
        .map_err(|e| os_err(Op::Unmap, e))?;
        let m = st
            .ranges
            .get_mut(&start)
            .expect("found above")
            .maps
            .remove(&addr)
            .expect("checked above");
        if let Some(h) = st.handles.get_mut(&m.handle) {
            h.map_count -= 1;
        }
        st.drop_handle_if_done(m.handle);
        Ok(())
    }

    fn set_access(&self, device: i32, addr: DevPtr, size: usize) -> Result<()> {
        self.check_device(device)?;
        let mut st = self.lock_live(Op::SetAccess)?;
        let start = match st.range_of(addr, size) {
            Some((start, r)) if r.maps.get(&addr).is_some_and(|m| m.size == size) => start,
            _ => {
                return Err(cuda_err(
                    Op::SetAccess,
                    cuda_code::INVALID_VALUE,
                    "not a mapping",
                ))
            }
        };
        // SAFETY: [addr, addr+size) is exactly one live mapping of ours.
        unsafe {
            mprotect(
                addr as *mut c_void,
                size,
                MprotectFlags::READ | MprotectFlags::WRITE,
            )
        }
        .map_err(|e| os_err(Op::SetAccess, e))?;
        st.ranges
            .get_mut(&start)
            .expect("found above")
            .maps
            .get_mut(&addr)
            .expect("checked")
            .accessible = true;
        Ok(())
    }

    unsafe fn copy_d2h(&self, device: i32, dst: HostPtr, src: DevPtr, size: usize) -> Result<()> {
        let d = self.check_device(device)?;
        let mut st = self.lock_live(Op::CopyD2H)?;
        st.check_copy(Op::CopyD2H, src, "source", dst.0, size)?;
        let pinned = st.host.pinned_covers(dst.0, size);
        let work = Work::D2H {
            dst: dst.0,
            src,
            size,
            pinned,
        };
        st.queue(Op::CopyD2H, d, work, self.config.stream_order)
    }

    unsafe fn copy_h2d(&self, device: i32, dst: DevPtr, src: HostPtr, size: usize) -> Result<()> {
        let d = self.check_device(device)?;
        let mut st = self.lock_live(Op::CopyH2D)?;
        st.check_copy(Op::CopyH2D, dst, "destination", src.0, size)?;
        let pinned = st.host.pinned_covers(src.0, size);
        let work = Work::H2D {
            dst,
            src: src.0,
            size,
            pinned,
        };
        st.queue(Op::CopyH2D, d, work, self.config.stream_order)
    }

    fn memset_zero(&self, device: i32, addr: DevPtr, size: usize) -> Result<()> {
        let d = self.check_device(device)?;
        let mut st = self.lock_live(Op::MemsetZero)?;
        if !st.accessible(addr, size) {
            return Err(cuda_err(
                Op::MemsetZero,
                cuda_code::INVALID_VALUE,
                "destination not mapped",
            ));
        }
        let work = Work::Memset { addr, size };
        st.queue(Op::MemsetZero, d, work, self.config.stream_order)
    }

    fn wait(&self, device: i32) -> Result<()> {
        let d = self.check_device(device)?;
        self.lock_live(Op::Wait)?.run(Op::Wait, d, Until::Idle)
    }

    fn queue_fingerprints(&self, device: i32, chunks: &[(DevPtr, usize)]) -> Result<()> {
        let d = self.check_device(device)?;
        let mut st = self.lock_live(Op::Fingerprint)?;
        let invalid = |why: String| cuda_err(Op::Fingerprint, cuda_code::INVALID_VALUE, &why);
        if st.fingerprints.contains_key(&device) {
            return Err(invalid(format!(
                "a batch is already queued on device {device}"
            )));
        }
        for &(addr, len) in chunks {
            if !len.is_multiple_of(fingerprint::WORD) || !st.accessible(addr, len.max(1)) {
                return Err(invalid(format!(
                    "chunk {addr:#x}+{len} not mapped or not whole words"
                )));
            }
        }
        st.fingerprints.insert(device, Batch::Queued);
        let work = Work::Fingerprints {
            chunks: chunks.to_vec(),
        };
        st.queue(Op::Fingerprint, d, work, self.config.stream_order)
    }

    fn take_fingerprints(&self, device: i32) -> Result<Vec<Fingerprint>> {
        self.check_device(device)?;
        let mut st = self.state.lock();
        let batch = st.fingerprints.remove(&device);
        st.live(Op::Fingerprint)?;
        match batch {
            Some(Batch::Done(prints)) => Ok(prints),
            // CUDA would hand out whatever the results buffer held: a race with the kernel still to run.
            Some(Batch::Queued) => {
                let what = format!(
                    "fingerprint batch of device {device} taken before its stream passed it (no wait)"
                );
                Err(st.poison(Op::Fingerprint, what))
            }
            None => Err(Error::InvalidState(format!(
                "no fingerprint batch queued on device {device}"
            ))),
        }
    }

    fn record_marker(&self, device: i32) -> Result<u64> {
        let d = self.check_device(device)?;
        let mut st = self.lock_live(Op::Record)?;
        st.next_marker += 1;
        let m = st.next_marker;
        st.markers.insert(m, d);
        st.streams[d].push_back(Work::Marker(m));
        Ok(m)
    }

    fn wait_marker(&self, device: i32, marker: u64) -> Result<()> {
        self.check_device(device)?;
        let mut st = self.state.lock();
        let recorded_on = st.markers.remove(&marker); // forgotten also on failure (the trait's promise)
        st.live(Op::Wait)?;
        let Some(d) = recorded_on else {
            return Err(cuda_err(
                Op::Wait,
                cuda_code::INVALID_HANDLE,
                "unknown marker",
            ));
        };
        st.run(Op::Wait, d, Until::Marker(marker))
    }

    /// The device's only stream that the emulation runs is its copy stream (no capture is emulated): synchronizing
    /// the device runs it.
    fn synchronize(&self, device: i32, _stream: u64) -> Result<()> {
        let d = self.check_device(device)?;
        self.lock_live(Op::Synchronize)?
            .run(Op::Synchronize, d, Until::Idle)
    }

    fn user_device_access(&self, device: i32, addr: DevPtr, len: usize, write: bool) -> Result<()> {
        self.check_device(device)?;
        self.lock_live(Op::Synchronize)?
            .no_race_with_user(addr, len, write)
    }

    fn user_host_access(&self, ptr: HostPtr, len: usize, write: bool) -> Result<()> {
        self.lock_live(Op::Synchronize)?
            .no_race_with_user_on_host(ptr.0, len, write)
    }

    unsafe fn host_register(&self, ptr: HostPtr, size: usize) -> Result<()> {
        if !self.config.host_register_delay.is_zero() {
            std::thread::sleep(self.config.host_register_delay);
        }
        let mut st = self.lock_live(Op::HostRegister)?;
        st.check_host_budget(Op::HostRegister, size, self.config.host_memory)?;
        // CUDA refuses memory that is registered already, wholly or in part.
        if !st.host.register(ptr.0, size) {
            return Err(cuda_err(
                Op::HostRegister,
                cuda_code::HOST_MEMORY_ALREADY_REGISTERED,
                "",
            ));
        }
        Ok(())
    }

    unsafe fn host_unregister(&self, ptr: HostPtr) -> Result<()> {
        let mut st = self.lock_live(Op::HostUnregister)?;
        let len = st.host.registered_len(ptr.0).unwrap_or(0);
        st.nothing_queued_on_host(Op::HostUnregister, ptr.0, len)?;
        if !st.host.unregister(ptr.0) {
            return Err(cuda_err(
                Op::HostUnregister,
                cuda_code::HOST_MEMORY_NOT_REGISTERED,
                "",
            ));
        }
        Ok(())
    }

    fn host_alloc(&self, size: usize) -> Result<HostPtr> {
        let mut st = self.lock_live(Op::HostAlloc)?;
        st.check_host_budget(Op::HostAlloc, size.max(1), self.config.host_memory)?;
        // SAFETY: a fresh anonymous read-write mapping at an address the kernel chooses.
        let ptr = unsafe {
            mmap_anonymous(
                std::ptr::null_mut(),
                size.max(1),
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }
        .map_err(|e| os_err(Op::HostAlloc, e))?;
        st.host.add_allocation(ptr as usize, size.max(1));
        Ok(HostPtr(ptr as usize))
    }

    unsafe fn host_free(&self, ptr: HostPtr) -> Result<()> {
        let mut st = self.lock_live(Op::HostAlloc)?;
        let len = st.host.allocated_len(ptr.0).unwrap_or(0);
        // Refused, so kept mapped: the context is dead, nothing will run, and the caller may not touch it again.
        st.nothing_queued_on_host(Op::HostAlloc, ptr.0, len)?;
        let size = st.host.remove_allocation(ptr.0).ok_or_else(|| {
            let code = cuda_code::INVALID_VALUE;
            let name = cuda_code::name(code);
            Error::driver("host_free", code, format!("{name} (not a host allocation)"))
        })?;
        // SAFETY: the mapping was made by host_alloc with this size and its owner gave it back.
        unsafe { munmap(ptr.0 as *mut c_void, size) }.map_err(|e| os_err(Op::HostAlloc, e))
    }

    fn codec(&self) -> Option<&dyn DeviceCodec> {
        self.config.compress.then_some(self as &dyn DeviceCodec)
    }

    fn host_available(&self) -> Option<usize> {
        (self.config.host_memory).map(|b| b.saturating_sub(self.state.lock().host.pinned()))
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        // Give back address space and host allocations that an aborted test may have left; physical memory goes
        // with the devices' memfds.
        let st = self.state.get_mut();
        for (&addr, r) in &st.ranges {
            // SAFETY: each is a reservation of ours; no engine outlives the driver it holds an Arc of.
            let _ = unsafe { munmap(addr as *mut c_void, r.size) };
        }
        for (ptr, size) in st.host.allocations() {
            // SAFETY: made by host_alloc; nobody can use it after the driver is gone.
            let _ = unsafe { munmap(ptr as *mut c_void, size) };
        }
    }
}
