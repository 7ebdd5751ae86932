//! The process-wide allocator on the CUDA driver: the one `my_malloc`/`my_free` serve torch from, and the one
//! `Allocator.cuda()` returns to Python. Created on first use; a failure (no GPU) is remembered and returned to
//! every caller.

use std::sync::{Arc, OnceLock};

use crate::driver::cuda::CudaDriver;
use crate::engine::Engine;
use crate::error::Result;

static CUDA_ENGINE: OnceLock<Result<Arc<Engine>>> = OnceLock::new();

pub fn cuda_engine() -> Result<&'static Arc<Engine>> {
    CUDA_ENGINE
        .get_or_init(|| {
            let driver = CudaDriver::new()?;
            Ok(Arc::new(Engine::new(Arc::new(driver))?))
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// The engine if it was created successfully already; never creates one.
pub fn existing_cuda_engine() -> Option<&'static Arc<Engine>> {
    CUDA_ENGINE.get().and_then(|r| r.as_ref().ok())
}
