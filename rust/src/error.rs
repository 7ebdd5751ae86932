//! One error type for the whole crate. Python sees these as `CumemError` subclasses (see `python/errors.rs`).

use thiserror::Error;

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum Error {
    /// Physical memory ran out (device or host). `what` says which operation wanted it.
    #[error("out of memory: {what}")]
    OutOfMemory { what: String },

    /// A driver call failed. `op` is the driver operation, `code` the CUDA result code.
    #[error("driver call {op} failed: {name} (code {code})")]
    Driver {
        op: &'static str,
        code: i32,
        name: String,
    },

    /// Bad argument from the caller (size, tag, address range, fault spec...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The address is not the start (or inside) of a live allocation of this allocator.
    #[error("unknown address {0:#x}: not a live allocation of this allocator")]
    UnknownAddress(u64),

    /// The operation does not fit the allocation's state (e.g. reading an asleep allocation).
    #[error("{0}")]
    InvalidState(String),

    /// No usable CUDA driver (library missing, no device, no VMM support).
    #[error("CUDA is not available: {0}")]
    NoCuda(String),

    /// The allocator was closed.
    #[error("the allocator is closed")]
    Closed,

    /// A Rust panic was caught at a boundary; the message is the panic payload.
    #[error("internal error (caught panic): {0}")]
    Panic(String),
}

/// The CUDA result codes this crate names, with cudarc's `CUresult` as the one source of their values: the
/// simulated driver answers with them, fault injection produces them, and `Error::driver` tells out-of-memory
/// apart by its code.
pub mod cuda_code {
    use cudarc::driver::sys::CUresult;

    pub const INVALID_VALUE: i32 = CUresult::CUDA_ERROR_INVALID_VALUE as i32;
    pub const OUT_OF_MEMORY: i32 = CUresult::CUDA_ERROR_OUT_OF_MEMORY as i32;
    pub const INVALID_HANDLE: i32 = CUresult::CUDA_ERROR_INVALID_HANDLE as i32;
    pub const HOST_MEMORY_ALREADY_REGISTERED: i32 =
        CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED as i32;
    pub const HOST_MEMORY_NOT_REGISTERED: i32 =
        CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED as i32;
    pub const NOT_PERMITTED: i32 = CUresult::CUDA_ERROR_NOT_PERMITTED as i32;
    pub const UNKNOWN: i32 = CUresult::CUDA_ERROR_UNKNOWN as i32;
    /// 700: device work touched memory that is not mapped (or host memory no longer pinned). Sticky: every
    /// later call of the context fails with it.
    pub const ILLEGAL_ADDRESS: i32 = CUresult::CUDA_ERROR_ILLEGAL_ADDRESS as i32;

    /// The codes above, by their `CUresult`, whose `Debug` form is the name `cuGetErrorName` gives.
    const NAMED: [CUresult; 8] = [
        CUresult::CUDA_ERROR_INVALID_VALUE,
        CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        CUresult::CUDA_ERROR_INVALID_HANDLE,
        CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
        CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
        CUresult::CUDA_ERROR_NOT_PERMITTED,
        CUresult::CUDA_ERROR_UNKNOWN,
        CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
    ];

    /// "CUDA_ERROR_INVALID_VALUE" and so on for a code of the table; other codes read as CUDA_ERROR_UNKNOWN
    /// (the simulated driver produces no others).
    pub fn name(code: i32) -> String {
        let known = NAMED.iter().find(|c| **c as i32 == code);
        format!("{:?}", known.unwrap_or(&CUresult::CUDA_ERROR_UNKNOWN))
    }
}

/// CUDA_ERROR_OUT_OF_MEMORY: the driver code that means "no physical memory".
pub const CUDA_ERROR_OUT_OF_MEMORY: i32 = cuda_code::OUT_OF_MEMORY;

impl Error {
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    /// Map a driver failure code into an error, keeping out-of-memory distinguishable.
    pub fn driver(op: &'static str, code: i32, name: impl Into<String>) -> Self {
        let name = name.into();
        if code == CUDA_ERROR_OUT_OF_MEMORY {
            Error::OutOfMemory {
                what: format!("{op} ({name})"),
            }
        } else {
            Error::Driver { op, code, name }
        }
    }

    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Error::OutOfMemory { .. })
    }
}

/// The text of a caught panic payload, for `Error::Panic` at the boundaries that catch panics (the C entry
/// points, the Python guard, loading the CUDA driver).
pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_codes_are_the_driver_api_values_and_names() {
        // The values CUDA documents; a wrong discriminant in the table would misreport every simulated error.
        assert_eq!((cuda_code::INVALID_VALUE, cuda_code::OUT_OF_MEMORY), (1, 2));
        assert_eq!(cuda_code::INVALID_HANDLE, 400);
        assert_eq!(
            (
                cuda_code::HOST_MEMORY_ALREADY_REGISTERED,
                cuda_code::HOST_MEMORY_NOT_REGISTERED
            ),
            (712, 713)
        );
        assert_eq!((cuda_code::NOT_PERMITTED, cuda_code::UNKNOWN), (800, 999));
        assert_eq!(
            cuda_code::name(cuda_code::HOST_MEMORY_NOT_REGISTERED),
            "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"
        );
        assert_eq!(cuda_code::name(12345), "CUDA_ERROR_UNKNOWN");
    }

    #[test]
    fn out_of_memory_code_becomes_out_of_memory_error() {
        assert!(Error::driver("create", CUDA_ERROR_OUT_OF_MEMORY, "x").is_out_of_memory());
        assert!(!Error::driver("create", cuda_code::INVALID_VALUE, "x").is_out_of_memory());
    }

    #[test]
    fn panic_message_reads_str_and_string_payloads() {
        let p = std::panic::catch_unwind(|| panic!("plain")).unwrap_err();
        assert_eq!(panic_message(&*p), "plain");
        let p = std::panic::catch_unwind(|| panic!("formatted {}", 7)).unwrap_err();
        assert_eq!(panic_message(&*p), "formatted 7");
        let p = std::panic::catch_unwind(|| std::panic::panic_any(3u8)).unwrap_err();
        assert_eq!(panic_message(&*p), "unknown panic");
    }
}
