//! Pause and resume single tags: a sleep and a wake limited to the named tags, with backups per tag policy.
//!
//! Other tags keep their memory and their kernels keep running. The one wait a pause imposes on them is the
//! synchronization of the paused allocations' devices before unmapping: the engine cannot know which streams
//! still use the paused memory (the stream recorded at malloc is only where torch allocated it; any kernel on
//! any stream may touch it since), so only a device-wide synchronize proves that no queued kernel still does.
//! That waits for work already queued on those devices; it never interrupts it, and devices without a paused
//! allocation are not synchronized at all.

use super::{tag_set, Engine, Report};
use crate::error::Result;

impl Engine {
    /// Release the awake allocations of `tags` (None: every tag), backing up those whose tag policy says so
    /// (unset: back up). Allocations already asleep and other tags are untouched, so pausing a paused tag is a
    /// no-op. Same ordering and guarantees as `sleep`: after a failure each allocation to back up is either
    /// awake with its data or asleep with a complete backup.
    pub fn pause<S: AsRef<str>>(&self, tags: Option<&[S]>) -> Result<Report> {
        let wanted = tags.map(tag_set);
        self.sleep_where(
            |a| wanted.as_ref().is_none_or(|w| w.contains(&*a.tag)),
            |p, a| p.pause_backup(&a.tag),
        )
    }

    /// Wake the asleep allocations of `tags` (None: every tag), all or nothing, exactly as `wake` does; resuming
    /// an awake tag is a no-op. Memory without a backup comes back per the tag's wake-fill policy.
    pub fn resume<S: AsRef<str>>(&self, tags: Option<&[S]>) -> Result<Report> {
        self.wake(tags)
    }
}
