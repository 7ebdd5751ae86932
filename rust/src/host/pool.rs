//! `HostPool`: the host buffer kept between sleeps, so that a steady sleep pins nothing.
//!
//! Policy `keep` (the default) caches the largest buffer a wake gave back; without it buffers go back to the OS.
//! A buffer the driver refuses to unpin stays cached for a later trim instead of leaking its registration.

use std::sync::Arc;

use super::returning::{Returning, DEFER_MIN};
use super::HostBuffer;
use crate::driver::Driver;
use crate::error::{Error, Result};

/// Runs a job off the caller's thread (the backup store's reclaim thread).
pub type Defer = fn(Box<dyn FnOnce() + Send>);

/// The host buffer cached for the next sleep: one at most (the largest offered), since a second one would only
/// hold RAM twice; more only while the driver refuses to unpin one (kept for a later trim rather than leaked).
pub struct HostPool {
    driver: Arc<dyn Driver>,
    cached: Vec<HostBuffer>,
    /// Registration failures that the fallback absorbed, for the engine to record.
    pub fallbacks: Vec<Error>,
    /// Helper threads that could not start while pinning (the work ran on the calling thread).
    pub notes: Vec<Error>,
    /// Keep buffers after wake (fast next sleep) or give them back to the OS (low host RAM).
    pub keep: bool,
    /// Large buffers on their way back to the OS (returning.rs), and how a job is run off the caller's thread
    /// (None: every buffer is returned on the caller's thread).
    pub returning: Arc<Returning>,
    pub defer: Option<Defer>,
}

impl HostPool {
    pub fn new(driver: Arc<dyn Driver>) -> Self {
        HostPool {
            driver,
            cached: Vec::new(),
            fallbacks: Vec::new(),
            notes: Vec::new(),
            keep: true,
            returning: Arc::default(),
            defer: None,
        }
    }

    /// A buffer of at least `len` bytes: the smallest cached one that fits, else a new one of exactly `len`
    /// bytes (cached buffers too small for it are returned to the OS first, so RAM is not held twice).
    pub fn acquire(&mut self, len: usize) -> Result<HostBuffer> {
        if let Some(buf) = self.take_cached(len) {
            return Ok(buf);
        }
        self.trim()?;
        self.pin_new(len)
    }

    /// A new buffer of exactly `len` bytes, not from the cache; what its pinning absorbed (a registration
    /// fallback, a helper thread that did not start) is kept for the engine to record.
    pub fn pin_new(&mut self, len: usize) -> Result<HostBuffer> {
        self.pin_new_growable(len, len)
    }

    /// A new buffer as `pin_new` gives, with address space to grow to `reserve` bytes in place.
    pub fn pin_new_growable(&mut self, len: usize, reserve: usize) -> Result<HostBuffer> {
        let (mut buf, fallback) = HostBuffer::acquire_growable(&self.driver, len, reserve)?;
        self.fallbacks.extend(fallback);
        self.notes.append(&mut buf.notes);
        Ok(buf)
    }

    /// The cached buffer that serves `len` bytes with the least memory: the smallest of at least `len`, else one
    /// that can grow in place to `len` (the caller grows it), if any.
    pub fn take_cached_or_growable(&mut self, len: usize) -> Option<HostBuffer> {
        if let Some(b) = self.take_cached(len) {
            return Some(b);
        }
        let i = (self.cached.iter()).position(|b| b.len() + b.room_to_grow() >= len)?;
        Some(self.cached.swap_remove(i))
    }

    /// The smallest cached buffer of at least `len` bytes, if any.
    pub fn take_cached(&mut self, len: usize) -> Option<HostBuffer> {
        let best = self
            .cached
            .iter()
            .enumerate()
            .filter(|(_, b)| b.len() >= len)
            .min_by_key(|(_, b)| b.len());
        best.map(|(i, _)| i).map(|i| self.cached.swap_remove(i))
    }

    /// Take back a buffer no allocation uses any more: cached if it is the largest one offered (policy `keep`),
    /// else returned to the OS.
    pub fn give_back(&mut self, buf: HostBuffer) -> Result<()> {
        if !self.keep {
            // Host memory is not kept (low host RAM; torch_memory_saver's retain_cpu_backup=False): it is back with
            // the OS when the call returns, as torch_memory_saver's resume promises (its RSS test measures it).
            return self.release_on(buf, false);
        }
        self.cache(buf)
    }

    /// Cache `buf` for the next sleep if it is the largest one offered, else return it to the OS (whatever the
    /// `keep` policy: a buffer reserved or pinned ahead for the next sleep).
    pub fn cache(&mut self, buf: HostBuffer) -> Result<()> {
        let largest = self.cached.iter().map(HostBuffer::len).max().unwrap_or(0);
        if buf.len() <= largest {
            return self.release_or_keep(buf);
        }
        let smaller = std::mem::replace(&mut self.cached, vec![buf]);
        let mut first_err = Ok(());
        for old in smaller {
            if let Err(e) = self.release_or_keep(old) {
                first_err = first_err.and(Err(e));
            }
        }
        first_err
    }

    fn release_or_keep(&mut self, buf: HostBuffer) -> Result<()> {
        self.release_on(buf, true)
    }

    /// Return `buf` to the OS, off the caller's thread where `may_defer` and it is large (returning.rs).
    fn release_on(&mut self, buf: HostBuffer, may_defer: bool) -> Result<()> {
        // Those the driver refused to unpin off the caller's thread, kept for a later trim.
        self.cached.append(&mut self.returning.take_refused());
        if let Some(defer) = self.defer.filter(|_| may_defer && buf.len() >= DEFER_MIN) {
            self.returning.start(&buf);
            let returning = self.returning.clone();
            defer(Box::new(move || returning.finish(buf)));
            return Ok(());
        }
        buf.release().map_err(|(buf, e)| {
            // Keep it for the next trim rather than leak the registration.
            self.cached.push(*buf);
            e
        })
    }

    /// Make sure at least `len` bytes are cached (reserve ahead of the first sleep).
    pub fn reserve(&mut self, len: usize) -> Result<()> {
        if self.cached.iter().any(|b| b.len() >= len) {
            return Ok(());
        }
        // `acquire` returned the cached buffers to the OS first (none was large enough), so this is the only one.
        let buf = self.acquire(len)?;
        self.cached.push(buf);
        Ok(())
    }

    pub fn cached_bytes(&self) -> usize {
        self.cached.iter().map(HostBuffer::len).sum()
    }

    /// Bytes of the cached buffers already pinned (a buffer pinned ahead may be pinned in part only).
    pub fn cached_pinned_bytes(&self) -> usize {
        self.cached
            .iter()
            .map(|b| b.len() - b.unpinned_below(b.len()))
            .sum()
    }

    /// Return every cached buffer to the OS, the large ones off the caller's thread (returning.rs); the bytes
    /// given up. The first error is reported after all were tried, and buffers the driver refused stay cached for
    /// a later trim.
    pub fn trim(&mut self) -> Result<usize> {
        self.trim_unless(|_| false)
    }

    /// Return to the OS every cached buffer for which `keep` says no (off the caller's thread where large, as
    /// `trim`): a caller about to pin a new buffer because none cached serves it drops those that serve nothing
    /// else, so the new one is never held beside them.
    pub fn trim_unless(&mut self, keep: impl Fn(&HostBuffer) -> bool) -> Result<usize> {
        let (kept, drop): (Vec<HostBuffer>, Vec<HostBuffer>) = std::mem::take(&mut self.cached)
            .into_iter()
            .partition(|b| keep(b));
        self.cached = kept;
        let mut freed = 0;
        let mut first_err = None;
        for buf in drop {
            let len = buf.len();
            match self.release_or_keep(buf) {
                Ok(()) => freed += len,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(freed), Err)
    }

    /// `trim`, everything back with the OS when it returns (`trim_host`, close): buffers on their way are waited
    /// for, and those returned now are returned on this thread.
    pub fn trim_now(&mut self) -> Result<usize> {
        self.returning.wait();
        let defer = self.defer.take();
        let trimmed = self.trim();
        self.defer = defer;
        trimmed
    }
}
