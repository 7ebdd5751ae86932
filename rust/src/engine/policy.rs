//! Per-tag policies set ahead of time, the per-tag status report, and reads of a paused allocation's backup.
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
//! Policies live in the engine, keyed by tag; they outlive the tag's allocations and apply to later ones.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use super::{Engine, Report};
use crate::driver::DevPtr;
use crate::error::{Error, Result};
use crate::registry::{Allocation, State, DEFAULT_TAG};

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

/// The policy of one tag. The default (no backup choice, undefined wake fill) is what a tag without one has.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TagPolicy {
    /// Back up when the releasing call does not say (None: the call's own default, see the module notes).
    pub backup: Option<bool>,
    pub wake_fill: WakeFill,
}

/// Policies by tag; a tag without an entry has the default policy.
#[derive(Debug, Default)]
pub(super) struct Policies(HashMap<String, TagPolicy>);

impl Policies {
    pub(super) fn get(&self, tag: &str) -> TagPolicy {
        self.0.get(tag).copied().unwrap_or_default()
    }

    fn set(&mut self, tag: &str, policy: TagPolicy) {
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

    pub(super) fn zero_on_wake(&self, tag: &str) -> bool {
        self.get(tag).wake_fill == WakeFill::Zero
    }
}

/// One tag as seen by `status`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TagStatus {
    pub allocations: usize,
    /// Bytes of its awake allocations (physically mapped).
    pub mapped_bytes: usize,
    /// Bytes of its asleep allocations (address range kept, no physical memory).
    pub asleep_bytes: usize,
    /// Host backup bytes held for its allocations: the backups of asleep ones plus `retained_bytes`.
    pub backup_bytes: usize,
    /// Host bytes of retained backups, kept bound to awake allocations after the wake that restored them.
    pub retained_bytes: usize,
    pub policy: TagPolicy,
}

impl TagStatus {
    /// "awake" (nothing asleep, also when it has no allocations), "asleep" (nothing awake) or "mixed".
    pub fn state(&self) -> &'static str {
        match (self.mapped_bytes > 0, self.asleep_bytes > 0) {
            (_, false) => "awake",
            (false, true) => "asleep",
            (true, true) => "mixed",
        }
    }
}

/// Every tag with an allocation or a policy.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Status {
    pub tags: BTreeMap<String, TagStatus>,
    /// True while any allocation is asleep.
    pub is_sleeping: bool,
}

impl Engine {
    /// Set the whole policy of `tag` (the default policy clears it).
    pub fn set_tag_policy(&self, tag: &str, policy: TagPolicy) -> Result<()> {
        if tag.is_empty() {
            return Err(Error::invalid("tag must be a non-empty string"));
        }
        self.lock_open()?.policies.set(tag, policy);
        Ok(())
    }

    pub fn tag_policy(&self, tag: &str) -> Result<TagPolicy> {
        Ok(self.lock_open()?.policies.get(tag))
    }

    /// Sleep without naming tags: each tag is backed up per its policy (unset: only "default" is, vLLM's rule),
    /// then every awake allocation is released. Same ordering and guarantees as `sleep`.
    pub fn sleep_by_policy(&self) -> Result<Report> {
        let start = Instant::now();
        let mut inner = self.lock_open()?;
        self.retry_pending(&mut inner);
        let (backed, bare) =
            Self::split_awake(&inner, |_| true, |a| inner.policies.sleep_backup(&a.tag));
        self.sleep_targets(&mut inner, backed, bare, start)
    }

    /// Per tag: allocations, mapped, asleep, backed-up and retained bytes, policy and state; plus whether anything
    /// sleeps.
    pub fn status(&self) -> Result<Status> {
        let inner = self.lock_open()?;
        let mut tags: BTreeMap<String, TagStatus> = BTreeMap::new();
        for a in inner.reg.iter() {
            let t = tags.entry(a.tag.to_string()).or_default();
            t.allocations += 1;
            match &a.state {
                State::Awake { .. } => {
                    t.mapped_bytes += a.size;
                    if inner.retained.contains_key(&a.addr) {
                        t.retained_bytes += a.size;
                        t.backup_bytes += a.size;
                    }
                }
                State::Asleep { backup } => {
                    t.asleep_bytes += a.size;
                    if backup.is_some() {
                        t.backup_bytes += a.size;
                    }
                }
            }
        }
        for tag in inner.policies.0.keys() {
            tags.entry(tag.clone()).or_default();
        }
        for (tag, t) in tags.iter_mut() {
            t.policy = inner.policies.get(tag);
        }
        let is_sleeping = tags.values().any(|t| t.asleep_bytes > 0);
        Ok(Status { tags, is_sleeping })
    }

    /// Whether cached host backup memory is kept after a wake (`set_keep_host_memory`).
    pub fn keep_host_memory(&self) -> bool {
        self.inner.lock().host.keep
    }

    /// The backed-up contents of [addr, addr+len) while its allocation is asleep with a backup; None while it is
    /// awake. An asleep allocation without a backup is an error (there is nothing to read).
    pub fn read_backup(&self, addr: DevPtr, len: usize) -> Result<Option<Vec<u8>>> {
        let inner = self.lock_open()?;
        let a: &Allocation = inner.reg.containing(addr, len.max(1)).ok_or_else(|| {
            Error::invalid(format!(
                "[{addr:#x}, +{len}) is not inside one live allocation"
            ))
        })?;
        match &a.state {
            State::Awake { .. } => Ok(None),
            State::Asleep { backup: None } => Err(Error::InvalidState(format!(
                "allocation {:#x} (tag {:?}) is asleep without a backup: its contents were released",
                a.addr, a.tag
            ))),
            State::Asleep {
                backup: Some(backup),
            } => {
                let mut out = vec![0u8; len];
                backup
                    .arena
                    .read_at(backup.offset + (addr - a.addr) as usize, &mut out);
                Ok(Some(out))
            }
        }
    }
}
