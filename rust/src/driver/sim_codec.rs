//! The simulated driver's codec: the `DeviceCodec` of `codec.rs` on the host, so that compressed backups run
//! wherever the emulation does (CPU-only CI included).
//!
//! Each range is read from the emulated device with the emulator's own checked copy (an unmapped range fails as
//! on CUDA), entropy coded with zstd (level 1, whose literals are Huffman coded), and written where the store's
//! `place` says. (The pure-Rust `ruzstd` was tried first: ~2 MB/s and a ratio of 0.74 for bf16 in its fastest
//! level, too slow for tests that sleep tens of MiB; libzstd, built from source by `zstd-sys` with the C
//! compiler every manylinux image has, codes hundreds of MB/s.) `DataKind::Bits16` first splits the range into its high bytes and its
//! low bytes and codes them apart, as nvCOMP's 16-bit ANS mode does: the high byte of a bf16 (sign and most of
//! the exponent) carries ~2.6 bits, the low byte ~8, so the sim's ratio for `normal_()` bf16 (~0.67) resembles
//! the GPU's. `Bits8` codes bytes as they are (fp8's bytes are its symbols).
//!
//! The emulator offers these functions over its own copies as its `DeviceCodec` (`sim/codec.rs`).
//!
//! A blob is `HEADER` bytes (magic, mode, raw length, length of the first stream) and the zstd frame(s). A range
//! that does not shrink below `RAW_RATIO` is stored raw (`Stored::raw`): its blob is its bytes.

use std::sync::atomic::{AtomicU64, Ordering};

use super::codec::{DataKind, DoneFn, PlaceFn, ReadyFn, RestoreItem, Stored, RAW_RATIO};
use super::{copy_from_slice, copy_to_slice, DevPtr, Driver, HostPtr};
use crate::error::{cuda_code, Error, Result};

const MAGIC: [u8; 2] = *b"cz";
/// magic (2), mode (1), reserved (1), raw length (u32), first stream's length (u32).
const HEADER: usize = 12;
const MODE_BYTES: u8 = 0;
const MODE_SPLIT16: u8 = 1;

/// Largest range one call codes (the trait's promise; the header stores lengths as u32).
pub const MAX_RANGE: usize = 2 << 20;

/// What the codec did, for tests (a retained chunk that did not change must not be compressed again).
#[derive(Debug, Default)]
pub struct SimCodecCounts {
    /// Ranges read and coded (stored raw or not).
    pub compressed: AtomicU64,
    /// Of those, the ones stored raw (did not shrink below `RAW_RATIO`).
    pub stored_raw: AtomicU64,
    /// Ranges restored.
    pub decompressed: AtomicU64,
}

fn codec_err(op: &'static str, what: impl std::fmt::Display) -> Error {
    Error::driver(
        op,
        cuda_code::UNKNOWN,
        format!(
            "{} (sim codec: {what})",
            cuda_code::name(cuda_code::UNKNOWN)
        ),
    )
}

type Contexts = (
    zstd::bulk::Compressor<'static>,
    zstd::bulk::Decompressor<'static>,
);

thread_local! {
    // One compression and one decompression context per thread: making one costs more than coding 64 KiB.
    static CONTEXTS: std::cell::RefCell<Option<Contexts>> = const { std::cell::RefCell::new(None) };
}

fn with_contexts<T>(f: impl FnOnce(&mut Contexts) -> Result<T>) -> Result<T> {
    CONTEXTS.with(|c| {
        let mut c = c.borrow_mut();
        if c.is_none() {
            let comp = zstd::bulk::Compressor::new(LEVEL).map_err(|e| codec_err("compress", e))?;
            let dec = zstd::bulk::Decompressor::new().map_err(|e| codec_err("decompress", e))?;
            *c = Some((comp, dec));
        }
        f(c.as_mut().expect("made above"))
    })
}

/// zstd's fastest level: its literals are Huffman coded, which is what the byte split feeds.
const LEVEL: i32 = 1;

fn zstd(bytes: &[u8]) -> Result<Vec<u8>> {
    with_contexts(|(comp, _)| comp.compress(bytes).map_err(|e| codec_err("compress", e)))
}

fn unzstd(frame: &[u8], out: &mut [u8]) -> Result<()> {
    let n = with_contexts(|(_, dec)| {
        (dec.decompress_to_buffer(frame, out)).map_err(|e| codec_err("decompress", e))
    })?;
    if n != out.len() {
        return Err(codec_err(
            "decompress",
            format!("{n} bytes decoded, {} expected", out.len()),
        ));
    }
    Ok(())
}

/// The high bytes and the low bytes of the little-endian 16-bit words of `raw` (even length). Plain indexed
/// loops over slices of known length: the compiler drops the bounds checks, and debug builds (the tests) stay
/// fast enough.
fn split16(raw: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let n = raw.len() / 2;
    let (mut hi, mut lo) = (vec![0u8; n], vec![0u8; n]);
    let (h, l, r) = (&mut hi[..n], &mut lo[..n], &raw[..2 * n]);
    for i in 0..n {
        l[i] = r[2 * i];
        h[i] = r[2 * i + 1];
    }
    (hi, lo)
}

/// The words back from `split16`'s halves.
fn join16(hi: &[u8], lo: &[u8], out: &mut [u8]) {
    let n = out.len() / 2;
    let (h, l, o) = (&hi[..n], &lo[..n], &mut out[..2 * n]);
    for i in 0..n {
        o[2 * i] = l[i];
        o[2 * i + 1] = h[i];
    }
}

/// The blob of `raw` in `kind`'s mode (header + frames), or None when it does not shrink below `RAW_RATIO`.
pub fn encode(raw: &[u8], kind: DataKind) -> Result<Option<Vec<u8>>> {
    let (mode, streams) = match kind {
        // An odd length has no 16-bit words to split: code its bytes as they are.
        DataKind::Bits16 if raw.len().is_multiple_of(2) => {
            let (hi, lo) = split16(raw);
            (MODE_SPLIT16, vec![zstd(&hi)?, zstd(&lo)?])
        }
        _ => (MODE_BYTES, vec![zstd(raw)?]),
    };
    let len = HEADER + streams.iter().map(Vec::len).sum::<usize>();
    if len as f64 >= RAW_RATIO * raw.len() as f64 {
        return Ok(None);
    }
    let mut blob = Vec::with_capacity(len);
    blob.extend_from_slice(&MAGIC);
    blob.extend_from_slice(&[mode, 0]);
    blob.extend_from_slice(&(raw.len() as u32).to_le_bytes());
    blob.extend_from_slice(&(streams[0].len() as u32).to_le_bytes());
    for s in &streams {
        blob.extend_from_slice(s);
    }
    Ok(Some(blob))
}

/// Restore the raw bytes of `blob` into `out` (its raw length); a blob that is not one of ours fails.
pub fn decode(blob: &[u8], out: &mut [u8]) -> Result<()> {
    let word =
        |at: usize| u32::from_le_bytes(blob[at..at + 4].try_into().expect("4 bytes")) as usize;
    if blob.len() < HEADER || blob[..2] != MAGIC {
        return Err(codec_err("decompress", "not a blob of this codec"));
    }
    if word(4) != out.len() {
        return Err(codec_err(
            "decompress",
            format!("blob of {} raw bytes for a range of {}", word(4), out.len()),
        ));
    }
    let body = &blob[HEADER..];
    match blob[2] {
        MODE_BYTES => unzstd(body, out),
        MODE_SPLIT16 => {
            let first = word(8);
            if first > body.len() || !out.len().is_multiple_of(2) {
                return Err(codec_err("decompress", "damaged 16-bit blob"));
            }
            let (mut hi, mut lo) = (vec![0u8; out.len() / 2], vec![0u8; out.len() / 2]);
            unzstd(&body[..first], &mut hi)?;
            unzstd(&body[first..], &mut lo)?;
            join16(&hi, &lo, out);
            Ok(())
        }
        m => Err(codec_err("decompress", format!("unknown mode {m}"))),
    }
}

/// Copy `bytes` to host memory at `dst`.
///
/// # Safety
/// `[dst, dst+bytes.len())` is host memory valid for writes that nothing else uses meanwhile (`PlaceFn`'s
/// promise: pinned memory of the store's, live until the store drops the backup).
unsafe fn write_host(dst: HostPtr, bytes: &[u8]) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst.0 as *mut u8, bytes.len()) };
}

/// Compress `ranges` of `device` through `driver`'s copies into the places `place` gives (the trait's
/// `compress_to_host`, for the emulator).
pub fn compress_ranges(
    driver: &dyn Driver,
    counts: &SimCodecCounts,
    device: i32,
    ranges: &[(DevPtr, usize)],
    kind: DataKind,
    place: &mut PlaceFn<'_>,
    done: &mut DoneFn<'_>,
) -> Result<Vec<Stored>> {
    let mut out = Vec::with_capacity(ranges.len());
    let mut raw = Vec::new();
    for (i, &(addr, len)) in ranges.iter().enumerate() {
        if len > MAX_RANGE {
            return Err(Error::invalid(format!(
                "codec range of {len} bytes: at most {MAX_RANGE}"
            )));
        }
        raw.resize(len, 0);
        copy_to_slice(driver, device, addr, &mut raw)?;
        counts.compressed.fetch_add(1, Ordering::Relaxed);
        let (bytes, stored) = match encode(&raw, kind)? {
            Some(blob) => {
                let s = Stored {
                    len: blob.len(),
                    raw: false,
                };
                (blob, s)
            }
            None => {
                counts.stored_raw.fetch_add(1, Ordering::Relaxed);
                let s = Stored { len, raw: true };
                (std::mem::take(&mut raw), s)
            }
        };
        let dst = place(i, bytes.len())?;
        // SAFETY: `place` returned memory of `bytes.len()` bytes for this blob (`PlaceFn`'s contract).
        unsafe { write_host(dst, &bytes) };
        if stored.raw {
            raw = bytes; // reuse the buffer
        }
        done(i, stored)?; // written synchronously: complete now
        out.push(stored);
    }
    Ok(out)
}

/// Restore `items` into their device ranges through `driver`'s copies (the trait's `decompress_from_host`).
pub fn decompress_items(
    driver: &dyn Driver,
    counts: &SimCodecCounts,
    device: i32,
    items: &[RestoreItem],
    ready: &mut ReadyFn<'_>,
) -> Result<()> {
    let mut raw = Vec::new();
    for (i, it) in items.iter().enumerate() {
        ready(i)?;
        // SAFETY: the blob lies at `src` for `stored.len` bytes and is not written while it is restored (the
        // trait's contract: the store keeps its blobs alive and unchanged until it drops the backup).
        let blob = unsafe { std::slice::from_raw_parts(it.src.0 as *const u8, it.stored.len) };
        if it.stored.raw {
            if it.stored.len != it.raw_len {
                return Err(codec_err("decompress", "raw blob of the wrong length"));
            }
            copy_from_slice(driver, device, it.dst, blob)?;
        } else {
            raw.resize(it.raw_len, 0);
            decode(blob, &mut raw)?;
            copy_from_slice(driver, device, it.dst, &raw)?;
        }
        counts.decompressed.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// bf16 bit patterns of N(0, 0.02) samples, from a small deterministic generator.
    pub(crate) fn bf16_like(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut out = Vec::with_capacity(n * 2);
        for _ in 0..n {
            // Box-Muller
            let (u, v) = (next().max(1e-300), next());
            let x = (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos() * 0.02;
            let bits = ((x as f32).to_bits() >> 16) as u16;
            out.extend_from_slice(&bits.to_le_bytes());
        }
        out
    }

    #[test]
    fn bits16_codes_bf16_like_data_near_the_gpu_ratio_and_restores_it() {
        let raw = bf16_like(1 << 20, 7);
        let blob = encode(&raw, DataKind::Bits16).unwrap().expect("shrinks");
        let ratio = blob.len() as f64 / raw.len() as f64;
        assert!((0.6..0.75).contains(&ratio), "ratio {ratio}");
        let plain = encode(&raw, DataKind::Bytes)
            .unwrap()
            .map_or(1.0, |b| b.len() as f64 / raw.len() as f64);
        assert!(ratio < plain, "the byte split helps: {ratio} vs {plain}");
        let mut back = vec![0; raw.len()];
        decode(&blob, &mut back).unwrap();
        assert!(back == raw);
    }

    #[test]
    fn random_bytes_are_stored_raw_and_zeros_shrink_to_almost_nothing() {
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        let random: Vec<u8> = (0..1 << 20)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (s >> 56) as u8
            })
            .collect();
        assert!(encode(&random, DataKind::Bits16).unwrap().is_none());
        let zeros = vec![0u8; 2 << 20];
        let blob = encode(&zeros, DataKind::Bytes).unwrap().unwrap();
        assert!(blob.len() < 1024, "{} bytes", blob.len());
        let mut back = vec![1u8; zeros.len()];
        decode(&blob, &mut back).unwrap();
        assert!(back == zeros);
    }

    #[test]
    fn a_damaged_or_foreign_blob_fails_to_decode() {
        let raw = bf16_like(4096, 3);
        let mut blob = encode(&raw, DataKind::Bits16).unwrap().unwrap();
        let mut out = vec![0; raw.len()];
        assert!(decode(&blob[..HEADER - 1], &mut out).is_err());
        assert!(decode(&blob, &mut out[..raw.len() - 2]).is_err());
        blob[0] = b'x';
        assert!(decode(&blob, &mut out).is_err());
    }
}
