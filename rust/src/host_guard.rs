//! How much host memory a backup may still take, so that a sleep refuses (with an out-of-memory error, before
//! anything is released) instead of letting the kernel's OOM killer end the process while it pins.
//!
//! Available = the smaller of: `MemAvailable` from /proc/meminfo; inside a cgroup (v2 `memory.max` minus
//! `memory.current`, or v1 `memory.limit_in_bytes` minus `memory.usage_in_bytes`) what the cgroup still allows.
//! None when nothing can be read (the guard then does not refuse). The backup store also applies the cap
//! `CUMEM_RS_HOST_MEMORY_LIMIT` (bytes; `K`, `M`, `G` suffixes) of the engine's configuration.

use std::fs;

/// The environment variable that caps the host memory backups may take (testing the guard, or leaving room).
pub const LIMIT_ENV: &str = "CUMEM_RS_HOST_MEMORY_LIMIT";

/// Bytes of host memory that can still be taken now, if known.
pub fn available() -> Option<usize> {
    [meminfo_available(), cgroup_available()]
        .into_iter()
        .flatten()
        .min()
}

/// "123", "64K", "512M", "16G" (binary units).
pub fn parse_size(text: &str) -> Option<usize> {
    let t = text.trim();
    let (digits, shift) = match t.chars().last()? {
        'k' | 'K' => (&t[..t.len() - 1], 10),
        'm' | 'M' => (&t[..t.len() - 1], 20),
        'g' | 'G' => (&t[..t.len() - 1], 30),
        _ => (t, 0),
    };
    digits
        .trim()
        .parse::<usize>()
        .ok()?
        .checked_mul(1usize << shift)
}

fn meminfo_available() -> Option<usize> {
    let text = fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

fn read_number(path: &str) -> Option<usize> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn cgroup_available() -> Option<usize> {
    // v2: the process's own cgroup from /proc/self/cgroup ("0::/path").
    if let Some(rel) = fs::read_to_string("/proc/self/cgroup").ok().and_then(|t| {
        t.lines()
            .find_map(|l| l.strip_prefix("0::").map(str::to_owned))
    }) {
        let dir = format!("/sys/fs/cgroup{}", rel.trim_end_matches('/'));
        if let (Some(max), Some(cur)) = (
            read_number(&format!("{dir}/memory.max")),
            read_number(&format!("{dir}/memory.current")),
        ) {
            return Some(max.saturating_sub(cur));
        }
    }
    // v1.
    let limit = read_number("/sys/fs/cgroup/memory/memory.limit_in_bytes")?;
    let usage = read_number("/sys/fs/cgroup/memory/memory.usage_in_bytes")?;
    // An unlimited v1 cgroup reports a limit near 2^63.
    (limit < 1 << 60).then(|| limit.saturating_sub(usage))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("64K"), Some(64 << 10));
        assert_eq!(parse_size(" 512m "), Some(512 << 20));
        assert_eq!(parse_size("16G"), Some(16 << 30));
        assert_eq!(parse_size("lots"), None);
        assert_eq!(parse_size(""), None);
    }

    #[test]
    fn this_host_reports_some_available_memory() {
        let a = available().expect("/proc/meminfo is readable on Linux");
        assert!(a > 0);
    }
}
