//! The real CUDA driver, loaded at run time through cudarc's dynamic loading: the wheel imports on machines
//! without a GPU and works with any driver that has the VMM API.
//!
//! Contexts: every call first makes the device's primary context current (retaining it once, lazily, so that a
//! process that only uses device 1 never creates a context on device 0). Loading the same libcuda.so.1 as torch
//! means this is the very context torch uses, so pointers and streams are shared.
//!
//! Compression: where nvCOMP 6 loads (`nvcomp.rs`, once per process, at `new`) and `CUMEM_RS_COMPRESS` is not
//! `0`, the driver is its own `DeviceCodec` (`cuda_codec.rs`), each device's staging ring taken at set-up.

use std::ffi::{c_void, CStr};
use std::sync::OnceLock;

use cudarc::driver::sys::{self, CUresult};

use super::codec::{DataKind, DeviceCodec, DoneFn, PlaceFn, ReadyFn, RestoreItem, Stored};
use super::cuda_check::check;
use super::cuda_codec::{self, CodecRing};
use super::cuda_fingerprint::FingerprintKernel;
use super::nvcomp::{self, NvComp};
use super::{DevPtr, DeviceInfo, Driver, HostPtr, Op, PhysHandle};
use crate::env;
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;

/// Per-device state, created on first use of the device.
struct DeviceState {
    ctx: sys::CUcontext,
    /// Non-blocking stream that carries sleep/wake copies.
    copy_stream: sys::CUstream,
    /// The fingerprint kernel, loaded (with its device buffer) at set-up.
    fingerprint: FingerprintKernel,
    /// The codec's staging ring, taken at set-up, or why this device has none (nvCOMP not loaded, no memory).
    codec: std::result::Result<CodecRing, String>,
    /// Device memory set-up took for the allocator itself (the kernel's module and buffer, the codec's ring),
    /// measured.
    own_bytes: usize,
}

// SAFETY: CUDA contexts and streams are process-wide handles, valid from any thread.
unsafe impl Send for DeviceState {}
// SAFETY: as above; the handles are never mutated after creation.
unsafe impl Sync for DeviceState {}

struct Device {
    ordinal: sys::CUdevice,
    granularity: usize,
    rdma_with_vmm: bool,
    /// Set on the first successful use. A failed set-up is not kept: the next call tries again (a transient
    /// failure must not disable a GPU for the life of the process).
    state: OnceLock<DeviceState>,
    /// Serializes set-up, so that two threads never both retain the context and create a stream.
    setup: parking_lot::Mutex<()>,
}

pub struct CudaDriver {
    devices: Vec<Device>,
    driver_version: i32,
    /// nvCOMP, where it loaded and compression is not switched off (`CUMEM_RS_COMPRESS=0`).
    nvcomp: Option<&'static NvComp>,
}

/// Whether `CUMEM_RS_COMPRESS` leaves compression on: the engine's parse of it (`env::compress_from`), so that
/// the two never disagree on a spelling.
fn compression_wanted() -> bool {
    env::compress_from(env::process_var)
}

/// Whether libcuda can be loaded; never panics.
pub fn library_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
}

impl CudaDriver {
    /// Load libcuda, initialise it and describe every device. Errors (no library, no device, no VMM support)
    /// come back as `Error::NoCuda`, never as a panic.
    pub fn new() -> Result<CudaDriver> {
        if !library_present() {
            return Err(Error::NoCuda(
                "libcuda.so could not be loaded (no NVIDIA driver on this machine)".into(),
            ));
        }
        std::panic::catch_unwind(Self::init).unwrap_or_else(|p| {
            Err(Error::NoCuda(format!(
                "loading the CUDA driver panicked: {}",
                crate::error::panic_message(&*p)
            )))
        })
    }

    fn init() -> Result<CudaDriver> {
        let no_cuda = |e: Error| Error::NoCuda(e.to_string());
        // SAFETY: plain driver calls with valid out-pointers.
        unsafe {
            check("cuInit", sys::cuInit(0)).map_err(no_cuda)?;
            let mut version = 0;
            check("cuDriverGetVersion", sys::cuDriverGetVersion(&mut version)).map_err(no_cuda)?;
            let mut count = 0;
            check("cuDeviceGetCount", sys::cuDeviceGetCount(&mut count)).map_err(no_cuda)?;
            if count == 0 {
                return Err(Error::NoCuda("the CUDA driver reports no device".into()));
            }
            let mut devices = Vec::with_capacity(count as usize);
            for i in 0..count {
                let mut dev = 0;
                check("cuDeviceGet", sys::cuDeviceGet(&mut dev, i)).map_err(no_cuda)?;
                let vmm = attribute(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)?;
                if vmm == 0 {
                    return Err(Error::NoCuda(format!(
                        "device {i} does not support virtual memory management"
                    )));
                }
                // GPUDirect RDMA-capable physical memory when the device supports it (NICs can then register our
                // memory); CUMEM_RS_GPU_DIRECT_RDMA=0 opts out.
                let rdma = rdma_wanted()
                    && attribute(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)?
                        != 0;
                let prop = allocation_prop(dev, false);
                let mut granularity = 0usize;
                check(
                    "cuMemGetAllocationGranularity",
                    sys::cuMemGetAllocationGranularity(
                        &mut granularity,
                        &prop,
                        sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                    ),
                )
                .map_err(no_cuda)?;
                devices.push(Device {
                    ordinal: dev,
                    granularity,
                    rdma_with_vmm: rdma,
                    state: OnceLock::new(),
                    setup: parking_lot::Mutex::new(()),
                });
            }
            let nvcomp = if compression_wanted() {
                nvcomp::load(version).ok()
            } else {
                log::info!("no GPU compression of backups: switched off by CUMEM_RS_COMPRESS");
                None
            };
            Ok(CudaDriver {
                devices,
                driver_version: version,
                nvcomp,
            })
        }
    }

    fn device(&self, device: i32) -> Result<&Device> {
        usize::try_from(device)
            .ok()
            .and_then(|i| self.devices.get(i))
            .ok_or_else(|| {
                Error::invalid(format!(
                    "device {device} does not exist ({} devices)",
                    self.devices.len()
                ))
            })
    }

    /// Make `device`'s primary context current on this thread (retaining it and creating its copy stream on
    /// first use). The guard puts back whatever context was current before when it is dropped, so the caller's
    /// current device (torch's `torch.cuda.current_device()`) never changes under it.
    fn enter(&self, device: i32) -> Result<(&DeviceState, CtxGuard)> {
        let d = self.device(device)?;
        let state = match d.state.get() {
            Some(state) => state,
            None => {
                let _serial = d.setup.lock();
                match d.state.get() {
                    Some(state) => state, // another thread set it up while this one waited
                    None => {
                        let fresh = set_up(d.ordinal, self.nvcomp)?;
                        d.state.get_or_init(|| fresh)
                    }
                }
            }
        };
        Ok((state, CtxGuard::switch_to(state.ctx)?))
    }

    /// The codec ring of `device` if the device was set up and has one; never sets a device up.
    fn codec_ring(&self, device: i32) -> Option<&CodecRing> {
        let state = self.device(device).ok()?.state.get()?;
        state.codec.as_ref().ok()
    }

    /// Some context current for calls that are not tied to one device (host pinning, unmap, release): the
    /// caller's own if it has one (PORTABLE pinning serves every context), else the context of a device this
    /// process already uses. Only a thread of a process that has touched no device yet gets device 0's: a rank
    /// that owns GPU 1 must not create a context (and its memory) on GPU 0 from our worker threads.
    fn enter_host(&self) -> Result<CtxGuard> {
        if !current_context()?.is_null() {
            return Ok(CtxGuard { previous: None });
        }
        let in_use = self.devices.iter().find_map(|d| d.state.get());
        match in_use {
            Some(state) => CtxGuard::switch_to(state.ctx),
            None => Ok(self.enter(0)?.1),
        }
    }
}

/// Retain `ordinal`'s primary context, create its copy stream and take the allocator's own device memory (the
/// fingerprint kernel, the codec's ring where `nvcomp` is given). On failure nothing stays retained.
fn set_up(ordinal: sys::CUdevice, nvcomp: Option<&'static NvComp>) -> Result<DeviceState> {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: valid out-pointer; once set-up succeeds the retained context is never released, as torch keeps the
    // same primary context for the life of the process.
    unsafe {
        check(
            "cuDevicePrimaryCtxRetain",
            sys::cuDevicePrimaryCtxRetain(&mut ctx, ordinal),
        )?
    };
    // Create the stream in the device's context, then take the allocator's own device memory (the fingerprint
    // kernel's module and buffer) now, before the first allocation is handed out, never inside a sleep; the guard
    // puts the caller's context back afterwards.
    let made = CtxGuard::switch_to(ctx).and_then(|_current| {
        let mut stream = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the device's context is current.
        unsafe {
            check(
                "cuStreamCreate",
                sys::cuStreamCreate(
                    &mut stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                ),
            )?
        };
        let before = free_memory();
        let fingerprint = FingerprintKernel::prepare(stream);
        // Without its ring the device still works, uncompressed (the failure is kept for `info` and errors).
        let codec = match nvcomp {
            Some(nv) => CodecRing::prepare(nv, ordinal).map_err(|e| {
                log::warn!("no nvCOMP codec on device {ordinal}: its staging ring could not be set up: {e}");
                e.to_string()
            }),
            None => Err("nvCOMP is not loaded".to_string()),
        };
        // What free memory dropped by (other threads' allocations in between would count too).
        let own_bytes = before
            .zip(free_memory())
            .map_or(0, |(b, a)| b.saturating_sub(a));
        Ok((stream, fingerprint, codec, own_bytes))
    });
    match made {
        Ok((copy_stream, fingerprint, codec, own_bytes)) => Ok(DeviceState {
            ctx,
            copy_stream,
            fingerprint,
            codec,
            own_bytes,
        }),
        Err(e) => {
            // SAFETY: balances the retain above; this context is not used by us afterwards.
            unsafe { sys::cuDevicePrimaryCtxRelease_v2(ordinal) };
            Err(e)
        }
    }
}

/// Free device memory of the current context's device, if the driver answers.
fn free_memory() -> Option<usize> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers; a context is current.
    let r = unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(free)
}

fn current_context() -> Result<sys::CUcontext> {
    let mut current = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    unsafe { check("cuCtxGetCurrent", sys::cuCtxGetCurrent(&mut current))? };
    Ok(current)
}

/// Restores the context that was current before `switch_to` when dropped (if it switched at all).
struct CtxGuard {
    previous: Option<sys::CUcontext>,
}

impl CtxGuard {
    fn switch_to(ctx: sys::CUcontext) -> Result<CtxGuard> {
        let current = current_context()?;
        if current == ctx {
            return Ok(CtxGuard { previous: None });
        }
        // SAFETY: `ctx` is a retained primary context, valid for the life of the process.
        unsafe { check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx))? };
        Ok(CtxGuard {
            previous: Some(current),
        })
    }
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            // SAFETY: puts back the context this thread had (possibly none); it was valid when we replaced it and
            // contexts current on a thread are not destroyed underneath it.
            unsafe { sys::cuCtxSetCurrent(previous) };
        }
    }
}

fn rdma_wanted() -> bool {
    env::flag(env::GPU_DIRECT_RDMA, true)
}

fn attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    let mut v = 0;
    // SAFETY: valid out-pointer and device ordinal.
    unsafe {
        check(
            "cuDeviceGetAttribute",
            sys::cuDeviceGetAttribute(&mut v, attr, dev),
        )
    }
    .map_err(|e| Error::NoCuda(e.to_string()))?;
    Ok(v)
}

fn location(dev: sys::CUdevice) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: dev,
    }
}

fn allocation_prop(dev: sys::CUdevice, rdma: bool) -> sys::CUmemAllocationProp {
    // SAFETY: CUmemAllocationProp is a plain C struct for which all-zero is the documented default.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = location(dev);
    prop.allocFlags.gpuDirectRDMACapable = u8::from(rdma);
    prop
}

impl Driver for CudaDriver {
    fn backend(&self) -> &'static str {
        "cuda"
    }

    fn device_count(&self) -> Result<usize> {
        Ok(self.devices.len())
    }

    fn granularity(&self, device: i32) -> Result<usize> {
        Ok(self.device(device)?.granularity)
    }

    fn mem_info(&self, device: i32) -> Result<(usize, usize)> {
        let _ctx = self.enter(device)?.1;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers; the device's context is current.
        unsafe { check("cuMemGetInfo", sys::cuMemGetInfo_v2(&mut free, &mut total))? };
        Ok((free, total))
    }

    fn device_info(&self, device: i32) -> Result<DeviceInfo> {
        let d = self.device(device)?;
        let mut name = [0 as std::ffi::c_char; 256];
        // SAFETY: the buffer holds 256 bytes and the driver writes a NUL-terminated name into it.
        unsafe {
            check(
                "cuDeviceGetName",
                sys::cuDeviceGetName(name.as_mut_ptr(), 256, d.ordinal),
            )?
        };
        // SAFETY: NUL-terminated by the driver (and zero-initialised).
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        Ok(DeviceInfo {
            name,
            granularity: d.granularity,
            rdma_with_vmm: d.rdma_with_vmm,
            driver_version: Some(self.driver_version),
        })
    }

    fn reserve(&self, device: i32, size: usize) -> Result<DevPtr> {
        let gran = self.device(device)?.granularity;
        let _ctx = self.enter(device)?.1;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; alignment is the device's granularity.
        unsafe {
            check(
                Op::Reserve.name(),
                sys::cuMemAddressReserve(&mut ptr, size, gran, 0, 0),
            )?
        };
        Ok(ptr)
    }

    fn free_range(&self, addr: DevPtr, size: usize) -> Result<()> {
        let _ctx = self.enter_host()?; // any context: see enter_host
                                       // SAFETY: frees a range this driver reserved; the engine unmapped it first.
        unsafe { check(Op::FreeRange.name(), sys::cuMemAddressFree(addr, size)) }
    }

    fn create(&self, device: i32, size: usize) -> Result<PhysHandle> {
        let d = self.device(device)?;
        let _ctx = self.enter(device)?.1;
        let prop = allocation_prop(d.ordinal, d.rdma_with_vmm);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer and property struct.
        unsafe {
            check(
                Op::Create.name(),
                sys::cuMemCreate(&mut handle, size, &prop, 0),
            )?
        };
        Ok(PhysHandle(handle))
    }

    fn release(&self, handle: PhysHandle) -> Result<()> {
        let _ctx = self.enter_host()?; // any context: see enter_host
                                       // SAFETY: releases a handle this driver created, once (the engine drops it from its records).
        unsafe { check(Op::Release.name(), sys::cuMemRelease(handle.0)) }
    }

    fn map(&self, addr: DevPtr, size: usize, handle: PhysHandle) -> Result<()> {
        let _ctx = self.enter_host()?; // any context: see enter_host
                                       // SAFETY: maps our handle into our reserved range; the driver validates both.
        unsafe { check(Op::Map.name(), sys::cuMemMap(addr, size, 0, handle.0, 0)) }
    }

    fn unmap(&self, addr: DevPtr, size: usize) -> Result<()> {
        let _ctx = self.enter_host()?; // any context: see enter_host
                                       // SAFETY: unmaps our own mapping after the engine made sure no work uses it.
        unsafe { check(Op::Unmap.name(), sys::cuMemUnmap(addr, size)) }
    }

    fn set_access(&self, device: i32, addr: DevPtr, size: usize) -> Result<()> {
        let d = self.device(device)?;
        let _ctx = self.enter(device)?.1;
        let desc = sys::CUmemAccessDesc {
            location: location(d.ordinal),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: one valid access descriptor for our mapped range.
        unsafe {
            check(
                Op::SetAccess.name(),
                sys::cuMemSetAccess(addr, size, &desc, 1),
            )
        }
    }

    unsafe fn copy_d2h(&self, device: i32, dst: HostPtr, src: DevPtr, size: usize) -> Result<()> {
        let (st, _ctx) = self.enter(device)?;
        // SAFETY: dst points into a live host buffer of at least `size` bytes that the engine keeps alive until
        // `wait`; the driver validates the device range.
        unsafe {
            check(
                Op::CopyD2H.name(),
                sys::cuMemcpyDtoHAsync_v2(dst.0 as *mut c_void, src, size, st.copy_stream),
            )
        }
    }

    unsafe fn copy_h2d(&self, device: i32, dst: DevPtr, src: HostPtr, size: usize) -> Result<()> {
        let (st, _ctx) = self.enter(device)?;
        // SAFETY: as in copy_d2h, with the roles swapped.
        unsafe {
            check(
                Op::CopyH2D.name(),
                sys::cuMemcpyHtoDAsync_v2(dst, src.0 as *const c_void, size, st.copy_stream),
            )
        }
    }

    fn memset_zero(&self, device: i32, addr: DevPtr, size: usize) -> Result<()> {
        let (st, _ctx) = self.enter(device)?;
        // 32-bit words when the size allows (it always does for granularity-rounded allocations). A fill kernel
        // with 16-byte stores was measured no faster on an H200 (48 GiB: 255 ms against 272 ms): the time goes to
        // the driver clearing recycled physical pages on their first write, not to the fill.
        // SAFETY: [addr, addr+size) is a mapped range of ours, made accessible by set_access before this call; the
        // fill is queued on our own copy stream and covered by the next `wait`.
        let r = unsafe {
            if size.is_multiple_of(4) {
                sys::cuMemsetD32Async(addr, 0, size / 4, st.copy_stream)
            } else {
                sys::cuMemsetD8Async(addr, 0, size, st.copy_stream)
            }
        };
        check(Op::MemsetZero.name(), r)
    }

    fn wait(&self, device: i32) -> Result<()> {
        let (st, _ctx) = self.enter(device)?;
        // SAFETY: our own stream.
        unsafe { check(Op::Wait.name(), sys::cuStreamSynchronize(st.copy_stream)) }
    }

    fn queue_fingerprints(&self, device: i32, chunks: &[(DevPtr, usize)]) -> Result<()> {
        let (st, _ctx) = self.enter(device)?;
        st.fingerprint.queue(st.copy_stream, chunks)
    }

    fn own_device_bytes(&self, device: i32) -> usize {
        (self.device(device).ok())
            .and_then(|d| d.state.get())
            .map_or(0, |st| st.own_bytes)
    }

    fn codec(&self) -> Option<&dyn DeviceCodec> {
        self.nvcomp.map(|_| self as &dyn DeviceCodec)
    }

    fn take_fingerprints(&self, device: i32) -> Result<Vec<Fingerprint>> {
        let (st, _ctx) = self.enter(device)?;
        st.fingerprint.take()
    }

    fn record_marker(&self, device: i32) -> Result<u64> {
        let (st, _ctx) = self.enter(device)?;
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the event is destroyed by wait_marker (or right here on failure).
        unsafe {
            check(
                Op::Record.name(),
                sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32),
            )?;
            if let Err(e) = check(Op::Record.name(), sys::cuEventRecord(ev, st.copy_stream)) {
                sys::cuEventDestroy_v2(ev);
                return Err(e);
            }
        }
        Ok(ev as u64)
    }

    fn wait_marker(&self, device: i32, marker: u64) -> Result<()> {
        let ev = marker as sys::CUevent;
        let _ctx = match self.enter(device) {
            Ok((_, guard)) => guard,
            Err(e) => {
                // SAFETY: the marker must be forgotten even on failure (trait contract); destroying an event
                // needs no particular current context.
                unsafe { sys::cuEventDestroy_v2(ev) };
                return Err(e);
            }
        };
        // SAFETY: `marker` is an event made by record_marker and waited for exactly once (the engine drops it).
        unsafe {
            let r = check(Op::Wait.name(), sys::cuEventSynchronize(ev));
            sys::cuEventDestroy_v2(ev);
            r
        }
    }

    fn synchronize(&self, device: i32, stream: u64) -> Result<()> {
        let _ctx = self.enter(device)?.1;
        if stream != 0 {
            let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
            // SAFETY: `stream` is the stream torch handed to my_malloc; valid out-pointer. If it no longer exists
            // the query fails and the whole context is synchronized instead (correct, only broader).
            let query = unsafe { sys::cuStreamIsCapturing(stream as sys::CUstream, &mut status) };
            if query != CUresult::CUDA_SUCCESS {
                status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
            }
            if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
                // Synchronizing would invalidate the capture; torch does not hand memory back mid-capture anyway.
                return Ok(());
            }
        }
        // SAFETY: synchronizes the current (device's primary) context.
        unsafe { check(Op::Synchronize.name(), sys::cuCtxSynchronize()) }
    }

    unsafe fn host_register(&self, ptr: HostPtr, size: usize) -> Result<()> {
        let _ctx = self.enter_host()?;
        // SAFETY: [ptr, ptr+size) is a live mapping owned by a HostBuffer; PORTABLE pins it for every context.
        unsafe {
            check(
                Op::HostRegister.name(),
                sys::cuMemHostRegister_v2(
                    ptr.0 as *mut c_void,
                    size,
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                ),
            )
        }
    }

    unsafe fn host_unregister(&self, ptr: HostPtr) -> Result<()> {
        let _ctx = self.enter_host()?;
        // SAFETY: unregisters memory we registered; no copy is in flight (the engine waited).
        unsafe {
            check(
                Op::HostUnregister.name(),
                sys::cuMemHostUnregister(ptr.0 as *mut c_void),
            )
        }
    }

    fn host_alloc(&self, size: usize) -> Result<HostPtr> {
        let _ctx = self.enter_host()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        unsafe {
            check(
                Op::HostAlloc.name(),
                sys::cuMemHostAlloc(&mut p, size, sys::CU_MEMHOSTALLOC_PORTABLE),
            )?
        };
        Ok(HostPtr(p as usize))
    }

    unsafe fn host_free(&self, ptr: HostPtr) -> Result<()> {
        let _ctx = self.enter_host()?;
        // SAFETY: frees memory from host_alloc, once.
        unsafe { check("cuMemFreeHost", sys::cuMemFreeHost(ptr.0 as *mut c_void)) }
    }
}

/// The driver is its own codec where nvCOMP loaded (`Driver::codec`): each device's ring lives in its state, and
/// the work is the ring's (`cuda_codec.rs`); this only finds the ring and makes the device's context current.
impl DeviceCodec for CudaDriver {
    fn describe(&self) -> String {
        self.nvcomp
            .map_or_else(|| "none".into(), cuda_codec::describe)
    }

    fn own_device_bytes(&self, device: i32) -> usize {
        self.codec_ring(device).map_or(0, |r| r.device_bytes())
    }

    fn compress_to_host(
        &self,
        device: i32,
        ranges: &[(DevPtr, usize)],
        kind: DataKind,
        place: &mut PlaceFn<'_>,
        done: &mut DoneFn<'_>,
    ) -> Result<Vec<Stored>> {
        let (st, _ctx) = self.enter(device)?;
        let ring = (st.codec.as_ref()).map_err(|why| cuda_codec::no_ring(true, device, why))?;
        ring.compress(st.copy_stream, ranges, kind, place, done)
    }

    fn decompress_from_host(
        &self,
        device: i32,
        items: &[RestoreItem],
        ready: &mut ReadyFn<'_>,
    ) -> Result<()> {
        let (st, _ctx) = self.enter(device)?;
        let ring = (st.codec.as_ref()).map_err(|why| cuda_codec::no_ring(false, device, why))?;
        ring.decompress(st.copy_stream, items, ready)
    }
}
