//! The Python face of the preload hook (`crate::preload`): the library's bytes, its registration, where routed
//! allocations go and this thread's routing. Thin wrappers: `cumem_rs._preload` and `memory_saver` hold the
//! logic of when to call them.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::convert::{bool_arg, tag_arg};
use super::{guard, Allocator};
use crate::preload;

/// The preload hook library (a shared object) to write to a file for LD_PRELOAD.
#[pyfunction]
fn preload_library(py: Python<'_>) -> Bound<'_, PyBytes> {
    PyBytes::new(py, preload::LIBRARY)
}

/// Install the hooks in the preload library if it is loaded in this process; False when it is not.
#[pyfunction]
fn preload_register() -> PyResult<bool> {
    guard(|| Ok(preload::register()?))
}

/// Whether the hooks are installed in a preloaded library in this process.
#[pyfunction]
fn preload_registered() -> bool {
    preload::is_registered()
}

/// Route allocations of the hook to `allocator` (None: the process-wide CUDA allocator).
#[pyfunction]
#[pyo3(signature = (allocator))]
fn preload_route_to(allocator: Option<&Bound<'_, Allocator>>) -> PyResult<()> {
    guard(|| {
        preload::set_target(allocator.map(|a| a.get().engine.clone()));
        Ok(())
    })
}

/// TMS_INIT_ENABLE: route every thread's allocations outside regions (under the default tag).
#[pyfunction]
fn preload_set_init_enable(on: &Bound<'_, PyAny>) -> PyResult<()> {
    guard(|| {
        preload::set_init_enable(bool_arg(on, "on")?);
        Ok(())
    })
}

/// Whether TMS_INIT_ENABLE's routing is on.
#[pyfunction]
fn preload_init_enable() -> bool {
    preload::init_enable()
}

/// Enter a region on this thread: its cudaMalloc calls are routed under `tag` until `preload_pop`.
#[pyfunction]
fn preload_push_region(tag: &Bound<'_, PyAny>) -> PyResult<()> {
    guard(|| Ok(preload::push_region(&tag_arg(tag)?)?))
}

/// Enter disable() on this thread: its cudaMalloc calls go to the runtime until `preload_pop`.
#[pyfunction]
fn preload_push_disabled() -> PyResult<()> {
    guard(|| {
        preload::push_disabled();
        Ok(())
    })
}

/// Leave this thread's innermost region or disable().
#[pyfunction]
fn preload_pop() -> PyResult<()> {
    guard(|| Ok(preload::pop()?))
}

/// The tag a cudaMalloc on this thread would get now; None: it would go to the runtime.
#[pyfunction]
fn preload_routed_tag() -> Option<String> {
    preload::routed_tag().map(|t| t.to_string())
}

/// How many pointers the hook handed out that are not freed yet.
#[pyfunction]
fn preload_live_pointers() -> usize {
    preload::live_pointers()
}

pub(super) fn add_functions(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(preload_library, m)?)?;
    m.add_function(wrap_pyfunction!(preload_register, m)?)?;
    m.add_function(wrap_pyfunction!(preload_registered, m)?)?;
    m.add_function(wrap_pyfunction!(preload_route_to, m)?)?;
    m.add_function(wrap_pyfunction!(preload_set_init_enable, m)?)?;
    m.add_function(wrap_pyfunction!(preload_init_enable, m)?)?;
    m.add_function(wrap_pyfunction!(preload_push_region, m)?)?;
    m.add_function(wrap_pyfunction!(preload_push_disabled, m)?)?;
    m.add_function(wrap_pyfunction!(preload_pop, m)?)?;
    m.add_function(wrap_pyfunction!(preload_routed_tag, m)?)?;
    m.add_function(wrap_pyfunction!(preload_live_pointers, m)?)?;
    Ok(())
}
