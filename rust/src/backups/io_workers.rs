//! The file tier's I/O threads: a few writer or reader threads per pipeline (sleep: file_tier.rs and
//! file_packed.rs; wake: file_wake.rs and file_packed.rs), fed slot by slot, and the I/O length of a backup.

use std::collections::VecDeque;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::Scope;

use super::spill_file::IO_ALIGN;
use crate::driver::Driver;
use crate::error::Error;

/// Writer or reader threads doing a pipeline's file I/O; on the calling thread when none can be started.
pub(super) struct Workers<T, R> {
    tx: Option<Sender<T>>,
    rx: Receiver<R>,
    threads: usize,
    /// Why fewer threads than asked for started (the work then runs on fewer, or on the calling thread).
    pub(super) refused: Option<Error>,
    /// Results of work done on the calling thread.
    ready: VecDeque<R>,
}

impl<T: Send, R: Send> Workers<T, R> {
    pub(super) fn start<'s, 'e: 's, W>(
        s: &'s Scope<'s, 'e>,
        n: usize,
        work: &'e W,
        driver: &dyn Driver,
    ) -> Self
    where
        W: Fn(T) -> R + Sync,
        T: 's,
        R: 's,
    {
        let (tx, task_rx) = channel::<T>();
        let (res_tx, rx) = channel::<R>();
        let task_rx = Arc::new(Mutex::new(task_rx));
        let (mut threads, mut refused) = (0, None);
        for i in 0..n {
            if let Err(e) = driver.thread_spawn() {
                refused = Some(e);
                break;
            }
            let (task_rx, res_tx) = (task_rx.clone(), res_tx.clone());
            let body = move || loop {
                let task = task_rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                let Ok(task) = task else { break };
                if res_tx.send(work(task)).is_err() {
                    break;
                }
            };
            match std::thread::Builder::new()
                .name(format!("cumem-spill-io-{i}"))
                .spawn_scoped(s, body)
            {
                Ok(_) => threads += 1,
                Err(e) => {
                    refused = Some(Error::InvalidState(format!(
                        "thread_spawn: the OS refused a new thread: {e}"
                    )));
                    break;
                }
            }
        }
        Workers {
            tx: Some(tx),
            rx,
            threads,
            refused,
            ready: VecDeque::new(),
        }
    }

    pub(super) fn submit(&mut self, task: T, work: &impl Fn(T) -> R) {
        if self.threads == 0 {
            self.ready.push_back(work(task));
        } else if let Err(e) = self.tx.as_ref().expect("open").send(task) {
            self.ready.push_back(work(e.0)); // no worker left: do it here
        }
    }

    /// A finished task's result: waiting for one when `block`.
    pub(super) fn next(&mut self, block: bool) -> Option<R> {
        if let Some(r) = self.ready.pop_front() {
            return Some(r);
        }
        if self.threads == 0 {
            return None;
        }
        if block {
            self.rx.recv().ok()
        } else {
            self.rx.try_recv().ok()
        }
    }
}

impl<T, R> Drop for Workers<T, R> {
    fn drop(&mut self) {
        self.tx.take(); // the workers' channel closes: they return and the scope joins them
    }
}

/// I/O threads per pipeline.
pub(super) const IO_THREADS: usize = 4;

pub(super) fn io_len(len: usize) -> usize {
    len.next_multiple_of(IO_ALIGN)
}
