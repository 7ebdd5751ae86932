//! Where a sleep's or a wake's time goes: named phases of CPU time (including the waits inside them), logged
//! at DEBUG on `cumem_rs.native`, so that a slow run can be read from its log without a profiler.

use std::time::{Duration, Instant};

/// Time spent per named phase of one operation, in the order the phases first occurred.
pub struct Phases {
    op: &'static str,
    start: Instant,
    spent: Vec<(&'static str, Duration)>,
    notes: Vec<String>,
}

impl Phases {
    pub fn new(op: &'static str) -> Phases {
        Phases {
            op,
            start: Instant::now(),
            spent: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// Count the time since `since` to phase `name`; returns now, the start of the next phase.
    pub fn add(&mut self, name: &'static str, since: Instant) -> Instant {
        let now = Instant::now();
        let d = now.saturating_duration_since(since);
        match self.spent.iter_mut().find(|(n, _)| *n == name) {
            Some((_, total)) => *total += d,
            None => self.spent.push((name, d)),
        }
        now
    }

    /// A figure for the log line (counts, bytes).
    pub fn note(&mut self, what: String) {
        self.notes.push(what);
    }

    /// One DEBUG line: the total, then each phase in milliseconds.
    pub fn log(&self) {
        if !log::log_enabled!(log::Level::Debug) {
            return;
        }
        let phases: Vec<String> = (self.spent.iter())
            .map(|(n, d)| format!("{n} {:.1}", d.as_secs_f64() * 1e3))
            .collect();
        log::debug!(
            "{} phases (ms): total {:.1}: {}{}{}",
            self.op,
            self.start.elapsed().as_secs_f64() * 1e3,
            phases.join(", "),
            if self.notes.is_empty() { "" } else { "; " },
            self.notes.join(", ")
        );
    }
}
