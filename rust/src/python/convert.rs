//! Python arguments into Rust values. Every check names the argument and shows the value given; a wrong type
//! raises `CumemTypeError`, a value out of range `CumemValueError` (see errors.rs), never PyO3's own
//! `OverflowError` or a bare `TypeError`. Integers go through one conversion (`int_arg`) that keeps the exact
//! value, so nothing is silently saturated or wrapped on the way to the engine.
//!
//! Arguments with a default are converted by PyO3 through `#[pyo3(from_py_with = ...)]`, which hands over the
//! object alone: the functions at the end of this file exist once per argument name for that reason.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyFloat, PyInt, PyString};

use super::errors::{type_error, value_error, CumemOutOfMemoryError};
use crate::driver::sim::FAULT_ERRORS;
use crate::driver::Op;
use crate::engine::{Compress, WakeFill};

const MAX_U64: i128 = u64::MAX as i128;

pub(super) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// An int argument, exactly as given: `value` is None when it does not even fit in 128 bits (then it is out of
/// every range below, and `text` still shows it).
struct IntArg {
    value: Option<i128>,
    text: String,
}

impl IntArg {
    /// The value when it lies in `lo..=hi`, else a CumemValueError "`what` must be `need`, got `text`".
    fn within(&self, what: &str, lo: i128, hi: i128, need: &str) -> PyResult<i128> {
        self.value
            .filter(|v| (lo..=hi).contains(v))
            .ok_or_else(|| value_error(format!("{what} must be {need}, got {}", self.text)))
    }

    fn is_negative(&self) -> bool {
        self.text.starts_with('-')
    }
}

/// The one integer conversion: a Python int, or an integer type that converts losslessly through `__index__`
/// (numpy's, as PyO3's own conversion accepted), with its exact value. Bools are refused: `True` is not a size.
fn int_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<IntArg> {
    let not_int = || type_error(format!("{what} must be an int, not {}", type_name(obj)));
    if obj.is_instance_of::<PyBool>() {
        return Err(not_int());
    }
    let int = if obj.is_instance_of::<PyInt>() {
        obj.clone()
    } else if obj.hasattr("__index__")? {
        let index = obj.py().import("operator")?.getattr("index")?;
        index.call1((obj,)).map_err(|_| not_int())?
    } else {
        return Err(not_int());
    };
    Ok(IntArg {
        value: int.extract::<i128>().ok(),
        text: int.str()?.to_string(),
    })
}

/// A byte count: positive (or, with `allow_zero`, non-negative) and below 2**64.
pub(super) fn size_arg(obj: &Bound<'_, PyAny>, what: &str, allow_zero: bool) -> PyResult<usize> {
    let n = int_arg(obj, what)?;
    let (lo, need) = if allow_zero {
        (0, "non-negative and below 2**64")
    } else {
        (1, "positive and below 2**64")
    };
    let v = n.within(what, lo, MAX_U64, need)?;
    usize::try_from(v).map_err(|_| value_error(format!("{what} must be {need}, got {}", n.text)))
}

/// The size of a `malloc`: like `size_arg`, except that a size beyond 64 bits is out-of-memory (no device can
/// ever hold it, the same answer as for 2**63) rather than a bad value. The message shows the size asked for.
pub(super) fn malloc_size_arg(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    let n = int_arg(obj, "size")?;
    if !n.is_negative() && n.value.is_none_or(|v| v > MAX_U64) {
        return Err(CumemOutOfMemoryError::new_err(format!(
            "out of memory: malloc of {} bytes (more than 2**64: no device can hold it)",
            n.text
        )));
    }
    size_arg(obj, "size", false)
}

pub(super) fn address_arg(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    let n = int_arg(obj, "address")?;
    n.value
        .and_then(|v| u64::try_from(v).ok())
        .ok_or_else(|| value_error(format!("address {} is not a valid device address", n.text)))
}

/// A device index. Negative and unknown indices that fit in 32 bits are left to the engine, which knows the
/// device count and says it; anything beyond 32 bits names no device of any machine.
pub(super) fn device_arg(obj: &Bound<'_, PyAny>) -> PyResult<i32> {
    let n = int_arg(obj, "device")?;
    n.value.and_then(|v| i32::try_from(v).ok()).ok_or_else(|| {
        value_error(format!(
            "device {} does not exist (not a 32-bit device index)",
            n.text
        ))
    })
}

/// Which call of an op a fault hits: a positive int that fits in 64 bits (the driver refuses one so far
/// ahead that the call counter could never reach it).
pub(super) fn nth_arg(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    let v = int_arg(obj, "nth")?.within("nth", 1, MAX_U64, "at least 1 and below 2**64")?;
    Ok(v as u64)
}

pub(super) fn bool_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<bool> {
    obj.cast::<PyBool>()
        .map(|b| b.is_true())
        .map_err(|_| type_error(format!("{what} must be a bool, not {}", type_name(obj))))
}

pub(super) fn str_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<String> {
    obj.cast::<PyString>()
        .map(|s| s.to_string())
        .map_err(|_| type_error(format!("{what} must be a str, not {}", type_name(obj))))
}

/// A float argument; ints are taken too (`1` seconds is `1.0` seconds), bools are not.
fn float_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<f64> {
    if obj.is_instance_of::<PyBool>()
        || !(obj.is_instance_of::<PyFloat>() || obj.is_instance_of::<PyInt>())
    {
        return Err(type_error(format!(
            "{what} must be a float, not {}",
            type_name(obj)
        )));
    }
    obj.extract::<f64>()
        .map_err(|_| value_error(format!("{what} is too large for a float, got {}", obj)))
}

/// Bytes for `write` and `fingerprint_bytes`: `bytes`, or any sequence of ints in 0..=255 (a bytearray, a list).
pub(super) fn bytes_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u8>> {
    obj.cast::<PyBytes>()
        .map(|b| b.as_bytes().to_vec())
        .or_else(|_| obj.extract::<Vec<u8>>())
        .map_err(|_| type_error(format!("{what} must be bytes, not {}", type_name(obj))))
}

/// The caller's stream for `malloc`, which `free` asks whether it is being captured into a CUDA graph. A raw
/// integer handle cannot be checked, and a wrong one makes the driver crash the process, so only 0 / None (no
/// stream: free synchronizes the device) or a `torch.cuda.Stream` (whose handle we read; torch never destroys
/// those streams) are taken. `torch.cuda.ExternalStream`, which wraps any integer, is refused like an int.
pub(super) fn stream_arg(py: Python<'_>, obj: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(0);
    };
    if obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyBool>() {
        let n = int_arg(obj, "stream")?;
        if n.value == Some(0) {
            return Ok(0);
        }
        let shown = n
            .value
            .map_or_else(|| n.text.clone(), |v| format!("{v:#x}"));
        return Err(value_error(format!(
            "stream {shown}: Allocator.malloc takes no raw stream handle (it cannot be checked, and a wrong one \
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
        return int_arg(&handle, "stream.cuda_stream")?
            .value
            .and_then(|v| u64::try_from(v).ok())
            .ok_or_else(|| value_error("stream.cuda_stream is not a stream handle"));
    }
    Err(type_error(format!(
        "stream must be 0, None or a torch.cuda.Stream, not {}",
        type_name(obj)
    )))
}

pub(super) fn tag_arg(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    let s = str_arg(obj, "tag")?;
    if s.is_empty() {
        return Err(value_error("tag must be a non-empty str"));
    }
    Ok(s)
}

/// A str (one tag) or an iterable of str.
pub(super) fn tags_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    if obj.is_instance_of::<PyString>() {
        return Ok(vec![tag_arg(obj)?]);
    }
    let iter = obj.try_iter().map_err(|_| {
        type_error(format!(
            "tags must be a str or a sequence of str, not {}",
            type_name(obj)
        ))
    })?;
    iter.map(|t| tag_arg(&t?)).collect()
}

pub(super) fn fault_ops() -> Vec<&'static str> {
    (Op::ALL.iter().filter(|o| o.fails_its_call()))
        .map(|o| o.name())
        .collect()
}

/// The fault ops whose call succeeds with wrong results instead of failing (`CORRUPTING_FAULT_OPS`).
pub(super) fn corrupting_fault_ops() -> Vec<&'static str> {
    (Op::ALL.iter().filter(|o| !o.fails_its_call()))
        .map(|o| o.name())
        .collect()
}

pub(super) fn fault_op(obj: &Bound<'_, PyAny>) -> PyResult<Op> {
    let name = str_arg(obj, "op")?;
    Op::parse(&name).ok_or_else(|| {
        value_error(format!(
            "unknown fault op {name:?}; expected one of {:?} or {:?}",
            fault_ops(),
            corrupting_fault_ops()
        ))
    })
}

// ----- `from_py_with` converters, one per argument name -----------------------------------------------------

pub(super) fn device(obj: &Bound<'_, PyAny>) -> PyResult<i32> {
    device_arg(obj)
}

pub(super) fn optional_device(obj: &Bound<'_, PyAny>) -> PyResult<Option<i32>> {
    (!obj.is_none()).then(|| device_arg(obj)).transpose()
}

pub(super) fn nth(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    nth_arg(obj)
}

pub(super) fn background(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    bool_arg(obj, "background")
}

/// The name of a fault error kind (one of `FAULT_ERRORS`).
pub(super) fn fault_error(obj: &Bound<'_, PyAny>) -> PyResult<&'static str> {
    let name = str_arg(obj, "error")?;
    FAULT_ERRORS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(n, _)| *n)
        .ok_or_else(|| {
            value_error(format!(
                "unknown fault error {name:?}; expected one of {:?}",
                FAULT_ERRORS.iter().map(|(n, _)| *n).collect::<Vec<_>>()
            ))
        })
}

/// A wake fill name, checked (the engine parses it again from the name returned).
pub(super) fn wake_fill(obj: &Bound<'_, PyAny>) -> PyResult<&'static str> {
    Ok(WakeFill::parse(&str_arg(obj, "wake_fill")?)?.name())
}

/// A compress policy name, checked (the engine parses it again from the name returned).
pub(super) fn compress(obj: &Bound<'_, PyAny>) -> PyResult<&'static str> {
    Ok(Compress::parse(&str_arg(obj, "compress")?)?.name())
}

/// Seconds, checked to be a float in 0..=60 (the default stays a literal, so the signature shows it).
pub(super) fn host_register_delay(obj: &Bound<'_, PyAny>) -> PyResult<f64> {
    let s = float_arg(obj, "host_register_delay")?;
    if !(0.0..=60.0).contains(&s) {
        return Err(value_error(format!(
            "host_register_delay must be between 0 and 60 seconds, got {s}"
        )));
    }
    Ok(s)
}
