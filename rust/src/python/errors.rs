//! The exception classes of `cumem_rs._native` and the one mapping of the crate's `Error` onto them.
//!
//! Bad arguments raise `CumemValueError` / `CumemTypeError`: each is a `CumemError` (so `except CumemError`
//! catches everything cumem_rs raises) and a `ValueError` / `TypeError` (so code written against the standard
//! exceptions, and `except ValueError` in existing callers, keeps working).

use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use crate::error::Error;

create_exception!(
    _native,
    CumemError,
    PyRuntimeError,
    "Base class of every error raised by cumem_rs."
);
create_exception!(
    _native,
    CumemOutOfMemoryError,
    CumemError,
    "Physical device or host backup memory ran out."
);
create_exception!(
    _native,
    DriverError,
    CumemError,
    "A driver call failed; `op` is the call, `code` the CUDA result code."
);
create_exception!(
    _native,
    ClosedError,
    CumemError,
    "The allocator was closed."
);

static VALUE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static TYPE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `class NAME(CumemError, standard)`: `create_exception!` takes one base only, so the class is made the way
/// Python's own `class` statement makes it, by calling `type(name, bases, namespace)`.
fn two_base_class<'py>(
    py: Python<'py>,
    name: &str,
    standard: Bound<'py, PyType>,
    doc: &str,
) -> PyResult<Py<PyType>> {
    let bases = PyTuple::new(py, [py.get_type::<CumemError>(), standard])?;
    let namespace = PyDict::new(py);
    namespace.set_item("__module__", "_native")?;
    namespace.set_item("__doc__", doc)?;
    let class = py.get_type::<PyType>().call1((name, bases, namespace))?;
    Ok(class.cast_into::<PyType>()?.unbind())
}

/// `CumemValueError(CumemError, ValueError)`: an argument of the right type with a value that cannot be used.
pub(crate) fn value_error_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    VALUE_ERROR
        .get_or_try_init(py, || {
            two_base_class(
                py,
                "CumemValueError",
                py.get_type::<PyValueError>(),
                "A bad argument value (a CumemError and a ValueError); the message names the argument.",
            )
        })
        .map(|t| t.bind(py))
}

/// `CumemTypeError(CumemError, TypeError)`: an argument of the wrong type.
pub(crate) fn type_error_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    TYPE_ERROR
        .get_or_try_init(py, || {
            two_base_class(
                py,
                "CumemTypeError",
                py.get_type::<PyTypeError>(),
                "An argument of the wrong type (a CumemError and a TypeError); the message names the argument.",
            )
        })
        .map(|t| t.bind(py))
}

/// A `CumemValueError` with `msg`. Every bad argument value the module refuses is raised through here.
pub(crate) fn value_error(msg: impl Into<String>) -> PyErr {
    let msg = msg.into();
    Python::attach(|py| match value_error_type(py) {
        Ok(t) => PyErr::from_type(t.clone(), msg),
        // Only if the class could not be made at all (out of memory in the interpreter): still a ValueError.
        Err(_) => PyValueError::new_err(msg),
    })
}

/// A `CumemTypeError` with `msg`. Every argument of a wrong type is raised through here.
pub(crate) fn type_error(msg: impl Into<String>) -> PyErr {
    let msg = msg.into();
    Python::attach(|py| match type_error_type(py) {
        Ok(t) => PyErr::from_type(t.clone(), msg),
        Err(_) => PyTypeError::new_err(msg),
    })
}

/// A `DriverError` carrying the failed driver call (`.op`) and its CUDA result code (`.code`), so callers can
/// branch on them instead of parsing the message.
fn driver_error(msg: String, op: &'static str, code: i32) -> PyErr {
    Python::attach(|py| {
        let err = DriverError::new_err(msg);
        let value = err.value(py);
        match value
            .setattr("op", op)
            .and_then(|()| value.setattr("code", code))
        {
            Ok(()) => err,
            Err(e) => e,
        }
    })
}

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        let msg = e.to_string();
        match e {
            Error::OutOfMemory { .. } => CumemOutOfMemoryError::new_err(msg),
            Error::Driver { op, code, .. } => driver_error(msg, op, code),
            Error::InvalidArgument(_) | Error::UnknownAddress(_) => value_error(msg),
            Error::Closed => ClosedError::new_err(msg),
            Error::InvalidState(_) | Error::NoCuda(_) | Error::Panic(_) => CumemError::new_err(msg),
        }
    }
}

/// Add every exception class to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("CumemError", py.get_type::<CumemError>())?;
    m.add(
        "CumemOutOfMemoryError",
        py.get_type::<CumemOutOfMemoryError>(),
    )?;
    m.add("CumemValueError", value_error_type(py)?)?;
    m.add("CumemTypeError", type_error_type(py)?)?;
    m.add("DriverError", py.get_type::<DriverError>())?;
    m.add("ClosedError", py.get_type::<ClosedError>())?;
    Ok(())
}
