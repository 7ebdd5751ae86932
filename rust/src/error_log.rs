//! The errors that could not be raised (a C-ABI free, a release after the point of no return, a fallback taken):
//! logged as warnings and kept, bounded, for `errors()`.

use crate::error::Error;

/// At most this many recorded errors are kept (oldest dropped first).
const MAX_RECORDED_ERRORS: usize = 1000;

#[derive(Debug, Default)]
pub struct ErrorLog {
    entries: Vec<String>,
    /// Every error recorded, also those dropped from `entries` since.
    recorded: u64,
}

impl ErrorLog {
    pub fn record(&mut self, context: &str, e: &Error) {
        if self.entries.len() >= MAX_RECORDED_ERRORS {
            self.entries.remove(0);
        }
        log::warn!("{context}: {e}");
        self.entries.push(format!("{context}: {e}"));
        self.recorded += 1;
    }

    pub fn entries(&self) -> &[String] {
        &self.entries
    }

    pub fn recorded(&self) -> u64 {
        self.recorded
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_newest_entries_and_counts_all() {
        let mut log = ErrorLog::default();
        for i in 0..MAX_RECORDED_ERRORS + 5 {
            log.record(&format!("call {i}"), &Error::Closed);
        }
        assert_eq!(log.entries().len(), MAX_RECORDED_ERRORS);
        assert_eq!(log.recorded(), (MAX_RECORDED_ERRORS + 5) as u64);
        assert!(
            log.entries()[0].starts_with("call 5: "),
            "{}",
            log.entries()[0]
        );
    }
}
