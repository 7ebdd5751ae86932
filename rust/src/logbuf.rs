//! Rust-side log records, queued for Python's `logging` (logger "cumem_rs.native").
//!
//! Why not pyo3-log: it takes the GIL inside every `log!` call, and our records are made under the engine lock,
//! where a torch thread may hold the GIL while it waits in my_malloc for that same lock: a deadlock. Records are
//! queued here instead (a leaf lock, no GIL) and the Python layer, which holds the GIL anyway, forwards them
//! after its calls (`cumem_rs.forward_native_logs()`).

use std::collections::VecDeque;

use log::{Level, LevelFilter, Log, Metadata, Record};
use parking_lot::Mutex;

/// Oldest records are dropped beyond this many undrained ones.
const MAX_QUEUED: usize = 10_000;

static QUEUE: Mutex<VecDeque<(Level, String)>> = Mutex::new(VecDeque::new());
static LOGGER: QueueLogger = QueueLogger;

struct QueueLogger;

impl Log for QueueLogger {
    fn enabled(&self, metadata: &Metadata) -> bool {
        metadata.level() <= log::max_level() && metadata.target().starts_with("cumem_rs")
    }

    fn log(&self, record: &Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let mut q = QUEUE.lock();
        if q.len() >= MAX_QUEUED {
            q.pop_front();
        }
        q.push_back((record.level(), record.args().to_string()));
    }

    fn flush(&self) {}
}

/// Route the `log` facade here (once per process; later calls change nothing).
pub fn install() {
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(LevelFilter::Debug);
    }
}

/// Take every queued record, oldest first, with Python's numeric levels.
pub fn drain() -> Vec<(u32, String)> {
    QUEUE
        .lock()
        .drain(..)
        .map(|(level, msg)| {
            let py_level = match level {
                Level::Error => 40,
                Level::Warn => 30,
                Level::Info => 20,
                Level::Debug | Level::Trace => 10,
            };
            (py_level, msg)
        })
        .collect()
}
