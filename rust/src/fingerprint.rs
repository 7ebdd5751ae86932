//! 128-bit chunk fingerprints: the host reference of the GPU kernel in `rust/kernels/fingerprint.cu`.
//!
//! A retained backup (a host copy that a wake restored from and kept) is still valid for the chunks whose
//! fingerprint did not change since that wake; only the others must be copied again at the next sleep. The
//! simulated driver computes fingerprints with this code, the CUDA driver with the kernel; both give the same
//! value for the same bytes (checked on the GPU by the test suite).
//!
//! Per 16-byte word (lo, hi) at word index i of its chunk: `h = fmix64(lo ^ i*K1 ^ fmix64(hi ^ (i*K2 + K3)))`,
//! a bijection of lo for fixed (hi, i) and of hi for fixed (lo, i), so a change confined to one word always
//! changes h and with it the first sum. Chunk fingerprint: `[fmix64(Σh + len), fmix64(Σ(h ^ K4)(2i+1) ^ len*K1)]`.

/// One chunk's fingerprint.
pub type Fingerprint = [u64; 2];

/// Chunk size by default: the CUDA granularity of current GPUs, so a typical allocation is a whole number of
/// chunks and one changed tensor element costs one 2 MiB copy.
pub const DEFAULT_CHUNK: usize = 2 << 20;

/// Fingerprinted bytes come in whole 16-byte words.
pub const WORD: usize = 16;

const K1: u64 = 0x9E37_79B9_7F4A_7C15;
const K2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const K3: u64 = 0x1656_67B1_9E37_79F9;
const K4: u64 = 0x27D4_EB2F_1656_67C5;

fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    k ^= k >> 33;
    k = k.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    k ^ (k >> 33)
}

/// Fingerprint of one chunk. `bytes.len()` must be a multiple of `WORD`.
pub fn fingerprint(bytes: &[u8]) -> Fingerprint {
    assert!(
        bytes.len().is_multiple_of(WORD),
        "fingerprinted length {} is not a multiple of {WORD}",
        bytes.len()
    );
    let (mut a, mut b) = (0u64, 0u64);
    for (i, w) in bytes.chunks_exact(WORD).enumerate() {
        let i = i as u64;
        let lo = u64::from_le_bytes(w[..8].try_into().expect("8 bytes"));
        let hi = u64::from_le_bytes(w[8..].try_into().expect("8 bytes"));
        let h = fmix64(lo ^ i.wrapping_mul(K1) ^ fmix64(hi ^ i.wrapping_mul(K2).wrapping_add(K3)));
        a = a.wrapping_add(h);
        b = b.wrapping_add((h ^ K4).wrapping_mul(i.wrapping_mul(2).wrapping_add(1)));
    }
    let len = bytes.len() as u64;
    [
        fmix64(a.wrapping_add(len)),
        fmix64(b ^ len.wrapping_mul(K1)),
    ]
}

/// The (offset, len) chunks of an allocation of `size` bytes: `chunk` bytes each, the last one shorter.
pub fn chunks(size: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..size.div_ceil(chunk)).map(move |i| (i * chunk, chunk.min(size - i * chunk)))
}

/// The same chunks as device ranges (address, len) of an allocation at `addr` (a `DevPtr`).
pub fn chunk_ranges(addr: u64, size: usize, chunk: usize) -> impl Iterator<Item = (u64, usize)> {
    chunks(size, chunk).map(move |(off, len)| (addr + off as u64, len))
}

/// The first chunk whose print `got` does not match `want` (a missing one counts as a mismatch).
pub fn first_mismatch(want: &[Fingerprint], got: &[Fingerprint]) -> Option<usize> {
    (want.iter().enumerate())
        .find(|(i, w)| got.get(*i) != Some(*w))
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn every_single_bit_flip_changes_the_fingerprint() {
        let data = sample(256, 7);
        let base = fingerprint(&data);
        for bit in 0..data.len() * 8 {
            let mut d = data.clone();
            d[bit / 8] ^= 1 << (bit % 8);
            assert_ne!(fingerprint(&d), base, "flip of bit {bit}");
        }
    }

    #[test]
    fn swapped_words_moved_values_and_zero_chunks_are_distinguished() {
        let data = sample(128, 3);
        let base = fingerprint(&data);
        let mut swapped = data.clone();
        swapped.copy_within(0..16, 64);
        swapped[..16].copy_from_slice(&data[64..80]);
        assert_ne!(fingerprint(&swapped), base, "two words swapped");
        let mut moved = data.clone();
        moved.copy_within(32..48, 96); // word 2's value written over word 6 as well
        assert_ne!(fingerprint(&moved), base, "same value written elsewhere");
        assert_ne!(
            fingerprint(&[0u8; 64]),
            fingerprint(&[0u8; 80]),
            "length counts"
        );
        assert_ne!(fingerprint(&[0u8; 64])[0], 0, "zeros do not hash to zero");
    }

    #[test]
    fn chunks_cover_the_allocation_once() {
        let c: Vec<_> = chunks(5 * 16, 32).collect();
        assert_eq!(c, vec![(0, 32), (32, 32), (64, 16)]);
        assert_eq!(chunks(64, 64).count(), 1);
        assert_eq!(chunks(0, 64).count(), 0);
    }
}
