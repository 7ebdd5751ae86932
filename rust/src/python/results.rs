//! The dicts the module returns, one builder per kind. Each builder's keys are those of the `TypedDict` of the
//! same name in `python/cumem_rs/results.py`, which `_native.pyi` uses as the return types;
//! `tests/test_results.py` compares the keys (and value types) of real calls with those TypedDicts, so a key
//! added or renamed here without the TypedDict fails there.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::backups::BackupTier;
use crate::driver::sim::SimCounts;
use crate::engine::Compress;
use crate::{AllocationInfo, PinAheadStatus, Report, Stats, Status, TagPolicy, TagStatus};

/// A dict from `"key" => value` pairs, in order.
macro_rules! dict {
    ($py:expr, { $($key:literal => $value:expr),* $(,)? }) => {{
        let d = PyDict::new($py);
        $(d.set_item($key, $value)?;)*
        d
    }};
}

/// `Report`: what one sleep, wake, discard, pause or resume did.
pub(super) fn report_dict<'py>(py: Python<'py>, r: &Report) -> PyResult<Bound<'py, PyDict>> {
    let gb_per_s = if r.seconds > 0.0 {
        r.copied_bytes as f64 / r.seconds / 1e9
    } else {
        0.0
    };
    let file_gb_per_s = if r.file_seconds > 0.0 {
        (r.written_bytes + r.read_bytes) as f64 / r.file_seconds / 1e9
    } else {
        0.0
    };
    Ok(dict!(py, {
        "allocations" => r.allocations,
        "copied_bytes" => r.copied_bytes,
        "discarded_bytes" => r.discarded_bytes,
        "zeroed_bytes" => r.zeroed_bytes,
        "skipped_bytes" => r.skipped_bytes,
        "chunks_checked" => r.chunks_checked,
        "fingerprint_seconds" => r.fingerprint_seconds,
        "written_bytes" => r.written_bytes,
        "read_bytes" => r.read_bytes,
        "file_seconds" => r.file_seconds,
        "file_read_wait_seconds" => r.file_read_wait_seconds,
        "file_copy_seconds" => r.file_copy_seconds,
        "release_seconds" => r.release_seconds,
        "file_gb_per_s" => file_gb_per_s,
        "raw_bytes" => r.raw_bytes,
        "stored_bytes" => r.stored_bytes,
        "verified_bytes" => r.verified_bytes,
        "seconds" => r.seconds,
        "gb_per_s" => gb_per_s,
    }))
}

fn optional_report<'py>(
    py: Python<'py>,
    r: Option<&Report>,
) -> PyResult<Option<Bound<'py, PyDict>>> {
    r.map(|r| report_dict(py, r)).transpose()
}

/// `backup_tier` and `compress` added to a policy's dict when they are not the default ("auto"): dicts of tags
/// that never chose one stay as they were before the file tier and the codec existed.
fn with_tier<'py>(d: Bound<'py, PyDict>, p: &TagPolicy) -> PyResult<Bound<'py, PyDict>> {
    if p.backup_tier != BackupTier::Auto {
        d.set_item("backup_tier", p.backup_tier.name())?;
    }
    if p.compress != Compress::Auto {
        d.set_item("compress", p.compress.name())?;
    }
    Ok(d)
}

/// `TagPolicy`: the policy of one tag.
pub(super) fn policy_dict<'py>(py: Python<'py>, p: &TagPolicy) -> PyResult<Bound<'py, PyDict>> {
    let d = dict!(py, {
        "backup" => p.backup,
        "wake_fill" => p.wake_fill.name(),
    });
    with_tier(d, p)
}

/// `TagStatus`: one tag of `status()`, its policy included.
fn tag_status_dict<'py>(py: Python<'py>, t: &TagStatus) -> PyResult<Bound<'py, PyDict>> {
    let d = dict!(py, {
        "allocations" => t.allocations,
        "mapped_bytes" => t.mapped_bytes,
        "asleep_bytes" => t.asleep_bytes,
        "backup_bytes" => t.backup_bytes,
        "retained_bytes" => t.retained_bytes,
        "backup" => t.policy.backup,
        "wake_fill" => t.policy.wake_fill.name(),
        "state" => t.state(),
    });
    if t.file_bytes > 0 {
        d.set_item("file_bytes", t.file_bytes)?;
    }
    with_tier(d, &t.policy)
}

/// `Status`: every tag with an allocation or a policy.
pub(super) fn status_dict<'py>(py: Python<'py>, s: &Status) -> PyResult<Bound<'py, PyDict>> {
    let tags = PyDict::new(py);
    for (tag, t) in &s.tags {
        tags.set_item(tag, tag_status_dict(py, t)?)?;
    }
    Ok(dict!(py, {
        "is_sleeping" => s.is_sleeping,
        "tags" => tags,
    }))
}

/// `AllocationRecord`: one live allocation.
fn allocation_dict<'py>(py: Python<'py>, a: &AllocationInfo) -> PyResult<Bound<'py, PyDict>> {
    Ok(dict!(py, {
        "address" => a.addr,
        "size" => a.size,
        "requested" => a.requested,
        "device" => a.device,
        "tag" => &a.tag,
        "asleep" => a.asleep,
        "backed_up" => a.backed_up,
    }))
}

pub(super) fn allocations_list<'py>(
    py: Python<'py>,
    all: &[AllocationInfo],
) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for a in all {
        list.append(allocation_dict(py, a)?)?;
    }
    Ok(list)
}

/// `Stats`: the allocator's counters.
pub(super) fn stats_dict<'py>(py: Python<'py>, s: &Stats) -> PyResult<Bound<'py, PyDict>> {
    // Process-wide: the preload hook routes for the whole process.
    let unrouted = crate::preload::unrouted_counts();
    Ok(dict!(py, {
        "live_allocations" => s.live_allocations,
        "asleep_allocations" => s.asleep_allocations,
        "mapped_bytes" => s.mapped_bytes,
        "asleep_bytes" => s.asleep_bytes,
        "peak_mapped_bytes" => s.peak_mapped_bytes,
        "host_backup_bytes" => s.host_backup_bytes,
        "host_cached_bytes" => s.host_cached_bytes,
        "host_retained_bytes" => s.host_retained_bytes,
        "host_tier_bytes" => s.host_tier_bytes,
        "file_tier_bytes" => s.file_tier_bytes,
        "host_tier_stored_bytes" => s.host_tier_stored_bytes,
        "file_tier_stored_bytes" => s.file_tier_stored_bytes,
        "compressed_bytes" => s.compressed_bytes,
        "compressed_raw_bytes" => s.compressed_raw_bytes,
        "compression_ratio" => s.compression_ratio,
        "codec" => s.codec.as_deref(),
        "staging_bytes" => s.staging_bytes,
        "retained_allocations" => s.retained_allocations,
        "mallocs" => s.mallocs,
        "frees" => s.frees,
        "sleeps" => s.sleeps,
        "wakes" => s.wakes,
        "recorded_errors" => s.recorded_errors,
        "pending_releases" => s.pending_releases,
        "wake_groups" => s.wake_groups,
        "unreturned_bytes" => s.unreturned_bytes,
        "own_device_bytes" => s.own_device_bytes,
        "preload_unrouted_calls" => unrouted.calls,
        "preload_unrouted_bytes" => unrouted.bytes,
        "last_sleep" => optional_report(py, s.last_sleep.as_ref())?,
        "last_wake" => optional_report(py, s.last_wake.as_ref())?,
    }))
}

/// `PinAheadStatus`: the background pinning worker (all false/0 when there is none).
pub(super) fn pin_ahead_dict<'py>(
    py: Python<'py>,
    s: &PinAheadStatus,
) -> PyResult<Bound<'py, PyDict>> {
    Ok(dict!(py, {
        "running" => s.running,
        "pinned" => s.pinned,
        "nbytes" => s.nbytes,
    }))
}

/// `DriverCounts`: what the simulated driver holds, and its calls per operation.
pub(super) fn driver_counts_dict<'py>(
    py: Python<'py>,
    c: &SimCounts,
) -> PyResult<Bound<'py, PyDict>> {
    let calls = PyDict::new(py);
    for (op, n) in &c.calls {
        calls.set_item(op, n)?;
    }
    Ok(dict!(py, {
        "ranges" => c.ranges,
        "handles" => c.handles,
        "mapped_bytes" => c.mapped_bytes,
        "used_bytes" => &c.used_bytes,
        "host_registered" => c.host_registered,
        "host_allocated" => c.host_allocated,
        "host_pinned_bytes" => c.host_pinned.0,
        "host_peak_pinned_bytes" => c.host_pinned.1,
        "markers" => c.markers,
        "fingerprint_batches" => c.fingerprint_batches,
        "codec_compressed" => c.codec_compressed,
        "codec_stored_raw" => c.codec_stored_raw,
        "codec_decompressed" => c.codec_decompressed,
        "calls" => calls,
    }))
}
