//! The allocation records `CuMemAllocator.pointer_to_data` reads: a tuple `(address, size, device, tag, asleep,
//! backed_up)` per live allocation. Tuples rather than the dicts of `allocations()`, and one Python string per
//! tag rather than per allocation, so that a walk over thousands of allocations stays cheap.

use std::collections::HashMap;

use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple};

use crate::AllocationInfo;

fn record_tuple<'py>(
    py: Python<'py>,
    a: &AllocationInfo,
    tag: Bound<'py, PyString>,
) -> PyResult<Bound<'py, PyTuple>> {
    (a.addr, a.size, a.device, tag, a.asleep, a.backed_up).into_pyobject(py)
}

/// One record tuple per allocation, in address order.
pub(super) fn records_list<'py>(
    py: Python<'py>,
    all: &[AllocationInfo],
) -> PyResult<Bound<'py, PyList>> {
    let mut tags: HashMap<&str, Bound<'py, PyString>> = HashMap::new();
    let list = PyList::empty(py);
    for a in all {
        let tag = tags
            .entry(a.tag.as_str())
            .or_insert_with(|| PyString::new(py, &a.tag))
            .clone();
        list.append(record_tuple(py, a, tag)?)?;
    }
    Ok(list)
}

/// The record tuple of one allocation.
pub(super) fn record<'py>(py: Python<'py>, a: &AllocationInfo) -> PyResult<Bound<'py, PyTuple>> {
    record_tuple(py, a, PyString::new(py, &a.tag))
}
