//! Fault injection of the simulated driver: the n-th next call of an operation fails with a chosen CUDA error
//! code, or panics inside the driver (to test that panics are contained), so that every rollback path of the
//! engine can be driven from tests.

use super::{SimDriver, State};
use crate::driver::Op;
use crate::error::{Error, Result};

/// Error kinds that fault injection can produce, with their CUDA codes.
pub const FAULT_ERRORS: [(&str, i32); 4] = [
    ("oom", 2),
    ("invalid", 1),
    ("unknown", 999),
    ("not_permitted", 800),
];

fn cuda_error_name(code: i32) -> &'static str {
    match code {
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        800 => "CUDA_ERROR_NOT_PERMITTED",
        _ => "CUDA_ERROR_UNKNOWN",
    }
}

pub(super) struct Fault {
    op: Op,
    /// The value of the op's call counter at which it fails.
    at_call: u64,
    /// The CUDA error code it returns; None: the call panics instead.
    code: Option<i32>,
}

impl SimDriver {
    /// The `nth` next call (1 = the very next) of `op` fails with CUDA error `code`.
    pub fn inject_fault(&self, op: Op, nth: u64, code: i32) -> Result<()> {
        self.arm(op, nth, Some(code))
    }

    /// The `nth` next call of `op` panics inside the driver (with the driver's lock held), as a bug would: to
    /// test that a panic never crosses into Python or C and never releases host memory under a queued copy.
    pub fn inject_panic(&self, op: Op, nth: u64) -> Result<()> {
        self.arm(op, nth, None)
    }

    fn arm(&self, op: Op, nth: u64, code: Option<i32>) -> Result<()> {
        if nth == 0 {
            return Err(Error::invalid("nth must be at least 1"));
        }
        let mut st = self.state.lock();
        // A fault past the end of the call counter could never fire: refuse it rather than wrap around.
        let at_call = st
            .calls
            .get(&op)
            .copied()
            .unwrap_or(0)
            .checked_add(nth)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "nth {nth} is too large: the fault could never fire"
                ))
            })?;
        st.faults.push(Fault { op, at_call, code });
        Ok(())
    }

    pub fn clear_faults(&self) {
        self.state.lock().faults.clear();
    }
}

impl State {
    /// Count the call and fail it if a fault is armed for it.
    pub(super) fn enter(&mut self, op: Op) -> Result<()> {
        let n = self.calls.entry(op).or_insert(0);
        *n += 1;
        let n = *n;
        if let Some(i) = self
            .faults
            .iter()
            .position(|f| f.op == op && f.at_call == n)
        {
            let f = self.faults.swap_remove(i);
            let Some(code) = f.code else {
                panic!("injected panic in simulated {} (call {n})", op.name());
            };
            return Err(Error::driver(op.name(), code, cuda_error_name(code)));
        }
        Ok(())
    }
}
