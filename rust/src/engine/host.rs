//! The engine's host-memory controls: what the backup store keeps, retains, reserves and pins ahead. Each takes
//! the lock and hands the work to the store.

use super::Engine;
use crate::backups::{FaultKind, PinAheadStatus};
use crate::error::{Error, Result};
use crate::fingerprint;

impl Engine {
    /// Cell size of pipelined pinning during a cold sleep, rounded up to whole pages. Zero, or a size that
    /// cannot be rounded up to a page within `isize::MAX`, is refused.
    pub fn set_pin_chunk(&self, bytes: usize) -> Result<()> {
        let page = rustix::param::page_size();
        let chunk = Some(bytes)
            .filter(|b| *b > 0)
            .and_then(|b| b.checked_next_multiple_of(page))
            .filter(|c| *c <= isize::MAX as usize)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "pin chunk must be between 1 and {} bytes, got {bytes}",
                    isize::MAX as usize / page * page
                ))
            })?;
        let mut locked = self.lock_open()?;
        let inner = &mut *locked;
        inner.backups.set_pin_chunk(chunk, &mut inner.log);
        Ok(())
    }

    /// Cap the pinned host memory held for backups (`host_bytes()`) at `budget` bytes, or lift the cap (None).
    /// A sleep whose backup would pass it spills to files where a spill directory is set, else is refused.
    pub fn set_host_budget(&self, budget: Option<usize>) -> Result<()> {
        let mut locked = self.lock_open()?;
        let inner = &mut *locked;
        inner.backups.set_host_budget(budget, &mut inner.log)
    }

    /// The host budget (`set_host_budget`), if one is set.
    pub fn host_budget(&self) -> Result<Option<usize>> {
        Ok(self.lock_open()?.backups.host_budget())
    }

    /// Set (or with None remove) the file tier's spill directory: an existing directory this process can create
    /// files in, else InvalidArgument naming it (a relative path is made absolute now). Backups already in files
    /// stay there.
    pub fn set_spill_dir(&self, path: Option<&std::path::Path>) -> Result<()> {
        self.set_spill_dir_named(path, false)
    }

    /// `set_spill_dir`; with `named`, each file-tier backup is a named file of its own in the directory, removed
    /// when the backup is dropped (torch_memory_saver's disk backup; see backups/spill_file.rs).
    pub fn set_spill_dir_named(&self, path: Option<&std::path::Path>, named: bool) -> Result<()> {
        self.lock_open()?.backups.set_spill_dir(path, named)
    }

    /// Wait until the disk blocks that spill files dropped so far held are back: the file system frees them when
    /// a file closes or a hole is punched, which the reclaim thread does after the call that dropped them.
    pub fn settle_spill_files(&self) {
        crate::backups::settle_spill_files();
    }

    pub fn spill_dir(&self) -> Result<Option<std::path::PathBuf>> {
        Ok(self.lock_open()?.backups.spill_dir())
    }

    /// Size of the file tier's pinned staging ring (default 256 MiB).
    pub fn set_staging_bytes(&self, bytes: usize) -> Result<()> {
        self.lock_open()?.backups.set_staging_bytes(bytes)
    }

    pub fn staging_bytes(&self) -> Result<usize> {
        Ok(self.lock_open()?.backups.staging_bytes())
    }

    /// Test hook: the `nth` next spill-file `op` ("write" or "read") fails with `kind` ("short", "enospc", "eio").
    pub fn inject_spill_fault(&self, op: &str, nth: u64, kind: &str) -> Result<()> {
        let write = match op {
            "write" => true,
            "read" => false,
            _ => {
                return Err(Error::invalid(format!(
                    "op must be \"write\" or \"read\", got {op:?}"
                )))
            }
        };
        let kind = FaultKind::parse(kind)?;
        self.lock_open()?
            .backups
            .inject_spill_fault(write, nth, kind)
    }

    pub fn clear_spill_faults(&self) -> Result<()> {
        self.lock_open()?.backups.clear_spill_faults();
        Ok(())
    }

    pub fn set_keep_host_memory(&self, keep: bool) -> Result<()> {
        let mut locked = self.lock_open()?;
        let inner = &mut *locked;
        inner.backups.set_keep_host_memory(keep, &mut inner.log)
    }

    /// Whether cached host backup memory is kept after a wake (`set_keep_host_memory`).
    pub fn keep_host_memory(&self) -> Result<bool> {
        Ok(self.lock_open()?.backups.keeps_host_memory())
    }

    /// Keep backups bound to their allocations across wake, so that a sleep copies only the chunks that
    /// changed (on by default where the fingerprint kernel runs). Off drops every retained backup.
    pub fn set_retain_backups(&self, on: bool) -> Result<()> {
        let mut locked = self.lock_open()?;
        let inner = &mut *locked;
        inner.backups.set_retain(on, &mut inner.log);
        Ok(())
    }

    /// Whether wakes keep backups now (policy on, host memory kept, fingerprint kernel available).
    pub fn retains_backups(&self) -> Result<bool> {
        Ok(self.lock_open()?.backups.retaining())
    }

    /// Compare what every wake restores with the fingerprints its sleep took, at every tier (on by default;
    /// `CUMEM_RS_VERIFY_WAKE=0` starts it off). Sleeps take those prints while it is on (or while backups are
    /// retained): a backup made by a sleep that took none is restored unverified.
    pub fn set_verify_wakes(&self, on: bool) -> Result<()> {
        self.lock_open()?.backups.set_verify_wakes(on);
        Ok(())
    }

    /// Whether wakes verify what they restore (`set_verify_wakes`).
    pub fn verifies_wakes(&self) -> Result<bool> {
        Ok(self.lock_open()?.backups.verifies_wakes())
    }

    /// Bytes per fingerprinted chunk: a positive multiple of 16. A change drops every retained backup.
    pub fn set_fingerprint_chunk(&self, bytes: usize) -> Result<()> {
        if bytes == 0 || !bytes.is_multiple_of(fingerprint::WORD) || bytes > 1 << 40 {
            return Err(Error::invalid(format!(
                "fingerprint chunk must be a positive multiple of {} bytes up to 1 TiB, got {bytes}",
                fingerprint::WORD
            )));
        }
        let mut locked = self.lock_open()?;
        let inner = &mut *locked;
        inner.backups.set_fingerprint_chunk(bytes, &mut inner.log);
        Ok(())
    }

    /// Make sure `len` bytes of pinned host memory are cached for the next sleep: now, or (`background`) on a
    /// worker thread that the next sleep stops and takes over (backups/pin_ahead.rs). Refused with an
    /// out-of-memory error when the host cannot give that much (a background worker stops at the limit instead,
    /// recording it).
    pub fn reserve_host(&self, len: usize, background: bool) -> Result<()> {
        if len == 0 {
            return Err(Error::invalid(
                "reserve_host needs a positive number of bytes",
            ));
        }
        let mut locked = self.lock_open()?;
        let inner = &mut *locked;
        if background {
            inner.backups.start_pin_ahead(len, &mut inner.log)
        } else {
            inner.backups.reserve_now(len, &mut inner.log)
        }
    }

    /// Return cached host backup memory (and every retained backup's) to the OS; the bytes freed.
    pub fn trim_host(&self) -> Result<usize> {
        let mut locked = self.lock_open()?;
        let inner = &mut *locked;
        self.retry_pending(inner);
        inner.backups.trim(&mut inner.log)
    }

    /// The background pinning worker's progress (not running when none was started or it was collected).
    pub fn pin_ahead_status(&self) -> Result<PinAheadStatus> {
        Ok(self.lock_open()?.backups.pin_ahead_status())
    }

    /// Stop background pinning now (the part pinned stays cached for the next sleep).
    pub fn stop_pinning_ahead(&self) -> Result<()> {
        let mut locked = self.lock_open()?;
        let inner = &mut *locked;
        inner.backups.stop_pin_ahead(&mut inner.log);
        Ok(())
    }
}
