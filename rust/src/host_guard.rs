//! How much host memory a backup may still take, so that a sleep refuses (with an out-of-memory error, before
//! anything is released) instead of letting the kernel's OOM killer end the process while it pins.
//!
//! Available = the smaller of: `MemAvailable` from /proc/meminfo; inside memory cgroups, the least room left under
//! any limit on the chain from the process's own cgroup up to the root (v2 `memory.max` minus `memory.current`, v1
//! `memory.limit_in_bytes` minus `memory.usage_in_bytes`): a parent's limit can be tighter than the child's, and the
//! kernel kills at whichever is passed first. None when nothing can be read (the guard then does not refuse). The
//! backup store keeps a margin for the process itself out of that (`MARGIN_ENV`: torch, the CUDA runtime and Python
//! keep allocating while we pin), and applies the cap `CUMEM_RS_HOST_MEMORY_LIMIT` (bytes; `K`, `M`, `G` suffixes)
//! of the engine's configuration to the host memory it holds.

use std::fs;
use std::path::{Path, PathBuf};

/// The environment variable that caps the host memory backups may take (testing the guard, or leaving room).
pub const LIMIT_ENV: &str = "CUMEM_RS_HOST_MEMORY_LIMIT";

/// The environment variable that sets the margin kept out of the host's room for the process itself.
pub const MARGIN_ENV: &str = "CUMEM_RS_HOST_MARGIN";

/// The margin's default: what a torch process may still allocate on the host while a sleep pins (its allocator's
/// caches, the CUDA runtime's, Python objects), so that the guard's last byte is never the one the kernel kills for.
pub const DEFAULT_MARGIN: usize = 512 << 20;

/// Limits at or above this are "no limit" (v1 reports one near 2^63).
const UNLIMITED: usize = 1 << 60;

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

fn read_number(path: &Path) -> Option<usize> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn cgroup_available() -> Option<usize> {
    let own = fs::read_to_string("/proc/self/cgroup").ok()?;
    cgroup_room(Path::new("/sys/fs/cgroup"), &own)
}

/// The least room under the memory limits of the process's cgroup and its ancestors, from `proc_self_cgroup` (the
/// text of /proc/self/cgroup) and the cgroup file systems mounted at `root`. A v1 memory controller (its line names
/// `memory`, its hierarchy mounted at `root/memory`) is read where there is one, as a hybrid system's limits live
/// there; else the v2 line (`0::path`, the unified hierarchy at `root`).
pub(crate) fn cgroup_room(root: &Path, proc_self_cgroup: &str) -> Option<usize> {
    let v1 = proc_self_cgroup.lines().find_map(|l| {
        let mut fields = l.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then_some(path)
    });
    if let Some(path) = v1 {
        let room = chain_room(
            &root.join("memory"),
            path,
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
        );
        if room.is_some() {
            return room;
        }
    }
    let v2 = proc_self_cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))?;
    chain_room(root, v2, "memory.max", "memory.current")
}

/// The least `limit - usage` over the directories from `mount/rel` up to `mount` itself. Levels whose files are
/// missing (a container sees its own cgroup at the mount's root while /proc names the host's path), or whose limit
/// is "max" or near 2^63, limit nothing.
fn chain_room(mount: &Path, rel: &str, limit: &str, usage: &str) -> Option<usize> {
    let mut dirs: Vec<PathBuf> = vec![mount.to_path_buf()];
    // A path outside the process's cgroup namespace shows as "/.."; only the mount's root is ours to read then.
    if !rel.split('/').any(|c| c == "..") {
        let mut dir = mount.to_path_buf();
        for part in rel.trim().split('/').filter(|c| !c.is_empty() && *c != ".") {
            dir.push(part);
            dirs.push(dir.clone());
        }
    }
    dirs.iter()
        .filter_map(|d| {
            let max = read_number(&d.join(limit)).filter(|m| *m < UNLIMITED)?;
            let cur = read_number(&d.join(usage))?;
            Some(max.saturating_sub(cur))
        })
        .min()
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

    /// A fake cgroup tree under a fresh directory: (directory under the root, [(file, contents)]).
    struct Tree(PathBuf);

    impl Tree {
        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn tree(levels: &[(&str, &[(&str, &str)])]) -> Tree {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let root =
            Tree(std::env::temp_dir().join(format!("cumem-rs-cgroup-{}-{n}", std::process::id())));
        for (dir, files) in levels {
            let d = root.path().join(dir);
            fs::create_dir_all(&d).unwrap();
            for (name, text) in *files {
                fs::write(d.join(name), text).unwrap();
            }
        }
        root
    }

    #[test]
    fn v2_takes_the_tightest_limit_on_the_chain_up_from_the_own_cgroup() {
        let root = tree(&[
            ("", &[("cgroup.controllers", "cpu memory")]),
            (
                "a",
                &[("memory.max", "1000\n"), ("memory.current", "900\n")],
            ),
            (
                "a/b",
                &[("memory.max", "max\n"), ("memory.current", "500\n")],
            ),
            (
                "a/b/c",
                &[("memory.max", "5000\n"), ("memory.current", "400\n")],
            ),
        ]);
        // The own cgroup allows 4600 more, its grandparent only 100: the kernel kills at the grandparent's.
        assert_eq!(cgroup_room(root.path(), "0::/a/b/c\n"), Some(100));
        // A cgroup with no limit on its chain limits nothing.
        let free = tree(&[("x", &[("memory.max", "max"), ("memory.current", "1")])]);
        assert_eq!(cgroup_room(free.path(), "0::/x\n"), None);
        // Outside the namespace: the mount's root only.
        let ns = tree(&[("", &[("memory.max", "300"), ("memory.current", "100")])]);
        assert_eq!(cgroup_room(ns.path(), "0::/../../x\n"), Some(200));
    }

    #[test]
    fn v1_reads_the_processs_own_memory_cgroup_and_its_ancestors_not_the_root_alone() {
        let big = "9223372036854771712\n";
        let root = tree(&[
            (
                "memory",
                &[
                    ("memory.limit_in_bytes", big),
                    ("memory.usage_in_bytes", "7000"),
                ],
            ),
            (
                "memory/job",
                &[
                    ("memory.limit_in_bytes", "8000"),
                    ("memory.usage_in_bytes", "3000"),
                ],
            ),
            (
                "memory/job/step",
                &[
                    ("memory.limit_in_bytes", "6000"),
                    ("memory.usage_in_bytes", "2500"),
                ],
            ),
        ]);
        let own = "12:pids:/job/step\n4:cpu,memory:/job/step\n0::/job/step\n";
        assert_eq!(cgroup_room(root.path(), own), Some(3500));
        // A container that sees its own cgroup at the mount's root while /proc names the host's path: the root.
        let ctr = tree(&[(
            "memory",
            &[
                ("memory.limit_in_bytes", "4000"),
                ("memory.usage_in_bytes", "1000"),
            ],
        )]);
        assert_eq!(
            cgroup_room(ctr.path(), "9:memory:/docker/abc\n"),
            Some(3000)
        );
    }
}
