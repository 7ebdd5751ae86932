//! Which byte ranges of one host buffer are registered with the driver (its pinned pieces), kept sorted by offset so
//! that every question a copy or a cell asks costs O(log n) in the number of pieces.
//!
//! Why sorted: a small pin chunk registers a buffer in many pieces (a 1 GiB arena in 4 KiB chunks is 262,144 of
//! them) and a sleep asks about every piece at least once, so a scan of the list per question made sleep and wake
//! quadratic in the bytes.
//!
//! Why adjacent pieces are not merged into runs: each is its own registration, and CUDA refuses an async copy whose
//! host side spans two registrations (CUDA_ERROR_INVALID_VALUE; the simulated driver enforces the same), so copies
//! are cut at every piece boundary anyway and a run would save no copy. Pieces never overlap: `insert` refuses one
//! that would.

use std::collections::BTreeMap;

#[derive(Default)]
pub(super) struct PinnedPieces {
    /// Offset in the buffer -> length of the piece registered there.
    by_offset: BTreeMap<usize, usize>,
    /// Sum of the pieces' lengths.
    bytes: usize,
    /// Entries looked at by the queries below, so that tests can prove each lookup stays logarithmic.
    #[cfg(test)]
    visited: std::sync::atomic::AtomicUsize,
}

impl PinnedPieces {
    /// Count one entry looked at (tests only: the release build has nothing to count).
    #[inline]
    fn visit<T>(&self, entry: T) -> T {
        #[cfg(test)]
        self.visited
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        entry
    }

    #[cfg(test)]
    pub(super) fn visited(&self) -> usize {
        self.visited.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The piece (offset, len) that holds byte `offset`, if any.
    pub(super) fn containing(&self, offset: usize) -> Option<(usize, usize)> {
        let (&start, &len) = self.visit(self.by_offset.range(..=offset).next_back()?);
        (offset < start + len).then_some((start, len))
    }

    /// Whether any byte of [offset, offset+len) lies in a piece.
    pub(super) fn overlaps(&self, offset: usize, len: usize) -> bool {
        len > 0
            && (self.containing(offset).is_some()
                || (self.by_offset.range(offset..offset + len).next())
                    .map(|e| self.visit(e))
                    .is_some())
    }

    /// Record [offset, offset+len) as registered. False (and nothing recorded) when it is empty or overlaps a piece.
    pub(super) fn insert(&mut self, offset: usize, len: usize) -> bool {
        if len == 0 || self.overlaps(offset, len) {
            return false;
        }
        self.by_offset.insert(offset, len);
        self.bytes += len;
        true
    }

    /// The ranges of [0, len) in no piece, in order.
    pub(super) fn gaps(&self, len: usize) -> Vec<(usize, usize)> {
        let mut gaps = Vec::new();
        let mut at = 0;
        for (&start, &l) in self.by_offset.range(..len) {
            self.visit(());
            if start > at {
                gaps.push((at, start - at));
            }
            at = at.max(start + l);
        }
        if at < len {
            gaps.push((at, len - at));
        }
        gaps
    }

    /// The piece at the highest offset (the next to unregister: any order works, this one is cheap to remove).
    pub(super) fn last(&self) -> Option<(usize, usize)> {
        self.by_offset.last_key_value().map(|(&o, &l)| (o, l))
    }

    /// Forget the piece registered at `offset` (it was unregistered).
    pub(super) fn remove(&mut self, offset: usize) {
        if let Some(len) = self.by_offset.remove(&offset) {
            self.bytes -= len;
        }
    }

    /// Bytes of pieces inside [0, end). O(log n) when no piece reaches past `end` (the common question: the whole
    /// buffer, or an arena pinned from the start); otherwise it also walks the pieces past `end`, once per call.
    pub(super) fn bytes_below(&self, end: usize) -> usize {
        let beyond = self.containing(end).map_or(0, |(start, len)| {
            // The piece holding byte `end` straddles it or starts there; either way its bytes from `end` on count.
            start + len - end
        });
        let after: usize = (self.by_offset.range(end.saturating_add(1)..))
            .map(|(_, &len)| self.visit(len))
            .sum();
        self.bytes - beyond - after
    }

    /// [offset, offset+len) cut at every piece boundary inside it, in order: each part lies wholly inside one piece
    /// or wholly outside every piece. O(log n + parts).
    pub(super) fn split(&self, offset: usize, len: usize) -> Vec<(usize, usize)> {
        let end = offset + len;
        let mut cuts = Vec::new();
        let mut cut = |c: usize| {
            if c > offset && c < end && cuts.last() != Some(&c) {
                cuts.push(c);
            }
        };
        if let Some((start, l)) = self.containing(offset) {
            cut(start + l);
        }
        // Pieces starting inside the range; non-overlapping, so their boundaries come in increasing order.
        let inside = (len > 1).then(|| self.by_offset.range(offset + 1..end));
        for (&start, &l) in inside.into_iter().flatten() {
            self.visit(());
            cut(start);
            cut(start + l);
        }
        let mut parts = Vec::with_capacity(cuts.len() + 1);
        let mut from = offset;
        for c in cuts {
            parts.push((from, c - from));
            from = c;
        }
        parts.push((from, end - from));
        parts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pieces of `cell` bytes at every offset in `at` (cell indices).
    fn pieces(cell: usize, at: impl IntoIterator<Item = usize>) -> PinnedPieces {
        let mut p = PinnedPieces::default();
        for i in at {
            assert!(p.insert(i * cell, cell));
        }
        p
    }

    #[test]
    fn containing_and_overlaps_find_the_right_piece() {
        let p = pieces(10, [1, 2, 5]); // [10,30) as two pieces, [50,60)
        assert_eq!(p.containing(9), None);
        assert_eq!(p.containing(10), Some((10, 10)));
        assert_eq!(p.containing(29), Some((20, 10)));
        assert_eq!(p.containing(30), None);
        assert_eq!(p.containing(55), Some((50, 10)));
        assert!(!p.overlaps(30, 20));
        assert!(p.overlaps(30, 21));
        assert!(p.overlaps(59, 100));
        assert!(!p.overlaps(60, 100));
        assert!(!p.overlaps(15, 0));
    }

    #[test]
    fn insert_refuses_overlaps_and_empty_pieces() {
        let mut p = pieces(10, [1]);
        assert!(!p.insert(5, 10), "overlaps the start");
        assert!(!p.insert(15, 10), "overlaps the end");
        assert!(!p.insert(10, 10), "same piece again");
        assert!(!p.insert(0, 100), "covers it");
        assert!(!p.insert(40, 0), "empty");
        assert!(p.insert(0, 10) && p.insert(20, 5));
        assert_eq!(p.bytes_below(usize::MAX), 25);
        p.remove(10);
        assert_eq!((p.bytes_below(usize::MAX), p.containing(12)), (15, None));
        assert_eq!(p.last(), Some((20, 5)));
    }

    #[test]
    fn bytes_below_counts_only_what_lies_under_the_end() {
        let p = pieces(10, [0, 1, 3, 7]); // [0,20) [30,40) [70,80)
        for (end, want) in [
            (0, 0),
            (5, 5),
            (20, 20),
            (25, 20),
            (35, 25),
            (70, 30),
            (75, 35),
            (80, 40),
        ] {
            assert_eq!(p.bytes_below(end), want, "below {end}");
        }
        assert_eq!(p.bytes_below(usize::MAX), 40);
    }

    #[test]
    fn gaps_are_the_ranges_in_no_piece() {
        let p = pieces(10, [1, 2, 5]); // [10,20) [20,30) [50,60)
        assert_eq!(p.gaps(100), [(0, 10), (30, 20), (60, 40)]);
        assert_eq!(p.gaps(55), [(0, 10), (30, 20)]);
        assert_eq!(pieces(10, [0]).gaps(10), []);
        assert_eq!(PinnedPieces::default().gaps(7), [(0, 7)]);
    }

    #[test]
    fn split_cuts_at_every_piece_boundary_and_nowhere_else() {
        let p = pieces(10, [1, 2, 5]); // [10,20) [20,30) [50,60)
        assert_eq!(
            p.split(0, 100),
            [(0, 10), (10, 10), (20, 10), (30, 20), (50, 10), (60, 40)]
        );
        assert_eq!(p.split(15, 10), [(15, 5), (20, 5)]);
        assert_eq!(p.split(12, 3), [(12, 3)]);
        assert_eq!(p.split(30, 20), [(30, 20)]);
        assert_eq!(p.split(20, 10), [(20, 10)]);
        assert_eq!(p.split(55, 10), [(55, 5), (60, 5)]);
        assert_eq!(p.split(20, 0), [(20, 0)]);
        assert_eq!(p.split(25, 1), [(25, 1)]);
    }

    /// The same answers as the linear scan this index replaced, on a buffer with gaps of every kind.
    #[test]
    fn split_matches_a_scan_of_every_piece() {
        let cell = 4;
        let p = pieces(cell, (0..64).filter(|i| i % 3 != 0 && i % 7 != 0));
        let list: Vec<(usize, usize)> = p.by_offset.iter().map(|(&o, &l)| (o, l)).collect();
        for offset in 0..256 {
            for len in 1..40 {
                let end = offset + len;
                let mut cuts: Vec<usize> = (list.iter())
                    .flat_map(|&(o, l)| [o, o + l])
                    .filter(|c| *c > offset && *c < end)
                    .collect();
                cuts.sort_unstable();
                cuts.dedup();
                let bounds: Vec<usize> = std::iter::once(offset).chain(cuts).chain([end]).collect();
                let want: Vec<(usize, usize)> =
                    bounds.windows(2).map(|w| (w[0], w[1] - w[0])).collect();
                assert_eq!(p.split(offset, len), want, "[{offset}, +{len})");
            }
        }
    }

    /// A regression to a scan per lookup fails here without timing anything: over 4096 pieces, asking once per
    /// piece must look at a bounded number of entries per question, not at all of them.
    #[test]
    fn lookups_look_at_a_bounded_number_of_entries() {
        let n = 1 << 12;
        let cell = 4096;
        let p = pieces(cell, 0..n);
        let before = p.visited();
        for i in 0..n {
            assert!(p.containing(i * cell + 7).is_some());
            assert_eq!(p.split(i * cell, cell), [(i * cell, cell)]);
            assert!(p.overlaps(i * cell, 1));
        }
        assert_eq!(p.bytes_below(n * cell), n * cell);
        let per_lookup = (p.visited() - before) as f64 / (3 * n) as f64;
        assert!(
            per_lookup <= 3.0,
            "{per_lookup} entries looked at per lookup"
        );
    }
}
