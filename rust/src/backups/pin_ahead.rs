//! Pinning ahead: a background worker pins, cell by cell, the host arena the next sleep will use, so that the
//! first sleep copies into page-locked memory instead of waiting for the pinning; and the host guard, which
//! refuses to pin more than the host can still give (`crate::host_guard`) rather than let the OS kill the process.
//!
//! The worker owns the buffer while it pins and never takes the engine lock: it hands the buffer back only
//! through its join handle. Every call that needs the arena or gives host memory back (sleep,
//! `reserve_host`, `trim_host`, `set_keep_host_memory(false)`, `set_pin_chunk`, close, drop) first stops it: it
//! sets the stop flag, which the worker checks between cells, and joins it (waiting for one cell's pinning at
//! most), then caches the buffer, pinned whole or in part (`stats` and `host_bytes` cache a finished worker's). A sleep takes it from the cache; the cold path of
//! `transfer::issue_copy_out` pins only the cells still unpinned (same cell grid), so no byte is pinned twice.
//! Malloc and free never look at the worker. The worker stops at the host guard's limit, recording one warning.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::{BackupStore, THREAD_REFUSED};
use crate::driver::Driver;
use crate::error::{Error, Result};
use crate::error_log::ErrorLog;
use crate::host::returning::Returning;
use crate::host::HostBuffer;
use crate::host_guard::{LIMIT_ENV, MARGIN_ENV};

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
    /// A worker pinning `buf` in cells of `cell` bytes, the store holding `held` bytes of host memory beside it.
    fn start(room: HostRoom, held: usize, mut buf: HostBuffer, cell: usize) -> Result<Worker> {
        let stop = Arc::new(AtomicBool::new(false));
        let progress = Arc::new(AtomicUsize::new(0));
        let len = buf.len();
        let (flag, done) = (stop.clone(), progress.clone());
        let body = move || {
            let mut errors = Vec::new();
            if let Err(e) = pin_rest(&room, held, &mut buf, cell, &flag, &done) {
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
/// the host memory available (the store holding `held` bytes beside `buf`) or that the driver refuses, with that
/// error (the cells before it stay pinned). Each cell is checked before its pages are touched: touching is what a
/// memory cgroup charges, so the check comes first or the kernel may kill the process during the touch.
fn pin_rest(
    room: &HostRoom,
    held: usize,
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
            let pinned = len - buf.unpinned_below(len);
            room.check(
                n,
                held + pinned,
                &format!("pinning ahead (bytes {off}..{} of {len})", off + n),
            )?;
            buf.pin(off, n)?;
        }
        off += n;
        done.store(off, Ordering::Release);
    }
    Ok(())
}

/// What the host can still give to pinning: the room the host leaves (on a simulated machine the driver's
/// answer, `Driver::host_available`; else `crate::host_guard::available`, MemAvailable and the memory cgroups, less
/// a margin for the process itself) and the configured cap less what the store holds.
#[derive(Clone)]
pub(super) struct HostRoom {
    pub driver: Arc<dyn Driver>,
    /// `CUMEM_RS_HOST_MEMORY_LIMIT`: the most host memory the store may hold (pinned or being returned).
    pub cap: Option<usize>,
    /// Bytes of the host's room kept for the process itself (`CUMEM_RS_HOST_MARGIN`).
    pub margin: usize,
    /// Reads the host's room (`host_guard::available`; a fixed answer in unit tests).
    pub reading: fn() -> Option<usize>,
    /// Host buffers on their way back to the OS (host/returning.rs): held until they are gone.
    pub returning: Arc<Returning>,
}

impl HostRoom {
    /// What may still be pinned now, if known, while the store holds `held` bytes of host memory besides the
    /// buffers on their way back (what the host reading counts already: only the cap needs telling).
    pub fn available(&self, held: usize) -> Option<usize> {
        let host = match self.driver.host_available() {
            Some(simulated) => Some(simulated),
            None => (self.reading)().map(|a| a.saturating_sub(self.margin)),
        };
        let held = held + self.returning.bytes();
        [host, self.cap.map(|c| c.saturating_sub(held))]
            .into_iter()
            .flatten()
            .min()
    }

    /// Err(OutOfMemory) naming the numbers when pinning `needed` more bytes, beside the `held` the store holds,
    /// would pass what the host can give.
    pub fn check(&self, needed: usize, held: usize, what: &str) -> Result<()> {
        if self.available(held).is_some_and(|a| needed > a) && self.returning.bytes() > 0 {
            // Memory on its way back is about to be free: wait for it rather than refuse.
            self.returning.wait();
        }
        match self.available(held) {
            Some(available) if needed > available => Err(Error::OutOfMemory {
                what: format!(
                    "{what} needs {needed} bytes of host memory but only {available} bytes are available (the \
                     least of MemAvailable and the memory cgroups' room less {} bytes kept for the process \
                     ({MARGIN_ENV}), and {LIMIT_ENV}{} less the {held} bytes of host memory held for backups)",
                    self.margin,
                    self.cap.map_or(" (unset)".to_string(), |c| format!("={c}")),
                ),
            }),
            _ => Ok(()),
        }
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

impl BackupStore {
    /// Stop the background worker, if any, record what it reported, and cache its buffer for the next sleep.
    pub fn stop_pin_ahead(&mut self, log: &mut ErrorLog) {
        let Some(mut worker) = self.pin_ahead.take() else {
            return;
        };
        let Some(out) = worker.finish() else {
            let e = Error::InvalidState("the worker panicked; its buffer was released".into());
            log.record(PIN_AHEAD, &e);
            return;
        };
        for (context, e) in &out.errors {
            log.record(context, e);
        }
        let mut buf = out.buf;
        if (out.errors.iter()).any(|(_, e)| matches!(e, Error::OutOfMemory { .. })) {
            // Stopped at the host's room: the buffer ends at its pinned cells (the rest is address space, left as
            // room to grow), so that what it is counted as holding is what it holds.
            buf.cut_unpinned_tail();
        }
        if let Err(e) = self.host.cache(buf) {
            log.record("returning cached host backup memory", &e);
        }
    }

    /// Cache the buffer of a worker that has finished (no waiting), so that host byte counts include it.
    pub fn collect_finished_pin_ahead(&mut self, log: &mut ErrorLog) {
        let finished = (self.pin_ahead.as_ref())
            .is_some_and(|w| w.handle.as_ref().is_none_or(|h| h.is_finished()));
        if finished {
            self.stop_pin_ahead(log);
        }
    }

    /// Start pinning `len` bytes of host memory for the next sleep in the background (see the module comment).
    /// A buffer already cached for it is reused (its pinned cells are kept); one wholly pinned needs no worker.
    pub fn start_pin_ahead(&mut self, len: usize, log: &mut ErrorLog) -> Result<()> {
        if self.pin_ahead.as_ref().is_some_and(|w| w.len >= len) {
            return Ok(()); // already pinning enough (a block of the same tags ended again)
        }
        self.stop_pin_ahead(log);
        self.make_room_for_spare(len, log);
        // Within the host budget: pin what it allows (the sleep refuses or spills the rest).
        let len = match self.budget_room() {
            Some(room) if room < len => {
                log::debug!("pinning ahead {room} of {len} bytes: the host budget allows no more");
                self.host.trim()?;
                room
            }
            _ => len,
        };
        if len == 0 {
            return Ok(());
        }
        let buf = match self.host.take_cached(len) {
            Some(b) if b.unpinned_below(b.len()) == 0 => return self.host.cache(b),
            Some(b) => b,
            None => {
                self.host.trim()?;
                HostBuffer::map_unpinned(&self.driver, len)?
            }
        };
        self.largest = self.largest.max(len);
        let started = self
            .driver
            .thread_spawn()
            .and_then(|()| Worker::start(self.room.clone(), self.resident(), buf, self.pin_chunk));
        match started {
            Ok(w) => self.pin_ahead = Some(w),
            // No background work: the next sleep pins as it would have without it.
            Err(e) => log.record(
                "starting the background pinning worker (not pinning ahead)",
                &e,
            ),
        }
        Ok(())
    }

    /// Make sure `len` bytes of pinned host memory are cached for the next sleep, now: stop the worker, finish
    /// pinning a cached buffer large enough (its pinned cells are kept), else pin a new one, after the host
    /// guard's check.
    pub fn reserve_now(&mut self, len: usize, log: &mut ErrorLog) -> Result<()> {
        let r = self.reserve_pinned(len, log);
        if r.is_ok() {
            self.largest = self.largest.max(len);
        }
        self.record_host_fallbacks(log);
        r
    }

    fn reserve_pinned(&mut self, len: usize, log: &mut ErrorLog) -> Result<()> {
        self.stop_pin_ahead(log);
        self.make_room_for_spare(len, log);
        let what = format!("reserve_host({len}), refused,");
        self.check_budget(len, &what)?;
        let Some(mut buf) = self.host.take_cached(len) else {
            self.host.trim()?;
            self.room.check(len, self.resident(), &what)?;
            return self.host.reserve(len);
        };
        let rest = buf.unpinned_below(buf.len());
        let (stop, done) = (AtomicBool::new(false), AtomicUsize::new(0));
        let base = self.resident();
        let pinned = (self.room.check(rest, base + (buf.len() - rest), &what))
            .and_then(|()| pin_rest(&self.room, base, &mut buf, self.pin_chunk, &stop, &done));
        let notes = std::mem::take(&mut buf.notes);
        self.host.notes.extend(notes);
        if matches!(pinned, Err(Error::OutOfMemory { .. })) {
            buf.cut_unpinned_tail(); // held as what it holds (see `stop_pin_ahead`)
        }
        // Cached even after a failure: its pinned cells serve the next sleep.
        self.host.cache(buf)?;
        pinned
    }

    /// The background pinning worker's progress (not running when none was started or it was collected).
    pub fn pin_ahead_status(&self) -> PinAheadStatus {
        self.pin_ahead
            .as_ref()
            .map_or_else(PinAheadStatus::default, |w| PinAheadStatus {
                running: w.handle.as_ref().is_some_and(|h| !h.is_finished()),
                pinned: w.progress.load(Ordering::Acquire),
                nbytes: w.len,
            })
    }

    /// Bytes of the buffer the worker holds (pinning, or done and not collected yet).
    pub(super) fn pin_ahead_bytes(&self) -> usize {
        self.pin_ahead.as_ref().map_or(0, |w| w.len)
    }

    /// Bytes the worker has pinned so far.
    pub(super) fn pin_ahead_pinned(&self) -> usize {
        (self.pin_ahead.as_ref()).map_or(0, |w| w.progress.load(Ordering::Acquire))
    }

    pub fn pin_chunk(&self) -> usize {
        self.pin_chunk
    }

    /// A new cell size for pipelined pinning. A buffer pinned ahead in cells of the old size would not match the
    /// next sleep's cells: the worker is stopped first.
    pub fn set_pin_chunk(&mut self, chunk: usize, log: &mut ErrorLog) {
        self.stop_pin_ahead(log);
        self.pin_chunk = chunk;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::sim::{SimConfig, SimDriver};

    const M: usize = 1 << 20;

    fn room(cap: Option<usize>) -> HostRoom {
        HostRoom {
            driver: Arc::new(SimDriver::new(SimConfig::default()).unwrap()),
            cap,
            margin: 256 * M,
            reading: || Some(1024 * M),
            returning: Arc::default(),
        }
    }

    #[test]
    fn the_room_is_the_hosts_less_the_margin_and_the_cap_less_what_is_held() {
        let r = room(None);
        assert_eq!(r.available(0), Some(768 * M), "the margin is the process's");
        assert!(r.check(768 * M, 0, "x").is_ok());
        let e = r.check(768 * M + 1, 0, "a test").unwrap_err().to_string();
        assert!(
            e.contains("CUMEM_RS_HOST_MARGIN") && e.contains("a test"),
            "{e}"
        );
        let r = room(Some(100 * M));
        assert_eq!(
            r.available(30 * M),
            Some(70 * M),
            "the cap bounds what the store holds"
        );
        assert_eq!(r.available(200 * M), Some(0));
        // A simulated machine's own budget is the host's room: no margin (it has no process of its own).
        let sim = SimDriver::new(SimConfig {
            host_memory: Some(64 * M),
            ..SimConfig::default()
        });
        let r = HostRoom {
            driver: Arc::new(sim.unwrap()),
            ..room(None)
        };
        assert_eq!(r.available(0), Some(64 * M));
    }
}
