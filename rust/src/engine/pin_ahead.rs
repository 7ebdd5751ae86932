//! Pinning ahead: a background worker pins, cell by cell, the host arena the next sleep will use, so that the
//! first sleep copies into page-locked memory instead of waiting for the pinning; and the host guard, which
//! refuses to pin more than the host can still give (`crate::host_guard`) rather than let the OS kill the process.
//!
//! The worker owns the buffer while it pins and never takes the engine lock: it hands the buffer back only
//! through its join handle. Every engine call that needs the arena or gives host memory back (sleep,
//! `reserve_host`, `trim_host`, `set_keep_host_memory(false)`, `set_pin_chunk`, close, drop) first stops it: it
//! sets the stop flag, which the worker checks between cells, and joins it (waiting for one cell's pinning at
//! most), then caches the buffer, pinned whole or in part (`stats` and `host_bytes` cache a finished worker's). A sleep takes it from the cache; the cold path of
//! `transfer::issue_copy_out` pins only the cells still unpinned (same cell grid), so no byte is pinned twice.
//! Malloc and free never look at the worker. The worker stops at the host guard's limit, recording one warning.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::{Engine, Inner, THREAD_REFUSED};
use crate::driver::Driver;
use crate::error::{Error, Result};
use crate::host::HostBuffer;
use crate::host_guard::LIMIT_ENV;

/// Context of the errors a worker recorded.
const PIN_AHEAD: &str = "pinning host memory ahead of the next sleep";

/// What a worker gives back: its buffer (pinned in part or whole) and what went wrong, to record.
struct Outcome {
    buf: HostBuffer,
    errors: Vec<(&'static str, Error)>,
}

/// A running (or finished, not yet collected) background pinning worker.
pub(super) struct Worker {
    stop: Arc<AtomicBool>,
    /// Bytes from the start of the buffer that are pinned so far.
    progress: Arc<AtomicUsize>,
    len: usize,
    handle: Option<JoinHandle<Outcome>>,
}

impl Worker {
    fn start(driver: Arc<dyn Driver>, mut buf: HostBuffer, cell: usize) -> Result<Worker> {
        let stop = Arc::new(AtomicBool::new(false));
        let progress = Arc::new(AtomicUsize::new(0));
        let len = buf.len();
        let (flag, done) = (stop.clone(), progress.clone());
        let body = move || {
            let mut errors = Vec::new();
            if let Err(e) = pin_rest(&*driver, &mut buf, cell, &flag, &done) {
                errors.push((PIN_AHEAD, e));
            }
            errors.extend(
                std::mem::take(&mut buf.notes)
                    .into_iter()
                    .map(|e| (THREAD_REFUSED, e)),
            );
            Outcome { buf, errors }
        };
        let handle = std::thread::Builder::new()
            .name("cumem-pin-ahead".into())
            .spawn(body)
            .map_err(|e| {
                Error::InvalidState(format!("thread_spawn: the OS refused a new thread: {e}"))
            })?;
        Ok(Worker {
            stop,
            progress,
            len,
            handle: Some(handle),
        })
    }

    /// Ask the worker to stop after its current cell and wait for it. None when it panicked (its buffer was
    /// dropped, so unpinned, during the unwind).
    fn finish(&mut self) -> Option<Outcome> {
        self.stop.store(true, Ordering::Release);
        self.handle.take().and_then(|h| h.join().ok())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Engine drop (or a collected worker): never leave a thread pinning into a buffer nobody owns.
        drop(self.finish());
    }
}

/// Pin the cells (of `cell` bytes, from the start) of `buf` that are not pinned yet, in order, until `stop` is
/// set, storing in `done` the bytes from the start that are pinned. Stops at the first cell that does not fit in
/// the host memory available or that the driver refuses, with that error (the cells before it stay pinned).
fn pin_rest(
    driver: &dyn Driver,
    buf: &mut HostBuffer,
    cell: usize,
    stop: &AtomicBool,
    done: &AtomicUsize,
) -> Result<()> {
    let len = buf.len();
    let mut off = 0;
    while off < len && !stop.load(Ordering::Acquire) {
        let n = cell.min(len - off);
        if !buf.is_pinned_at(off) {
            check_room(
                driver,
                n,
                &format!("pinning ahead (bytes {off}..{} of {len})", off + n),
            )?;
            buf.pin(off, n)?;
        }
        off += n;
        done.store(off, Ordering::Release);
    }
    Ok(())
}

/// Err(OutOfMemory) naming both numbers when pinning `needed` more bytes would pass what the host can give.
pub(super) fn check_room(driver: &dyn Driver, needed: usize, what: &str) -> Result<()> {
    match driver.host_available() {
        Some(available) if needed > available => Err(Error::OutOfMemory {
            what: format!(
                "{what} needs {needed} bytes of host memory but only {available} bytes are available \
                 (the least of MemAvailable, the cgroup's limit and {LIMIT_ENV})"
            ),
        }),
        _ => Ok(()),
    }
}

/// Progress of the background pinning worker, if one is running.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PinAheadStatus {
    pub running: bool,
    /// Bytes pinned so far from the start of the buffer.
    pub pinned: usize,
    /// Bytes the worker pins in all.
    pub nbytes: usize,
}

impl Engine {
    /// Stop the background worker, if any, record what it reported, and cache its buffer for the next sleep.
    pub(super) fn stop_pin_ahead(&self, inner: &mut Inner) {
        let Some(mut worker) = inner.pin_ahead.take() else {
            return;
        };
        let Some(out) = worker.finish() else {
            let e = Error::InvalidState("the worker panicked; its buffer was released".into());
            Self::record(inner, PIN_AHEAD, &e);
            return;
        };
        for (context, e) in &out.errors {
            Self::record(inner, context, e);
        }
        if let Err(e) = inner.host.cache(out.buf) {
            Self::record(inner, "returning cached host backup memory", &e);
        }
    }

    /// Cache the buffer of a worker that has finished (no waiting), so that host byte counts include it.
    pub(super) fn collect_finished_pin_ahead(&self, inner: &mut Inner) {
        let finished = (inner.pin_ahead.as_ref())
            .is_some_and(|w| w.handle.as_ref().is_none_or(|h| h.is_finished()));
        if finished {
            self.stop_pin_ahead(inner);
        }
    }

    /// Start pinning `len` bytes of host memory for the next sleep in the background (see the module comment).
    /// A buffer already cached for it is reused (its pinned cells are kept); one wholly pinned needs no worker.
    pub(super) fn start_pin_ahead(&self, inner: &mut Inner, len: usize) -> Result<()> {
        if inner.pin_ahead.as_ref().is_some_and(|w| w.len >= len) {
            return Ok(()); // already pinning enough (a block of the same tags ended again)
        }
        self.stop_pin_ahead(inner);
        let buf = match inner.host.take_cached(len) {
            Some(b) if b.unpinned_below(b.len()) == 0 => return inner.host.cache(b),
            Some(b) => b,
            None => {
                inner.host.trim()?;
                HostBuffer::map_unpinned(&self.driver, len)?
            }
        };
        inner.largest_backup = inner.largest_backup.max(len);
        let started = self
            .driver
            .thread_spawn()
            .and_then(|()| Worker::start(self.driver.clone(), buf, inner.pin_chunk));
        match started {
            Ok(w) => inner.pin_ahead = Some(w),
            // No background work: the next sleep pins as it would have without it.
            Err(e) => Self::record(
                inner,
                "starting the background pinning worker (not pinning ahead)",
                &e,
            ),
        }
        Ok(())
    }

    /// `reserve_host` now: stop the worker, finish pinning a cached buffer large enough (its pinned cells are
    /// kept), else pin a new one, after the host guard's check.
    pub(super) fn reserve_now(&self, inner: &mut Inner, len: usize) -> Result<()> {
        self.stop_pin_ahead(inner);
        let what = format!("reserve_host({len}), refused,");
        let Some(mut buf) = inner.host.take_cached(len) else {
            inner.host.trim()?;
            check_room(&*self.driver, len, &what)?;
            return inner.host.reserve(len);
        };
        let rest = buf.unpinned_below(buf.len());
        let (stop, done) = (AtomicBool::new(false), AtomicUsize::new(0));
        let pinned = check_room(&*self.driver, rest, &what)
            .and_then(|()| pin_rest(&*self.driver, &mut buf, inner.pin_chunk, &stop, &done));
        let notes = std::mem::take(&mut buf.notes);
        inner.host.notes.extend(notes);
        // Cached even after a failure: its pinned cells serve the next sleep.
        inner.host.cache(buf)?;
        pinned
    }

    /// Bytes of the arena a sleep offloading `tags` would need now: their awake allocations, except those of
    /// tags whose policy is not to back up and those with a retained backup (which need no new arena). What to
    /// pin ahead when the allocations of those tags have been made.
    pub fn backup_bytes_of<S: AsRef<str>>(&self, tags: &[S]) -> Result<usize> {
        let wanted = super::tag_set(tags);
        let inner = self.lock_open()?;
        Ok((inner.reg.iter())
            .filter(|a| a.is_awake() && wanted.contains(&*a.tag))
            .filter(|a| {
                inner.policies.pause_backup(&a.tag) && !inner.retained.contains_key(&a.addr)
            })
            .map(|a| a.size)
            .sum())
    }

    /// The background pinning worker's progress (not running when none was started or it was collected).
    pub fn pin_ahead_status(&self) -> PinAheadStatus {
        let inner = self.inner.lock();
        inner
            .pin_ahead
            .as_ref()
            .map_or_else(PinAheadStatus::default, |w| PinAheadStatus {
                running: w.handle.as_ref().is_some_and(|h| !h.is_finished()),
                pinned: w.progress.load(Ordering::Acquire),
                nbytes: w.len,
            })
    }

    /// Stop background pinning now (the part pinned stays cached for the next sleep).
    pub fn stop_pinning_ahead(&self) -> Result<()> {
        let mut inner = self.lock_unpoisoned()?;
        self.stop_pin_ahead(&mut inner);
        Ok(())
    }
}
