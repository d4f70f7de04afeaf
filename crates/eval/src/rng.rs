//! SplitMix64: a tiny, fixed pseudo-random generator, so that a task generated from a seed
//! is the same on every platform and every version of every dependency (rand's `StdRng`
//! promises neither).

#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    /// A generator for one item of a family: mixes the parts into one seed.
    pub fn for_parts(parts: &[u64]) -> SplitMix64 {
        let mut r = SplitMix64(0x5e_ed0f_ba5e);
        for &p in parts {
            r.0 ^= p;
            r.next_u64();
        }
        r
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, n)` (n > 0); the modulo bias is irrelevant at these sizes.
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0, "below(0)");
        (self.next_u64() % n as u64) as usize
    }

    /// A number of exactly `digits` decimal digits (no leading zero).
    pub fn digits(&mut self, digits: u32) -> String {
        let lo = 10u64.pow(digits - 1);
        (lo + self.next_u64() % (9 * lo)).to_string()
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// A stable 64-bit hash of a string (FNV-1a), for mixing names into seeds.
pub fn hash_str(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream() {
        let a: Vec<u64> = (0..4)
            .map({
                let mut r = SplitMix64::new(7);
                move |_| r.next_u64()
            })
            .collect();
        let b: Vec<u64> = (0..4)
            .map({
                let mut r = SplitMix64::new(7);
                move |_| r.next_u64()
            })
            .collect();
        assert_eq!(a, b);
        assert_ne!(
            SplitMix64::for_parts(&[1, 2]).next_u64(),
            SplitMix64::for_parts(&[2, 1]).next_u64()
        );
    }

    #[test]
    fn digits_have_the_requested_length() {
        let mut r = SplitMix64::new(1);
        for _ in 0..100 {
            assert_eq!(r.digits(7).len(), 7);
        }
    }
}
