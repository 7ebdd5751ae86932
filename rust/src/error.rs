//! One error type for the whole crate. Python sees these as `CumemError` subclasses (see `python.rs`).

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

/// CUDA_ERROR_OUT_OF_MEMORY: the driver code that means "no physical memory".
pub const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;

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
