//! `HostBytes`: a view of a raw host backup where it lies (`Allocator.view_backup`), the zero-copy path of
//! `memory_saver.get_cpu_backup`. It only reports where the bytes are; the Python side wraps that memory in a
//! tensor that keeps this object alive, so the bytes stay mapped as long as any tensor over them lives.

use pyo3::prelude::*;

use crate::backups::HostView;

/// `nbytes` bytes of host backup memory at `address`, mapped as long as this object lives (see
/// `Allocator.view_backup`).
#[pyclass(frozen, module = "cumem_rs._native")]
pub struct HostBytes {
    view: HostView,
}

impl HostBytes {
    pub(super) fn new(view: HostView) -> HostBytes {
        HostBytes { view }
    }
}

#[pymethods]
impl HostBytes {
    /// Address of the first byte (host memory of this process).
    #[getter]
    fn address(&self) -> usize {
        self.view.address()
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.view.len()
    }

    fn __len__(&self) -> usize {
        self.view.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "HostBytes(address={:#x}, nbytes={})",
            self.view.address(),
            self.view.len()
        )
    }
}
