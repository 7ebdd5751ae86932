//! Giving spill-file disk blocks back off the caller's thread (and large host buffers: host/returning.rs).
//!
//! Closing the last descriptor of an unlinked spill file makes the file system free its blocks then and there:
//! measured on the GPU host, 1.0-1.2 s for a 3.9 GiB file, at the end of the wake that dropped its last backup
//! (a wake whose reads took under 3 s: a third more on top). Punching the holes a partial wake leaves costs the
//! same per byte. Neither is anything the caller waits for: the data is already
//! where it belongs. So the store hands both to one background thread (`defer`), and waits for them only where
//! the space must really be back: before the next sleep checks the free space (`SpillDir::check_space`), when
//! the allocator closes, and when asked (`settle`: `Allocator.settle_spill_files()`).
//!
//! One thread for the process, started on first use. A job that cannot be handed over (the thread would not
//! start) runs on the caller's thread, as before. In a forked child the parent's thread does not exist: the
//! first call there starts afresh (the parent's queued jobs hold descriptors the child closes at its exit).

use std::sync::mpsc::{channel, Sender};
use std::sync::{Condvar, Mutex, OnceLock};

type Job = Box<dyn FnOnce() + Send>;

struct State {
    /// The process the thread runs in (a forked child has none).
    pid: u32,
    tx: Option<Sender<Job>>,
    /// Jobs handed over and not finished yet.
    pending: usize,
}

struct Reclaimer {
    state: Mutex<State>,
    idle: Condvar,
}

fn reclaimer() -> &'static Reclaimer {
    static R: OnceLock<Reclaimer> = OnceLock::new();
    R.get_or_init(|| Reclaimer {
        state: Mutex::new(State {
            pid: 0,
            tx: None,
            pending: 0,
        }),
        idle: Condvar::new(),
    })
}

impl Reclaimer {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.pid != std::process::id() {
            // A new process (first use, or a forked child): no thread runs here, nothing is pending here.
            s.pid = std::process::id();
            s.tx = None;
            s.pending = 0;
        }
        s
    }

    fn start(&'static self) -> Option<Sender<Job>> {
        let (tx, rx) = channel::<Job>();
        let spawned = std::thread::Builder::new()
            .name("cumem-rs-spill-reclaim".into())
            .spawn(move || {
                for job in rx {
                    // A panic in a job (none is expected: they close files and punch holes) must not stop the
                    // thread or leave `pending` counting it.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                    let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
                    s.pending = s.pending.saturating_sub(1);
                    if s.pending == 0 {
                        self.idle.notify_all();
                    }
                }
            });
        match spawned {
            Ok(_) => Some(tx),
            Err(e) => {
                log::warn!(
                    "cumem_rs: could not start the spill-file reclaim thread ({e}); spill files are closed on the \
                     calling thread"
                );
                None
            }
        }
    }
}

/// Run `job` (closing a spill file, punching its released ranges) on the reclaim thread; on this thread when
/// that thread cannot be had.
pub fn defer(job: impl FnOnce() + Send + 'static) {
    let r = reclaimer();
    let job: Job = Box::new(job);
    let job = {
        let mut s = r.lock();
        if s.tx.is_none() {
            s.tx = r.start();
        }
        match &s.tx {
            Some(tx) => match tx.send(job) {
                Ok(()) => {
                    s.pending += 1;
                    return;
                }
                Err(returned) => {
                    s.tx = None;
                    returned.0
                }
            },
            None => job,
        }
    };
    job();
}

/// `defer` of a boxed job: the host pool's way off the caller's thread (host/returning.rs).
pub fn defer_boxed(job: Box<dyn FnOnce() + Send>) {
    defer(job);
}

/// Wait until every job deferred so far has run (those they defer in turn included).
pub fn settle() {
    let r = reclaimer();
    let mut s = r.lock();
    while s.pending > 0 {
        s = r.idle.wait(s).unwrap_or_else(|p| p.into_inner());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn deferred_jobs_run_on_another_thread_and_settle_waits_for_them_and_for_what_they_defer() {
        let done = Arc::new(AtomicUsize::new(0));
        let caller = std::thread::current().id();
        for _ in 0..3 {
            let done = done.clone();
            defer(move || {
                assert_ne!(
                    std::thread::current().id(),
                    caller,
                    "ran on the caller's thread"
                );
                std::thread::sleep(Duration::from_millis(30));
                let inner = done.clone();
                // A job that drops the last reference of a file defers that file's close in turn.
                defer(move || {
                    std::thread::sleep(Duration::from_millis(30));
                    inner.fetch_add(1, Ordering::SeqCst);
                });
                done.fetch_add(1, Ordering::SeqCst);
            });
        }
        settle();
        assert_eq!(done.load(Ordering::SeqCst), 6);
    }
}
