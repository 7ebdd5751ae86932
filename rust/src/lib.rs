//! cumem_rs: a CUDA virtual-memory allocator for PyTorch that can put GPU memory to sleep (back up or discard,
//! release the physical memory, keep the addresses) and wake it up at the same addresses.
//!
//! Layers, arrows one way: `python`/`ffi` -> `engine` -> components (`registry`, `tags`, `address_space`,
//! `backups` over `host` + `transfer` + `fingerprint`, `error_log`) -> `driver` (cuda | sim).

pub mod address_space;
pub mod backups;
pub mod driver;
pub mod engine;
pub mod env;
pub mod error;
pub mod error_log;
pub mod ffi;
pub mod fingerprint;
pub mod global;
pub mod host;
pub mod host_guard;
pub mod logbuf;
pub mod preload;
pub mod registry;
pub mod tags;
pub mod timing;
pub mod transfer;

#[cfg(feature = "python")]
mod python;

pub use driver::sim::{SimConfig, SimDriver};
pub use engine::{
    AllocationInfo, Compress, Engine, EngineConfig, PinAheadStatus, Report, Stats, Status,
    TagPolicy, TagStatus, WakeFill,
};
pub use error::{Error, Result};
