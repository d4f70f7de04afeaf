//! Long-prefill attention on the AVX-512 kernel: a task's rows (its query tokens × the
//! heads of one KV head's group) walk the keys one range at a time, every row through a
//! range before any row moves to the next, with each row's softmax state kept in memory
//! between ranges (`attn512` NOTE 3: the same bits as one uninterrupted walk).
//!
//! Why: at 8K keys one KV head's f16 K and V take 4 MiB, more than a core's L2, and the task's
//! 96 pairs of rows (32 tokens × 6 heads of Qwen2.5-1.5B, two rows a kernel call) each streamed
//! all of it again from L3, widening every f16 value to f32 on the way. Here a range's K/V are
//! widened once into an f32 scratch small enough to stay in L1 while every row pair reads it
//! ([`range_keys`]; docs/results/benchmarks-history.md, "Issue 39 on an Intel Xeon with AMX").

use std::cell::RefCell;

use crate::kernels::attn512::{self, HeadKv, Row, RowState};

/// Keys per range: as many as keep the range's K and V in f32 within two thirds of the core's
/// L1 data cache (the rest holds the rows' queries and states), rounded down to whole blocks,
/// at least one. Each pair of rows then reads the range from L1 instead of L2: with ranges of
/// 256 keys (256 KiB of a 128-wide head, the L2-sized first choice) every pair streamed 16 KiB
/// from L2 per 512 multiply-adds, and L2 bandwidth, not the FMA ports, bounded the kernel. On a
/// 48 KiB L1 (Sapphire Rapids) a 128-wide head gets 32 keys: `bench perf --contexts 8192` on
/// Qwen2.5-Coder-1.5B went from 87.6 to 99.4 tok/s (docs/results/benchmarks-history.md,
/// "Long-prompt attention from L1"); 16 and 48 keys were slower than 32.
fn range_keys(head_dim: usize, block_size: usize) -> usize {
    let budget_bytes = l1d_bytes() * 2 / 3;
    let keys = budget_bytes / (head_dim * 2 * std::mem::size_of::<f32>()).max(1);
    (keys / block_size).max(1) * block_size
}

/// The L1 data cache of CPU 0 in bytes (Linux's sysfs), or 32 KiB where it cannot be read.
fn l1d_bytes() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| {
        let dir = "/sys/devices/system/cpu/cpu0/cache";
        let read = |index: usize, file: &str| {
            std::fs::read_to_string(format!("{dir}/index{index}/{file}")).ok()
        };
        (0..8)
            .find(|&i| {
                read(i, "level").is_some_and(|l| l.trim() == "1")
                    && read(i, "type").is_some_and(|t| t.trim() == "Data")
            })
            .and_then(|i| read(i, "size"))
            .and_then(|size| parse_cache_size(size.trim()))
            .unwrap_or(32 << 10)
    })
}

/// `48K`, `1M` or a plain byte count, as sysfs writes a cache's size.
fn parse_cache_size(text: &str) -> Option<usize> {
    let (digits, unit) = match text.strip_suffix('K') {
        Some(d) => (d, 1 << 10),
        None => match text.strip_suffix('M') {
            Some(d) => (d, 1 << 20),
            None => (text, 1),
        },
    };
    digits.parse::<usize>().ok().map(|n| n * unit)
}

thread_local! {
    /// The current range's K and V in f32 (store layout, one KV head) and the block table
    /// that maps the range's blocks onto it; reused across tasks so prefill does not
    /// allocate per task.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>, Vec<u32>)> = const {
        RefCell::new((Vec::new(), Vec::new(), Vec::new()))
    };
}

/// Computes every row of `rows` (batches of `max_rows` as `attn512::attend` takes them).
///
/// # Safety
/// As for `attn512::attend` on every batch; `kv` is an f16 or f32 store (not quantised).
pub(super) unsafe fn attend_rows_ranged(kv: &HeadKv, rows: &[Row], max_rows: usize, scale: f32) {
    let n_max = rows.iter().map(|r| r.n_visible).max().unwrap_or(0);
    let first_min = rows.iter().map(|r| r.first_visible).min().unwrap_or(0);
    let bs = kv.block_size;
    let range_keys = range_keys(kv.head_dim, bs);
    let range_blocks = range_keys / bs;
    let mut states = vec![RowState::default(); rows.len()];
    SCRATCH.with_borrow_mut(|(k32, v32, table)| {
        let block_elems = bs * kv.head_dim;
        if kv.f16 {
            k32.resize(range_blocks * block_elems, 0.0);
            v32.resize(range_blocks * block_elems, 0.0);
            table.clear();
            table.resize(n_max.div_ceil(bs), 0);
        }
        let mut k0 = first_min / range_keys * range_keys;
        while k0 < n_max {
            let k1 = k0 + range_keys;
            let scratch;
            let kv_range = if kv.f16 {
                // Blocks wholly before every row's window may have been released (a
                // sliding-window layer's table holds no valid block there): never read them.
                let first_block = (k0 / bs).max(first_min / bs);
                let blocks = first_block..(k1 / bs).min(n_max.div_ceil(bs));
                scratch = widen_range(kv, blocks, k0 / bs, k32, v32, table);
                &scratch
            } else {
                kv
            };
            for (batch, st) in rows.chunks(max_rows).zip(states.chunks_mut(max_rows)) {
                let batch_end = batch.iter().map(|r| r.n_visible).max().unwrap_or(0);
                let batch_start = batch.iter().map(|r| r.first_visible).min().unwrap_or(0);
                if batch_end <= k0 || batch_start >= k1 {
                    continue;
                }
                attn512::attend_range(kv_range, batch, scale, k0..k1, Some(st));
            }
            k0 = k1;
        }
    });
    for (batch, st) in rows.chunks(max_rows).zip(states.chunks(max_rows)) {
        attn512::finish(batch, st, kv.head_dim);
    }
}

/// Widens the K and V of blocks `blocks` of `kv`'s head into the scratch, points the
/// scratch table's entries for those blocks at it, and returns a view of the scratch that
/// `attn512` walks like the store (one head, f32).
unsafe fn widen_range<'t>(
    kv: &HeadKv,
    blocks: std::ops::Range<usize>,
    range_first_block: usize,
    k32: &mut [f32],
    v32: &mut [f32],
    table: &'t mut [u32],
) -> HeadKv<'t> {
    let block_elems = kv.block_size * kv.head_dim;
    for b in blocks {
        let i = b - range_first_block;
        let src = (kv.block_table[b] as usize * kv.n_kv_heads + kv.kv_head) * block_elems;
        // f16 elements are 2 bytes: the store's layer arrays hold u16 bit patterns.
        let (ks, vs) = (kv.k as *const u16, kv.v as *const u16);
        attn512::widen_f16(
            ks.add(src),
            k32.as_mut_ptr().add(i * block_elems),
            block_elems,
        );
        attn512::widen_f16(
            vs.add(src),
            v32.as_mut_ptr().add(i * block_elems),
            block_elems,
        );
        table[b] = i as u32;
    }
    HeadKv {
        k: k32.as_ptr() as *const u8,
        v: v32.as_ptr() as *const u8,
        f16: false,
        block_table: table,
        n_kv_heads: 1,
        kv_head: 0,
        block_size: kv.block_size,
        head_dim: kv.head_dim,
        prefetch: false,
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_cache_size, range_keys};

    #[test]
    fn ranges_fit_the_l1_in_whole_blocks() {
        assert_eq!(parse_cache_size("48K"), Some(48 << 10));
        assert_eq!(parse_cache_size("2M"), Some(2 << 20));
        assert_eq!(parse_cache_size("32768"), Some(32768));
        assert_eq!(parse_cache_size("big"), None);
        for (hd, bs) in [(64, 16), (128, 16), (256, 16), (128, 32)] {
            let keys = range_keys(hd, bs);
            assert!(keys >= bs && keys.is_multiple_of(bs), "{hd} {bs}: {keys}");
            // Never more than the L1 can hold beside the rows, unless one block already is.
            assert!(
                keys == bs || keys * hd * 8 <= super::l1d_bytes(),
                "{hd} {bs}: {keys}"
            );
        }
    }
}
