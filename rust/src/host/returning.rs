//! Host buffers on their way back to the OS off the caller's thread.
//!
//! Unpinning and unmapping gigabytes takes as long as pinning them (H200, issue 35: 2.6 s of a 3.4 s sleep went to
//! returning the arena a retained compressed backup no longer needed). A large buffer no longer wanted is handed to
//! a background thread (the store's reclaim thread, `HostPool::defer`) instead; until it is gone its bytes count
//! here, and the host guard counts them as held (`backups::HostRoom`): a room check that fails while some are on
//! their way waits for them and reads the room again, so a sleep is never refused for memory about to be free. A
//! buffer the driver refuses to unpin comes back to the pool for a later trim, as on the caller's thread.

use std::sync::{Condvar, Mutex, MutexGuard};

use super::HostBuffer;

/// Buffers at least this large are returned off the caller's thread (smaller ones cost less than the hand-over).
pub const DEFER_MIN: usize = 64 << 20;

#[derive(Default)]
struct State {
    /// Bytes handed over and not returned yet.
    bytes: usize,
    /// Buffers the driver refused to unpin, for the pool to keep.
    refused: Vec<HostBuffer>,
}

/// The buffers of one pool on their way back (shared with the jobs returning them).
#[derive(Default)]
pub struct Returning {
    state: Mutex<State>,
    gone: Condvar,
}

impl Returning {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes handed over and not yet back with the OS.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    /// Wait until every buffer handed over so far is returned (or refused).
    pub fn wait(&self) {
        let mut s = self.lock();
        while s.bytes > 0 {
            s = self.gone.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    pub(super) fn take_refused(&self) -> Vec<HostBuffer> {
        std::mem::take(&mut self.lock().refused)
    }

    /// Count `buf` as on its way; the job then calls `finish` with it.
    pub(super) fn start(&self, buf: &HostBuffer) {
        self.lock().bytes += buf.len();
    }

    /// Return `buf` to the OS (on the background thread), then stop counting it.
    pub(super) fn finish(&self, buf: HostBuffer) {
        let len = buf.len();
        let refused = buf.release().err();
        let mut s = self.lock();
        if let Some((buf, e)) = refused {
            log::warn!("cumem_rs: returning {len} bytes of host backup memory: {e} (kept for a later trim)");
            s.refused.push(*buf);
        }
        s.bytes -= len;
        if s.bytes == 0 {
            self.gone.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::DEFER_MIN;
    use crate::driver::sim::{SimConfig, SimDriver};
    use crate::driver::Driver;
    use crate::host::HostPool;

    type Job = Box<dyn FnOnce() + Send>;
    static HELD: Mutex<Vec<Job>> = Mutex::new(Vec::new());

    #[test]
    fn a_large_buffer_goes_back_off_the_callers_thread_and_counts_until_it_is_gone() {
        let sim = Arc::new(SimDriver::new(SimConfig::default()).unwrap());
        let driver: Arc<dyn Driver> = sim.clone();
        let mut pool = HostPool::new(driver);
        pool.keep = true;
        // The jobs are held here instead of run: what the caller sees before the background thread gets to them.
        pool.defer = Some(|job| HELD.lock().unwrap().push(job));
        let largest = pool.pin_new(2 * DEFER_MIN).unwrap();
        pool.give_back(largest).unwrap();
        assert_eq!(
            pool.cached_bytes(),
            2 * DEFER_MIN,
            "the largest one offered is kept"
        );
        let big = pool.pin_new(DEFER_MIN).unwrap();
        let small = pool.pin_new(1 << 20).unwrap();
        pool.give_back(small).unwrap();
        assert_eq!(
            sim.counts().host_pinned.0,
            3 * DEFER_MIN,
            "a small one goes back at once"
        );
        // Smaller than the cached one: not kept, and large enough to go back off this thread.
        pool.give_back(big).unwrap();
        assert_eq!(pool.returning.bytes(), DEFER_MIN, "on its way, counted");
        assert_eq!(
            sim.counts().host_pinned.0,
            3 * DEFER_MIN,
            "not unpinned on the caller's thread"
        );
        let jobs: Vec<Job> = std::mem::take(&mut *HELD.lock().unwrap());
        assert_eq!(jobs.len(), 1);
        let returning = pool.returning.clone();
        let t = std::thread::spawn(move || jobs.into_iter().for_each(|j| j()));
        returning.wait();
        t.join().unwrap();
        assert_eq!(
            (pool.returning.bytes(), sim.counts().host_pinned.0),
            (0, 2 * DEFER_MIN)
        );
    }

    #[test]
    fn memory_not_kept_is_back_with_the_os_when_give_back_returns() {
        // torch_memory_saver's resume with retain_cpu_backup=False promises the RSS is down when it returns.
        let sim = Arc::new(SimDriver::new(SimConfig::default()).unwrap());
        let driver: Arc<dyn Driver> = sim.clone();
        let mut pool = HostPool::new(driver);
        pool.keep = false;
        pool.defer =
            Some(|_job| panic!("memory not kept must not be handed to the background thread"));
        let big = pool.pin_new(DEFER_MIN).unwrap();
        pool.give_back(big).unwrap();
        assert_eq!(
            (
                pool.returning.bytes(),
                pool.cached_bytes(),
                sim.counts().host_pinned.0
            ),
            (0, 0, 0)
        );
    }
}
