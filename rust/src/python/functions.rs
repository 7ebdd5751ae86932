//! The module's functions (not methods of `Allocator`): CUDA availability, the FFI's errors, the log queue and the
//! host reference fingerprint.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::convert::{size_arg, type_name};
use super::errors::{type_error, value_error};
use super::guard;
use crate::driver::cuda;
use crate::{ffi, global};

/// The host reference fingerprint of `data` (a multiple of 16 bytes) in chunks of `chunk` bytes: the same
/// values the GPU kernel computes on the same bytes.
#[pyfunction]
fn fingerprint_bytes(
    data: &Bound<'_, PyAny>,
    chunk: &Bound<'_, PyAny>,
) -> PyResult<Vec<(u64, u64)>> {
    guard(|| {
        let data = data
            .cast::<PyBytes>()
            .map_err(|_| type_error(format!("data must be bytes, not {}", type_name(data))))?
            .as_bytes();
        let chunk = size_arg(chunk, "chunk", false)?;
        if !chunk.is_multiple_of(crate::fingerprint::WORD)
            || !data.len().is_multiple_of(crate::fingerprint::WORD)
        {
            return Err(value_error(format!(
                "chunk and len(data) must be multiples of 16, got chunk {chunk} and len(data) {}",
                data.len()
            )));
        }
        Ok(crate::fingerprint::chunks(data.len(), chunk)
            .map(|(off, len)| {
                let [a, b] = crate::fingerprint::fingerprint(&data[off..off + len]);
                (a, b)
            })
            .collect())
    })
}

/// The switch `name` of the process environment, read as the Rust side reads every switch (`crate::env::flag`:
/// 1/true/yes/on, 0/false/no/off; unset, empty or unreadable: `default`), so Python-side switches spell the same.
#[pyfunction]
fn env_flag(name: &str, default: bool) -> PyResult<bool> {
    guard(|| Ok(crate::env::flag(name, default)))
}

/// True when libcuda loads and reports at least one VMM-capable device. Never raises.
#[pyfunction]
fn cuda_available(py: Python<'_>) -> bool {
    guard(|| Ok(cuda::library_present() && py.detach(global::cuda_engine).is_ok())).unwrap_or(false)
}

#[pyfunction]
fn is_cuda_allocator_ready() -> PyResult<bool> {
    guard(|| Ok(global::existing_cuda_engine().is_some()))
}

/// Errors recorded by my_malloc/my_free when no CUDA allocator existed to record them.
#[pyfunction]
fn ffi_errors() -> PyResult<Vec<String>> {
    guard(|| Ok(ffi::ffi_errors()))
}

/// Rust-side log records queued since the last call, oldest first: (Python logging level, message).
#[pyfunction]
fn drain_logs() -> PyResult<Vec<(u32, String)>> {
    guard(|| Ok(crate::logbuf::drain()))
}

/// Test hook: the next my_malloc or my_free call panics inside (the panic must be caught there).
#[pyfunction]
fn _panic_in_next_ffi_call(on: bool) -> PyResult<()> {
    guard(|| {
        ffi::set_panic_next_call(on);
        Ok(())
    })
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(env_flag, m)?)?;
    m.add_function(wrap_pyfunction!(is_cuda_allocator_ready, m)?)?;
    m.add_function(wrap_pyfunction!(ffi_errors, m)?)?;
    m.add_function(wrap_pyfunction!(drain_logs, m)?)?;
    m.add_function(wrap_pyfunction!(fingerprint_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(_panic_in_next_ffi_call, m)?)?;
    Ok(())
}
