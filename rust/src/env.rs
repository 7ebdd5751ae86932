//! The environment variables the Rust side reads, by name, and their parsers: one place, so that one variable
//! never means two things in two modules. A leaf (it uses nothing of the crate): the drivers and the engine both
//! read through it and their layers stay one-way.
//!
//! A switch (`flag`) has one set of spellings everywhere: `1`, `true`, `yes`, `on` and `0`, `false`, `no`, `off`,
//! in any case, blanks around ignored; unset or empty means the default. Anything else is ignored with a warning
//! naming the variable (a typo must not stop the process from starting).

/// `CUMEM_RS_COMPRESS`: compressed backups where the driver has a codec (default on). Off, the CUDA driver does
/// not even load nvCOMP (no staging ring is taken) and the engine backs up raw.
pub const COMPRESS: &str = "CUMEM_RS_COMPRESS";
/// `CUMEM_RS_RETAIN_BACKUPS`: keep backups bound to their allocations across wake (default on).
pub const RETAIN_BACKUPS: &str = "CUMEM_RS_RETAIN_BACKUPS";
/// `CUMEM_RS_VERIFY_WAKE`: every wake compares what it restored with the fingerprints its sleep took (default on).
pub const VERIFY_WAKE: &str = "CUMEM_RS_VERIFY_WAKE";
/// `CUMEM_RS_GPU_DIRECT_RDMA`: ask for GPUDirect RDMA on allocations of devices that support it (default on).
pub const GPU_DIRECT_RDMA: &str = "CUMEM_RS_GPU_DIRECT_RDMA";
/// `CUMEM_RS_NVCOMP_BATCH_COPY`: the codec copies a batch with one `cuMemcpyBatchAsync` (default on).
pub const NVCOMP_BATCH_COPY: &str = "CUMEM_RS_NVCOMP_BATCH_COPY";
/// `CUMEM_RS_NVCOMP_MAPPED_SIZES`: the codec reads compressed sizes through mapped host memory (default on).
pub const NVCOMP_MAPPED_SIZES: &str = "CUMEM_RS_NVCOMP_MAPPED_SIZES";

/// `CUMEM_RS_NVCOMP_LIB`: the nvCOMP library to open, a path (read as an OS string: any bytes).
pub const NVCOMP_LIB: &str = "CUMEM_RS_NVCOMP_LIB";
/// `CUMEM_RS_NVCOMP_CHUNK_KIB`: raw bytes per nvCOMP chunk, in KiB (a power of two from 64 to 2048).
pub const NVCOMP_CHUNK_KIB: &str = "CUMEM_RS_NVCOMP_CHUNK_KIB";
/// `CUMEM_RS_NVCOMP_RING_MIB`: device bytes of the codec's staging ring, in MiB.
pub const NVCOMP_RING_MIB: &str = "CUMEM_RS_NVCOMP_RING_MIB";

/// The process environment's value of `name`; None when unset or not UTF-8.
pub fn process_var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// The process environment's value of `name` as the OS gives it (a path may be any bytes); None when unset.
pub fn process_var_os(name: &str) -> Option<std::ffi::OsString> {
    std::env::var_os(name)
}

/// The switch spelled `text`: Some(on/off), or None for anything that is not one of the spellings.
pub fn parse_flag(text: &str) -> Option<bool> {
    const ON: [&str; 4] = ["1", "true", "yes", "on"];
    const OFF: [&str; 4] = ["0", "false", "no", "off"];
    let t = text.trim();
    if ON.iter().any(|s| t.eq_ignore_ascii_case(s)) {
        Some(true)
    } else if OFF.iter().any(|s| t.eq_ignore_ascii_case(s)) {
        Some(false)
    } else {
        None
    }
}

/// The switch `name` read through `var`: its value, or `default` when unset, empty or unreadable (with a
/// warning).
pub fn flag_from(var: impl Fn(&str) -> Option<String>, name: &str, default: bool) -> bool {
    let Some(value) = var(name).filter(|v| !v.trim().is_empty()) else {
        return default;
    };
    parse_flag(&value).unwrap_or_else(|| {
        log::warn!(
            "{name}={value:?} is not a switch (1/true/yes/on or 0/false/no/off); using {}",
            if default { "on" } else { "off" }
        );
        default
    })
}

/// The switch `name` of the process environment (`flag_from` over `process_var`).
pub fn flag(name: &str, default: bool) -> bool {
    flag_from(process_var, name, default)
}

/// Whether backups compress (`COMPRESS`, default on), read through `var`: what the CUDA driver asks before
/// loading nvCOMP and what the engine's configuration holds, one parse for both.
pub fn compress_from(var: impl Fn(&str) -> Option<String>) -> bool {
    flag_from(var, COMPRESS, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(name: &'static str, value: &'static str) -> impl Fn(&str) -> Option<String> {
        move |n| (n == name).then(|| value.to_string())
    }

    #[test]
    fn every_spelling_of_a_switch_reads_the_same_everywhere() {
        for on in ["1", "true", "TRUE", "Yes", "on", " ON "] {
            assert_eq!(parse_flag(on), Some(true), "{on:?}");
        }
        for off in ["0", "false", "False", "no", "NO", "off", "Off\n"] {
            assert_eq!(parse_flag(off), Some(false), "{off:?}");
        }
        for bad in ["", "2", "enabled", "0x0", "offf", "\u{0660}"] {
            assert_eq!(parse_flag(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn unset_empty_and_unreadable_switches_keep_their_default() {
        for default in [true, false] {
            assert_eq!(flag_from(|_| None, COMPRESS, default), default);
            assert_eq!(flag_from(one(COMPRESS, ""), COMPRESS, default), default);
            assert_eq!(
                flag_from(one(COMPRESS, "maybe"), COMPRESS, default),
                default
            );
        }
        assert!(!flag_from(one(COMPRESS, "off"), COMPRESS, true));
        assert!(flag_from(one(COMPRESS, "on"), COMPRESS, false));
    }

    #[test]
    fn compression_is_on_unless_switched_off() {
        assert!(compress_from(|_| None));
        for off in ["0", "off", "false", "no"] {
            assert!(!compress_from(one(COMPRESS, off)), "{off:?}");
        }
        assert!(compress_from(one(COMPRESS, "1")));
    }
}
