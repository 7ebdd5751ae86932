//! The fingerprint kernel on the CUDA driver: PTX embedded in the crate (compiled from
//! `rust/kernels/fingerprint.cu` by `scripts/gen_ptx.py`, so building the wheel needs no CUDA toolkit), loaded
//! per device on first use with `cuModuleLoadData`, launched on the device's copy stream.
//!
//! A batch is: chunk table host -> device, one launch (a block per chunk), fingerprints device -> host, all
//! queued on the copy stream behind the copies, through one pinned staging buffer and one device buffer per
//! device that grow as needed and are kept for the next batch.

use std::ffi::c_void;

use cudarc::driver::sys;
use parking_lot::Mutex;

use super::cuda_check::check;
use super::{DevPtr, Op};
use crate::error::{cuda_code, Error, Result};
use crate::fingerprint::{Fingerprint, WORD};

/// PTX ISA 8.0 (loads on drivers from CUDA 12.0 on), NUL-terminated as cuModuleLoadData wants it.
const PTX: &str = concat!(include_str!("../../kernels/fingerprint.ptx"), "\0");
const KERNEL: &std::ffi::CStr = c"cumem_fingerprint";
const THREADS: u32 = 256;
/// Table entry and result are 16 bytes each per chunk.
const BYTES_PER_CHUNK: usize = 32;

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
    function: Option<sys::CUfunction>,
    /// Chunks the staging buffers hold.
    capacity: usize,
    device_buf: sys::CUdeviceptr,
    host_buf: *mut u8,
    /// Chunks of the batch queued and not taken yet.
    pending: Option<usize>,
}

// SAFETY: the raw handles and pointers are process-wide CUDA objects, used only under the mutex.
unsafe impl Send for Inner {}

impl FingerprintKernel {
    pub(super) fn new() -> Self {
        FingerprintKernel {
            inner: Mutex::new(Inner {
                function: None,
                capacity: 0,
                device_buf: 0,
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
        let function = st.function()?;
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
        let (dev_table, dev_out) = (st.device_buf, st.device_buf + (16 * n) as u64);
        // SAFETY: the buffers hold 32*n bytes each side; the copies and the launch are ordered on `stream`.
        let queued = unsafe {
            check(
                op,
                sys::cuMemcpyHtoDAsync_v2(dev_table, st.host_buf as *const c_void, 16 * n, stream),
            )
            .and_then(|()| {
                let (mut t, mut o) = (dev_table, dev_out);
                let mut params = [
                    &mut t as *mut sys::CUdeviceptr as *mut c_void,
                    &mut o as *mut sys::CUdeviceptr as *mut c_void,
                ];
                check(
                    op,
                    sys::cuLaunchKernel(
                        function,
                        n as u32,
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
            })
            .and_then(|()| {
                check(
                    op,
                    sys::cuMemcpyDtoHAsync_v2(
                        st.host_buf.add(16 * n) as *mut c_void,
                        dev_out,
                        16 * n,
                        stream,
                    ),
                )
            })
        };
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

impl Inner {
    /// The kernel, loading the module on first use. A failure is returned and tried again next time.
    fn function(&mut self) -> Result<sys::CUfunction> {
        if let Some(f) = self.function {
            return Ok(f);
        }
        let function = load_function(PTX, KERNEL)?;
        self.function = Some(function);
        Ok(function)
    }

    /// Grow the staging buffers to hold `n` chunks (no batch is in flight when this runs).
    fn reserve(&mut self, n: usize) -> Result<()> {
        if n <= self.capacity {
            return Ok(());
        }
        let want = n.next_power_of_two().max(1024);
        let bytes = want * BYTES_PER_CHUNK;
        let mut dev = 0;
        let mut host = std::ptr::null_mut();
        // SAFETY: valid out-pointers; the old buffers are freed only after the new ones exist, and nothing is in
        // flight on them (no pending batch).
        unsafe {
            check("cuMemAlloc", sys::cuMemAlloc_v2(&mut dev, bytes))?;
            if let Err(e) = check("cuMemAllocHost", sys::cuMemAllocHost_v2(&mut host, bytes)) {
                sys::cuMemFree_v2(dev);
                return Err(e);
            }
            if self.capacity > 0 {
                sys::cuMemFree_v2(self.device_buf);
                sys::cuMemFreeHost(self.host_buf as *mut c_void);
            }
        }
        self.device_buf = dev;
        self.host_buf = host as *mut u8;
        self.capacity = want;
        Ok(())
    }
}

/// Test helper for every embedded kernel: PTX ISA 8.0 (what CUDA 12.0 drivers accept; a newer ISA would be
/// refused by them), the entry present, NUL-terminated for cuModuleLoadData.
#[cfg(test)]
pub(super) fn assert_loadable_ptx(ptx: &str, entry: &str) {
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
    fn embedded_ptx_loads_on_cuda_12_0_drivers() {
        super::assert_loadable_ptx(super::PTX, "cumem_fingerprint");
    }
}
