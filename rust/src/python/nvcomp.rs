//! nvCOMP for Python: the hand-over of the installed wheels' library paths (before the CUDA driver loads), what
//! codec is active for `python -m cumem_rs info`, and the codec's round-trip diagnostic for the GPU self-check.

use pyo3::prelude::*;

use super::guard;
use crate::driver::codec::DataKind;
use crate::driver::{codec_round_trip, nvcomp};
use crate::error::Error;
use crate::global;

/// Remember the installed nvCOMP wheels as (CUDA major, library path); heeded when the CUDA driver loads.
#[pyfunction]
fn set_nvcomp_wheels(wheels: Vec<(u32, String)>) -> PyResult<()> {
    guard(|| {
        nvcomp::set_wheel_candidates(wheels.into_iter().map(|(m, p)| (m, p.into())).collect());
        Ok(())
    })
}

/// (active, text): the CUDA backend's codec and where it comes from, or why there is none. Never loads the CUDA
/// driver itself.
#[pyfunction]
fn cuda_codec_status() -> PyResult<(bool, String)> {
    guard(|| {
        let Some(engine) = global::existing_cuda_engine() else {
            return Ok((false, "the CUDA backend is not loaded".into()));
        };
        if let Some(codec) = engine.driver().codec() {
            return Ok((true, codec.describe()));
        }
        let why = match nvcomp::outcome() {
            Some(Err(why)) => why.to_string(),
            _ => "switched off by CUMEM_RS_COMPRESS".to_string(),
        };
        Ok((false, why))
    })
}

/// Device bytes the CUDA codec holds on `device` (its staging ring; 0 before the device was first used).
#[pyfunction]
fn cuda_codec_device_bytes(device: i32) -> PyResult<usize> {
    guard(|| {
        let bytes = global::existing_cuda_engine()
            .and_then(|e| e.driver().codec().map(|c| c.own_device_bytes(device)));
        Ok(bytes.unwrap_or(0))
    })
}

/// Diagnostic: compress `nbytes` at device address `src` through the CUDA codec and restore them at `dst`;
/// returns (stored bytes, raw) per 2 MiB range. `kind` is "bytes", "bits8" or "bits16".
#[pyfunction]
#[pyo3(signature = (device, src, dst, nbytes, kind = "bits16"))]
fn _codec_round_trip(
    py: Python<'_>,
    device: i32,
    src: u64,
    dst: u64,
    nbytes: usize,
    kind: &str,
) -> PyResult<Vec<(usize, bool)>> {
    guard(|| {
        let kind = match kind {
            "bytes" => DataKind::Bytes,
            "bits8" => DataKind::Bits8,
            "bits16" => DataKind::Bits16,
            other => {
                return Err(Error::invalid(format!(
                    "kind must be 'bytes', 'bits8' or 'bits16', not {other:?}"
                ))
                .into())
            }
        };
        let stored = py.detach(|| {
            let engine = global::cuda_engine()?;
            codec_round_trip::round_trip(&**engine.driver(), device, src, dst, nbytes, kind)
        })?;
        Ok(stored.into_iter().map(|s| (s.len, s.raw)).collect())
    })
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(set_nvcomp_wheels, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_codec_status, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_codec_device_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(_codec_round_trip, m)?)?;
    Ok(())
}
