//! A diagnostic of a driver's codec on its own: device ranges compressed into pinned host memory of the
//! diagnostic's, restored into other device ranges, and what was stored returned. The GPU self-check of the
//! nvCOMP codec (`tests/test_nvcomp_cuda.py`, `_native._codec_round_trip`) uses it to test the codec apart from
//! the backup store; no sleep or wake goes through here.

use super::codec::{DataKind, RestoreItem, Stored};
use super::{DevPtr, Driver, HostPtr};
use crate::error::{Error, Result};

/// Ranges the diagnostic hands the codec: the largest the trait allows.
const RANGE: usize = 2 << 20;

/// Compress `[src, src+len)` on `device` through `driver`'s codec and restore it at `[dst, dst+len)`, in ranges of
/// 2 MiB (the last one shorter); returns what each range was stored as. The device work that wrote `src` must be
/// finished, and `dst` must not overlap it.
pub fn round_trip(
    driver: &dyn Driver,
    device: i32,
    src: DevPtr,
    dst: DevPtr,
    len: usize,
    kind: DataKind,
) -> Result<Vec<Stored>> {
    let codec = driver.codec().ok_or_else(|| {
        Error::InvalidState(
            "this driver has no codec (nvCOMP not loaded, or CUMEM_RS_COMPRESS=0)".into(),
        )
    })?;
    if len == 0 {
        return Err(Error::invalid("nbytes must be positive"));
    }
    let overlap = src < dst + len as u64 && dst < src + len as u64;
    if overlap {
        return Err(Error::invalid("src and dst ranges overlap"));
    }
    let ranges: Vec<(DevPtr, usize)> = (0..len)
        .step_by(RANGE)
        .map(|off| (src + off as u64, RANGE.min(len - off)))
        .collect();
    // A blob is never longer than its range (it is stored raw otherwise), so each range's place is its own
    // 2 MiB of one buffer.
    let host = driver.host_alloc(len)?;
    let at = |i: usize| HostPtr(host.0 + i * RANGE);
    let result = (|| {
        let stored = codec.compress_to_host(
            device,
            &ranges,
            kind,
            &mut |i, blob_len| {
                if blob_len > ranges[i].1 {
                    return Err(Error::InvalidState(format!(
                        "the codec asked {blob_len} bytes for a range of {}",
                        ranges[i].1
                    )));
                }
                Ok(at(i))
            },
            &mut |_, _| Ok(()),
        )?;
        let items: Vec<RestoreItem> = ranges
            .iter()
            .zip(&stored)
            .enumerate()
            .map(|(i, (&(addr, raw_len), &stored))| RestoreItem {
                src: at(i),
                stored,
                dst: dst + (addr - src),
                raw_len,
                kind,
                joins_previous: false,
            })
            .collect();
        codec.decompress_from_host(device, &items, &mut |_| Ok(()))?;
        Ok(stored)
    })();
    // SAFETY: `host` came from this driver's host_alloc and is freed once; both codec calls are synchronous (also
    // on error), so no copy uses it any more.
    let freed = unsafe { driver.host_free(host) };
    let stored = result?;
    freed.map(|()| stored)
}
