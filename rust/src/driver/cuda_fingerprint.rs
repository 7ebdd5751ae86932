//! The fingerprint kernel on the CUDA driver: PTX embedded in the crate (compiled from
//! `rust/kernels/fingerprint.cu` by `scripts/gen_ptx.py`, so building the wheel needs no CUDA toolkit), loaded
//! per device on first use with `cuModuleLoadData`, launched on the device's copy stream.
//!
//! A batch is: chunk table host -> device, one launch (a block per chunk), fingerprints device -> host, all
//! queued on the copy stream behind the copies, through one pinned host staging buffer per device (grown as
//! needed) and one device buffer of a fixed size; a batch larger than the device buffer goes through it in
//! pieces, in stream order.
//!
//! Device memory is the allocator's own and is taken once, when the device is set up (before its first
//! allocation is handed out): the module and the device buffer (`prepare`). Taken lazily at the first sleep, it
//! made that sleep give back less than it unmapped.

use std::ffi::c_void;

use cudarc::driver::sys;
use parking_lot::Mutex;

use super::cuda_check::check;
use super::{DevPtr, Op, FINGERPRINTS_UNAVAILABLE};
use crate::error::{cuda_code, Error, Result};
use crate::fingerprint::{Fingerprint, WORD};

/// PTX ISA 8.0 (loads on drivers from CUDA 12.0 on), NUL-terminated as cuModuleLoadData wants it.
const PTX: &str = concat!(include_str!("../../kernels/fingerprint.ptx"), "\0");
const KERNEL: &std::ffi::CStr = c"cumem_fingerprint";
const THREADS: u32 = 256;
/// Table entry and result are 16 bytes each per chunk.
const BYTES_PER_CHUNK: usize = 32;
/// Chunks the device buffer holds: 2 MiB of device memory (one allocation granule), 128 GiB of 2 MiB chunks
/// per launch.
const DEVICE_CHUNKS: usize = 65536;

/// Load a NUL-terminated PTX image into the current context and look up `name` in it. The module stays loaded
/// for the life of the process (as the device's primary context does).
pub(super) fn load_function(ptx: &str, name: &std::ffi::CStr) -> Result<sys::CUfunction> {
    debug_assert!(ptx.ends_with('\0'));
    let mut module = std::ptr::null_mut();
    let mut function = std::ptr::null_mut();
    // SAFETY: `ptx` is a NUL-terminated image; valid out-pointers; the caller made a context current.
    unsafe {
        check(
            "cuModuleLoadData",
            sys::cuModuleLoadData(&mut module, ptx.as_ptr() as *const c_void),
        )?;
        check(
            "cuModuleGetFunction",
            sys::cuModuleGetFunction(&mut function, module, name.as_ptr()),
        )?;
    }
    Ok(function)
}

/// Per-device kernel state; lives as long as the device state (the process).
pub(super) struct FingerprintKernel {
    inner: Mutex<Inner>,
}

struct Inner {
    /// The kernel and the device buffer (DEVICE_CHUNKS table entries, then as many results), or why they could
    /// not be had at set-up (every batch then fails with that error, and the engine copies everything).
    prepared: std::result::Result<(sys::CUfunction, sys::CUdeviceptr), Error>,
    /// Chunks the host staging buffer holds.
    capacity: usize,
    host_buf: *mut u8,
    /// Chunks of the batch queued and not taken yet.
    pending: Option<usize>,
}

// SAFETY: the raw handles and pointers are process-wide CUDA objects, used only under the mutex.
unsafe impl Send for Inner {}

impl FingerprintKernel {
    /// Load the module, take the device buffer and run the kernel once on `stream` (what a first launch takes
    /// lazily, such as its stack, is taken now too), in the device's context (current). A failure is kept, not
    /// returned: the device works without fingerprints.
    pub(super) fn prepare(stream: sys::CUstream) -> Self {
        let prepared = load_function(PTX, KERNEL).and_then(|function| {
            let mut dev = 0;
            // SAFETY: valid out-pointer; the device's context is current.
            unsafe {
                check(
                    "cuMemAlloc",
                    sys::cuMemAlloc_v2(&mut dev, DEVICE_CHUNKS * BYTES_PER_CHUNK),
                )?
            };
            if let Err(e) = warm_up(function, dev, stream) {
                // SAFETY: our own allocation, nothing in flight on it (warm_up synchronized or never queued).
                unsafe { sys::cuMemFree_v2(dev) };
                return Err(e);
            }
            Ok((function, dev))
        });
        // Whatever failed, every batch on this device fails the same way from now on, under one op the engine
        // reads as "unavailable for good" (a first launch refused is as final as a module that does not load).
        let prepared = prepared.map_err(|e| {
            log::warn!("fingerprint kernel unavailable on this device: {e}");
            let code = match e {
                Error::Driver { code, .. } => code,
                Error::OutOfMemory { .. } => cuda_code::OUT_OF_MEMORY,
                _ => cuda_code::UNKNOWN,
            };
            Error::Driver {
                op: FINGERPRINTS_UNAVAILABLE,
                code,
                name: e.to_string(),
            }
        });
        FingerprintKernel {
            inner: Mutex::new(Inner {
                prepared,
                capacity: 0,
                host_buf: std::ptr::null_mut(),
                pending: None,
            }),
        }
    }

    /// Queue a batch on `stream`. The device's context must be current.
    pub(super) fn queue(&self, stream: sys::CUstream, chunks: &[(DevPtr, usize)]) -> Result<()> {
        let op = Op::Fingerprint.name();
        let invalid = |why: String| {
            let code = cuda_code::INVALID_VALUE;
            Error::driver(op, code, format!("{} ({why})", cuda_code::name(code)))
        };
        let mut st = self.inner.lock();
        if st.pending.is_some() {
            return Err(invalid(
                "a fingerprint batch is already queued on this device".into(),
            ));
        }
        let n = chunks.len();
        if n == 0 || n > i32::MAX as usize {
            return Err(invalid(format!("{n} chunks")));
        }
        if let Some(&(a, l)) = chunks
            .iter()
            .find(|(a, l)| !(*a as usize).is_multiple_of(WORD) || !l.is_multiple_of(WORD))
        {
            return Err(invalid(format!(
                "chunk {a:#x}+{l} not in whole 16-byte words"
            )));
        }
        let (function, device_buf) = st.prepared.clone()?;
        st.reserve(n)?;
        // SAFETY: host_buf holds at least 32*n bytes (reserve); no earlier batch still reads it (pending is
        // None: the previous batch was taken after its stream passed it, or its failure synchronized the stream).
        unsafe {
            let table = st.host_buf as *mut u64;
            for (i, &(addr, len)) in chunks.iter().enumerate() {
                table.add(2 * i).write(addr);
                table.add(2 * i + 1).write(len as u64);
            }
        }
        let (dev_table, dev_out) = (device_buf, device_buf + (16 * DEVICE_CHUNKS) as u64);
        let host = st.host_buf;
        // The pieces in order: each reuses the device buffer after the previous one's results were copied out
        // of it (stream order).
        let queued = (0..n).step_by(DEVICE_CHUNKS).try_for_each(|first| {
            let m = DEVICE_CHUNKS.min(n - first);
            // SAFETY: the host buffer holds the table and results of all n chunks (reserve), the device buffer
            // those of DEVICE_CHUNKS >= m; the copies and the launch are ordered on `stream`.
            unsafe {
                let table = host.add(16 * first) as *const c_void;
                check(
                    op,
                    sys::cuMemcpyHtoDAsync_v2(dev_table, table, 16 * m, stream),
                )?;
                launch(op, function, dev_table, dev_out, m, stream)?;
                let out = host.add(16 * (n + first)) as *mut c_void;
                check(op, sys::cuMemcpyDtoHAsync_v2(out, dev_out, 16 * m, stream))
            }
        });
        match queued {
            Ok(()) => {
                st.pending = Some(n);
                Ok(())
            }
            Err(e) => {
                // Whatever part was queued must be done with the staging buffers before they are reused.
                // SAFETY: our own stream.
                unsafe { sys::cuStreamSynchronize(stream) };
                Err(e)
            }
        }
    }

    /// The results of the pending batch; the caller has waited for the stream.
    pub(super) fn take(&self) -> Result<Vec<Fingerprint>> {
        let mut st = self.inner.lock();
        let n = st.pending.take().ok_or_else(|| {
            Error::InvalidState("no fingerprint batch queued on this device".into())
        })?;
        // SAFETY: the batch wrote 16*n bytes at host_buf+16n, and the caller waited for the stream that wrote them.
        let out =
            unsafe { std::slice::from_raw_parts(st.host_buf.add(16 * n) as *const u64, 2 * n) };
        Ok(out.chunks_exact(2).map(|p| [p[0], p[1]]).collect())
    }
}

/// Launch the kernel over `blocks` table entries at `table`, results to `out`, on `stream`.
///
/// # Safety
/// `table` holds `blocks` entries of device ranges readable by the kernel, `out` room for as many results, until
/// the launch is done on `stream`; the function's context is current.
unsafe fn launch(
    op: &'static str,
    function: sys::CUfunction,
    table: sys::CUdeviceptr,
    out: sys::CUdeviceptr,
    blocks: usize,
    stream: sys::CUstream,
) -> Result<()> {
    let (mut t, mut o) = (table, out);
    let mut params = [
        &mut t as *mut sys::CUdeviceptr as *mut c_void,
        &mut o as *mut sys::CUdeviceptr as *mut c_void,
    ];
    // SAFETY: the caller's contract; `params` outlives the call (the driver copies the arguments at launch).
    unsafe {
        check(
            op,
            sys::cuLaunchKernel(
                function,
                blocks as u32,
                1,
                1,
                THREADS,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            ),
        )
    }
}

/// One launch over the first table entry's 16 bytes (the results area of `buf` itself), waited for.
fn warm_up(function: sys::CUfunction, buf: sys::CUdeviceptr, stream: sys::CUstream) -> Result<()> {
    let (table, out) = (buf, buf + (16 * DEVICE_CHUNKS) as u64);
    let entry: [u64; 2] = [out, WORD as u64];
    // SAFETY: the entry is 16 bytes on this stack frame, copied synchronously; the launch reads 16 bytes at `out`
    // and writes 16 there, both inside `buf`; the stream is synchronized before returning.
    unsafe {
        check(
            "cuMemcpyHtoD",
            sys::cuMemcpyHtoD_v2(table, entry.as_ptr() as *const c_void, 16),
        )?;
        launch("cuLaunchKernel", function, table, out, 1, stream)?;
        check("cuStreamSynchronize", sys::cuStreamSynchronize(stream))
    }
}

impl Inner {
    /// Grow the host staging buffer to hold `n` chunks (no batch is in flight when this runs).
    fn reserve(&mut self, n: usize) -> Result<()> {
        if n <= self.capacity {
            return Ok(());
        }
        let want = n.next_power_of_two().max(1024);
        let mut host = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the old buffer is freed only after the new one exists, and nothing is in
        // flight on it (no pending batch).
        unsafe {
            check(
                "cuMemAllocHost",
                sys::cuMemAllocHost_v2(&mut host, want * BYTES_PER_CHUNK),
            )?;
            if self.capacity > 0 {
                sys::cuMemFreeHost(self.host_buf as *mut c_void);
            }
        }
        self.host_buf = host as *mut u8;
        self.capacity = want;
        Ok(())
    }
}

/// Test helper for every embedded kernel: PTX ISA 8.0 (what CUDA 12.0 drivers accept; a newer ISA would be
/// refused by them), the entry present, NUL-terminated for cuModuleLoadData. It reads the text only: loading the
/// module takes a GPU, where every test of retained backups on CUDA loads it.
#[cfg(test)]
pub(super) fn assert_ptx_text_for_cuda_12_0(ptx: &str, entry: &str) {
    let version = ptx
        .lines()
        .find(|l| l.starts_with(".version"))
        .expect(".version line");
    assert_eq!(
        version.trim(),
        ".version 8.0",
        "regenerate with scripts/gen_ptx.py (NVRTC 12.0)"
    );
    assert!(
        ptx.contains(&format!(".entry {entry}(")),
        "kernel entry {entry} missing"
    );
    assert!(ptx.ends_with('\0'));
}

#[cfg(test)]
mod tests {
    #[test]
    fn embedded_ptx_is_isa_8_0_with_its_entry_nul_terminated() {
        super::assert_ptx_text_for_cuda_12_0(super::PTX, "cumem_fingerprint");
    }
}
