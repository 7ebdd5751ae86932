//! Helper threads for first touch and pinning, started so that a refusal never panics.
//!
//! They are started with `std::thread::Builder`, never `Scope::spawn`, which panics when the OS refuses a thread (a
//! container's process limit): when no thread can be started the work runs on the calling thread, slower but the
//! same, and the refusal is kept in `HostBuffer::notes` for the engine to record.

use std::thread::Scope;

use crate::driver::Driver;
use crate::error::{Error, Result};

/// Start `f` on a scoped thread named `name`. Err when no thread could be started (the driver's test hook or
/// the OS refused); the caller then does the work itself. Never panics, unlike `Scope::spawn`.
pub(super) fn try_spawn<'scope, F>(
    s: &'scope Scope<'scope, '_>,
    driver: &dyn Driver,
    name: &str,
    f: F,
) -> Result<()>
where
    F: FnOnce() + Send + 'scope,
{
    driver.thread_spawn()?;
    std::thread::Builder::new()
        .name(name.into())
        .spawn_scoped(s, f)
        .map(drop)
        .map_err(|e| Error::InvalidState(format!("thread_spawn: the OS refused a new thread: {e}")))
}
