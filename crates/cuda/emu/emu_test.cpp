// The CUDA kernels, unchanged, run on the host emulator (cuda_emu.h) against naive
// references written out here; run by crates/cuda/tests/emulated.rs. Checks the kernels'
// logic (indexing, block tables, split-K merging, barriers, warp reductions) on machines
// without a GPU; the real-GPU tests (tests/kernels.rs) compare with pk-model's CPU code.
//
// Exit status 0 when every check passes; each failure prints what and where.

#include "cuda_emu.h"

#include "../src/kernels/prelude.cu"
#include "../src/kernels/elementwise.cu"
#include "../src/kernels/dequant.cu"
#include "../src/kernels/attention.cu"
#include "../src/kernels/transfer.cu"

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>

static int g_failures = 0;
static std::mt19937 g_rng(12345);

static std::vector<float> uniform(size_t n, float scale) {
    std::uniform_real_distribution<float> d(-scale, scale);
    std::vector<float> v(n);
    for (auto& x : v) x = d(g_rng);
    return v;
}

static float h2f(u16 h) { return f16_to_f32(h); }
static float round_f16(float x) { return h2f(f32_to_f16(x)); }

// |got - want| <= abs + rel * |want| for every element, else one line naming the worst.
static void check(const std::string& what, const std::vector<float>& got, const std::vector<float>& want, float abs, float rel) {
    size_t worst = 0;
    float excess = 0;
    for (size_t i = 0; i < want.size(); i++) {
        const float e = std::fabs(got[i] - want[i]) - (abs + rel * std::fabs(want[i]));
        if (!(e <= excess)) {  // NaN counts as a failure
            excess = std::isnan(e) ? INFINITY : e;
            worst = i;
        }
    }
    if (excess > 0) {
        std::printf("FAIL %s: element %zu got %g want %g\n", what.c_str(), worst, got[worst], want[worst]);
        g_failures++;
    } else {
        std::printf("ok   %s (%zu values)\n", what.c_str(), want.size());
    }
}

static void test_rmsnorm() {
    const int n = 3, d = 300;
    auto x = uniform(n * d, 3), w = uniform(d, 2);
    std::vector<u16> out(2 * d);
    std::vector<int> rows = {2, 0};
    emu_launch(rmsnorm, 2, 256, 0, x.data(), w.data(), out.data(), rows.data(), d, 1e-5f);
    std::vector<float> got(2 * d), want(2 * d);
    for (int r = 0; r < 2; r++) {
        double ss = 0;
        for (int i = 0; i < d; i++) ss += (double)x[rows[r] * d + i] * x[rows[r] * d + i];
        const double scale = 1.0 / std::sqrt(ss / d + 1e-5);
        for (int i = 0; i < d; i++) {
            got[r * d + i] = h2f(out[r * d + i]);
            want[r * d + i] = (float)(x[rows[r] * d + i] * scale * w[i]);
        }
    }
    check("rmsnorm (row map, f16 out)", got, want, 1e-6f, 1.0f / 1024);
}

// Rotation by position * inv_freq[i] of pairs (2i, 2i+1), or (i, i + hd/2) with neox.
static void rope_ref(float* h, int hd, int pos, const std::vector<float>& inv_freq, bool neox) {
    for (int i = 0; i < hd / 2; i++) {
        const double a = (double)(float)((float)pos * inv_freq[i]);
        const int p = neox ? i : 2 * i, q = neox ? i + hd / 2 : 2 * i + 1;
        const double x0 = h[p], x1 = h[q];
        h[p] = (float)(x0 * std::cos(a) - x1 * std::sin(a));
        h[q] = (float)(x0 * std::sin(a) + x1 * std::cos(a));
    }
}

static void test_rope_kv_write() {
    const int n_heads = 4, n_kv = 2, hd = 64, bs = 16, n_blocks = 6;
    const int stride = (n_heads + 2 * n_kv) * hd + 8;
    std::vector<float> inv_freq(hd / 2);
    for (int i = 0; i < hd / 2; i++) inv_freq[i] = std::pow(10000.0f, -2.0f * i / hd);
    std::vector<int> positions = {0, 7, 70000}, slots = {3 * bs + 5, 0, 5 * bs + 15};
    for (int neox = 0; neox < 2; neox++) {
        auto qkv = uniform(positions.size() * stride, 1);
        auto want_qkv = qkv;
        std::vector<u16> kp(n_blocks * n_kv * bs * hd, 0), vp(kp.size(), 0);
        emu_launch(rope_kv_write, (unsigned)positions.size(), 256, 0, qkv.data(), stride, positions.data(), inv_freq.data(),
                   n_heads, n_kv, hd, neox, kp.data(), vp.data(), slots.data(), bs);
        std::vector<float> got_kv, want_kv;
        for (size_t r = 0; r < positions.size(); r++) {
            for (int h = 0; h < n_heads + n_kv; h++) rope_ref(&want_qkv[r * stride + h * hd], hd, positions[r], inv_freq, neox);
            const int block = slots[r] / bs, slot = slots[r] % bs;
            for (int h = 0; h < n_kv; h++) {
                for (int d = 0; d < hd; d++) {
                    const size_t at = (((size_t)block * n_kv + h) * bs + slot) * hd + d;
                    got_kv.push_back(h2f(kp[at]));
                    want_kv.push_back(round_f16(want_qkv[r * stride + (n_heads + h) * hd + d]));
                    got_kv.push_back(h2f(vp[at]));
                    want_kv.push_back(round_f16(want_qkv[r * stride + (n_heads + n_kv + h) * hd + d]));
                }
            }
        }
        const std::string style = neox ? " neox" : " normal";
        check("rope_kv_write: rotated Q and K in place" + style, qkv, want_qkv, 2e-5f, 2e-5f);
        check("rope_kv_write: K and V in the pool" + style, got_kv, want_kv, 1e-3f, 1.0f / 512);
    }
}

static void test_swiglu_embed_argmax() {
    const int n = 2, ff = 300;
    auto gu = uniform(n * 2 * ff, 6);
    std::vector<u16> out(n * ff);
    emu_launch(swiglu, 2, 256, 0, gu.data(), out.data(), n, ff);
    std::vector<float> got(n * ff), want(n * ff);
    for (int r = 0; r < n; r++)
        for (int i = 0; i < ff; i++) {
            const double g = gu[r * 2 * ff + i], u = gu[r * 2 * ff + ff + i];
            got[r * ff + i] = h2f(out[r * ff + i]);
            want[r * ff + i] = (float)(g / (1 + std::exp(-g)) * u);
        }
    check("swiglu", got, want, 1e-6f, 1.0f / 1024);

    const int vocab = 50, d = 40;
    std::vector<u16> table(vocab * d);
    for (auto& t : table) t = f32_to_f16(uniform(1, 1)[0]);
    std::vector<int> tokens = {49, 0, 7};
    std::vector<float> x(tokens.size() * d), want_x;
    emu_launch(embed, 3, 64, 0, table.data(), tokens.data(), x.data(), d);
    for (int t : tokens)
        for (int i = 0; i < d; i++) want_x.push_back(h2f(table[t * d + i]));
    check("embed", x, want_x, 0, 0);

    auto logits = uniform(2 * 3000, 5);
    logits[1234] = 9;
    logits[3000 + 17] = 9;
    logits[3000 + 2999] = 9;  // a tie: the lower index wins
    std::vector<int> am(2);
    emu_launch(argmax_rows, 2, 1024, 0, logits.data(), 3000, am.data());
    check("argmax_rows", {(float)am[0], (float)am[1]}, {1234, 17}, 0, 0);
}

static void test_dequant() {
    const long long n = 32 * 5;
    std::uniform_int_distribution<int> byte(0, 255);
    for (int kind = 0; kind < 3; kind++) {  // q4_0, q4_1, q8_0
        const int bb = kind == 0 ? 18 : kind == 1 ? 20 : 34;
        std::vector<u8> src(n / 32 * bb);
        for (auto& b : src) b = (u8)byte(g_rng);
        std::vector<float> want(n);
        for (int blk = 0; blk < n / 32; blk++) {
            u8* b = &src[blk * bb];
            const u16 d16 = f32_to_f16(0.01f * (blk + 1)), m16 = f32_to_f16(-0.02f * blk);
            std::memcpy(b, &d16, 2);
            if (kind == 1) std::memcpy(b + 2, &m16, 2);
            const float d = h2f(d16), m = h2f(m16);
            for (int j = 0; j < 32; j++) {
                float v;
                if (kind == 2) {
                    v = (float)(signed char)b[2 + j] * d;
                } else {
                    const u8* qs = b + (kind == 0 ? 2 : 4);
                    const int q = j < 16 ? (qs[j] & 15) : (qs[j - 16] >> 4);
                    v = kind == 0 ? (q - 8) * d : q * d + m;
                }
                want[blk * 32 + j] = round_f16(v);
            }
        }
        std::vector<u16> out(n);
        auto k = kind == 0 ? dequant_q4_0 : kind == 1 ? dequant_q4_1 : dequant_q8_0;
        emu_launch(k, 1, 64, 0, src.data(), out.data(), n);
        std::vector<float> got(n);
        for (long long i = 0; i < n; i++) got[i] = h2f(out[i]);
        check(std::string("dequant ") + (kind == 0 ? "q4_0" : kind == 1 ? "q4_1" : "q8_0"), got, want, 0, 1.0f / 1024);
    }
}

// One sequence of an attention call: its new tokens' count, where they are stored, and its
// (scattered) block table.
struct Seq {
    int n_queries, stored_start;
    std::vector<int> table;
};

// Mirrors crates/cuda/src/attention.rs's plan with a given split count per sequence.
static void test_attention(int splits_wanted) {
    const int n_heads = 6, n_kv = 2, hd = 64, bs = 16, n_blocks = 24, group = n_heads / n_kv;
    const int tile = std::max(1, 16 / group);
    std::vector<int> ids(n_blocks);
    for (int i = 0; i < n_blocks; i++) ids[i] = i;
    std::shuffle(ids.begin(), ids.end(), g_rng);
    std::vector<Seq> seqs = {
        {1, 150, std::vector<int>(ids.begin(), ids.begin() + 10)},        // decode, long context
        {9, 5, std::vector<int>(ids.begin() + 10, ids.begin() + 11)},     // chunk after a prefix
        {17, 0, std::vector<int>(ids.begin() + 11, ids.begin() + 13)},    // fresh prompt, 2 blocks
    };
    const int kvd = n_kv * hd, qd = n_heads * hd;
    std::vector<u16> kp(n_blocks * n_kv * bs * hd, 0), vp(kp.size(), 0);
    std::vector<int> seq_desc, items, row_splits, tables;
    int n_rows = 0, max_splits = 1;
    for (size_t si = 0; si < seqs.size(); si++) {
        const Seq& s = seqs[si];
        const int visible = s.stored_start + s.n_queries;
        // Every stored token's K/V, written through kv_write at its (block, slot).
        auto k = uniform(visible * kvd, 2), v = uniform(visible * kvd, 2);
        std::vector<int> slots(visible);
        for (int i = 0; i < visible; i++) slots[i] = s.table[i / bs] * bs + i % bs;
        emu_launch(kv_write, visible, 32, 0, k.data(), v.data(), kvd, kp.data(), vp.data(), slots.data(), n_kv, hd, bs);
        int splits = std::min(splits_wanted, (visible + 2 * bs - 1) / (2 * bs));
        splits = std::max(1, splits);
        const int kps = ((visible + splits - 1) / splits + bs - 1) / bs * bs;
        splits = (visible + kps - 1) / kps;
        max_splits = std::max(max_splits, splits);
        seq_desc.insert(seq_desc.end(), {(int)tables.size(), s.stored_start, s.n_queries, n_rows, splits, kps});
        tables.insert(tables.end(), s.table.begin(), s.table.end());
        for (int h = 0; h < n_kv; h++)
            for (int t0 = 0; t0 < s.n_queries; t0 += tile)
                for (int sp = 0; sp < splits; sp++) items.insert(items.end(), {(int)si, h, t0, sp});
        for (int t = 0; t < s.n_queries; t++) row_splits.push_back(splits);
        n_rows += s.n_queries;
    }
    const int stride = qd + 40;  // rows wider than Q, as in the fused QKV buffer
    auto q = uniform(n_rows * stride, 1);
    std::vector<float> partial((size_t)max_splits * n_rows * n_heads * (hd + 2), NAN);
    std::vector<u16> out(n_rows * qd);
    const float scale = 1.0f / std::sqrt((float)hd);
    emu_launch(paged_attention, (unsigned)(items.size() / 4), 32 * tile * group, 2 * bs * hd * 4, (const float*)q.data(), stride,
               (const u16*)kp.data(), (const u16*)vp.data(), (const int*)tables.data(), (const int*)seq_desc.data(),
               (const int*)items.data(), partial.data(), n_heads, n_kv, hd, bs, tile, n_rows, scale);
    emu_launch(attn_combine, n_rows * n_heads, hd, 0, (const float*)partial.data(), (const int*)row_splits.data(), out.data(), n_heads,
               hd, n_rows);
    // Naive reference: softmax over each row's visible keys, read back through the table.
    std::vector<float> got(n_rows * qd), want(n_rows * qd);
    int row = 0;
    for (const Seq& s : seqs) {
        for (int t = 0; t < s.n_queries; t++, row++) {
            const int visible = s.stored_start + t + 1;
            for (int h = 0; h < n_heads; h++) {
                const int kvh = h / group;
                std::vector<double> p(visible);
                double m = -INFINITY, sum = 0;
                for (int j = 0; j < visible; j++) {
                    const size_t base = (((size_t)s.table[j / bs] * n_kv + kvh) * bs + j % bs) * hd;
                    double dot = 0;
                    for (int d = 0; d < hd; d++) dot += (double)q[row * stride + h * hd + d] * h2f(kp[base + d]);
                    p[j] = dot * scale;
                    m = std::max(m, p[j]);
                }
                for (int j = 0; j < visible; j++) sum += (p[j] = std::exp(p[j] - m));
                for (int d = 0; d < hd; d++) {
                    double acc = 0;
                    for (int j = 0; j < visible; j++) {
                        const size_t base = (((size_t)s.table[j / bs] * n_kv + kvh) * bs + j % bs) * hd;
                        acc += p[j] * h2f(vp[base + d]);
                    }
                    want[row * qd + h * hd + d] = (float)(acc / sum);
                    got[row * qd + h * hd + d] = h2f(out[row * qd + h * hd + d]);
                }
            }
        }
    }
    check("paged attention + combine, up to " + std::to_string(max_splits) + " splits", got, want, 2e-3f, 1.0f / 512);
}

// kv_scatter writes a staged chunk where kv_write's layout puts each stored token, leaves
// every other pool word alone, and kv_gather reads the same chunk back bit for bit: for
// chunks of several whole layers and for a token range of one layer starting mid-block.
static void test_transfer() {
    const int n_layers = 3, n_kv = 2, hd = 8, bs = 4, n_blocks = 6;
    const std::vector<int> table = {4, 1, 5, 0};
    const size_t layer_elems = (size_t)n_blocks * n_kv * bs * hd;
    std::uniform_int_distribution<int> bits(0, 0xffff);
    struct Case { int layer0, layers, first, n; };
    for (Case c : {Case{0, 3, 0, 16}, Case{1, 2, 3, 9}, Case{2, 1, 5, 2}}) {
        std::vector<u16> kp(n_layers * layer_elems), vp(n_layers * layer_elems);
        for (auto& x : kp) x = (u16)bits(g_rng);
        for (auto& x : vp) x = (u16)bits(g_rng);
        std::vector<u16> staging((size_t)c.layers * 2 * n_kv * c.n * hd);
        for (auto& x : staging) x = (u16)bits(g_rng);
        auto want_k = kp, want_v = vp;
        size_t e = 0;
        for (int l = 0; l < c.layers; l++)
            for (int side = 0; side < 2; side++)
                for (int h = 0; h < n_kv; h++)
                    for (int i = 0; i < c.n; i++)
                        for (int d = 0; d < hd; d++, e++) {
                            const int t = c.first + i;
                            const size_t at = (c.layer0 + l) * layer_elems + (((size_t)table[t / bs] * n_kv + h) * bs + t % bs) * hd + d;
                            (side ? want_v : want_k)[at] = staging[e];
                        }
        const long long stride_pairs = (long long)layer_elems / 2;
        u32* kbase = (u32*)(kp.data() + c.layer0 * layer_elems);
        u32* vbase = (u32*)(vp.data() + c.layer0 * layer_elems);
        emu_launch(kv_scatter, 2, 64, 0, (const u32*)staging.data(), kbase, vbase, stride_pairs, c.layers, table.data(),
                   c.first, c.n, n_kv, hd, bs);
        const std::string name = "chunk of " + std::to_string(c.layers) + " layers, tokens " + std::to_string(c.first) + "+" + std::to_string(c.n);
        const bool scattered = kp == want_k && vp == want_v;
        std::printf("%s kv_scatter %s\n", scattered ? "ok  " : "FAIL", name.c_str());
        g_failures += !scattered;
        std::vector<u16> back(staging.size(), 0);
        emu_launch(kv_gather, 3, 32, 0, (u32*)back.data(), (const u32*)kbase, (const u32*)vbase, stride_pairs, c.layers,
                   table.data(), c.first, c.n, n_kv, hd, bs);
        const bool gathered = back == staging;
        std::printf("%s kv_gather %s\n", gathered ? "ok  " : "FAIL", name.c_str());
        g_failures += !gathered;
    }
}

int main() {
    test_rmsnorm();
    test_rope_kv_write();
    test_swiglu_embed_argmax();
    test_dequant();
    for (int splits : {1, 64}) test_attention(splits);
    test_transfer();
    std::printf("%d failure(s)\n", g_failures);
    return g_failures == 0 ? 0 : 1;
}
