//! The device->host copies of one sleep batch (each chunk of each blob, each raw range), queued on the copy
//! stream in one `cuMemcpyBatchAsync` where the driver has it (CUDA >= 12.8): a batch of about a hundred copies
//! then costs one call instead of a hundred, which keeps the CPU ahead of the link. Elsewhere, or with
//! `CUMEM_RS_NVCOMP_BATCH_COPY=0`, one `cuMemcpyDtoHAsync` each.
//!
//! A copy writes the same bytes to the same place however often it runs, so after a batch call that fails, for
//! whatever reason, the plain copies of the whole batch are queued instead, and batch calls are not tried again
//! in this process (one WARNING line).

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys;

use crate::driver::cuda_check::check;
use crate::error::Result;

/// Set once a batch call failed: the rest of the process copies one by one.
static BATCH_FAILED: AtomicBool = AtomicBool::new(false);

/// Whether the driver exports the batch call and the user did not switch it off; asked once per ring.
pub(super) fn batch_available() -> bool {
    if !crate::env::flag(crate::env::NVCOMP_BATCH_COPY, true) {
        return false;
    }
    // SAFETY: looks a symbol up in the loaded libcuda without calling it (cudarc would panic on a missing one).
    unsafe {
        sys::culib()
            .get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync\0")
            .is_ok()
    }
}

/// The copies of one batch: host destinations, device sources, lengths.
#[derive(Default)]
pub(super) struct D2hCopies {
    dsts: Vec<sys::CUdeviceptr>,
    srcs: Vec<sys::CUdeviceptr>,
    sizes: Vec<usize>,
}

impl D2hCopies {
    pub fn push(&mut self, dst: usize, src: u64, len: usize) {
        if len > 0 {
            self.dsts.push(dst as sys::CUdeviceptr);
            self.srcs.push(src);
            self.sizes.push(len);
        }
    }

    pub fn len(&self) -> usize {
        self.sizes.len()
    }

    /// Queue every copy on `stream` (device `device`'s) and forget them.
    ///
    /// # Safety
    /// Every destination is host memory valid for writes of its length until `stream` has passed the copies, and
    /// every source device memory that nothing changes until then.
    pub unsafe fn queue(&mut self, stream: sys::CUstream, device: i32, batch: bool) -> Result<()> {
        if self.sizes.is_empty() {
            return Ok(());
        }
        let batched = batch
            && !BATCH_FAILED.load(Ordering::Relaxed)
            && {
                // SAFETY: the caller's contract, for all of them.
                match unsafe { self.batch(stream, device) } {
                    Ok(()) => true,
                    Err(why) => {
                        if !BATCH_FAILED.swap(true, Ordering::Relaxed) {
                            log::warn!("cuMemcpyBatchAsync failed ({why}); the nvCOMP codec copies chunk by chunk");
                        }
                        false
                    }
                }
            };
        let result = if batched {
            Ok(())
        } else {
            (0..self.sizes.len()).try_for_each(|i| {
                // SAFETY: the caller's contract.
                unsafe {
                    check(
                        "cuMemcpyDtoHAsync",
                        sys::cuMemcpyDtoHAsync_v2(
                            self.dsts[i] as *mut c_void,
                            self.srcs[i],
                            self.sizes[i],
                            stream,
                        ),
                    )
                }
            })
        };
        self.dsts.clear();
        self.srcs.clear();
        self.sizes.clear();
        result
    }

    /// One batch call for all of them, the sources read in stream order.
    ///
    /// # Safety
    /// As for `queue`.
    unsafe fn batch(
        &mut self,
        stream: sys::CUstream,
        device: i32,
    ) -> std::result::Result<(), String> {
        let mut attrs = sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: device,
            },
            dstLocHint: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
                id: 0,
            },
            flags: 0,
        };
        let mut attr_index = [0usize];
        let mut failed_at = usize::MAX;
        // SAFETY: three arrays of `len` entries, one attribute applying from copy 0 on, valid out-pointer; the
        // memory behind the addresses is the caller's contract.
        let r = unsafe {
            sys::cuMemcpyBatchAsync(
                self.dsts.as_mut_ptr(),
                self.srcs.as_mut_ptr(),
                self.sizes.as_mut_ptr(),
                self.sizes.len(),
                &mut attrs,
                attr_index.as_mut_ptr(),
                1,
                &mut failed_at,
                stream,
            )
        };
        if r == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(format!("{r:?} at copy {failed_at} of {}", self.sizes.len()))
        }
    }
}
