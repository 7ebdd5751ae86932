//! Fault injection around any driver, in the manner of RAPIDS RMM's resource adaptors: `FaultInjector<D>` is a
//! `Driver` that counts every call it forwards to `D` and makes the n-th next call of a chosen operation fail
//! with a chosen CUDA error code (or panic, to test that panics are contained), so that every rollback path of
//! the engine can be driven from tests. The driver inside knows nothing of it; the simulated driver users get
//! (`sim::SimDriver`) is this adaptor around the host emulation.

use std::collections::HashMap;

use parking_lot::Mutex;

use super::codec::{DataKind, DeviceCodec, DoneFn, PlaceFn, ReadyFn, RestoreItem, Stored};
use super::{copy_from_slice, copy_to_slice, DevPtr, DeviceInfo, Driver, HostPtr, Op, PhysHandle};
use crate::error::{cuda_code, Error, Result};
use crate::fingerprint::Fingerprint;

/// Error kinds that fault injection can produce (by the names Python passes), with their CUDA codes.
pub const FAULT_ERRORS: [(&str, i32); 4] = [
    ("oom", cuda_code::OUT_OF_MEMORY),
    ("invalid", cuda_code::INVALID_VALUE),
    ("unknown", cuda_code::UNKNOWN),
    ("not_permitted", cuda_code::NOT_PERMITTED),
];

struct Fault {
    op: Op,
    /// The value of the op's call counter at which it fails.
    at_call: u64,
    /// The CUDA error code it returns; None: the call panics instead.
    code: Option<i32>,
}

#[derive(Default)]
struct Armed {
    calls: HashMap<Op, u64>,
    faults: Vec<Fault>,
}

/// A driver whose calls are counted and can be made to fail (see the module notes).
pub struct FaultInjector<D> {
    inner: D,
    armed: Mutex<Armed>,
    /// The wrong first bytes that `Op::CorruptCopyH2D` copies behind the copy it corrupts: they must live until
    /// that copy ran, and it is queued, so they live as long as the injector (one byte per fault fired).
    /// Boxed so that each byte keeps its address while the Vec grows.
    #[allow(clippy::vec_box)]
    corrupt_bytes: Mutex<Vec<Box<u8>>>,
}

impl<D> FaultInjector<D> {
    /// `inner` with no fault armed.
    pub fn around(inner: D) -> Self {
        FaultInjector {
            inner,
            armed: Mutex::new(Armed::default()),
            corrupt_bytes: Mutex::new(Vec::new()),
        }
    }

    /// The driver the calls go to.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// The `nth` next call (1 = the very next) of `op` fails with CUDA error `code`.
    pub fn inject_fault(&self, op: Op, nth: u64, code: i32) -> Result<()> {
        self.arm(op, nth, Some(code))
    }

    /// The `nth` next call of `op` panics inside the driver, as a bug would: to test that a panic never crosses
    /// into Python or C and never releases host memory under a queued copy.
    pub fn inject_panic(&self, op: Op, nth: u64) -> Result<()> {
        self.arm(op, nth, None)
    }

    fn arm(&self, op: Op, nth: u64, code: Option<i32>) -> Result<()> {
        if nth == 0 {
            return Err(Error::invalid("nth must be at least 1"));
        }
        let mut armed = self.armed.lock();
        // A fault past the end of the call counter could never fire: refuse it rather than wrap around.
        let at_call = armed
            .calls
            .get(&op)
            .copied()
            .unwrap_or(0)
            .checked_add(nth)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "nth {nth} is too large: the fault could never fire"
                ))
            })?;
        armed.faults.push(Fault { op, at_call, code });
        Ok(())
    }

    pub fn clear_faults(&self) {
        self.armed.lock().faults.clear();
    }

    /// How often each operation was called so far (every `Op`, in `Op::ALL` order), for sizing fault walks.
    pub fn calls(&self) -> Vec<(&'static str, u64)> {
        let armed = self.armed.lock();
        Op::ALL
            .iter()
            .map(|op| (op.name(), armed.calls.get(op).copied().unwrap_or(0)))
            .collect()
    }

    /// Count a call of `op` and fail it if a fault is armed for it.
    fn enter(&self, op: Op) -> Result<()> {
        let (n, fault) = {
            let mut armed = self.armed.lock();
            let n = armed.calls.entry(op).or_insert(0);
            *n += 1;
            let n = *n;
            let i = armed
                .faults
                .iter()
                .position(|f| f.op == op && f.at_call == n);
            (n, i.map(|i| armed.faults.swap_remove(i)))
        };
        match fault {
            None => Ok(()),
            Some(Fault { code: None, .. }) => {
                panic!("injected panic in driver call {} (call {n})", op.name())
            }
            Some(Fault {
                code: Some(code), ..
            }) => Err(Error::driver(op.name(), code, cuda_code::name(code))),
        }
    }
}

impl<D: Driver> Driver for FaultInjector<D> {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn device_count(&self) -> Result<usize> {
        self.inner.device_count()
    }

    fn granularity(&self, device: i32) -> Result<usize> {
        self.inner.granularity(device)
    }

    fn mem_info(&self, device: i32) -> Result<(usize, usize)> {
        self.inner.mem_info(device)
    }

    fn device_info(&self, device: i32) -> Result<DeviceInfo> {
        self.inner.device_info(device)
    }

    fn reserve(&self, device: i32, size: usize) -> Result<DevPtr> {
        self.enter(Op::Reserve)?;
        self.inner.reserve(device, size)
    }

    fn free_range(&self, addr: DevPtr, size: usize) -> Result<()> {
        self.enter(Op::FreeRange)?;
        self.inner.free_range(addr, size)
    }

    fn create(&self, device: i32, size: usize) -> Result<PhysHandle> {
        self.enter(Op::Create)?;
        self.inner.create(device, size)
    }

    fn release(&self, handle: PhysHandle) -> Result<()> {
        self.enter(Op::Release)?;
        self.inner.release(handle)
    }

    fn map(&self, addr: DevPtr, size: usize, handle: PhysHandle) -> Result<()> {
        self.enter(Op::Map)?;
        self.inner.map(addr, size, handle)
    }

    fn unmap(&self, addr: DevPtr, size: usize) -> Result<()> {
        self.enter(Op::Unmap)?;
        self.inner.unmap(addr, size)
    }

    fn set_access(&self, device: i32, addr: DevPtr, size: usize) -> Result<()> {
        self.enter(Op::SetAccess)?;
        self.inner.set_access(device, addr, size)
    }

    unsafe fn copy_d2h(&self, device: i32, dst: HostPtr, src: DevPtr, size: usize) -> Result<()> {
        self.enter(Op::CopyD2H)?;
        // SAFETY: forwarded under the caller's contract of this unsafe fn.
        unsafe { self.inner.copy_d2h(device, dst, src, size) }
    }

    /// `Op::CorruptCopyH2D` lets the copy succeed and then flips its first byte on the device (as a host copy
    /// damaged where it lay would restore it), so that tests reach the wake's verification of raw backups. The
    /// flip is a one-byte copy queued behind it, so the stream's order is kept (waiting here would run work that
    /// the caller has not waited for yet, and hide a missing wait).
    unsafe fn copy_h2d(&self, device: i32, dst: DevPtr, src: HostPtr, size: usize) -> Result<()> {
        self.enter(Op::CopyH2D)?;
        // SAFETY: forwarded under the caller's contract of this unsafe fn.
        unsafe { self.inner.copy_h2d(device, dst, src, size)? };
        if size > 0 && self.enter(Op::CorruptCopyH2D).is_err() {
            // SAFETY: `src` is valid for reads of `size` > 0 bytes and not written until the copy finished (the
            // caller's contract), so its first byte now is what the copy will carry.
            let first = unsafe { *(src.0 as *const u8) };
            let wrong = Box::new(first ^ 0x5A);
            let at = HostPtr(&*wrong as *const u8 as usize);
            self.corrupt_bytes.lock().push(wrong);
            // SAFETY: the byte at `at` lives in `corrupt_bytes` as long as this injector, is never written again,
            // and the driver inside lives as long (it is a field).
            unsafe { self.inner.copy_h2d(device, dst, at, 1)? };
        }
        Ok(())
    }

    fn memset_zero(&self, device: i32, addr: DevPtr, size: usize) -> Result<()> {
        self.enter(Op::MemsetZero)?;
        self.inner.memset_zero(device, addr, size)
    }

    /// A failed wait (and a failed `synchronize`) still reaches the driver inside, as `wait_marker` does: the
    /// fault is a wait that reports an error, not a stream left running behind the caller's back (on CUDA such
    /// errors are sticky: the context runs nothing more).
    fn wait(&self, device: i32) -> Result<()> {
        let injected = self.enter(Op::Wait);
        let answer = self.inner.wait(device);
        injected.and(answer)
    }

    fn record_marker(&self, device: i32) -> Result<u64> {
        self.enter(Op::Record)?;
        self.inner.record_marker(device)
    }

    fn wait_marker(&self, device: i32, marker: u64) -> Result<()> {
        // The marker is forgotten also when the wait fails (the trait's contract), so a failed wait still
        // reaches the driver inside, and the injected error replaces its answer.
        let injected = self.enter(Op::Wait);
        let answer = self.inner.wait_marker(device, marker);
        injected.and(answer)
    }

    fn synchronize(&self, device: i32, stream: u64) -> Result<()> {
        let injected = self.enter(Op::Synchronize);
        let answer = self.inner.synchronize(device, stream);
        injected.and(answer)
    }

    fn user_device_access(&self, device: i32, addr: DevPtr, len: usize, write: bool) -> Result<()> {
        self.inner.user_device_access(device, addr, len, write)
    }

    fn user_host_access(&self, ptr: HostPtr, len: usize, write: bool) -> Result<()> {
        self.inner.user_host_access(ptr, len, write)
    }

    fn queue_fingerprints(&self, device: i32, chunks: &[(DevPtr, usize)]) -> Result<()> {
        self.enter(Op::Fingerprint)?;
        self.inner.queue_fingerprints(device, chunks)
    }

    fn take_fingerprints(&self, device: i32) -> Result<Vec<Fingerprint>> {
        self.inner.take_fingerprints(device)
    }

    fn own_device_bytes(&self, device: i32) -> usize {
        self.inner.own_device_bytes(device)
    }

    /// The inner driver's codec, behind this injector (its calls counted and failed as `Op::Compress`,
    /// `Op::Decompress` and `Op::CorruptDecompress`).
    fn codec(&self) -> Option<&dyn DeviceCodec> {
        self.inner.codec().map(|_| self as &dyn DeviceCodec)
    }

    unsafe fn host_register(&self, ptr: HostPtr, size: usize) -> Result<()> {
        self.enter(Op::HostRegister)?;
        // SAFETY: forwarded under the caller's contract of this unsafe fn.
        unsafe { self.inner.host_register(ptr, size) }
    }

    unsafe fn host_unregister(&self, ptr: HostPtr) -> Result<()> {
        self.enter(Op::HostUnregister)?;
        // SAFETY: forwarded under the caller's contract of this unsafe fn.
        unsafe { self.inner.host_unregister(ptr) }
    }

    fn host_alloc(&self, size: usize) -> Result<HostPtr> {
        self.enter(Op::HostAlloc)?;
        self.inner.host_alloc(size)
    }

    unsafe fn host_free(&self, ptr: HostPtr) -> Result<()> {
        // SAFETY: forwarded under the caller's contract of this unsafe fn.
        unsafe { self.inner.host_free(ptr) }
    }

    fn thread_spawn(&self) -> Result<()> {
        self.enter(Op::ThreadSpawn)?;
        self.inner.thread_spawn()
    }

    fn host_available(&self) -> Option<usize> {
        self.inner.host_available()
    }
}

/// The codec of the driver inside, with faults: `Op::Compress` and `Op::Decompress` fail their call;
/// `Op::CorruptDecompress` lets a decompression succeed and then flips a byte of what it restored, so that
/// tests reach the wake's verification against the sleep's fingerprints.
impl<D: Driver> DeviceCodec for FaultInjector<D> {
    fn describe(&self) -> String {
        self.inner
            .codec()
            .map_or_else(String::new, |c| c.describe())
    }

    fn own_device_bytes(&self, device: i32) -> usize {
        self.inner.codec().map_or(0, |c| c.own_device_bytes(device))
    }

    fn compress_to_host(
        &self,
        device: i32,
        ranges: &[(DevPtr, usize)],
        kind: DataKind,
        place: &mut PlaceFn<'_>,
        done: &mut DoneFn<'_>,
    ) -> Result<Vec<Stored>> {
        self.enter(Op::Compress)?;
        let codec = self
            .inner
            .codec()
            .expect("offered only with the inner codec");
        // Each finished blob counts as a call of `CompressBlob`: a fault there fails the compression after the
        // blobs before it are complete (and may have been released by the caller).
        let mut counted = |i: usize, stored: Stored| {
            self.enter(Op::CompressBlob)?;
            done(i, stored)
        };
        codec.compress_to_host(device, ranges, kind, place, &mut counted)
    }

    fn decompress_from_host(
        &self,
        device: i32,
        items: &[RestoreItem],
        ready: &mut ReadyFn<'_>,
    ) -> Result<()> {
        self.enter(Op::Decompress)?;
        let codec = self
            .inner
            .codec()
            .expect("offered only with the inner codec");
        codec.decompress_from_host(device, items, ready)?;
        if self.enter(Op::CorruptDecompress).is_err() {
            if let Some(first) = items.first().filter(|it| it.raw_len > 0) {
                flip_first_byte(&self.inner, device, first.dst)?;
            }
        }
        Ok(())
    }
}

/// Change the byte at `addr` on `device` (a corrupting fault), waiting for the copies that do it.
fn flip_first_byte(driver: &dyn Driver, device: i32, addr: DevPtr) -> Result<()> {
    let mut byte = [0u8];
    copy_to_slice(driver, device, addr, &mut byte)?;
    byte[0] ^= 0x5A;
    copy_from_slice(driver, device, addr, &byte)
}
