//! The Python module `cumem_rs._native`: thin wrappers only. Arguments are checked in `python/convert.rs`, the
//! exception classes and the error mapping live in `python/errors.rs`, the returned dicts are built in
//! `python/results.rs`.
//! Every call into the engine releases the GIL, so a torch thread blocked in my_malloc (which never takes the
//! GIL) can always make progress.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyList};

use crate::backups::BackupTier;
use crate::driver::sim::{SimConfig, SimDriver, FAULT_ERRORS};
use crate::engine::{Compress, Engine, Report, TagPolicy, WakeFill};
use crate::error::Error;
use crate::global;

mod convert;
mod errors;
mod functions;
mod host_bytes;
mod nvcomp;
mod preload;
mod records;
mod results;

use convert::{
    address_arg, bool_arg, bytes_arg, fault_op, malloc_size_arg, size_arg, str_arg, stream_arg,
    tag_arg, tags_arg, type_name,
};
use errors::{type_error, value_error, CumemError};
use results::{
    allocations_list, driver_counts_dict, pin_ahead_dict, policy_dict, report_dict, stats_dict,
    status_dict,
};

/// Run the body of a Python entry point, turning a Rust panic into `CumemError`: every entry goes through here,
/// so no panic reaches Python as PyO3's `PanicException` (a `BaseException`, which `except Exception` misses).
/// A panic that interrupted an engine call while it held the allocator's lock has also poisoned that allocator.
fn guard<T>(body: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    catch_unwind(AssertUnwindSafe(body))
        .unwrap_or_else(|p| Err(Error::Panic(crate::error::panic_message(&*p)).into()))
}

/// An engine call over optional tags (None: all), without the GIL, and its report as a dict.
fn tags_report<'py>(
    py: Python<'py>,
    tags: Option<&Bound<'py, PyAny>>,
    call: impl FnOnce(Option<&[String]>) -> crate::error::Result<Report> + Send,
) -> PyResult<Bound<'py, PyDict>> {
    let tags = tags.map(tags_arg).transpose()?;
    let r = py.detach(|| call(tags.as_deref()))?;
    report_dict(py, &r)
}

/// Virtual-memory allocator over one driver (simulated or CUDA).
#[pyclass(frozen, module = "cumem_rs._native")]
pub struct Allocator {
    engine: Arc<Engine>,
    /// The simulated driver under the engine, for fault injection and driver counts; None on CUDA.
    sim: Option<Arc<SimDriver>>,
    /// The process-wide CUDA engine is never closed from Python (torch may still hold its memory).
    shared: bool,
}

impl Allocator {
    fn sim(&self) -> PyResult<&SimDriver> {
        self.sim.as_deref().ok_or_else(|| {
            CumemError::new_err(
                "fault injection and driver counts exist on the simulated driver only",
            )
        })
    }
}

#[pymethods]
impl Allocator {
    #[staticmethod]
    #[pyo3(signature = (devices = None, capacity = None, granularity = None, host_memory = None,
                        host_register_delay = 0.0, compress = true))]
    fn simulated(
        devices: Option<&Bound<'_, PyAny>>,
        capacity: Option<&Bound<'_, PyAny>>,
        granularity: Option<&Bound<'_, PyAny>>,
        host_memory: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = convert::host_register_delay)] host_register_delay: f64,
        compress: bool,
    ) -> PyResult<Allocator> {
        guard(|| {
            let defaults = SimConfig::default();
            let arg = |obj: Option<&Bound<'_, PyAny>>, what, default| {
                obj.map_or(Ok(default), |o| size_arg(o, what, false))
            };
            let config = SimConfig {
                devices: arg(devices, "devices", defaults.devices)?,
                capacity: arg(capacity, "capacity", defaults.capacity)?,
                granularity: arg(granularity, "granularity", defaults.granularity)?,
                host_memory: host_memory
                    .map(|o| size_arg(o, "host_memory", true))
                    .transpose()?,
                host_register_delay: std::time::Duration::from_secs_f64(host_register_delay),
                compress,
                stream_order: defaults.stream_order,
            };
            let sim = Arc::new(SimDriver::new(config)?);
            let engine = Engine::new(sim.clone())?;
            Ok(Allocator {
                engine: Arc::new(engine),
                sim: Some(sim),
                shared: false,
            })
        })
    }

    #[staticmethod]
    fn cuda(py: Python<'_>) -> PyResult<Allocator> {
        guard(|| {
            let engine = py.detach(global::cuda_engine)?.clone();
            Ok(Allocator {
                engine,
                sim: None,
                shared: true,
            })
        })
    }

    #[getter]
    fn backend(&self) -> PyResult<&'static str> {
        guard(|| Ok(self.engine.driver().backend()))
    }

    fn device_count(&self) -> PyResult<usize> {
        guard(|| {
            self.engine.check_not_forked()?;
            Ok(self.engine.device_count())
        })
    }

    #[pyo3(signature = (device = 0))]
    fn granularity(&self, #[pyo3(from_py_with = convert::device)] device: i32) -> PyResult<usize> {
        guard(|| {
            self.engine.check_not_forked()?;
            Ok(self.engine.granularity(device)?)
        })
    }

    #[pyo3(signature = (device = 0))]
    fn mem_info(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = convert::device)] device: i32,
    ) -> PyResult<(usize, usize)> {
        guard(|| {
            self.engine.check_not_forked()?;
            self.engine.granularity(device)?;
            Ok(py.detach(|| self.engine.driver().mem_info(device))?)
        })
    }

    /// Backend, devices and their properties.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guard(|| {
            self.engine.check_not_forked()?;
            let d = PyDict::new(py);
            let driver = self.engine.driver();
            d.set_item("backend", driver.backend())?;
            let devices = PyList::empty(py);
            let mut driver_version = None;
            for dev in 0..self.engine.device_count() as i32 {
                let e = PyDict::new(py);
                let (free, total) = py.detach(|| driver.mem_info(dev))?;
                let facts = py.detach(|| driver.device_info(dev))?;
                e.set_item("device", dev)?;
                e.set_item("free", free)?;
                e.set_item("total", total)?;
                e.set_item("granularity", self.engine.granularity(dev)?)?;
                e.set_item("name", facts.name)?;
                e.set_item("rdma_with_vmm", facts.rdma_with_vmm)?;
                devices.append(e)?;
                driver_version = driver_version.or(facts.driver_version);
            }
            d.set_item("devices", &devices)?;
            // The codec sleeps compress with (None: backups are raw).
            d.set_item("codec", py.detach(|| self.engine.stats().codec))?;
            if let Some(version) = driver_version {
                d.set_item("driver_version", version)?;
            }
            Ok(d)
        })
    }

    #[pyo3(signature = (size, device = 0, stream = None))]
    fn malloc(
        &self,
        py: Python<'_>,
        size: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = convert::device)] device: i32,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        guard(|| {
            let size = malloc_size_arg(size)?;
            let stream = stream_arg(py, stream)?;
            // Engine::malloc tags the allocation with the calling thread's current tag.
            Ok(py.detach(|| self.engine.malloc(size, device, stream))?)
        })
    }

    fn free(&self, py: Python<'_>, address: &Bound<'_, PyAny>) -> PyResult<()> {
        guard(|| {
            let addr = address_arg(address)?;
            Ok(py.detach(|| self.engine.free(addr))?)
        })
    }

    fn push_tag(&self, py: Python<'_>, tag: &Bound<'_, PyAny>) -> PyResult<()> {
        guard(|| {
            let tag = tag_arg(tag)?;
            Ok(py.detach(|| self.engine.push_tag(&tag))?)
        })
    }

    fn pop_tag(&self) -> PyResult<String> {
        guard(|| Ok(self.engine.pop_tag()?))
    }

    fn current_tag(&self) -> PyResult<String> {
        guard(|| Ok(self.engine.current_tag()?))
    }

    #[pyo3(signature = (offload_tags = None))]
    fn sleep<'py>(
        &self,
        py: Python<'py>,
        offload_tags: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        guard(|| {
            // None: each tag per its policy, "default" only for tags without one (vLLM's rule when none is set).
            let tags = offload_tags.map(tags_arg).transpose()?;
            let r = py.detach(|| match &tags {
                Some(tags) => self.engine.sleep(tags),
                None => self.engine.sleep_by_policy(),
            })?;
            report_dict(py, &r)
        })
    }

    #[pyo3(signature = (tags = None))]
    fn wake_up<'py>(
        &self,
        py: Python<'py>,
        tags: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        guard(|| tags_report(py, tags, |t| self.engine.wake(t)))
    }

    fn discard<'py>(
        &self,
        py: Python<'py>,
        tags: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        guard(|| {
            let tags = tags_arg(tags)?;
            let r = py.detach(|| self.engine.discard(&tags))?;
            report_dict(py, &r)
        })
    }

    fn read<'py>(
        &self,
        py: Python<'py>,
        address: &Bound<'py, PyAny>,
        size: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        guard(|| {
            let addr = address_arg(address)?;
            let size = size_arg(size, "size", true)?;
            let data = py.detach(|| self.engine.read(addr, size))?;
            Ok(PyBytes::new(py, &data))
        })
    }

    fn write(
        &self,
        py: Python<'_>,
        address: &Bound<'_, PyAny>,
        data: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        guard(|| {
            let addr = address_arg(address)?;
            let bytes = bytes_arg(data, "data")?;
            Ok(py.detach(|| self.engine.write(addr, &bytes))?)
        })
    }

    #[pyo3(signature = (device = None))]
    fn usage(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = convert::optional_device)] device: Option<i32>,
    ) -> PyResult<usize> {
        guard(|| {
            if let Some(d) = device {
                self.engine.granularity(d)?;
            }
            Ok(py.detach(|| self.engine.usage(device))?)
        })
    }

    fn allocations<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        guard(|| allocations_list(py, &py.detach(|| self.engine.allocations())?))
    }

    /// `(address, size, device, tag, asleep, backed_up)` per live allocation, in address order; with `address`,
    /// the one allocation that starts there, or None. Read under the allocator's lock without the GIL.
    #[pyo3(signature = (address = None))]
    fn records<'py>(
        &self,
        py: Python<'py>,
        address: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        guard(|| match address {
            None => {
                let all = py.detach(|| self.engine.allocations())?;
                Ok(Some(records::records_list(py, &all)?.into_any()))
            }
            Some(address) => {
                let addr = address_arg(address)?;
                let one = py.detach(|| self.engine.allocation(addr))?;
                one.map(|a| Ok(records::record(py, &a)?.into_any()))
                    .transpose()
            }
        })
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guard(|| {
            self.engine.check_not_forked()?;
            let s = py.detach(|| self.engine.stats());
            stats_dict(py, &s)
        })
    }

    fn host_bytes(&self, py: Python<'_>) -> PyResult<usize> {
        guard(|| {
            self.engine.check_not_forked()?;
            Ok(py.detach(|| self.engine.host_bytes()))
        })
    }

    /// The file tier's spill directory (None: no file tier); `named`: a visible file per backup there.
    #[pyo3(signature = (path, named = false))]
    fn set_spill_dir(&self, py: Python<'_>, path: &Bound<'_, PyAny>, named: bool) -> PyResult<()> {
        guard(|| {
            let path: Option<std::path::PathBuf> = if path.is_none() {
                None
            } else {
                Some(path.extract().map_err(|_| {
                    type_error(format!(
                        "path must be a str, os.PathLike or None, not {}",
                        type_name(path)
                    ))
                })?)
            };
            Ok(py.detach(|| self.engine.set_spill_dir_named(path.as_deref(), named))?)
        })
    }

    /// Remove the names of this process's named spill files from their directories (an exit handler's job);
    /// their backups stay readable. How many were removed.
    #[staticmethod]
    fn unlink_named_spill_files() -> PyResult<usize> {
        guard(|| Ok(crate::backups::unlink_named_files()))
    }

    #[getter]
    fn spill_dir(&self, py: Python<'_>) -> PyResult<Option<std::path::PathBuf>> {
        guard(|| Ok(py.detach(|| self.engine.spill_dir())?))
    }

    /// Wait until the disk blocks of the spill files and holes given back so far are free (the reclaim thread
    /// frees them after the call that dropped their backups).
    fn settle_spill_files(&self, py: Python<'_>) -> PyResult<()> {
        guard(|| {
            py.detach(|| self.engine.settle_spill_files());
            Ok(())
        })
    }

    fn set_staging_bytes(&self, py: Python<'_>, nbytes: &Bound<'_, PyAny>) -> PyResult<()> {
        guard(|| {
            let n = size_arg(nbytes, "nbytes", false)?;
            Ok(py.detach(|| self.engine.set_staging_bytes(n))?)
        })
    }

    /// Test hook: the `nth` next spill-file write or read fails ("short", "enospc", "eio").
    #[pyo3(signature = (op, nth = 1, error = "eio"))]
    fn inject_spill_fault(
        &self,
        op: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = convert::nth)] nth: u64,
        error: &str,
    ) -> PyResult<()> {
        guard(|| {
            let op = str_arg(op, "op")?;
            Ok(self.engine.inject_spill_fault(&op, nth, error)?)
        })
    }

    fn clear_spill_faults(&self) -> PyResult<()> {
        guard(|| Ok(self.engine.clear_spill_faults()?))
    }

    /// Cap the pinned host memory held for backups at `nbytes` (None: no cap).
    fn set_host_budget(&self, py: Python<'_>, nbytes: &Bound<'_, PyAny>) -> PyResult<()> {
        guard(|| {
            let n = if nbytes.is_none() {
                None
            } else {
                Some(size_arg(nbytes, "nbytes", true)?)
            };
            Ok(py.detach(|| self.engine.set_host_budget(n))?)
        })
    }

    #[getter]
    fn host_budget(&self, py: Python<'_>) -> PyResult<Option<usize>> {
        guard(|| Ok(py.detach(|| self.engine.host_budget())?))
    }

    fn set_keep_host_memory(&self, py: Python<'_>, keep: &Bound<'_, PyAny>) -> PyResult<()> {
        guard(|| {
            let keep = bool_arg(keep, "keep")?;
            Ok(py.detach(|| self.engine.set_keep_host_memory(keep))?)
        })
    }

    #[pyo3(signature = (nbytes, background = false))]
    fn reserve_host(
        &self,
        py: Python<'_>,
        nbytes: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = convert::background)] background: bool,
    ) -> PyResult<()> {
        guard(|| {
            let n = size_arg(nbytes, "nbytes", false)?;
            Ok(py.detach(|| self.engine.reserve_host(n, background))?)
        })
    }

    /// The background pinning worker: {"running", "pinned", "nbytes"} (all false/0 when there is none).
    fn pin_ahead_status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guard(|| {
            let s = py.detach(|| self.engine.pin_ahead_status())?;
            pin_ahead_dict(py, &s)
        })
    }

    /// Bytes of host arena a sleep offloading `tags` would need now (what to pin ahead for them).
    fn backup_bytes_of(&self, py: Python<'_>, tags: &Bound<'_, PyAny>) -> PyResult<usize> {
        guard(|| {
            let tags = tags_arg(tags)?;
            Ok(py.detach(|| self.engine.backup_bytes_of(&tags))?)
        })
    }

    /// Stop background pinning (what it pinned stays cached for the next sleep).
    fn stop_pinning_ahead(&self, py: Python<'_>) -> PyResult<()> {
        guard(|| Ok(py.detach(|| self.engine.stop_pinning_ahead())?))
    }

    fn set_pin_chunk(&self, py: Python<'_>, nbytes: &Bound<'_, PyAny>) -> PyResult<()> {
        guard(|| {
            let n = size_arg(nbytes, "nbytes", false)?;
            Ok(py.detach(|| self.engine.set_pin_chunk(n))?)
        })
    }

    fn set_retain_backups(&self, py: Python<'_>, on: &Bound<'_, PyAny>) -> PyResult<()> {
        guard(|| {
            let on = bool_arg(on, "on")?;
            Ok(py.detach(|| self.engine.set_retain_backups(on))?)
        })
    }

    fn retains_backups(&self, py: Python<'_>) -> PyResult<bool> {
        guard(|| Ok(py.detach(|| self.engine.retains_backups())?))
    }

    fn set_verify_wakes(&self, py: Python<'_>, on: &Bound<'_, PyAny>) -> PyResult<()> {
        guard(|| {
            let on = bool_arg(on, "on")?;
            Ok(py.detach(|| self.engine.set_verify_wakes(on))?)
        })
    }

    fn verifies_wakes(&self, py: Python<'_>) -> PyResult<bool> {
        guard(|| Ok(py.detach(|| self.engine.verifies_wakes())?))
    }

    fn set_fingerprint_chunk(&self, py: Python<'_>, nbytes: &Bound<'_, PyAny>) -> PyResult<()> {
        guard(|| {
            let n = size_arg(nbytes, "nbytes", false)?;
            Ok(py.detach(|| self.engine.set_fingerprint_chunk(n))?)
        })
    }

    fn set_wake_group_bytes(&self, py: Python<'_>, nbytes: &Bound<'_, PyAny>) -> PyResult<()> {
        guard(|| {
            let n = size_arg(nbytes, "nbytes", true)?;
            Ok(py.detach(|| self.engine.set_wake_group_bytes(n))?)
        })
    }

    #[getter]
    fn wake_group_bytes(&self, py: Python<'_>) -> PyResult<usize> {
        guard(|| {
            self.engine.check_not_forked()?;
            Ok(py.detach(|| self.engine.wake_group_bytes()))
        })
    }

    /// Driver-computed fingerprints of [address, address+length): a list of (lo, hi) pairs, one per chunk.
    fn fingerprints(
        &self,
        py: Python<'_>,
        address: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(u64, u64)>> {
        guard(|| {
            let addr = address_arg(address)?;
            let len = size_arg(length, "length", false)?;
            let fps = py.detach(|| self.engine.fingerprints(addr, len))?;
            Ok(fps.into_iter().map(|[a, b]| (a, b)).collect())
        })
    }

    fn trim_host(&self, py: Python<'_>) -> PyResult<usize> {
        guard(|| Ok(py.detach(|| self.engine.trim_host())?))
    }

    fn errors(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        guard(|| {
            self.engine.check_not_forked()?;
            Ok(py.detach(|| self.engine.errors()))
        })
    }

    #[pyo3(signature = (op, nth = 1, error = "unknown"))]
    fn inject_fault(
        &self,
        op: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = convert::nth)] nth: u64,
        #[pyo3(from_py_with = convert::fault_error)] error: &'static str,
    ) -> PyResult<()> {
        guard(|| {
            let sim = self.sim()?;
            let op = fault_op(op)?;
            let code = FAULT_ERRORS
                .iter()
                .find(|(n, _)| *n == error)
                .map(|(_, c)| *c)
                .ok_or_else(|| {
                    value_error(format!(
                        "unknown fault error {error:?}; expected one of {:?}",
                        FAULT_ERRORS.iter().map(|(n, _)| *n).collect::<Vec<_>>()
                    ))
                })?;
            Ok(sim.inject_fault(op, nth, code)?)
        })
    }

    /// Test hook: the `nth` next call of `op` panics inside the simulated driver.
    #[pyo3(signature = (op, nth = 1))]
    fn inject_panic(
        &self,
        op: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = convert::nth)] nth: u64,
    ) -> PyResult<()> {
        guard(|| {
            let sim = self.sim()?;
            Ok(sim.inject_panic(fault_op(op)?, nth)?)
        })
    }

    fn clear_faults(&self) -> PyResult<()> {
        guard(|| {
            self.sim()?.clear_faults();
            Ok(())
        })
    }

    fn driver_counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guard(|| {
            let c = self.sim()?.counts();
            driver_counts_dict(py, &c)
        })
    }

    fn close(&self, py: Python<'_>) -> PyResult<()> {
        guard(|| {
            if self.shared {
                return Err(CumemError::new_err(
                    "the process-wide CUDA allocator cannot be closed (torch may still hold its memory); free \
                     its allocations or release the torch pools instead",
                ));
            }
            Ok(py.detach(|| self.engine.close())?)
        })
    }

    #[getter]
    fn closed(&self, py: Python<'_>) -> PyResult<bool> {
        guard(|| {
            self.engine.check_not_forked()?;
            Ok(py.detach(|| self.engine.is_closed()))
        })
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        guard(|| {
            let s = py.detach(|| self.engine.stats());
            Ok(format!(
                "Allocator(backend={:?}, devices={}, live={}, mapped={} bytes)",
                self.engine.driver().backend(),
                self.engine.device_count(),
                s.live_allocations,
                s.mapped_bytes
            ))
        })
    }

    // ----- tag policies, pause/resume, status (engine/policy.rs, engine/pause.rs) ---------------------------

    #[pyo3(signature = (tag, backup = None, wake_fill = "undefined", backup_tier = "auto", compress = "auto"))]
    fn set_tag_policy(
        &self,
        py: Python<'_>,
        tag: &Bound<'_, PyAny>,
        backup: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = convert::wake_fill)] wake_fill: &'static str,
        backup_tier: &str,
        #[pyo3(from_py_with = convert::compress)] compress: &'static str,
    ) -> PyResult<()> {
        guard(|| {
            let tag = tag_arg(tag)?;
            let backup = match backup {
                None => None,
                Some(b) => Some(b.cast::<PyBool>().map(|b| b.is_true()).map_err(|_| {
                    type_error(format!(
                        "backup must be a bool or None, not {}",
                        type_name(b)
                    ))
                })?),
            };
            let policy = TagPolicy {
                backup,
                wake_fill: WakeFill::parse(wake_fill)?,
                backup_tier: BackupTier::parse(backup_tier)?,
                compress: Compress::parse(compress)?,
            };
            Ok(py.detach(|| self.engine.set_tag_policy(&tag, policy))?)
        })
    }

    fn tag_policy<'py>(
        &self,
        py: Python<'py>,
        tag: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        guard(|| {
            let tag = tag_arg(tag)?;
            let p = py.detach(|| self.engine.tag_policy(&tag))?;
            policy_dict(py, &p)
        })
    }

    #[pyo3(signature = (tags = None))]
    fn pause<'py>(
        &self,
        py: Python<'py>,
        tags: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        guard(|| tags_report(py, tags, |t| self.engine.pause(t)))
    }

    #[pyo3(signature = (tags = None))]
    fn resume<'py>(
        &self,
        py: Python<'py>,
        tags: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        guard(|| tags_report(py, tags, |t| self.engine.resume(t)))
    }

    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guard(|| {
            let s = py.detach(|| self.engine.status())?;
            status_dict(py, &s)
        })
    }

    fn read_backup<'py>(
        &self,
        py: Python<'py>,
        address: &Bound<'py, PyAny>,
        size: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        guard(|| {
            let addr = address_arg(address)?;
            let size = size_arg(size, "size", true)?;
            let data = py.detach(|| self.engine.read_backup(addr, size))?;
            Ok(data.map(|d| PyBytes::new(py, &d)))
        })
    }

    /// The backed-up bytes [address, address+size) where they lie: a `HostBytes` when the backup (asleep, or
    /// retained by an awake allocation) is raw host memory, else None (read_backup copies the others).
    #[pyo3(signature = (address, size, writable = None))]
    fn view_backup<'py>(
        &self,
        py: Python<'py>,
        address: &Bound<'py, PyAny>,
        size: &Bound<'py, PyAny>,
        writable: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<host_bytes::HostBytes>> {
        guard(|| {
            let addr = address_arg(address)?;
            let size = size_arg(size, "size", true)?;
            let writable = writable.map_or(Ok(true), |w| bool_arg(w, "writable"))?;
            let view = py.detach(|| self.engine.view_backup(addr, size, writable))?;
            Ok(view.map(host_bytes::HostBytes::new))
        })
    }

    fn keep_host_memory(&self, py: Python<'_>) -> PyResult<bool> {
        guard(|| Ok(py.detach(|| self.engine.keep_host_memory())?))
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    guard(|| {
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add("FAULT_OPS", convert::fault_ops())?;
        m.add("CORRUPTING_FAULT_OPS", convert::corrupting_fault_ops())?;
        m.add(
            "FAULT_ERRORS",
            FAULT_ERRORS.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        )?;
        errors::register(m)?;
        m.add_class::<Allocator>()?;
        m.add_class::<host_bytes::HostBytes>()?;
        functions::register(m)?;
        preload::add_functions(m)?;
        nvcomp::register(m)?;
        crate::logbuf::install();
        Ok(())
    })
}
