//! Python values in and out of the bindings: argument checks (each names the argument and the problem) and the
//! dicts that reports, policies and stats come back as.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyInt, PyString};

use crate::driver::Op;
use crate::engine::{Report, TagPolicy};

/// The caller's stream for `malloc`, which `free` asks whether it is being captured into a CUDA graph. A raw
/// integer handle cannot be checked, and a wrong one makes the driver crash the process, so only 0 / None (no
/// stream: free synchronizes the device) or a `torch.cuda.Stream` (whose handle we read; torch never destroys
/// those streams) are taken. `torch.cuda.ExternalStream`, which wraps any integer, is refused like an int.
pub(super) fn stream_arg(py: Python<'_>, obj: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(0);
    };
    if obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyBool>() {
        let v = int_arg(obj, "stream")?;
        if v == 0 {
            return Ok(0);
        }
        return Err(PyValueError::new_err(format!(
            "stream {v:#x}: Allocator.malloc takes no raw stream handle (it cannot be checked, and a wrong one \
             would crash the process at free); pass 0 or None, or a torch.cuda.Stream"
        )));
    }
    let torch_stream = py
        .import("sys")?
        .getattr("modules")?
        .get_item("torch.cuda")
        .and_then(|m| m.getattr("Stream"))
        .ok();
    if torch_stream.is_some_and(|cls| obj.get_type().is(&cls)) {
        let handle = obj.getattr("cuda_stream")?;
        return u64::try_from(int_arg(&handle, "stream.cuda_stream")?)
            .map_err(|_| PyValueError::new_err("stream.cuda_stream is not a stream handle"));
    }
    Err(PyTypeError::new_err(format!(
        "stream must be 0, None or a torch.cuda.Stream, not {}",
        type_name(obj)
    )))
}

pub(super) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// An int argument (bools refused). Ints beyond u64 saturate, so absurd sizes fail as out-of-memory.
fn int_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<i128> {
    if !obj.is_instance_of::<PyInt>() || obj.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be an int, not {}",
            type_name(obj)
        )));
    }
    Ok(obj.extract::<i128>().unwrap_or_else(|_| {
        if obj.lt(0).unwrap_or(false) {
            i128::MIN
        } else {
            i128::MAX
        }
    }))
}

pub(super) fn size_arg(obj: &Bound<'_, PyAny>, what: &str, allow_zero: bool) -> PyResult<usize> {
    let v = int_arg(obj, what)?;
    if v < 0 || (v == 0 && !allow_zero) {
        let need = if allow_zero {
            "non-negative"
        } else {
            "positive"
        };
        return Err(PyValueError::new_err(format!(
            "{what} must be {need}, got {v}"
        )));
    }
    Ok(usize::try_from(v).unwrap_or(usize::MAX))
}

pub(super) fn address_arg(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    let v = int_arg(obj, "address")?;
    u64::try_from(v)
        .map_err(|_| PyValueError::new_err(format!("address {v} is not a valid device address")))
}

pub(super) fn tag_arg(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    let s = obj
        .cast::<PyString>()
        .map_err(|_| PyTypeError::new_err(format!("tag must be a str, not {}", type_name(obj))))?
        .to_string();
    if s.is_empty() {
        return Err(PyValueError::new_err("tag must be a non-empty str"));
    }
    Ok(s)
}

/// A str (one tag) or an iterable of str.
pub(super) fn tags_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    if obj.is_instance_of::<PyString>() {
        return Ok(vec![tag_arg(obj)?]);
    }
    let iter = obj.try_iter().map_err(|_| {
        PyTypeError::new_err(format!(
            "tags must be a str or a sequence of str, not {}",
            type_name(obj)
        ))
    })?;
    iter.map(|t| tag_arg(&t?)).collect()
}

/// An engine call over optional tags (None: all), without the GIL, and its report as a dict.
pub(super) fn tags_report<'py>(
    py: Python<'py>,
    tags: Option<&Bound<'py, PyAny>>,
    call: impl FnOnce(Option<&[String]>) -> crate::error::Result<Report> + Send,
) -> PyResult<Bound<'py, PyDict>> {
    let tags = tags.map(tags_arg).transpose()?;
    let r = py.detach(|| call(tags.as_deref()))?;
    report_dict(py, &r)
}

pub(super) fn report_dict<'py>(py: Python<'py>, r: &Report) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("allocations", r.allocations)?;
    d.set_item("copied_bytes", r.copied_bytes)?;
    d.set_item("discarded_bytes", r.discarded_bytes)?;
    d.set_item("zeroed_bytes", r.zeroed_bytes)?;
    d.set_item("skipped_bytes", r.skipped_bytes)?;
    d.set_item("chunks_checked", r.chunks_checked)?;
    d.set_item("fingerprint_seconds", r.fingerprint_seconds)?;
    d.set_item("seconds", r.seconds)?;
    d.set_item(
        "gb_per_s",
        if r.seconds > 0.0 {
            r.copied_bytes as f64 / r.seconds / 1e9
        } else {
            0.0
        },
    )?;
    Ok(d)
}

pub(super) fn policy_dict<'py>(py: Python<'py>, p: &TagPolicy) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("backup", p.backup)?;
    d.set_item("wake_fill", p.wake_fill.name())?;
    Ok(d)
}

pub(super) fn fault_op(name: &str) -> PyResult<Op> {
    Op::parse(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unknown fault op {name:?}; expected one of {:?}",
            super::fault_ops()
        ))
    })
}

/// Which call of an op a fault hits: a positive int that fits in 64 bits (the driver refuses one so far
/// ahead that the call counter could never reach it).
pub(super) fn nth_arg(v: i128) -> PyResult<u64> {
    u64::try_from(v).ok().filter(|n| *n > 0).ok_or_else(|| {
        PyValueError::new_err(format!("nth must be at least 1 and below 2**64, got {v}"))
    })
}
