//! Per-tag policies set ahead of time.
//!
//! A policy says, for one tag:
//! - `backup`: whether its awake allocations are copied to host memory when they are released by a call that
//!   does not say so itself. `pause` always follows it (unset: back up). `sleep` follows it only when called
//!   without `offload_tags` (`sleep_by_policy`; unset: back up the "default" tag only, vLLM's rule); a sleep
//!   with explicit `offload_tags` decides for every tag, as vLLM's `sleep(offload_tags)` always has. `discard`
//!   never backs up.
//! - `wake_fill`: what its memory shows when it wakes without a backup: `Undefined` (whatever the new physical
//!   memory holds; the simulated device shows poison) or `Zero` (one async memset per allocation, queued on the
//!   copy stream after the restore copies, so it costs device bandwidth, not host time).
//!
//! - `backup_tier`: where its backups go: "host" (pinned host memory), "file" (the spill directory) or "auto"
//!   (default: host memory up to the host budget, files for the rest; backups/file_tier.rs says why).
//!
//! - `compress`: whether (and in which mode) its host backups are compressed where the driver has a codec
//!   (`backups/compressed.rs`): "auto" (default: the 16-bit mode, best for the bf16/fp16 weights and KV caches
//!   that sleep; other data costs ratio, never correctness, and what does not shrink is stored raw), "off",
//!   "bits16", "bits8" (fp8) or "bytes" (any data).
//!
//! Policies live in the engine, keyed by tag; they outlive the tag's allocations and apply to later ones.

use std::collections::HashMap;

pub use crate::backups::BackupTier;
use crate::driver::codec::DataKind;
use crate::error::{Error, Result};
use crate::tags::DEFAULT_TAG;

/// What memory woken without a backup shows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WakeFill {
    /// Whatever the new physical memory holds (never promised; the simulated device shows poison bytes).
    #[default]
    Undefined,
    /// Zeros, written by the device on the copy stream before the wake returns.
    Zero,
}

impl WakeFill {
    pub const NAMES: [&'static str; 2] = ["undefined", "zero"];

    pub fn name(self) -> &'static str {
        match self {
            WakeFill::Undefined => "undefined",
            WakeFill::Zero => "zero",
        }
    }

    pub fn parse(name: &str) -> Result<WakeFill> {
        match name {
            "undefined" => Ok(WakeFill::Undefined),
            "zero" => Ok(WakeFill::Zero),
            _ => Err(Error::invalid(format!(
                "wake_fill must be one of {:?}, got {name:?}",
                WakeFill::NAMES
            ))),
        }
    }
}

/// Whether and how a tag's host backups are compressed (see the module notes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Compress {
    #[default]
    Auto,
    Off,
    Bits16,
    Bits8,
    Bytes,
}

impl Compress {
    pub const NAMES: [&'static str; 5] = ["auto", "off", "bits16", "bits8", "bytes"];

    pub fn name(self) -> &'static str {
        match self {
            Compress::Auto => "auto",
            Compress::Off => "off",
            Compress::Bits16 => "bits16",
            Compress::Bits8 => "bits8",
            Compress::Bytes => "bytes",
        }
    }

    pub fn parse(name: &str) -> Result<Compress> {
        Compress::NAMES
            .iter()
            .position(|n| *n == name)
            .map(|i| {
                [
                    Compress::Auto,
                    Compress::Off,
                    Compress::Bits16,
                    Compress::Bits8,
                    Compress::Bytes,
                ][i]
            })
            .ok_or_else(|| {
                Error::invalid(format!(
                    "compress must be one of {:?}, got {name:?}",
                    Compress::NAMES
                ))
            })
    }

    /// The codec's mode for this policy; None: not compressed.
    pub fn kind(self) -> Option<DataKind> {
        match self {
            Compress::Off => None,
            Compress::Auto | Compress::Bits16 => Some(DataKind::Bits16),
            Compress::Bits8 => Some(DataKind::Bits8),
            Compress::Bytes => Some(DataKind::Bytes),
        }
    }
}

/// The policy of one tag. The default (no backup choice, undefined wake fill) is what a tag without one has.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TagPolicy {
    /// Back up when the releasing call does not say (None: the call's own default, see the module notes).
    pub backup: Option<bool>,
    pub wake_fill: WakeFill,
    /// Where its backups go: host memory, a spill file, or host up to the budget then files (backups/file_tier.rs).
    pub backup_tier: BackupTier,
    /// Whether and how its host backups are compressed.
    pub compress: Compress,
}

/// Policies by tag; a tag without an entry has the default policy.
#[derive(Debug, Default)]
pub(super) struct Policies(HashMap<String, TagPolicy>);

impl Policies {
    pub(super) fn get(&self, tag: &str) -> TagPolicy {
        self.0.get(tag).copied().unwrap_or_default()
    }

    pub(super) fn set(&mut self, tag: &str, policy: TagPolicy) {
        if policy == TagPolicy::default() {
            self.0.remove(tag);
        } else {
            self.0.insert(tag.to_string(), policy);
        }
    }

    /// Whether a sleep that names no tags backs `tag` up: its policy, else vLLM's default (only "default").
    pub(super) fn sleep_backup(&self, tag: &str) -> bool {
        self.get(tag).backup.unwrap_or(tag == DEFAULT_TAG)
    }

    /// Whether a pause backs `tag` up: its policy, else yes (a pause never loses data it was not told to).
    pub(super) fn pause_backup(&self, tag: &str) -> bool {
        self.get(tag).backup.unwrap_or(true)
    }

    pub(super) fn backup_tier(&self, tag: &str) -> BackupTier {
        self.get(tag).backup_tier
    }

    /// The codec mode of `tag`'s host backups; None: raw.
    pub(super) fn compress_kind(&self, tag: &str) -> Option<DataKind> {
        self.get(tag).compress.kind()
    }

    pub(super) fn zero_on_wake(&self, tag: &str) -> bool {
        self.get(tag).wake_fill == WakeFill::Zero
    }

    /// The tags that have a policy.
    pub(super) fn tags(&self) -> impl Iterator<Item = &str> {
        self.0.keys().map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_policies_follow_vllm_for_sleep_and_keep_data_for_pause() {
        let p = Policies::default();
        assert!(p.sleep_backup(DEFAULT_TAG) && !p.sleep_backup("kv_cache"));
        assert!(p.pause_backup("kv_cache"));
        assert!(!p.zero_on_wake("kv_cache"));
    }

    #[test]
    fn a_policy_overrides_the_defaults_and_the_default_policy_clears_it() {
        let mut p = Policies::default();
        let no_backup_zero = TagPolicy {
            backup: Some(false),
            wake_fill: WakeFill::Zero,
            backup_tier: BackupTier::Auto,
            compress: Compress::Off,
        };
        p.set("kv_cache", no_backup_zero);
        p.set(DEFAULT_TAG, no_backup_zero);
        assert!(!p.pause_backup("kv_cache") && !p.sleep_backup(DEFAULT_TAG));
        assert!(p.zero_on_wake("kv_cache"));
        assert_eq!(p.tags().count(), 2);
        p.set("kv_cache", TagPolicy::default());
        assert_eq!(p.tags().collect::<Vec<_>>(), vec![DEFAULT_TAG]);
        assert_eq!(WakeFill::parse("zero"), Ok(WakeFill::Zero));
        assert!(WakeFill::parse("ones").is_err());
        assert_eq!(Compress::parse("bits8"), Ok(Compress::Bits8));
        assert_eq!(Compress::Auto.kind(), Some(DataKind::Bits16));
        assert_eq!(Compress::Off.kind(), None);
        assert!(Compress::parse("zip").is_err());
    }
}
