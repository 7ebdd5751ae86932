//! The extension's side of the preload hook library (`rust/preload/cumem_rs_preload.c`, torch_memory_saver's
//! "preload" hook mode): the library's bytes, its registration, and the hooks it calls for `cudaMalloc`,
//! `cudaFree`, `tms_pause` and `tms_resume`, and for the runtime's other allocators (`unrouted_hook`).
//!
//! The library is `LD_PRELOAD`ed into a process (`configure_subprocess()` sets that for children) and forwards
//! everything to the real CUDA runtime until the extension, imported into that process, finds it and registers
//! `HOOKS` (`register`). From then on a `cudaMalloc` is ours when the calling thread is inside a region
//! (`push_region`), or outside any region and routing from process start is on (`set_init_enable`, the
//! `TMS_INIT_ENABLE=1` of torch_memory_saver), and not inside `push_disabled`; ours means it is allocated by the
//! routed engine (`set_target`; by default the process-wide CUDA engine, the one `my_malloc` serves) under the
//! region's tag. A `cudaFree` is ours when the pointer is one of ours (looked up by address: the runtime's free
//! has no size); anything else is forwarded.
//!
//! The runtime's other allocators (`cudaMallocAsync`, `cudaMallocManaged`, and `cudaFreeAsync` of a pointer that
//! is not ours) are never ours: the library forwards them and reports each successful one here. Made where a
//! cudaMalloc would be routed, that memory cannot be paused, so the first such call of each name logs a WARNING
//! and every one is counted (`unrouted_counts`, in `stats()`). A `cudaFreeAsync` of a pointer of ours is freed
//! here, like a `cudaFree`.
//!
//! Like `my_malloc`/`my_free` the hooks never take the GIL, never unwind into C (`catch_unwind`) and never fail
//! the process: a failed allocation returns a CUDA error code, a failed free is recorded (`ffi_errors()` or the
//! engine's `errors()`). This is an FFI module: its `unsafe` is the C boundary (dlsym, the pointers C hands us).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::{ffi, global, tags};

/// The preload library, built by build.rs; written to a file by the Python package for `LD_PRELOAD`.
pub static LIBRARY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libcumem_rs_preload.so"));

/// Must equal CUMEM_RS_PRELOAD_ABI in the C source (checked by the library at registration).
const ABI: c_uint = 2;
/// A hook's answer for a call that is not ours: the library forwards it to the real runtime.
const NOT_OURS: c_int = -1;
// cudaError_t values (driver_types.h).
const CUDA_SUCCESS: c_int = 0;
const CUDA_ERROR_INVALID_VALUE: c_int = 1;
const CUDA_ERROR_MEMORY_ALLOCATION: c_int = 2;
const CUDA_ERROR_INITIALIZATION: c_int = 3;
/// The library's `current_device` when the process has no `cudaGetDevice` to ask (CUMEM_RS_NO_GET_DEVICE).
const NO_GET_DEVICE: c_int = -2;
const CUDA_ERROR_UNKNOWN: c_int = 999;

/// The library's `cumem_rs_device_fn`: the calling thread's current device, through the real `cudaGetDevice`.
type DeviceFn = unsafe extern "C" fn(*mut c_int) -> c_int;

/// Mirrors `struct cumem_rs_preload_hooks` in the C source, field for field.
#[repr(C)]
struct Hooks {
    abi: c_uint,
    malloc_hook: extern "C" fn(*mut *mut c_void, usize, DeviceFn) -> c_int,
    free_hook: extern "C" fn(*mut c_void) -> c_int,
    pause_hook: extern "C" fn(*const c_char) -> c_int,
    resume_hook: extern "C" fn(*const c_char) -> c_int,
    unrouted_hook: extern "C" fn(*const c_char, usize),
}

/// Static, so the library may keep the pointer for the life of the process (the extension is never unloaded).
static HOOKS: Hooks = Hooks {
    abi: ABI,
    malloc_hook,
    free_hook,
    pause_hook,
    resume_hook,
    unrouted_hook,
};

/// The engine routed allocations go to; None: the process-wide CUDA engine, created at the first one.
static TARGET: RwLock<Option<Arc<Engine>>> = RwLock::new(None);
/// `TMS_INIT_ENABLE`: outside any region, every thread's allocations are ours (under `INIT_TAG`).
static INIT_ENABLE: AtomicBool = AtomicBool::new(false);
static REGISTERED: AtomicBool = AtomicBool::new(false);
/// The tag of allocations routed outside any region: torch_memory_saver's default tag.
pub const INIT_TAG: &str = tags::DEFAULT_TAG;
/// Every pointer the hook handed out and not yet freed, with the engine that owns it (the target may change
/// later; a free goes to the allocation's own engine).
static OURS: Mutex<BTreeMap<u64, Arc<Engine>>> = Mutex::new(BTreeMap::new());

/// One entry of a thread's routing stack: inside a region (allocate under the tag) or inside `disable()`.
#[derive(Clone)]
enum Route {
    Region(Arc<str>),
    Disabled,
}

thread_local! {
    /// This thread's routing, innermost last; empty: `INIT_ENABLE` decides.
    static ROUTES: RefCell<Vec<Route>> = const { RefCell::new(Vec::new()) };
}

extern "C" {
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

/// Glibc's RTLD_DEFAULT: search the global scope, where an LD_PRELOADed library is.
const RTLD_DEFAULT: *mut c_void = std::ptr::null_mut();

/// Install `HOOKS` in the preload library if it is loaded in this process. Ok(false): it is not (nothing is
/// routed); Ok(true): installed (again: idempotent). Fails when the loaded library speaks another ABI.
pub fn register() -> Result<bool> {
    type RegisterFn = unsafe extern "C" fn(*const Hooks) -> c_int;
    // SAFETY: dlsym with a NUL-terminated name has no preconditions; the result is only used when non-null.
    let sym = unsafe { dlsym(RTLD_DEFAULT, c"cumem_rs_preload_register".as_ptr()) };
    if sym.is_null() {
        return Ok(false);
    }
    // SAFETY: the symbol is the library's `int cumem_rs_preload_register(const struct cumem_rs_preload_hooks *)`,
    // whose struct `Hooks` mirrors; HOOKS is static, so the pointer it keeps stays valid.
    let rc = unsafe {
        let register: RegisterFn = std::mem::transmute::<*mut c_void, RegisterFn>(sym);
        register(&HOOKS)
    };
    if rc != 0 {
        return Err(Error::InvalidState(format!(
            "the preloaded cumem_rs hook library speaks ABI {rc}, this extension ABI {ABI}: LD_PRELOAD a \
             library written by this version of cumem_rs (configure_subprocess())"
        )));
    }
    REGISTERED.store(true, Ordering::SeqCst);
    Ok(true)
}

/// Whether `register` installed the hooks in this process.
pub fn is_registered() -> bool {
    REGISTERED.load(Ordering::SeqCst)
}

/// Route allocations to `engine` (None: the process-wide CUDA engine). Live allocations stay with their engine.
pub fn set_target(engine: Option<Arc<Engine>>) {
    *TARGET.write() = engine;
}

pub fn set_init_enable(on: bool) {
    INIT_ENABLE.store(on, Ordering::SeqCst);
}

pub fn init_enable() -> bool {
    INIT_ENABLE.load(Ordering::SeqCst)
}

/// Enter a region on this thread: its allocations are ours under `tag` until the matching `pop`.
pub fn push_region(tag: &str) -> Result<()> {
    if tag.is_empty() {
        return Err(Error::invalid("tag must be a non-empty string"));
    }
    ROUTES.with(|r| r.borrow_mut().push(Route::Region(Arc::from(tag))));
    Ok(())
}

/// Enter `disable()` on this thread: its allocations are the runtime's until the matching `pop`.
pub fn push_disabled() {
    ROUTES.with(|r| r.borrow_mut().push(Route::Disabled));
}

/// Leave the innermost region or `disable()` of this thread.
pub fn pop() -> Result<()> {
    ROUTES
        .with(|r| r.borrow_mut().pop())
        .map(drop)
        .ok_or_else(|| {
            Error::InvalidState(
                "preload pop without a matching region or disable on this thread".into(),
            )
        })
}

/// The tag a `cudaMalloc` on this thread gets now, or None when it is forwarded to the runtime.
pub fn routed_tag() -> Option<Arc<str>> {
    // try_with / try_borrow: a thread whose locals are being torn down (a free from a destructor) routes by
    // INIT_ENABLE alone instead of panicking.
    let top = ROUTES
        .try_with(|r| r.try_borrow().ok().and_then(|r| r.last().cloned()))
        .ok()
        .flatten();
    match top {
        Some(Route::Region(tag)) => Some(tag),
        Some(Route::Disabled) => None,
        None => init_enable().then(|| Arc::from(INIT_TAG)),
    }
}

/// How many pointers the hook handed out that are not freed yet.
pub fn live_pointers() -> usize {
    OURS.lock().len()
}

fn target() -> Result<Arc<Engine>> {
    if let Some(engine) = TARGET.read().as_ref() {
        return Ok(engine.clone());
    }
    Ok(global::cuda_engine()?.clone())
}

/// Run `f`, turning a panic into `Error::Panic`.
fn guarded<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f))
        .unwrap_or_else(|p| Err(Error::Panic(crate::error::panic_message(&*p))))
}

/// Pops the tag pushed for one routed malloc, also when the malloc panics.
struct TagScope<'a>(&'a Engine);

impl Drop for TagScope<'_> {
    fn drop(&mut self) {
        let _ = self.0.pop_tag();
    }
}

/// Allocate `size` bytes in the target engine under `tag`, on the device `current_device` names (the calling
/// thread's, as the runtime's cudaMalloc uses it; asked only of a CUDA engine: the simulated driver's devices are
/// not the runtime's, and allocations go to its device 0). Returns the address, or the runtime's error code.
pub fn malloc_routed(
    tag: &str,
    size: usize,
    current_device: impl FnOnce() -> std::result::Result<i32, c_int>,
) -> Result<std::result::Result<u64, c_int>> {
    let engine = target()?;
    let device = if engine.driver().backend() == "sim" {
        0
    } else {
        match runtime_device(size, current_device) {
            Ok(d) => d,
            Err(rc) => return Ok(Err(rc)),
        }
    };
    engine.push_tag(tag)?;
    let scope = TagScope(&engine);
    let addr = engine.malloc(size, device, 0)?;
    drop(scope);
    OURS.lock().insert(addr, engine);
    Ok(Ok(addr))
}

/// The calling thread's device for a routed allocation of `size` bytes on the CUDA driver, or the error code the
/// allocation returns. Without a `cudaGetDevice` in the process (`NO_GET_DEVICE`) there is no device to take:
/// guessing one would put the memory of a thread that uses device 1 on device 0, so the allocation fails with
/// cudaErrorInitializationError and the reason is recorded (`errors()`, or `ffi_errors()` without a CUDA engine).
fn runtime_device(
    size: usize,
    current_device: impl FnOnce() -> std::result::Result<i32, c_int>,
) -> std::result::Result<i32, c_int> {
    match current_device() {
        Err(NO_GET_DEVICE) => {
            let why = Error::InvalidState(
                "the process has no cudaGetDevice (no CUDA runtime loaded, or one that does not export it), so the \
                 calling thread's device is unknown; the allocation is refused rather than put on a guessed device"
                    .into(),
            );
            ffi::record(&format!("cudaMalloc({size}) routed to cumem_rs"), &why);
            Err(CUDA_ERROR_INITIALIZATION)
        }
        other => other,
    }
}

/// Free `addr` if the hook handed it out: Ok(false) when it is not ours. The pointer is forgotten whatever the
/// engine says (the caller forgets it too), as `my_free` does.
pub fn free_routed(addr: u64) -> Result<bool> {
    let Some(engine) = OURS.lock().remove(&addr) else {
        return Ok(false);
    };
    engine.free_or_queue(addr)?;
    Ok(true)
}

extern "C" fn malloc_hook(ptr: *mut *mut c_void, size: usize, current_device: DeviceFn) -> c_int {
    let routed = catch_unwind(routed_tag).unwrap_or(None);
    let Some(tag) = routed else {
        return NOT_OURS;
    };
    if ptr.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if size == 0 {
        // The runtime's answer to a zero-byte cudaMalloc: success and a null pointer.
        // SAFETY: ptr is non-null and points to the caller's `void *` out-parameter.
        unsafe { *ptr = std::ptr::null_mut() };
        return CUDA_SUCCESS;
    }
    let device = || {
        let mut device: c_int = 0;
        // SAFETY: the library's current_device writes one int through the pointer it is given.
        match unsafe { current_device(&mut device) } {
            CUDA_SUCCESS => Ok(device),
            rc => Err(rc),
        }
    };
    match guarded(|| malloc_routed(&tag, size, device)) {
        Ok(Err(rc)) => rc,
        Ok(Ok(addr)) => {
            // SAFETY: as above, ptr is the caller's non-null out-parameter.
            unsafe { *ptr = addr as *mut c_void };
            CUDA_SUCCESS
        }
        Err(e) => {
            // Running out of memory is the caller's to report (torch raises OutOfMemoryError); anything else
            // is also recorded.
            if !e.is_out_of_memory() {
                ffi::record(&format!("cudaMalloc({size}) routed to cumem_rs"), &e);
            }
            CUDA_ERROR_MEMORY_ALLOCATION
        }
    }
}

extern "C" fn free_hook(ptr: *mut c_void) -> c_int {
    match guarded(|| free_routed(ptr as u64)) {
        Ok(true) => CUDA_SUCCESS,
        Ok(false) => NOT_OURS,
        Err(e) => {
            // The pointer is gone for the caller either way; a failure to release is recorded, not fatal.
            ffi::record(&format!("cudaFree({ptr:p}) routed to cumem_rs"), &e);
            CUDA_SUCCESS
        }
    }
}

/// The runtime's other allocators the library reports (`unrouted_hook`), in `UNROUTED`'s order.
pub const UNROUTED_CALLS: [&str; 3] = ["cudaMallocAsync", "cudaFreeAsync", "cudaMallocManaged"];

/// Calls and bytes of one of `UNROUTED_CALLS` made while routing was on, and whether it was logged.
struct Unrouted {
    calls: AtomicU64,
    bytes: AtomicU64,
    warned: AtomicBool,
}

static UNROUTED: [Unrouted; 3] = [const {
    Unrouted {
        calls: AtomicU64::new(0),
        bytes: AtomicU64::new(0),
        warned: AtomicBool::new(false),
    }
}; 3];

/// Calls of the runtime's other allocators made while routing was on, and their bytes (process-wide).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UnroutedCounts {
    pub calls: u64,
    pub bytes: u64,
}

/// The counts of `UNROUTED_CALLS`, each by name, since the process started.
pub fn unrouted_by_call() -> Vec<(&'static str, UnroutedCounts)> {
    UNROUTED_CALLS
        .iter()
        .zip(&UNROUTED)
        .map(|(name, u)| {
            let c = UnroutedCounts {
                calls: u.calls.load(Ordering::Relaxed),
                bytes: u.bytes.load(Ordering::Relaxed),
            };
            (*name, c)
        })
        .collect()
}

/// The counts of all of `UNROUTED_CALLS` together.
pub fn unrouted_counts() -> UnroutedCounts {
    unrouted_by_call()
        .into_iter()
        .fold(UnroutedCounts::default(), |a, (_, c)| UnroutedCounts {
            calls: a.calls + c.calls,
            bytes: a.bytes + c.bytes,
        })
}

/// A successful call of `call` (one of `UNROUTED_CALLS`), `size` bytes, forwarded to the runtime: counted and,
/// the first time for its name, logged, when this thread's cudaMalloc would have been routed now (outside
/// regions and TMS_INIT_ENABLE the runtime's memory is expected). Whether it was counted.
pub fn note_unrouted(call: &str, size: usize) -> bool {
    let Some(tag) = routed_tag() else {
        return false;
    };
    let Some(u) = UNROUTED_CALLS
        .iter()
        .position(|c| *c == call)
        .map(|i| &UNROUTED[i])
    else {
        return false;
    };
    u.calls.fetch_add(1, Ordering::Relaxed);
    u.bytes.fetch_add(size as u64, Ordering::Relaxed);
    if !u.warned.swap(true, Ordering::Relaxed) {
        log::warn!(
            "{call} was called while cudaMalloc is routed to cumem_rs (tag {tag:?}): the preload hook forwards it \
             to the CUDA runtime, so that memory is not cumem_rs's and is neither paused nor backed up (warned \
             once per call name; every such call is counted in stats()['preload_unrouted_calls'] and \
             ['preload_unrouted_bytes'])"
        );
    }
    true
}

extern "C" fn unrouted_hook(call: *const c_char, size: usize) {
    if call.is_null() {
        return;
    }
    // SAFETY: the library passes one of its NUL-terminated string literals.
    let name = unsafe { CStr::from_ptr(call) };
    if let Ok(name) = name.to_str() {
        // Never unwinds into C; a failure here only loses a count.
        let _ = catch_unwind(|| note_unrouted(name, size));
    }
}

/// The tags of a `tms_pause`/`tms_resume`: NULL or "" means every tag (torch_memory_saver's None).
fn tag_arg(tag: *const c_char) -> Result<Option<String>> {
    if tag.is_null() {
        return Ok(None);
    }
    // SAFETY: a non-null tag is the caller's NUL-terminated C string, valid for the call.
    let text = unsafe { CStr::from_ptr(tag) };
    let text = text
        .to_str()
        .map_err(|_| Error::invalid("tag must be UTF-8"))?;
    Ok((!text.is_empty()).then(|| text.to_owned()))
}

/// Pause (or resume) `tag` of the target engine, None: every tag.
pub fn pause_routed(tag: Option<&str>, resume: bool) -> Result<()> {
    let engine = target()?;
    let tags = tag.map(|t| [t]);
    let tags = tags.as_ref().map(|t| &t[..]);
    if resume {
        engine.resume(tags)?;
    } else {
        engine.pause(tags)?;
    }
    Ok(())
}

fn pause_or_resume(tag: *const c_char, resume: bool) -> c_int {
    let what = if resume { "tms_resume" } else { "tms_pause" };
    match guarded(|| pause_routed(tag_arg(tag)?.as_deref(), resume)) {
        Ok(()) => CUDA_SUCCESS,
        Err(e) => {
            ffi::record(what, &e);
            match e {
                Error::OutOfMemory { .. } => CUDA_ERROR_MEMORY_ALLOCATION,
                Error::InvalidArgument(_) => CUDA_ERROR_INVALID_VALUE,
                _ => CUDA_ERROR_UNKNOWN,
            }
        }
    }
}

extern "C" fn pause_hook(tag: *const c_char) -> c_int {
    pause_or_resume(tag, false)
}

extern "C" fn resume_hook(tag: *const c_char) -> c_int {
    pause_or_resume(tag, true)
}

#[cfg(test)]
mod tests {
    //! The hooks called as the library calls them, over a simulated engine. One test: the routing state is
    //! process-wide, so the steps must not interleave with another test's.

    use super::*;
    use crate::driver::sim::{SimConfig, SimDriver};

    unsafe extern "C" fn device_zero(device: *mut c_int) -> c_int {
        // SAFETY: the hook passes a pointer to its own int.
        unsafe { *device = 0 };
        CUDA_SUCCESS
    }

    fn malloc(size: usize) -> (c_int, u64) {
        let mut p: *mut c_void = std::ptr::null_mut();
        let rc = malloc_hook(&mut p, size, device_zero);
        (rc, p as u64)
    }

    #[test]
    fn hooks_route_by_region_init_enable_and_disable() {
        let sim = Arc::new(SimDriver::new(SimConfig::default()).unwrap());
        let engine = Arc::new(Engine::new(sim).unwrap());
        set_target(Some(engine.clone()));

        assert_eq!(malloc(4096).0, NOT_OURS, "outside any region: forwarded");
        push_region("weights").unwrap();
        let (rc, w) = malloc(4096);
        assert_eq!(rc, CUDA_SUCCESS);
        let infos = engine.allocations().unwrap();
        assert_eq!(infos.len(), 1);
        assert_eq!((infos[0].addr, &*infos[0].tag), (w, "weights"));
        push_disabled();
        assert_eq!(
            malloc(4096).0,
            NOT_OURS,
            "disable() inside a region: forwarded"
        );
        pop().unwrap();
        pop().unwrap();
        assert!(pop().is_err(), "an unmatched pop is refused");

        set_init_enable(true);
        let (rc, d) = std::thread::spawn(|| malloc(4096)).join().unwrap();
        assert_eq!(rc, CUDA_SUCCESS, "TMS_INIT_ENABLE routes every thread");
        let tag = |a: u64| {
            let infos = engine.allocations().unwrap();
            infos
                .iter()
                .find(|i| i.addr == a)
                .map(|i| i.tag.to_string())
        };
        assert_eq!(tag(d).as_deref(), Some(INIT_TAG));
        push_disabled();
        assert_eq!(malloc(4096).0, NOT_OURS);
        pop().unwrap();
        set_init_enable(false);

        engine.write(w, &[7u8; 4096]).unwrap();
        assert_eq!(pause_hook(c"weights".as_ptr()), CUDA_SUCCESS);
        assert_eq!(resume_hook(std::ptr::null()), CUDA_SUCCESS);
        assert_eq!(engine.read(w, 4096).unwrap(), vec![7u8; 4096]);
        let bad = [0xffu8, 0];
        assert_eq!(
            pause_hook(bad.as_ptr().cast()),
            CUDA_ERROR_INVALID_VALUE,
            "a tag that is not UTF-8"
        );

        assert_eq!(
            free_hook(0x1000 as *mut c_void),
            NOT_OURS,
            "not ours: forwarded"
        );
        assert_eq!(free_hook(w as *mut c_void), CUDA_SUCCESS);
        assert_eq!(free_hook(w as *mut c_void), NOT_OURS, "freed once only");
        assert_eq!(free_hook(d as *mut c_void), CUDA_SUCCESS);
        assert_eq!(live_pointers(), 0);
        assert!(engine.allocations().unwrap().is_empty());

        push_region("x").unwrap();
        let mut p: *mut c_void = std::ptr::dangling_mut();
        assert_eq!(malloc_hook(&mut p, 0, device_zero), CUDA_SUCCESS);
        assert!(
            p.is_null(),
            "zero bytes: success and a null pointer, as the runtime does"
        );
        assert_eq!(
            malloc_hook(std::ptr::null_mut(), 8, device_zero),
            CUDA_ERROR_INVALID_VALUE
        );
        engine.close().unwrap();
        assert_eq!(
            malloc(4096).0,
            CUDA_ERROR_MEMORY_ALLOCATION,
            "a closed engine fails the call cleanly"
        );
        pop().unwrap();

        // Without cudaGetDevice there is no device to guess: refused, recorded. Other answers pass through.
        let no_device = runtime_device(4096, || Err(NO_GET_DEVICE));
        assert_eq!(no_device, Err(CUDA_ERROR_INITIALIZATION));
        // Recorded where ffi::record puts it: the process-wide CUDA engine's errors() when one exists.
        let mut recorded = ffi::ffi_errors();
        recorded.extend(
            global::existing_cuda_engine()
                .map(|e| e.errors())
                .unwrap_or_default(),
        );
        assert!(
            recorded
                .iter()
                .any(|e| e.contains("cudaMalloc(4096)") && e.contains("no cudaGetDevice")),
            "{recorded:?}"
        );
        assert_eq!(runtime_device(1, || Ok(3)), Ok(3));
        assert_eq!(runtime_device(1, || Err(100)), Err(100));

        // The runtime's other allocators: counted only where routing is on, by name, with their bytes.
        let before = unrouted_counts();
        assert!(
            !note_unrouted("cudaMallocAsync", 1000),
            "not routed: the runtime's, as expected"
        );
        push_region("r").unwrap();
        assert!(note_unrouted("cudaMallocAsync", 1000));
        assert!(note_unrouted("cudaMallocManaged", 24));
        assert!(note_unrouted("cudaFreeAsync", 0));
        assert!(
            !note_unrouted("cudaMallocPitch", 5),
            "not a name the library reports"
        );
        pop().unwrap();
        let after = unrouted_counts();
        assert_eq!(
            (after.calls - before.calls, after.bytes - before.bytes),
            (3, 1024)
        );
        set_target(None);
    }
}
