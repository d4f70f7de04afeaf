//! Every CUDA kernel against its CPU reference in pk-model / pk-gguf, on random inputs.
//! Each test needs a GPU, so each is `#[ignore]`d: on a machine without one cargo's summary
//! counts them as ignored, never as passed, and run anyway (`--ignored`) they fail.
//! scripts/gpu/check.sh runs them on a GPU machine with `--include-ignored`.

mod common;

use common::*;
use pk_cuda::attention::plan;
use pk_cuda::{kargs, ActDtype, Gpu, GpuKvPool};
use pk_gguf::GgmlType;
use pk_model::attention::{paged_attention_with, AttnSeq, AttnShape, Kernel};
use pk_model::{KvDtype, KvGeometry, KvStore, SeqForward};
use rand::Rng;

const ACTS: [ActDtype; 2] = [ActDtype::F16, ActDtype::Bf16];

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu/check.sh runs it on one with --include-ignored"]
fn rmsnorm_matches_cpu() {
    for act in ACTS {
        let gpu = gpu(act);
        let (n, d, eps) = (5, 4096, 1e-5f32);
        let mut r = rng(1);
        let x: Vec<f32> = uniform(&mut r, n * d, 3.0);
        let w: Vec<f32> = uniform(&mut r, d, 2.0);
        let (dx, dw, dout) = (
            gpu.upload(&x).unwrap(),
            gpu.upload(&w).unwrap(),
            gpu.alloc::<u16>(n * d).unwrap(),
        );
        // Rows 3 and 1 only, through the row map (the output head's selection).
        let rows = gpu.upload(&[3i32, 1]).unwrap();
        // SAFETY: the arguments follow rmsnorm(const float* x, const float* w, act_t* out,
        // const int* rows, int d, float eps); the 2 blocks read rows 3 and 1 of x's n rows
        // of d floats and d floats of w, and write 2 rows of d act_t into out's n × d.
        unsafe {
            gpu.launch(
                "rmsnorm",
                2,
                256,
                0,
                kargs![
                    gpu.ptr(&dx),
                    gpu.ptr(&dw),
                    gpu.ptr(&dout),
                    gpu.ptr(&rows),
                    d as i32,
                    eps
                ],
            )
            .unwrap()
        };
        let got = from_act(act, &gpu.download(&dout, 2 * d).unwrap());
        let mut want = vec![0f32; 2 * d];
        for (i, &row) in [3usize, 1].iter().enumerate() {
            pk_model::kernels::rmsnorm(
                &x[row * d..(row + 1) * d],
                &w,
                eps,
                &mut want[i * d..(i + 1) * d],
            );
        }
        assert_close(&format!("rmsnorm {act:?}"), &got, &want, 1e-6, act_eps(act));
    }
}

/// The CPU's RoPE (`Llama::rope`), restated: it is private to the model.
fn rope_ref(x: &mut [f32], head_dim: usize, pos: usize, inv_freq: &[f32], neox: bool) {
    let half = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        for (i, &f) in inv_freq.iter().enumerate().take(half) {
            let (sin, cos) = (pos as f32 * f).sin_cos();
            let (a, b) = if neox {
                (i, i + half)
            } else {
                (2 * i, 2 * i + 1)
            };
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * cos - x1 * sin;
            head[b] = x0 * sin + x1 * cos;
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu/check.sh runs it on one with --include-ignored"]
fn rope_matches_cpu_both_styles_and_large_positions() {
    let gpu = gpu(ActDtype::F16);
    let (n_heads, hd, stride) = (8usize, 128usize, 8 * 128 + 64);
    let positions: Vec<i32> = vec![0, 1, 17, 4095, 131_071];
    let inv_freq: Vec<f32> = (0..hd / 2)
        .map(|i| 500000f32.powf(-2.0 * i as f32 / hd as f32))
        .collect();
    for neox in [false, true] {
        let mut r = rng(2);
        let x = uniform(&mut r, positions.len() * stride, 1.0);
        let dx = gpu.upload(&x).unwrap();
        let (dp, df) = (
            gpu.upload(&positions).unwrap(),
            gpu.upload(&inv_freq).unwrap(),
        );
        // SAFETY: the arguments follow rope(float* x, int row_stride, const int* positions,
        // const float* inv_freq, int n_heads, int head_dim, int neox); each of the
        // positions.len() blocks rotates n_heads × hd ≤ stride floats of its row of x (which
        // holds that many rows of `stride`), reads its position, and reads hd / 2 inv_freq.
        unsafe {
            gpu.launch(
                "rope",
                positions.len() as u32,
                128,
                0,
                kargs![
                    gpu.ptr(&dx),
                    stride as i32,
                    gpu.ptr(&dp),
                    gpu.ptr(&df),
                    n_heads as i32,
                    hd as i32,
                    neox as i32
                ],
            )
            .unwrap()
        };
        let got = gpu.download(&dx, x.len()).unwrap();
        let mut want = x.clone();
        for (row, &p) in positions.iter().enumerate() {
            rope_ref(
                &mut want[row * stride..row * stride + n_heads * hd],
                hd,
                p as usize,
                &inv_freq,
                neox,
            );
        }
        // Both compute sin/cos of the same f32 angle; they differ in the last bits only.
        assert_close(&format!("rope neox={neox}"), &got, &want, 2e-6, 2e-6);
    }
}

/// The fused decode kernel equals `rope` on Q and K followed by `kv_write`, bit for bit.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu/check.sh runs it on one with --include-ignored"]
fn rope_kv_write_equals_rope_then_kv_write() {
    let gpu = gpu(ActDtype::F16);
    let (n_heads, n_kv, hd, bs) = (32usize, 8usize, 128usize, 16usize);
    let (qd, kvd) = (n_heads * hd, n_kv * hd);
    let stride = qd + 2 * kvd;
    let positions: Vec<i32> = vec![3, 900, 131_000];
    let slots: Vec<i32> = vec![5 * 16 + 3, 0, 2 * 16 + 15];
    let inv_freq: Vec<f32> = (0..hd / 2)
        .map(|i| 500000f32.powf(-2.0 * i as f32 / hd as f32))
        .collect();
    let qkv = uniform(&mut rng(8), positions.len() * stride, 1.0);
    let g = KvGeometry {
        n_layers: 1,
        n_kv_heads: n_kv,
        head_dim: hd,
        block_size_tokens: bs,
        num_blocks: 8,
    };
    let (dp, df, ds) = (
        gpu.upload(&positions).unwrap(),
        gpu.upload(&inv_freq).unwrap(),
        gpu.upload(&slots).unwrap(),
    );
    let n = positions.len() as u32;
    // Separate kernels.
    let (sep, sep_pool) = (gpu.upload(&qkv).unwrap(), GpuKvPool::new(&gpu, g).unwrap());
    let (kp, vp) = sep_pool.layer_ptrs(&gpu, 0);
    let base = gpu.ptr(&sep);
    // SAFETY: the arguments follow rope(float*, int, const int*, const float*, int, int, int)
    // and kv_write(const float* k, const float* v, int row_stride, u16* k_pool, u16* v_pool,
    // const int* slots, int n_kv_heads, int head_dim, int block_size). Each of the n rows of
    // `sep` holds `stride` = qd + 2 × kvd floats: Q at 0, K at qd (byte offset 4 × qd), V at
    // qd + kvd, so every head the launches touch lies inside its row; `dp` and `ds` hold n
    // positions and slots, `df` hd / 2 frequencies, and every slot is below the pool's
    // 8 blocks × 16 slots, which `layer_ptrs` addresses for layer 0.
    unsafe {
        gpu.launch(
            "rope",
            n,
            128,
            0,
            kargs![
                base,
                stride as i32,
                gpu.ptr(&dp),
                gpu.ptr(&df),
                n_heads as i32,
                hd as i32,
                0i32
            ],
        )
        .unwrap();
        gpu.launch(
            "rope",
            n,
            128,
            0,
            kargs![
                base + 4 * qd as u64,
                stride as i32,
                gpu.ptr(&dp),
                gpu.ptr(&df),
                n_kv as i32,
                hd as i32,
                0i32
            ],
        )
        .unwrap();
        gpu.launch(
            "kv_write",
            n,
            256,
            0,
            kargs![
                base + 4 * qd as u64,
                base + 4 * (qd + kvd) as u64,
                stride as i32,
                kp,
                vp,
                gpu.ptr(&ds),
                n_kv as i32,
                hd as i32,
                bs as i32
            ],
        )
        .unwrap();
    }
    // Fused.
    let (fused, fused_pool) = (gpu.upload(&qkv).unwrap(), GpuKvPool::new(&gpu, g).unwrap());
    let (kf, vf) = fused_pool.layer_ptrs(&gpu, 0);
    // SAFETY: the arguments follow rope_kv_write(float* qkv, int row_stride,
    // const int* positions, const float* inv_freq, int n_heads, int n_kv_heads, int head_dim,
    // int neox, u16* k_pool, u16* v_pool, const int* slots, int block_size); the buffers are
    // shaped as for the separate kernels above (n rows of Q, K and V, slots inside the pool).
    unsafe {
        gpu.launch(
            "rope_kv_write",
            n,
            256,
            0,
            kargs![
                gpu.ptr(&fused),
                stride as i32,
                gpu.ptr(&dp),
                gpu.ptr(&df),
                n_heads as i32,
                n_kv as i32,
                hd as i32,
                0i32,
                kf,
                vf,
                gpu.ptr(&ds),
                bs as i32
            ],
        )
        .unwrap();
    }
    let (a, b) = (
        gpu.download(&sep, qkv.len()).unwrap(),
        gpu.download(&fused, qkv.len()).unwrap(),
    );
    for r in 0..positions.len() {
        assert_eq!(
            &a[r * stride..r * stride + qd],
            &b[r * stride..r * stride + qd],
            "row {r}: rotated Q"
        );
    }
    for &slot in &slots {
        let (blk, s) = (slot as usize / bs, slot as usize % bs);
        assert_eq!(
            sep_pool.read_token(&gpu, 0, blk, s).unwrap(),
            fused_pool.read_token(&gpu, 0, blk, s).unwrap(),
            "slot {slot}"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu/check.sh runs it on one with --include-ignored"]
fn swiglu_matches_cpu() {
    for act in ACTS {
        let gpu = gpu(act);
        let (n, ff) = (3usize, 1000usize);
        let mut r = rng(3);
        let gate_up = uniform(&mut r, n * 2 * ff, 8.0);
        let (dg, dout) = (
            gpu.upload(&gate_up).unwrap(),
            gpu.alloc::<u16>(n * ff).unwrap(),
        );
        // SAFETY: the arguments follow swiglu(const float* gate_up, act_t* out, int n_rows,
        // int d_ff); the grid-stride loop stays below n × ff outputs, reading n rows of
        // 2 × ff floats of gate_up and writing n × ff act_t into out.
        unsafe {
            gpu.launch(
                "swiglu",
                4,
                256,
                0,
                kargs![gpu.ptr(&dg), gpu.ptr(&dout), n as i32, ff as i32],
            )
            .unwrap()
        };
        let got = from_act(act, &gpu.download(&dout, n * ff).unwrap());
        let mut want = Vec::new();
        for row in gate_up.chunks_exact(2 * ff) {
            let mut g = row[..ff].to_vec();
            pk_model::kernels::silu_mul_in_place(&mut g, &row[ff..]);
            want.extend(g);
        }
        assert_close(&format!("swiglu {act:?}"), &got, &want, 1e-6, act_eps(act));
    }
}

/// Random GGUF blocks of `ty` whose scale fields are small valid f16 values.
fn random_blocks(r: &mut impl Rng, ty: GgmlType, n: usize) -> Vec<u8> {
    let mut data = vec![0u8; ty.row_bytes(n).unwrap()];
    r.fill(&mut data[..]);
    let bb = ty.block_bytes();
    for blk in data.chunks_exact_mut(bb) {
        let mut scale = || half::f16::from_f32(r.gen_range(-0.02f32..0.02)).to_le_bytes();
        match ty {
            GgmlType::Q4_0 | GgmlType::Q8_0 => blk[0..2].copy_from_slice(&scale()),
            GgmlType::Q4_1 => {
                blk[0..2].copy_from_slice(&scale());
                blk[2..4].copy_from_slice(&scale());
            }
            GgmlType::F16 => blk.copy_from_slice(&scale()),
            GgmlType::BF16 => {
                blk.copy_from_slice(&half::bf16::from_f32(r.gen_range(-1.0f32..1.0)).to_le_bytes())
            }
            GgmlType::F32 => blk.copy_from_slice(&r.gen_range(-1.0f32..1.0).to_le_bytes()),
            _ => unreachable!(),
        }
    }
    data
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu/check.sh runs it on one with --include-ignored"]
fn dequantisation_matches_pk_gguf() {
    for act in ACTS {
        let gpu = gpu(act);
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::F16,
            GgmlType::BF16,
            GgmlType::F32,
        ] {
            let n = 32 * 333;
            let bytes = random_blocks(&mut rng(4), ty, n);
            let out = gpu.alloc::<u16>(n).unwrap();
            pk_cuda::weights::dequantize_into(&gpu, ty, &bytes, n, gpu.ptr(&out)).unwrap();
            let got = from_act(act, &gpu.download(&out, n).unwrap());
            let mut want = vec![0f32; n];
            pk_gguf::dequantize(ty, &bytes, &mut want);
            // The device rounds the exact value to act_t once; the reference is f32.
            assert_close(
                &format!("dequant {ty} to {act:?}"),
                &got,
                &from_act(act, &to_act(act, &want)),
                0.0,
                act_eps(act),
            );
        }
        assert!(
            pk_cuda::weights::dequantize_into(&gpu, GgmlType::Q6K, &[0u8; 210], 256, 0).is_err()
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu/check.sh runs it on one with --include-ignored"]
fn embedding_and_argmax() {
    let gpu = gpu(ActDtype::Bf16);
    let (vocab, d) = (1000usize, 96usize);
    let mut r = rng(5);
    let table = to_act(ActDtype::Bf16, &uniform(&mut r, vocab * d, 1.0));
    let tokens = [7i32, 999, 0, 7];
    let (dt, dtok, dx) = (
        gpu.upload(&table).unwrap(),
        gpu.upload(&tokens).unwrap(),
        gpu.alloc::<f32>(4 * d).unwrap(),
    );
    // SAFETY: the arguments follow embed(const act_t* table, const int* tokens, float* x,
    // int d); the 4 blocks read 4 token ids, all below `vocab`, then d act_t of the
    // vocab × d table each, and write 4 × d floats into dx.
    unsafe {
        gpu.launch(
            "embed",
            4,
            256,
            0,
            kargs![gpu.ptr(&dt), gpu.ptr(&dtok), gpu.ptr(&dx), d as i32],
        )
        .unwrap()
    };
    let got = gpu.download(&dx, 4 * d).unwrap();
    for (i, &t) in tokens.iter().enumerate() {
        assert_eq!(
            &got[i * d..(i + 1) * d],
            &from_act(ActDtype::Bf16, &table[t as usize * d..(t as usize + 1) * d])[..]
        );
    }
    let mut logits = uniform(&mut r, 3 * 50_000, 10.0);
    logits[123] = 50.0;
    logits[50_000 + 49_999] = 50.0;
    logits[100_000 + 7] = 50.0;
    logits[100_000 + 9] = 50.0; // a tie: the lower index wins, as a scan from the left would
    let (dl, dout) = (gpu.upload(&logits).unwrap(), gpu.alloc::<i32>(3).unwrap());
    // SAFETY: the arguments follow argmax_rows(const float* logits, int vocab, int* out); the
    // 3 blocks read 3 rows of 50 000 logits and write 3 ints.
    unsafe {
        gpu.launch(
            "argmax_rows",
            3,
            1024,
            0,
            kargs![gpu.ptr(&dl), 50_000i32, gpu.ptr(&dout)],
        )
        .unwrap()
    };
    assert_eq!(gpu.download(&dout, 3).unwrap(), vec![123, 49_999, 7]);
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu/check.sh runs it on one with --include-ignored"]
fn gemm_matches_f64_reference_with_and_without_accumulation() {
    for act in ACTS {
        let gpu = gpu(act);
        let (rows, cols) = (300usize, 512usize);
        for n in [1usize, 7, 64] {
            let mut r = rng(6 + n as u64);
            let w = to_act(act, &uniform(&mut r, rows * cols, 0.1));
            let x = to_act(act, &uniform(&mut r, n * cols, 1.0));
            let y0 = uniform(&mut r, n * rows, 1.0);
            let (wf, xf) = (from_act(act, &w), from_act(act, &x));
            let (dw, dx) = (gpu.upload(&w).unwrap(), gpu.upload(&x).unwrap());
            for beta in [0.0f32, 1.0] {
                let dy = gpu.upload(&y0).unwrap();
                gpu.gemm(
                    gpu.ptr(&dw),
                    rows,
                    cols,
                    gpu.ptr(&dx),
                    n,
                    gpu.ptr(&dy),
                    beta,
                )
                .unwrap();
                let got = gpu.download(&dy, n * rows).unwrap();
                let want: Vec<f32> = (0..n * rows)
                    .map(|i| {
                        let (t, o) = (i / rows, i % rows);
                        let dot: f64 = (0..cols)
                            .map(|c| wf[o * cols + c] as f64 * xf[t * cols + c] as f64)
                            .sum();
                        (dot + beta as f64 * y0[i] as f64) as f32
                    })
                    .collect();
                assert_close(
                    &format!("gemm {act:?} n={n} beta={beta}"),
                    &got,
                    &want,
                    1e-4,
                    1e-4,
                );
            }
        }
    }
}

/// Three sequences as the engine makes them: a decode step over a long context whose block
/// table is scattered (as after evictions and reuse), a prompt chunk after a cached prefix,
/// and a fresh prompt. K/V are written by `kv_write` on the GPU and `write_token` on the CPU.
fn attention_case(
    gpu: &Gpu,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    target_blocks: usize,
) {
    let bs = 16usize;
    let g = KvGeometry {
        n_layers: 1,
        n_kv_heads,
        head_dim,
        block_size_tokens: bs,
        num_blocks: 64,
    };
    let mut ids: Vec<u32> = (0..64).collect();
    let mut r = rng(7);
    for i in (1..ids.len()).rev() {
        ids.swap(i, r.gen_range(0..=i));
    }
    let (ta, tb, tc) = (&ids[0..45], &ids[45..50], &ids[50..51]);
    let (qa, qb, qc) = (vec![0u32; 1], vec![0u32; 37], vec![0u32; 5]);
    let seqs = [
        SeqForward {
            tokens: &qa,
            start_position: 5000,
            stored_start: 710,
            block_table: ta,
            logits_from: 0,
            stored_positions: &[],
            window_tables: &[],
            head_first_keys: &[],
        },
        SeqForward {
            tokens: &qb,
            start_position: 20,
            stored_start: 20,
            block_table: tb,
            logits_from: 0,
            stored_positions: &[],
            window_tables: &[],
            head_first_keys: &[],
        },
        SeqForward {
            tokens: &qc,
            start_position: 0,
            stored_start: 0,
            block_table: tc,
            logits_from: 0,
            stored_positions: &[],
            window_tables: &[],
            head_first_keys: &[],
        },
    ];
    let kvd = n_kv_heads * head_dim;
    let (mut cpu, mut slots, mut k_all, mut v_all) = (
        KvStore::new(g, KvDtype::F16),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    for s in &seqs {
        for i in 0..s.stored_start + s.tokens.len() {
            let (k, v) = (uniform(&mut r, kvd, 2.0), uniform(&mut r, kvd, 2.0));
            let block = s.block_table[i / bs];
            cpu.write_token(0, block, i % bs, &k, &v);
            slots.push((block as usize * bs + i % bs) as i32);
            k_all.extend(k);
            v_all.extend(v);
        }
    }
    let mut pool = GpuKvPool::new(gpu, g).unwrap();
    let (dk, dv, ds) = (
        gpu.upload(&k_all).unwrap(),
        gpu.upload(&v_all).unwrap(),
        gpu.upload(&slots).unwrap(),
    );
    let (kp, vp) = pool.layer_ptrs(gpu, 0);
    // SAFETY: the arguments follow kv_write(const float* k, const float* v, int row_stride,
    // u16* k_pool, u16* v_pool, const int* slots, int n_kv_heads, int head_dim,
    // int block_size); one block per slot reads one row of kvd floats of dk and dv (which
    // hold slots.len() such rows) and writes it at a slot of a block from the sequences'
    // tables, all of them below the pool's 64 blocks.
    unsafe {
        gpu.launch(
            "kv_write",
            slots.len() as u32,
            256,
            0,
            kargs![
                gpu.ptr(&dk),
                gpu.ptr(&dv),
                kvd as i32,
                kp,
                vp,
                gpu.ptr(&ds),
                n_kv_heads as i32,
                head_dim as i32,
                bs as i32
            ],
        )
        .unwrap()
    };
    // The pool holds what the CPU store holds, token by token.
    for (i, &slot) in slots.iter().enumerate().step_by(97) {
        let (k, v) = pool
            .read_token(gpu, 0, slot as usize / bs, slot as usize % bs)
            .unwrap();
        let (mut kc, mut vc) = (vec![0f32; bs * head_dim], vec![0f32; bs * head_dim]);
        cpu.read_k(0, slot as u32 / bs as u32, 0, &mut kc);
        cpu.read_v(0, slot as u32 / bs as u32, 0, &mut vc);
        let at = (slot as usize % bs) * head_dim;
        assert_eq!(&k[..head_dim], &kc[at..at + head_dim], "token {i}: K");
        assert_eq!(&v[..head_dim], &vc[at..at + head_dim], "token {i}: V");
    }
    let _ = &mut pool;

    let n_rows = 43usize;
    let qd = n_heads * head_dim;
    let q = uniform(&mut r, n_rows * qd, 1.0);
    let p = plan(&seqs, n_heads, n_kv_heads, bs, target_blocks).unwrap();
    let up = |v: &[i32]| gpu.upload(v).unwrap();
    let (dq, dt, dseq, dit, drs) = (
        gpu.upload(&q).unwrap(),
        up(&p.tables),
        up(&p.seqs),
        up(&p.items),
        up(&p.row_splits),
    );
    let partial = gpu
        .alloc::<f32>(p.max_splits * n_rows * n_heads * (head_dim + 2))
        .unwrap();
    let out = gpu.alloc::<u16>(n_rows * qd).unwrap();
    let scale = 1.0 / (head_dim as f32).sqrt();
    // SAFETY: the arguments follow paged_attention and attn_combine in attention.cu. `plan`
    // built the tables, sequences, work items and row splits from `seqs`, whose block tables
    // name blocks of the 64-block pool; q holds n_rows = 1 + 37 + 5 rows of qd floats;
    // `partial` holds max_splits × n_rows × n_heads × (head_dim + 2) floats, the stride
    // attn_combine reads per split, and `out` n_rows × qd act_t; the dynamic shared memory
    // is one block of K and V in f32 (2 × bs × head_dim × 4 bytes).
    unsafe {
        gpu.launch(
            "paged_attention",
            p.n_items() as u32,
            p.threads_per_block,
            (2 * bs * head_dim * 4) as u32,
            kargs![
                gpu.ptr(&dq),
                qd as i32,
                kp,
                vp,
                gpu.ptr(&dt),
                gpu.ptr(&dseq),
                gpu.ptr(&dit),
                gpu.ptr(&partial),
                n_heads as i32,
                n_kv_heads as i32,
                head_dim as i32,
                bs as i32,
                p.tile_tokens as i32,
                n_rows as i32,
                scale
            ],
        )
        .unwrap();
        gpu.launch(
            "attn_combine",
            (n_rows * n_heads) as u32,
            head_dim as u32,
            0,
            kargs![
                gpu.ptr(&partial),
                gpu.ptr(&drs),
                gpu.ptr(&out),
                n_heads as i32,
                head_dim as i32,
                n_rows as i32
            ],
        )
        .unwrap();
    }
    let got = from_act(gpu.act, &gpu.download(&out, n_rows * qd).unwrap());
    let mut row = 0;
    let attn_seqs: Vec<AttnSeq> = seqs
        .iter()
        .map(|s| {
            let a = AttnSeq {
                block_table: s.block_table,
                stored_start: s.stored_start,
                n_queries: s.tokens.len(),
                row_offset: row,
                head_first_keys: &[],
            };
            row += s.tokens.len();
            a
        })
        .collect();
    let mut want = vec![0f32; n_rows * qd];
    paged_attention_with(
        Kernel::Scalar,
        &cpu,
        0,
        AttnShape {
            n_heads,
            n_kv_heads,
            head_dim,
        },
        &attn_seqs,
        &q,
        &mut want,
    );
    assert_close(
        &format!(
            "attention {n_heads}/{n_kv_heads}x{head_dim} target {target_blocks} splits {}",
            p.max_splits
        ),
        &got,
        &want,
        1e-3,
        2.0 * act_eps(gpu.act),
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu/check.sh runs it on one with --include-ignored"]
fn paged_attention_matches_cpu_decode_prefill_and_scattered_tables() {
    for act in ACTS {
        let gpu = gpu(act);
        for (h, kvh, hd) in [(32, 8, 128), (9, 3, 64)] {
            // One split everywhere, then as many as the planner makes for a big GPU.
            for target in [1, 264, 4096] {
                attention_case(&gpu, h, kvh, hd, target);
            }
        }
    }
}
