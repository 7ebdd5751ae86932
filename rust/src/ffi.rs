//! C-ABI entry points for `torch.cuda.memory.CUDAPluggableAllocator(path, "my_malloc", "my_free")`.
//!
//! They never take the GIL (torch may call them from any thread, with or without it) and never let a panic
//! unwind into C++: malloc failures return NULL, which torch turns into an OutOfMemoryError; free failures are
//! recorded (see `Allocator.errors()` / `ffi_errors()`), never fatal.

use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use crate::error::Error;
use crate::global;

/// Failures from calls that had no engine to record into (no GPU), oldest first, bounded.
static FFI_ERRORS: Mutex<Vec<String>> = Mutex::new(Vec::new());
const MAX_FFI_ERRORS: usize = 1000;

/// Test hook: make the next my_malloc/my_free panic inside, to prove the panic is caught.
static PANIC_NEXT_CALL: AtomicBool = AtomicBool::new(false);

pub fn set_panic_next_call(on: bool) {
    PANIC_NEXT_CALL.store(on, Ordering::SeqCst);
}

pub fn ffi_errors() -> Vec<String> {
    FFI_ERRORS.lock().clone()
}

pub(crate) fn record(context: &str, e: &Error) {
    match global::existing_cuda_engine() {
        Some(engine) => engine.record_error(context, e),
        None => {
            let mut errs = FFI_ERRORS.lock();
            if errs.len() >= MAX_FFI_ERRORS {
                errs.remove(0);
            }
            errs.push(format!("{context}: {e}"));
        }
    }
}

fn maybe_test_panic() {
    if PANIC_NEXT_CALL.swap(false, Ordering::SeqCst) {
        panic!("test hook: panic inside the C-ABI entry point");
    }
}

/// Run `f`, turning a panic into `Error::Panic`.
fn guarded<T>(f: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
    catch_unwind(AssertUnwindSafe(|| {
        maybe_test_panic();
        f()
    }))
    .unwrap_or_else(|p| Err(Error::Panic(crate::error::panic_message(&*p))))
}

/// Allocate `size` bytes on `device` for torch, under the calling thread's current tag.
#[no_mangle]
pub extern "C" fn my_malloc(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void {
    match guarded(|| global::cuda_engine()?.malloc(size, device, stream as u64)) {
        Ok(addr) => addr as *mut c_void,
        Err(e) => {
            // Running out of memory is torch's to report (OutOfMemoryError); anything else is also recorded.
            if !e.is_out_of_memory() {
                record(&format!("my_malloc({size}, device {device})"), &e);
            }
            std::ptr::null_mut()
        }
    }
}

/// Free memory torch got from `my_malloc`. torch forgets the pointer whatever happens here, so a release that
/// fails part way is recorded and queued for retry (`Engine::free_or_queue`), never left as a live allocation.
#[no_mangle]
pub extern "C" fn my_free(ptr: *mut c_void, size: usize, device: c_int, _stream: *mut c_void) {
    if let Err(e) = guarded(|| global::cuda_engine()?.free_or_queue(ptr as u64)) {
        record(&format!("my_free({ptr:p}, {size}, device {device})"), &e);
    }
}
