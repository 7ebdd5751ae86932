//! Turning a CUDA driver result into our `Error`: the one helper every module that calls libcuda uses
//! (`cuda.rs`, `cuda_fingerprint.rs`), so that they depend on it and not on each other.

use std::ffi::CStr;

use cudarc::driver::sys::{self, CUresult};

use crate::error::{Error, Result};

/// The driver's name for `code` ("CUDA_ERROR_OUT_OF_MEMORY"), or cudarc's spelling of it when the driver
/// cannot say.
fn error_name(code: CUresult) -> String {
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string or leaves it null.
    let r = unsafe { sys::cuGetErrorName(code, &mut p) };
    if r == CUresult::CUDA_SUCCESS && !p.is_null() {
        // SAFETY: non-null pointer to a NUL-terminated static string owned by the driver.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    } else {
        format!("{code:?}")
    }
}

/// Ok on CUDA_SUCCESS, else the error of driver call `op` with the code and its name.
pub(super) fn check(op: &'static str, r: CUresult) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::driver(op, r as i32, error_name(r)))
    }
}
