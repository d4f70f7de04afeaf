//! Read-only passes over a buffer: the DRAM read bound that memory-bound decode is judged
//! against (`stream_bench`, `decode_bench --vs-stream`).
//!
//! Two plans, because either can be the faster on a host: [`read_pass_plain`] leaves the lines
//! to the hardware prefetcher, and [`read_pass_prefetched`] also asks for them ahead exactly as
//! a decode tile does (`x86::prefetch_plan`: into L2 8 KiB ahead and into L1 512 B ahead on
//! Intel, into L2 only elsewhere, 8 KiB ahead on AMD Zen 4 and 4 KiB on older AMD;
//! [`decode_prefetch`] names it).
//! On the AMX host the second read 16.5–18.3 GB/s on one thread where the first read
//! 15.6–15.9 (2026-12-06, docs/results/benchmarks-history.md): a bound taken from the plain
//! pass alone was 4–15 % too low, and decode's share of it too high.

/// Sums `bytes` as 64-bit words with eight independent accumulators a 64-byte line, which
/// the compiler vectorises; only the hardware prefetcher fetches ahead.
pub fn read_pass_plain(bytes: &[u8]) -> u64 {
    let mut acc = [0u64; 8];
    for line in bytes.chunks_exact(64) {
        for (a, w) in acc.iter_mut().zip(line.chunks_exact(8)) {
            *a = a.wrapping_add(u64::from_le_bytes(w.try_into().unwrap()));
        }
    }
    acc.iter().fold(0, |x, &y| x.wrapping_add(y))
}

/// As [`read_pass_plain`] (the same sum), with decode's software prefetches ahead of every
/// line on x86-64 hosts with AVX2; elsewhere the plain pass.
pub fn read_pass_prefetched(bytes: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected just above.
        return unsafe { super::x86::read_pass_prefetched(bytes) };
    }
    read_pass_plain(bytes)
}

/// Decode's weight prefetches on this host, for benchmarks to print beside their figures:
/// the plan (`PK_PREFETCH_PLAN`) and, where it has one, the L2 distance
/// (`PK_PREFETCH_FAR_BYTES`).
pub fn decode_prefetch() -> String {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        return match super::x86::prefetch_plan() {
            super::x86::PrefetchPlan::Near => {
                format!("near (L1 {} B ahead)", super::x86::PREFETCH_AHEAD_BYTES)
            }
            super::x86::PrefetchPlan::TwoLevel { far_bytes } => format!(
                "far (L2 {far_bytes} B and L1 {} B ahead)",
                super::x86::PREFETCH_NEAR_BYTES
            ),
            super::x86::PrefetchPlan::L2 { far_bytes } => format!("l2 (L2 {far_bytes} B ahead)"),
            super::x86::PrefetchPlan::Off => "none".to_string(),
        };
    }
    "none (no AVX2)".to_string()
}

/// The shortest of `passes` timed passes of `pass` over `bytes` in `threads` parts.
pub fn best_seconds(bytes: &[u8], threads: usize, passes: usize, pass: fn(&[u8]) -> u64) -> f64 {
    (0..passes)
        .map(|_| timed_pass(bytes, threads, pass))
        .fold(f64::INFINITY, f64::min)
}

/// Seconds one pass of `pass` over `bytes` takes, split into `threads` equal parts read by
/// as many scoped threads (the caller's thread reads the first).
pub fn timed_pass(bytes: &[u8], threads: usize, pass: fn(&[u8]) -> u64) -> f64 {
    timed_pass_parts(&[bytes], threads, pass)
}

/// Seconds one pass of `pass` over every one of `parts` in order takes, each part split into
/// `threads` equal shares and thread `i` reading share `i` of each (as decode splits each
/// matrix's rows), on as many scoped threads (the caller's thread is thread 0).
pub fn timed_pass_parts(parts: &[&[u8]], threads: usize, pass: fn(&[u8]) -> u64) -> f64 {
    let threads = threads.max(1);
    let share = move |i: usize| {
        parts.iter().fold(0u64, |sum, part| {
            let len = (part.len() / threads) & !63;
            sum.wrapping_add(pass(&part[i * len..(i + 1) * len]))
        })
    };
    let t0 = std::time::Instant::now();
    let sum = std::thread::scope(|s| {
        let others: Vec<_> = (1..threads).map(|i| s.spawn(move || share(i))).collect();
        let first = share(0);
        others
            .into_iter()
            .map(|h| h.join().unwrap())
            .fold(first, u64::wrapping_add)
    });
    std::hint::black_box(sum);
    t0.elapsed().as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_plans_sum_the_same_words() {
        let bytes: Vec<u8> = (0..64 * 1000 + 17).map(|i| (i * 7 + 3) as u8).collect();
        let want = bytes.chunks_exact(8).take(8 * 1000).fold(0u64, |s, w| {
            s.wrapping_add(u64::from_le_bytes(w.try_into().unwrap()))
        });
        assert_eq!(read_pass_plain(&bytes), want);
        assert_eq!(read_pass_prefetched(&bytes), want);
    }
}
