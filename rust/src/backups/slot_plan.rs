//! How the file tier's pipelines cut their work into staging-ring slots: one file read or write per slot, as
//! large as the slot, spanning as many backups as lie back to back in the file.
//!
//! Why: a sleep writes its file-tier backups back to back into one file, and cutting each backup on its own
//! left a short I/O at every backup's end. The reference model at a quarter of its size (291 weight tensors,
//! 8 MiB slots) made 641 I/Os averaging 6.2 MiB instead of 496 full slots; on the H200 host's disk the pipelines
//! then ran at 0.83-0.87x of the file system's own rate (measured with full 8 MiB blocks, as many in flight). A
//! slot is now filled from (or emptied into) several backups by one device copy each, and the file sees one
//! I/O per slot, at consecutive offsets.
//!
//! A slot spans items only where they are contiguous in the same file (`key`) and on the same device (one
//! copy marker per slot). Each item starts on an I/O block (the sleep pads every backup to whole blocks,
//! `io_len`), so a segment that ends an item takes its padding with it, and every segment starts where the slot
//! is block-aligned.

use super::io_workers::io_len;
use super::spill_file::SpillFile;

/// Where one item (a backup, or a run of one) lies: the file it is in (`key`: the same for the same file), its
/// device, its offset in that file, and its length.
#[derive(Debug, Clone, Copy)]
pub struct Item {
    pub key: usize,
    pub device: i32,
    pub offset: u64,
    pub len: usize,
}

impl Item {
    /// `len` bytes at `offset` of spill file `file`, to or from `device` (keyed by the file: one I/O never
    /// spans two files).
    pub fn in_file(file: &SpillFile, device: i32, offset: u64, len: usize) -> Item {
        Item {
            key: file as *const SpillFile as usize,
            device,
            offset,
            len,
        }
    }
}

/// `len` bytes of item `item`, `at` bytes into it, at `slot_off` of the slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub item: usize,
    pub at: usize,
    pub slot_off: usize,
    pub len: usize,
}

/// One slot's I/O: `len` bytes (whole I/O blocks) at `offset` of the file of `segments[0].item`, on `device`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotIo {
    pub device: i32,
    pub offset: u64,
    pub len: usize,
    pub segments: Vec<Segment>,
}

impl SlotIo {
    pub fn item(&self) -> usize {
        self.segments[0].item
    }
}

/// The slots' I/Os for `items`, in their order (the order the pipeline reaches them).
pub fn plan(items: &[Item], slot: usize) -> Vec<SlotIo> {
    let mut out: Vec<SlotIo> = Vec::new();
    let mut open: Option<(usize, SlotIo)> = None; // (key, the slot being filled)
    for (i, it) in items.iter().enumerate() {
        let mut at = 0;
        while at < it.len {
            let here = it.offset + at as u64;
            let joins = open.as_ref().is_some_and(|(key, s)| {
                *key == it.key
                    && s.device == it.device
                    && s.offset + s.len as u64 == here
                    && s.len < slot
            });
            if !joins {
                out.extend(open.take().map(|(_, s)| s));
                open = Some((
                    it.key,
                    SlotIo {
                        device: it.device,
                        offset: here,
                        len: 0,
                        segments: Vec::new(),
                    },
                ));
            }
            let (_, s) = open.as_mut().expect("a slot being filled");
            let len = (slot - s.len).min(it.len - at);
            s.segments.push(Segment {
                item: i,
                at,
                slot_off: s.len,
                len,
            });
            // Short of the item's end only when the slot is full (a whole number of blocks); at its end, padded.
            s.len += io_len(len);
            at += len;
            if s.len >= slot {
                out.extend(open.take().map(|(_, s)| s));
            }
        }
    }
    out.extend(open.map(|(_, s)| s));
    out
}

/// Segments of each item in `plan` (a pipeline hands an item over once all of them are done).
pub fn segments_per_item(plan: &[SlotIo], items: usize) -> Vec<usize> {
    let mut n = vec![0; items];
    for s in plan {
        for seg in &s.segments {
            n[seg.item] += 1;
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::staging::IO_ALIGN;

    const B: usize = IO_ALIGN;

    fn item(key: usize, offset: u64, len: usize) -> Item {
        Item {
            key,
            device: 0,
            offset,
            len,
        }
    }

    #[test]
    fn backups_back_to_back_share_full_slots_and_every_byte_is_covered_once() {
        // Three backups back to back, the second not a whole number of blocks (padded in the file).
        let items = [
            item(7, 0, 3 * B),
            item(7, 3 * B as u64, 2 * B + 100),
            item(7, 6 * B as u64, 5 * B),
        ];
        let p = plan(&items, 4 * B);
        assert_eq!(
            p.iter().map(|s| (s.offset, s.len)).collect::<Vec<_>>(),
            [(0, 4 * B), (4 * B as u64, 4 * B), (8 * B as u64, 3 * B)],
            "one I/O per full slot at consecutive offsets"
        );
        let segs: Vec<_> = p.iter().flat_map(|s| s.segments.clone()).collect();
        assert_eq!(
            segs,
            [
                Segment {
                    item: 0,
                    at: 0,
                    slot_off: 0,
                    len: 3 * B
                },
                Segment {
                    item: 1,
                    at: 0,
                    slot_off: 3 * B,
                    len: B
                },
                Segment {
                    item: 1,
                    at: B,
                    slot_off: 0,
                    len: B + 100
                },
                Segment {
                    item: 2,
                    at: 0,
                    slot_off: 2 * B,
                    len: 2 * B
                },
                Segment {
                    item: 2,
                    at: 2 * B,
                    slot_off: 0,
                    len: 3 * B
                },
            ]
        );
        // Each segment's file offset is its slot's offset plus its place in the slot.
        for s in &p {
            for g in &s.segments {
                assert_eq!(
                    items[g.item].offset + g.at as u64,
                    s.offset + g.slot_off as u64
                );
            }
        }
        assert_eq!(segments_per_item(&p, 3), [1, 2, 2]);
    }

    #[test]
    fn slots_never_span_files_devices_or_gaps() {
        let mut other_device = item(1, 2 * B as u64, B);
        other_device.device = 1;
        let items = [
            item(1, 0, B),
            item(2, B as u64, B), // another file
            item(1, B as u64, B), // the first file again: its slot was closed by the other file
            other_device,
            item(1, 5 * B as u64, B), // a gap before it
        ];
        let p = plan(&items, 16 * B);
        assert_eq!(p.len(), 5, "{p:?}");
        assert!(p.iter().all(|s| s.segments.len() == 1));
    }

    #[test]
    fn a_backup_larger_than_a_slot_is_cut_into_whole_slots() {
        let p = plan(&[item(0, 0, 10 * B + 1)], 4 * B);
        assert_eq!(
            p.iter().map(|s| s.len).collect::<Vec<_>>(),
            [4 * B, 4 * B, 3 * B]
        );
        assert_eq!(p[2].segments[0].len, 2 * B + 1);
    }
}
