//! The blob the CUDA codec (`cuda_codec.rs`) stores for one compressed range: a header naming the nvCOMP data
//! type, the raw length, the chunk size and each chunk's compressed size, then the chunks' nvCOMP bitstreams,
//! each starting at a multiple of 16 bytes (nvCOMP's ANS needs 16-byte aligned inputs, and the wake copies a
//! blob whole to a 256-byte aligned place on the device, so the offsets stay aligned there).
//!
//! Pure layout, no device: the wake parses and checks every header on the host before it queues anything, so a
//! damaged blob fails the wake before a device byte changes.

/// Alignment of every chunk's bitstream inside a blob (and of the header's length).
pub(super) const ALIGN: usize = 16;
const MAGIC: u32 = u32::from_le_bytes(*b"CMNV");
const FORMAT: u32 = 1;
/// magic, format, data type, raw length, chunk size, chunk count.
const FIXED_WORDS: usize = 6;

pub(super) fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

/// What a blob holds, read from or written to its header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Header {
    /// nvCOMP data type code the chunks were compressed with (decompression uses the same).
    pub data_type: i32,
    /// Bytes of the range it restores.
    pub raw_len: usize,
    /// Raw bytes per chunk (the last chunk holds the rest).
    pub chunk: usize,
    /// Compressed bytes of each chunk.
    pub sizes: Vec<usize>,
}

impl Header {
    /// Bytes of the header itself, for `chunks` chunks.
    pub fn header_len(chunks: usize) -> usize {
        round_up(4 * (FIXED_WORDS + chunks), ALIGN)
    }

    /// Bytes of the whole blob: header, then every chunk padded to `ALIGN`.
    pub fn blob_len(&self) -> usize {
        Self::header_len(self.sizes.len())
            + self
                .sizes
                .iter()
                .map(|s| round_up(*s, ALIGN))
                .sum::<usize>()
    }

    /// Offset of each chunk's bitstream from the start of the blob.
    pub fn offsets(&self) -> Vec<usize> {
        let mut at = Self::header_len(self.sizes.len());
        self.sizes
            .iter()
            .map(|s| {
                let here = at;
                at += round_up(*s, ALIGN);
                here
            })
            .collect()
    }

    /// Raw bytes chunk `j` restores.
    pub fn chunk_raw_len(&self, j: usize) -> usize {
        self.chunk.min(self.raw_len - j * self.chunk)
    }

    /// The header's bytes (`header_len` of them, zero padded).
    pub fn encode(&self) -> Vec<u8> {
        let fixed = [
            MAGIC,
            FORMAT,
            self.data_type as u32,
            self.raw_len as u32,
            self.chunk as u32,
            self.sizes.len() as u32,
        ];
        let mut out = Vec::with_capacity(Self::header_len(self.sizes.len()));
        for w in fixed
            .iter()
            .copied()
            .chain(self.sizes.iter().map(|s| *s as u32))
        {
            out.extend_from_slice(&w.to_le_bytes());
        }
        out.resize(Self::header_len(self.sizes.len()), 0);
        out
    }

    /// Read and check the header of `blob` (the stored bytes, `Stored::len` of them), which must restore
    /// `raw_len` bytes in chunks of `chunk` bytes, each compressing to at most `max_chunk_out`. Every mismatch
    /// is an error naming what is wrong: the blob is never decompressed on a guess.
    pub fn parse(
        blob: &[u8],
        raw_len: usize,
        chunk: usize,
        max_chunk_out: usize,
    ) -> Result<Header, String> {
        let word = |i: usize| -> Result<u32, String> {
            blob.get(4 * i..4 * i + 4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .ok_or_else(|| format!("blob of {} bytes is shorter than its header", blob.len()))
        };
        if word(0)? != MAGIC {
            return Err("not a blob of the nvCOMP codec (bad magic)".into());
        }
        if word(1)? != FORMAT {
            return Err(format!(
                "blob format {} (this codec writes {FORMAT})",
                word(1)?
            ));
        }
        let header = Header {
            data_type: word(2)? as i32,
            raw_len: word(3)? as usize,
            chunk: word(4)? as usize,
            sizes: Vec::new(),
        };
        if header.raw_len != raw_len || header.chunk != chunk {
            return Err(format!(
                "blob restores {} bytes in chunks of {}, expected {raw_len} in chunks of {chunk}",
                header.raw_len, header.chunk
            ));
        }
        let n = word(5)? as usize;
        if n != raw_len.div_ceil(chunk) {
            return Err(format!("blob has {n} chunks for {raw_len} bytes"));
        }
        let sizes = (0..n)
            .map(|j| word(FIXED_WORDS + j).map(|s| s as usize))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(s) = sizes.iter().find(|s| **s == 0 || **s > max_chunk_out) {
            return Err(format!(
                "blob names a chunk of {s} compressed bytes (at most {max_chunk_out})"
            ));
        }
        let header = Header { sizes, ..header };
        if header.blob_len() != blob.len() {
            return Err(format!(
                "blob holds {} bytes, its header describes {}",
                blob.len(),
                header.blob_len()
            ));
        }
        Ok(header)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Header {
        Header {
            data_type: 10,
            raw_len: (2 << 20) - 4096,
            chunk: 256 << 10,
            sizes: vec![170_001, 169_999, 1, 16, 17, 170_000, 170_000, 2900],
        }
    }

    #[test]
    fn offsets_are_aligned_and_the_blob_ends_after_the_last_chunk() {
        let h = sample();
        let offs = h.offsets();
        assert!(offs.iter().all(|o| o % ALIGN == 0));
        assert_eq!(offs[0], Header::header_len(8));
        assert_eq!(offs[1], offs[0] + round_up(170_001, ALIGN));
        assert_eq!(h.blob_len(), offs[7] + round_up(2900, ALIGN));
        assert_eq!(h.chunk_raw_len(0), 256 << 10);
        assert_eq!(h.chunk_raw_len(7), (256 << 10) - 4096);
    }

    #[test]
    fn a_header_reads_back_as_written() {
        let h = sample();
        let mut blob = h.encode();
        blob.resize(h.blob_len(), 0xAB);
        assert_eq!(Header::parse(&blob, h.raw_len, h.chunk, 300_000), Ok(h));
    }

    #[test]
    fn damaged_or_foreign_blobs_are_refused_by_what_is_wrong() {
        let h = sample();
        let mut blob = h.encode();
        blob.resize(h.blob_len(), 0);
        let parse = |b: &[u8]| Header::parse(b, h.raw_len, h.chunk, 300_000).unwrap_err();
        assert!(parse(&blob[..blob.len() - 1]).contains("holds"));
        assert!(parse(&blob[..10]).contains("shorter"));
        let mut bad = blob.clone();
        bad[0] ^= 1;
        assert!(parse(&bad).contains("magic"));
        assert!(Header::parse(&blob, h.raw_len + 1, h.chunk, 300_000)
            .unwrap_err()
            .contains("expected"));
        assert!(Header::parse(&blob, h.raw_len, h.chunk, 100_000)
            .unwrap_err()
            .contains("at most"));
        let mut zero = blob.clone();
        zero[4 * FIXED_WORDS..4 * FIXED_WORDS + 4].copy_from_slice(&0u32.to_le_bytes());
        assert!(parse(&zero).contains("0 compressed bytes"));
    }
}
