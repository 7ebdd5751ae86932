//! Allocations whose last compressed backup the codec could not shrink: every chunk was stored raw (random
//! bytes, packed int4, data already compressed). Their next sleeps take the raw path straight away instead of
//! compressing every chunk to keep none of it (H200, 15 GiB of random bytes: the codec's pass cost a sleep 7%
//! and a wake 8% against the raw path). Every `RETRY_AFTER` sleeps such an allocation is given to the codec
//! again, since its contents may have changed (a KV cache refilled, a buffer reused).

use std::collections::HashMap;

use crate::driver::DevPtr;

/// Sleeps of an incompressible allocation that skip the codec before the next one tries it again.
const RETRY_AFTER: u32 = 8;

#[derive(Default)]
pub(super) struct Incompressible {
    /// Allocation -> sleeps still to skip the codec.
    skips_left: HashMap<DevPtr, u32>,
}

impl Incompressible {
    /// Whether this sleep copies `addr` raw without trying the codec (counts the sleep).
    pub(super) fn skip(&mut self, addr: DevPtr) -> bool {
        match self.skips_left.get_mut(&addr) {
            Some(0) => {
                self.skips_left.remove(&addr);
                false
            }
            Some(n) => {
                *n -= 1;
                true
            }
            None => false,
        }
    }

    /// Whether the next sleep would copy `addr` raw without trying the codec (nothing counted).
    pub(super) fn would_skip(&self, addr: DevPtr) -> bool {
        self.skips_left.get(&addr).is_some_and(|n| *n > 0)
    }

    /// What the codec made of `addr`'s fresh backup: every chunk raw, or not.
    pub(super) fn record(&mut self, addr: DevPtr, all_raw: bool) {
        match all_raw {
            true => self.skips_left.insert(addr, RETRY_AFTER),
            false => self.skips_left.remove(&addr),
        };
    }

    /// `addrs` were freed: a new allocation at the same address starts unknown.
    pub(super) fn forget(&mut self, addrs: &[DevPtr]) {
        for a in addrs {
            self.skips_left.remove(a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_incompressible_allocation_skips_the_codec_then_tries_it_again() {
        let mut inc = Incompressible::default();
        assert!(!inc.skip(0x1000), "unknown: tried");
        inc.record(0x1000, true);
        for _ in 0..RETRY_AFTER {
            assert!(inc.would_skip(0x1000));
            assert!(inc.skip(0x1000));
        }
        assert!(!inc.would_skip(0x1000), "the next sleep retries it");
        assert!(!inc.skip(0x1000), "the retry");
        inc.record(0x1000, false);
        assert!(!inc.skip(0x1000), "it compressed: tried every time");
        inc.record(0x2000, true);
        inc.forget(&[0x2000]);
        assert!(!inc.skip(0x2000), "freed: unknown again");
    }
}
