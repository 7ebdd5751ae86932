//! The engine's configuration: the environment variables of the engine and its backup store, read once, when an
//! engine is made, through `crate::env` (where every variable the Rust side reads is named and parsed).
//! (docs/configuration.md's table of environment variables lists these and the Python-side ones.)

pub use crate::backups::BUDGET_ENV as HOST_BUDGET_ENV;
pub use crate::backups::SPILL_DIR_ENV;
use crate::backups::{StoreConfig, DEFAULT_PIN_CHUNK};
use crate::env;
use crate::fingerprint;
use crate::host_guard::parse_size;

use super::group::DEFAULT_GROUP_BYTES;

/// `CUMEM_RS_RETAIN_BACKUPS`: a switch (`crate::env::flag`), default on.
pub use crate::env::RETAIN_BACKUPS as RETAIN_ENV;
/// `CUMEM_RS_WAKE_GROUP_BYTES`: the largest wake group, bytes with `K`/`M`/`G` suffixes; `0` turns groups off.
pub const WAKE_GROUP_ENV: &str = "CUMEM_RS_WAKE_GROUP_BYTES";
/// `CUMEM_RS_COMPRESS`: a switch, default on where the driver has a codec; the CUDA driver reads it through the
/// same parser (`crate::env::compress_from`).
pub use crate::env::COMPRESS as COMPRESS_ENV;
/// `CUMEM_RS_VERIFY_WAKE`: a switch, default on: every wake compares what it restored with the fingerprints its
/// sleep took (`crate::backups` verify.rs).
pub use crate::env::VERIFY_WAKE as VERIFY_WAKE_ENV;
/// `CUMEM_RS_HOST_MEMORY_LIMIT`: a cap on the host memory backups may take (see `crate::host_guard`).
pub use crate::host_guard::LIMIT_ENV as HOST_MEMORY_LIMIT_ENV;
/// `CUMEM_RS_HOST_MARGIN`: host memory the guard leaves to the process (see `crate::host_guard`).
pub use crate::host_guard::MARGIN_ENV as HOST_MARGIN_ENV;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// Keep backups bound to their allocations across wake (on by default where the fingerprint kernel runs).
    pub retain_backups: bool,
    /// Largest run of neighbours one wake maps on one handle (0: every allocation on its own).
    pub wake_group_bytes: usize,
    /// Cell size of pipelined pinning during a cold sleep.
    pub pin_chunk: usize,
    /// Bytes per fingerprinted chunk.
    pub fingerprint_chunk: usize,
    /// At most this much host memory is held for backups (besides what the host and its cgroups allow).
    pub host_memory_limit: Option<usize>,
    /// Bytes of the room the host and its cgroups leave that backups never take (`CUMEM_RS_HOST_MARGIN`): the
    /// process's own.
    pub host_margin: usize,
    /// At most this much pinned host memory is held for backups at any time (`CUMEM_RS_HOST_BUDGET`).
    pub host_budget: Option<usize>,
    /// The file tier's spill directory (`CUMEM_RS_SPILL_DIR`); one that cannot be used is ignored with a warning.
    pub spill_dir: Option<std::path::PathBuf>,
    /// Compress host backups where the driver has a codec (`CUMEM_RS_COMPRESS=0`: off).
    pub compress: bool,
    /// Verify every wake against the sleep's fingerprints (`CUMEM_RS_VERIFY_WAKE=0`: off).
    pub verify_wake: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            retain_backups: true,
            wake_group_bytes: DEFAULT_GROUP_BYTES,
            pin_chunk: DEFAULT_PIN_CHUNK,
            fingerprint_chunk: fingerprint::DEFAULT_CHUNK,
            host_memory_limit: None,
            host_margin: crate::host_guard::DEFAULT_MARGIN,
            host_budget: None,
            spill_dir: None,
            compress: true,
            verify_wake: true,
        }
    }
}

impl EngineConfig {
    /// The defaults, changed by the environment variables set. A value that cannot be read is ignored with a
    /// warning (a typo must not stop the process from starting).
    pub fn from_env() -> EngineConfig {
        Self::from_vars(env::process_var)
    }

    /// As `from_env`, reading variables through `var`.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> EngineConfig {
        let mut c = EngineConfig::default();
        c.retain_backups = env::flag_from(&var, RETAIN_ENV, c.retain_backups);
        if let Some(v) = var(WAKE_GROUP_ENV) {
            match parse_size(&v) {
                Some(n) => c.wake_group_bytes = n,
                None => log::warn!(
                    "{WAKE_GROUP_ENV}={v:?} is not a byte count; using {}",
                    c.wake_group_bytes
                ),
            }
        }
        if let Some(v) = var(HOST_MEMORY_LIMIT_ENV) {
            // Ignored when unreadable rather than blocking every sleep.
            c.host_memory_limit = parse_size(&v);
            if c.host_memory_limit.is_none() {
                log::warn!("{HOST_MEMORY_LIMIT_ENV}={v:?} is not a byte count; ignored");
            }
        }
        if let Some(v) = var(HOST_MARGIN_ENV) {
            match parse_size(&v) {
                Some(n) => c.host_margin = n,
                None => log::warn!(
                    "{HOST_MARGIN_ENV}={v:?} is not a byte count; using {}",
                    c.host_margin
                ),
            }
        }
        if let Some(v) = var(HOST_BUDGET_ENV) {
            c.host_budget = parse_size(&v);
            if c.host_budget.is_none() {
                log::warn!("{HOST_BUDGET_ENV}={v:?} is not a byte count; ignored");
            }
        }
        c.compress = env::compress_from(&var);
        c.verify_wake = env::flag_from(&var, VERIFY_WAKE_ENV, c.verify_wake);
        c.spill_dir = var(SPILL_DIR_ENV).filter(|v| !v.is_empty()).map(Into::into);
        c
    }

    pub(super) fn store(&self) -> StoreConfig {
        StoreConfig {
            retain: self.retain_backups,
            fingerprint_chunk: self.fingerprint_chunk,
            pin_chunk: self.pin_chunk,
            host_limit: self.host_memory_limit,
            host_margin: self.host_margin,
            host_budget: self.host_budget,
            spill_dir: self.spill_dir.clone(),
            compress: self.compress,
            verify_wake: self.verify_wake,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> EngineConfig {
        EngineConfig::from_vars(|name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn variables_change_their_knob_and_bad_values_keep_the_default() {
        assert_eq!(with(&[]), EngineConfig::default());
        assert!(!with(&[(RETAIN_ENV, "0")]).retain_backups);
        assert!(with(&[(RETAIN_ENV, "1")]).retain_backups);
        assert_eq!(with(&[(WAKE_GROUP_ENV, "8M")]).wake_group_bytes, 8 << 20);
        assert_eq!(with(&[(WAKE_GROUP_ENV, "0")]).wake_group_bytes, 0);
        assert_eq!(
            with(&[(WAKE_GROUP_ENV, "lots")]).wake_group_bytes,
            DEFAULT_GROUP_BYTES
        );
        assert_eq!(
            with(&[(HOST_MEMORY_LIMIT_ENV, "1M")]).host_memory_limit,
            Some(1 << 20)
        );
        assert_eq!(
            with(&[(HOST_MEMORY_LIMIT_ENV, "x")]).host_memory_limit,
            None
        );
        assert_eq!(with(&[(HOST_MARGIN_ENV, "1G")]).host_margin, 1 << 30);
        assert_eq!(with(&[(HOST_MARGIN_ENV, "0")]).host_margin, 0);
        assert_eq!(
            with(&[(HOST_MARGIN_ENV, "half")]).host_margin,
            crate::host_guard::DEFAULT_MARGIN
        );
        assert_eq!(with(&[(HOST_BUDGET_ENV, "4G")]).host_budget, Some(4 << 30));
        assert_eq!(with(&[(HOST_BUDGET_ENV, "some")]).host_budget, None);
        assert_eq!(
            with(&[(SPILL_DIR_ENV, "/tmp")]).spill_dir,
            Some("/tmp".into())
        );
        assert_eq!(with(&[(SPILL_DIR_ENV, "")]).spill_dir, None);
        assert!(with(&[]).compress);
        assert!(!with(&[(COMPRESS_ENV, "0")]).compress);
        assert!(with(&[(COMPRESS_ENV, "1")]).compress);
        assert!(with(&[]).verify_wake);
        assert!(!with(&[(VERIFY_WAKE_ENV, "0")]).verify_wake);
        assert!(with(&[(VERIFY_WAKE_ENV, "1")]).verify_wake);
    }

    /// The engine's switches take the spellings of every switch (`crate::env::parse_flag`): `off` is off, as
    /// the CUDA driver reads `CUMEM_RS_COMPRESS` before it loads nvCOMP.
    #[test]
    fn switches_read_every_spelling_as_the_driver_does() {
        for (text, on) in [
            ("off", false),
            ("false", false),
            ("No", false),
            ("on", true),
            ("TRUE", true),
        ] {
            assert_eq!(
                with(&[(COMPRESS_ENV, text)]).compress,
                on,
                "{COMPRESS_ENV}={text}"
            );
            assert_eq!(
                with(&[(RETAIN_ENV, text)]).retain_backups,
                on,
                "{RETAIN_ENV}={text}"
            );
            assert_eq!(
                with(&[(VERIFY_WAKE_ENV, text)]).verify_wake,
                on,
                "{VERIFY_WAKE_ENV}={text}"
            );
        }
        // Unset, empty or unreadable: the default (on), as before.
        for text in ["", "maybe"] {
            assert!(with(&[(COMPRESS_ENV, text)]).compress);
            assert!(with(&[(RETAIN_ENV, text)]).retain_backups);
            assert!(with(&[(VERIFY_WAKE_ENV, text)]).verify_wake);
        }
    }
}
