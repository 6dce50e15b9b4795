// Batched decode: one step for B sequences (B up to 32), each weight read once for all of them.
//
// Rows of a step are sequences: row b has its own token, position and KV-cache slot (the row table,
// batch.py). The step, per layer (runtime/cuda_batch.py):
//
//   batch_rmsnorm      x[b] += the previous linear's partial sums; h = rms_norm(x[b]) * w as fp16
//   batch_gemv         parts[s][b][n] = sum over slice s of K of W[n][k] h[b][k]   (tensor cores; q4, q8, f16)
//   batch_rope_store   qkv = sum_s parts (+ bias); q rotated (times 1/sqrt(hd)); k, v into the slot's cache
//   batch_attention    each row over its own slot's positions first_key(pos)..pos -> fp16
//   batch_swiglu       silu(gate) * up from the gate/up parts -> fp16
//   batch_logits       logits[b] = sum_s parts; greedy argmax per row (lowest id on ties)
//
// The linears write partial sums per K slice instead of adding them with atomics, and the next
// kernel adds the slices in a fixed order, so a step's results do not depend on block timing.
// Programmatic dependent launch (kernels/pdl.py): every kernel lets the next one launch at its top
// and waits (pdl_wait) before its first read of an activation; the GEMV requests its first weights
// before that. Activations are read through pointers without __restrict__ (plain loads) or with
// __ldcg, never ld.global.nc, which ptxas may move above the wait (kernels/README.md).
// Plain kernels are extern "C"; the GEMV template goes through NVRTC name expressions.
#include "common.cuh"

#define BG_WARPS 8          // warps per GEMV block, each on its own 16-row tiles
#ifndef BG_DEPTH
#define BG_DEPTH 3          // items (16 rows x one piece) a warp has in flight ahead of its products
#endif
#define BG_STAGE_LOADS 8    // loads of h a thread issues before it stores them in shared memory
#define BG_F16 0            // weight encodings (template argument ENC)
#define BG_Q8 1
#define BG_Q4 2

// Columns of one 64-byte piece of a row (kernels/layout.py), and the k-steps of one lane's 16 bytes.
template <int ENC> struct BatchEncoding {
    static constexpr int piece_cols = ENC == BG_Q4 ? 128 : ENC == BG_Q8 ? 64 : 32;
    static constexpr int steps = piece_cols / 16;
    static constexpr int quads = steps / 2;     // staged uint4 of h per lane and piece (two k-steps each)
    static constexpr int bits = ENC == BG_Q4 ? 4 : ENC == BG_Q8 ? 8 : 16;
};

// (w & MASK) | 0x64006400 in one LOP3 (C's & then | takes two: one immediate each).
template <u32 MASK> TI_DEVICE __half2 nibbles_in_1024(u32 w) {
    u32 bits;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(bits) : "r"(w), "n"(MASK), "n"(0x64006400u));
    return *reinterpret_cast<const __half2*>(&bits);
}

// The 8 nibbles of a u32 as four pairs of exact fp16 (n - 8): pair i holds nibbles i and i + 4. The
// low nibble of a half's byte lands in 1024 + n (0x6400 is 1024.0), the high one in 1024 + 16 n,
// which times 1/16 minus 72 is n - 8 with no rounding; the upper byte pairs go through w >> 8.
TI_DEVICE void q4_word(u32 w, __half2 (&n)[4]) {
    const u32 w8 = w >> 8;
    const __half2 sixteenth = __float2half2_rn(0.0625f), low = __float2half2_rn(-1032.f), high = __float2half2_rn(-72.f);
    n[0] = __hadd2(nibbles_in_1024<0x000F000Fu>(w), low);
    n[1] = __hfma2(nibbles_in_1024<0x00F000F0u>(w), sixteenth, high);
    n[2] = __hadd2(nibbles_in_1024<0x000F000Fu>(w8), low);
    n[3] = __hfma2(nibbles_in_1024<0x00F000F0u>(w8), sixteenth, high);
}

// Two int8 weights of a u32 (bytes at selector positions), exact as fp16: (v ^ 0x80) = v + 128 into
// the low byte of 1024 + u, minus 1152; then the scale.
TI_DEVICE u32 q8_scaled_pair(u32 flipped, u32 selector, __half2 scale) {
    const u32 bits = __byte_perm(flipped, 0x64646464u, selector);
    return as_u32(__hmul2(__hsub2(*reinterpret_cast<const __half2*>(&bits), __float2half2_rn(1152.f)), scale));
}

// One item of a warp: 16 rows (two 8-row blocks) x one piece, and the rows' scales (q4, q8).
struct WeightItem {
    uint4 lo, hi;           // row g and row g + 8 of the tile (the lane's 16 bytes of each)
    __half s_lo, s_hi;      // their scales for the lane's columns
};

// A's registers (a0 row g, a1 row g + 8 at k slots 2t, 2t+1; a2, a3 at 2t+8, 2t+9) of k-steps 2j
// (a[0..3]) and 2j + 1 (a[4..7]). q4: word j, nibbles 0,4 and 1,5 (k-step 2j: columns 0,4 and 1,5 of
// the word), 2,6 and 3,7 (2j + 1). q8: words 2j and 2j + 1, bytes 0,1 and 2,3 of each. f16: words
// 4j .. 4j + 3 as they are.
template <int ENC>
TI_DEVICE void a_fragments(const WeightItem& it, int j, __half2 s_lo, __half2 s_hi, u32 (&a)[8]) {
    if (ENC == BG_Q4) {
        __half2 lo[4], hi[4];
        q4_word(word_of(it.lo, j), lo);
        q4_word(word_of(it.hi, j), hi);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            a[2 * i] = as_u32(__hmul2(lo[i], s_lo));
            a[2 * i + 1] = as_u32(__hmul2(hi[i], s_hi));
        }
    } else if (ENC == BG_Q8) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const u32 wl = word_of(it.lo, 2 * j + half) ^ 0x80808080u, wh = word_of(it.hi, 2 * j + half) ^ 0x80808080u;
            a[4 * half] = q8_scaled_pair(wl, 0x5140u, s_lo);
            a[4 * half + 1] = q8_scaled_pair(wh, 0x5140u, s_hi);
            a[4 * half + 2] = q8_scaled_pair(wl, 0x5342u, s_lo);
            a[4 * half + 3] = q8_scaled_pair(wh, 0x5342u, s_hi);
        }
    } else {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int s = 2 * j + half;
            a[4 * half] = word_of(it.lo, 2 * s);
            a[4 * half + 1] = word_of(it.hi, 2 * s);
            a[4 * half + 2] = word_of(it.lo, 2 * s + 1);
            a[4 * half + 3] = word_of(it.hi, 2 * s + 1);
        }
    }
}

// h's 8 columns for one staged uint4 in the order of a_fragment's k slots: (b0, b1) of two k-steps.
// q8 and f16 take columns in their order; q4 pairs columns 0,4 / 1,5 (k-step 2j) and 2,6 / 3,7.
template <int ENC>
TI_DEVICE uint4 staged_quad(uint4 v) {
    if (ENC != BG_Q4) return v;
    uint4 f;
    f.x = __byte_perm(v.x, v.z, 0x5410);    // columns 0, 4: k-step 2j, b0
    f.y = __byte_perm(v.x, v.z, 0x7632);    // columns 1, 5: k-step 2j, b1
    f.z = __byte_perm(v.y, v.w, 0x5410);    // columns 2, 6: k-step 2j + 1, b0
    f.w = __byte_perm(v.y, v.w, 0x7632);    // columns 3, 7: k-step 2j + 1, b1
    return f;
}

// Stage the block's slice of h (rows NB * 8, pieces p0 .. p0 + np) into shared memory in the
// order of a_fragments' k slots: entry (piece p, row b, lane t, quad j) at hs[((p NB + b / 8) quads
// + j) 32 + (b % 8) 4 + t]. Each thread issues BG_STAGE_LOADS loads before it stores any (one after
// the other, each had waited a round trip to the L2); neither has a branch, or ptxas sinks each load
// to its store.
template <int ENC, int NB>
TI_DEVICE void stage_h(uint4* hs, const __half* h, int ldh, int p0, int np) {
    using E = BatchEncoding<ENC>;
    constexpr int per_piece = NB * 8 * 4 * E::quads;    // entries of one piece, quad fastest
    const int total = np * per_piece;
    for (int i0 = threadIdx.x; i0 < total; i0 += BG_STAGE_LOADS * blockDim.x) {
        uint4 v[BG_STAGE_LOADS];
        int at[BG_STAGE_LOADS];                           // each load's place in hs
#pragma unroll
        for (int u = 0; u < BG_STAGE_LOADS; ++u) {
            // Clamped, so the loads need no predicate: past the end, the last entry again.
            const int i = min(i0 + u * (int)blockDim.x, total - 1);
            const int p = i / per_piece, e = i % per_piece;
            const int j = e % E::quads, tt = (e / E::quads) & 3, b = e / (4 * E::quads);
            v[u] = __ldcg(reinterpret_cast<const uint4*>(h + (size_t)b * ldh + (size_t)(p0 + p) * E::piece_cols
                                                         + E::piece_cols / 4 * tt + 8 * j));
            at[u] = ((p * NB + (b >> 3)) * E::quads + j) * 32 + (b & 7) * 4 + tt;
        }
#pragma unroll
        for (int u = 0; u < BG_STAGE_LOADS; ++u) hs[at[u]] = staged_quad<ENC>(v[u]);
    }
}

// y = W h for NB * 8 rows of h at once, W in 8-row blocks (layout.py; rows a multiple of 8, rows of
// whole 64-byte pieces), q4/q8 groups of 32, 64 or 128 columns.
//
// mma.m16n8k16 with A = 16 weight rows, B = 8 rows of h. The sum over k does not care which column
// sits in which k slot as long as A and B agree, so lane (g, t) feeds its own 16-byte load: row g
// (and g + 8), columns piece_cols / 4 * t .. of the piece (within one group: one scale). q4: word j
// of the load holds columns 8 j .. 8 j + 7; k-step 2 j takes columns (0, 4) as A's k slots 2t, 2t+1
// and (1, 5) as 2t+8, 2t+9, k-step 2 j + 1 columns (2, 6) and (3, 7) (q4_word). q8 and f16 take the
// lane's columns in order, four per k-step. h is staged once per block in shared memory in exactly
// that order (staged_quad: a uint4 per lane holds b0/b1 of two k-steps). Quantized weights are
// rounded to fp16 as (n - 8) * scale or v * scale, as prefill's dequantization rounds them.
//
// Grid (row groups of tiles_per_block tiles, K slices of pieces_per_slice pieces); block BG_WARPS
// warps, warp w takes tiles w, w + BG_WARPS, ... of its group over its slice, BG_DEPTH items' loads
// in flight ahead of the products. Dynamic shared memory: NB * 8 rows x the slice's columns, fp16.
// The loop issues about 160 instructions an item (q4, 16 rows), a quarter of them the products: at
// 16 rows and more the GEMV is bound by instruction issue as much as by the weights' bytes.
template <int ENC, int NB>
__global__ void __launch_bounds__(BG_WARPS * 32, 2) batch_gemv(
    const unsigned char* __restrict__ w, const __half* __restrict__ scales, int rows, int kpad, int group,
    const __half* h, int ldh,                 // [NB * 8][ldh] fp16, columns kpad of them read
    int pieces_per_slice, int tiles_per_block,
    float* __restrict__ parts)                // [gridDim.y][NB * 8][rows]
{
    extern __shared__ __align__(16) unsigned char bg_smem[];
    using E = BatchEncoding<ENC>;
    uint4* hs = reinterpret_cast<uint4*>(bg_smem);      // [piece][NB][quad][lane]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n_pieces = kpad / E::piece_cols;
    const int p0 = blockIdx.y * pieces_per_slice;
    const int np = min(pieces_per_slice, n_pieces - p0);
    const int n_tiles = (rows + 15) >> 4;
    const int groups = ENC == BG_F16 ? 0 : kpad / group;
    const int group_shift = __ffs(group) - 1;           // groups are powers of two
    const size_t row_bytes = (size_t)kpad * E::bits / 8;
    const int first_tile = blockIdx.x * tiles_per_block + warp;
    const int tile_end = min(n_tiles, (int)(blockIdx.x + 1) * tiles_per_block);
    const int my_tiles = first_tile < tile_end ? (tile_end - first_tile + BG_WARPS - 1) / BG_WARPS : 0;
    const int n_items = my_tiles * np;

    // The warp's items in order: its tiles one after the other, each over the slice's pieces. A
    // cursor walks them (a division per item had cost ~60 instructions of the loop's ~430).
    struct Cursor { int tile, piece; };
    auto advance = [&](Cursor& c) {
        if (++c.piece == np) { c.piece = 0; c.tile += BG_WARPS; }
    };
    auto load_item = [&](const Cursor& c) {
        WeightItem it;
        const int piece = p0 + c.piece;
        const bool has_hi = c.tile * 16 + 8 < rows;
        const unsigned char* block_lo = w + (size_t)c.tile * 16 * row_bytes + (size_t)piece * 512 + g * 64 + 16 * t;
        it.lo = load_stream(block_lo);
        it.hi = has_hi ? load_stream(block_lo + 8 * row_bytes) : make_uint4(0u, 0u, 0u, 0u);
        it.s_lo = it.s_hi = __float2half(0.f);
        if (ENC != BG_F16) {
            const int scale_col = 8 * ((piece * E::piece_cols + E::piece_cols / 4 * t) >> group_shift) + g;
            const __half* scale_lo = scales + (size_t)c.tile * 16 * groups + scale_col;
            it.s_lo = scale_lo[0];
            if (has_hi) it.s_hi = scale_lo[8 * groups];
        }
        return it;
    };

    // The first items' weights are requested before the previous kernel has finished.
    pdl_launch_dependents();
    WeightItem ring[BG_DEPTH];
    Cursor fetch = {first_tile, 0}, use = {first_tile, 0};
#pragma unroll
    for (int d = 0; d < BG_DEPTH; ++d) {
        if (d < n_items) ring[d] = load_item(fetch);
        advance(fetch);
    }
    pdl_wait();
    stage_h<ENC, NB>(hs, h, ldh, p0, np);
    __syncthreads();

    float acc[NB][4];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.f;
    float* out = parts + (size_t)blockIdx.y * NB * 8 * rows;

    for (int k0 = 0; k0 < n_items; k0 += BG_DEPTH) {
#pragma unroll
        for (int d = 0; d < BG_DEPTH; ++d) {
            if (k0 + d >= n_items) break;
            const WeightItem cur = ring[d];
            if (k0 + d + BG_DEPTH < n_items) ring[d] = load_item(fetch);
            advance(fetch);
            const __half2 s_lo = __half2half2(cur.s_lo), s_hi = __half2half2(cur.s_hi);
#pragma unroll
            for (int j = 0; j < E::quads; ++j) {
                uint4 b[NB];
#pragma unroll
                for (int nb = 0; nb < NB; ++nb) b[nb] = hs[((use.piece * NB + nb) * E::quads + j) * 32 + lane];
                u32 a[8];
                a_fragments<ENC>(cur, j, s_lo, s_hi, a);
#pragma unroll
                for (int nb = 0; nb < NB; ++nb) {
                    mma_16816(acc[nb], a[0], a[1], a[2], a[3], b[nb].x, b[nb].y);
                    mma_16816(acc[nb], a[4], a[5], a[6], a[7], b[nb].z, b[nb].w);
                }
            }
            if (use.piece == np - 1) {                    // the tile's last piece: store its sums
                const int r_lo = use.tile * 16 + g, r_hi = r_lo + 8;
                const bool has_hi = use.tile * 16 + 8 < rows;
#pragma unroll
                for (int nb = 0; nb < NB; ++nb) {
                    const int b0 = nb * 8 + 2 * t;
                    out[(size_t)b0 * rows + r_lo] = acc[nb][0];
                    out[(size_t)(b0 + 1) * rows + r_lo] = acc[nb][1];
                    if (has_hi) {
                        out[(size_t)b0 * rows + r_hi] = acc[nb][2];
                        out[(size_t)(b0 + 1) * rows + r_hi] = acc[nb][3];
                    }
                    acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.f;
                }
            }
            advance(use);
        }
    }
}

template __global__ void batch_gemv<BG_F16,1>(const unsigned char*, const __half*, int, int, int, const __half*, int,
                                           int, int, float*);
template __global__ void batch_gemv<BG_F16,2>(const unsigned char*, const __half*, int, int, int, const __half*, int,
                                           int, int, float*);
template __global__ void batch_gemv<BG_F16,4>(const unsigned char*, const __half*, int, int, int, const __half*, int,
                                           int, int, float*);
template __global__ void batch_gemv<BG_Q8,1>(const unsigned char*, const __half*, int, int, int, const __half*, int,
                                           int, int, float*);
template __global__ void batch_gemv<BG_Q8,2>(const unsigned char*, const __half*, int, int, int, const __half*, int,
                                           int, int, float*);
template __global__ void batch_gemv<BG_Q8,4>(const unsigned char*, const __half*, int, int, int, const __half*, int,
                                           int, int, float*);
template __global__ void batch_gemv<BG_Q4,1>(const unsigned char*, const __half*, int, int, int, const __half*, int,
                                           int, int, float*);
template __global__ void batch_gemv<BG_Q4,2>(const unsigned char*, const __half*, int, int, int, const __half*, int,
                                           int, int, float*);
template __global__ void batch_gemv<BG_Q4,4>(const unsigned char*, const __half*, int, int, int, const __half*, int,
                                           int, int, float*);

// Sum of the K slices' partial sums of element i of row b (a linear's [slices][rows_pad][n] parts);
// unrolled so that several slices' loads are in flight at once.
TI_DEVICE float slice_sum(const float* parts, int n_slices, size_t slice_stride, size_t index) {
    float total = 0.f;
#pragma unroll 8
    for (int s = 0; s < n_slices; ++s) total += parts[s * slice_stride + index];
    return total;
}

#define BR_THREADS 1024    // batch_rmsnorm's largest block
#define BR_SLICE_LOADS 8    // 16-byte loads of the slices each thread has in flight at once

// Row b: x[b] += the slices of parts (n_slices = 0: none), then out[b] = rms_norm(x[b]) * w as fp16.
// A thread holds VECS float4 of the row (elements 4 c .. 4 c + 3, c = threadIdx.x + e * blockDim.x)
// and loads BR_SLICE_LOADS / VECS slices' pieces into registers of their own before it adds any: with
// one accumulator per element the loads of consecutive slices had waited on each other's adds, one
// round trip per slice (~14 us a launch). dim a multiple of 4; parts: [n_slices][slice_stride / dim][dim].
template <int VECS>
TI_DEVICE void rmsnorm_row(float* x, const float* parts, int n_slices, long long slice_stride,
                           const float* __restrict__ w, int dim, float eps, __half* out, int ldo)
{
    constexpr int SLICES = BR_SLICE_LOADS / VECS;
    __shared__ float scratch[32];
    pdl_launch_dependents();
    pdl_wait();
    const int b = blockIdx.x, n_vec = dim >> 2;
    float4* row = reinterpret_cast<float4*>(x + (size_t)b * dim);
    const float4* row_parts = reinterpret_cast<const float4*>(parts + (size_t)b * dim);
    const size_t vec_stride = (size_t)slice_stride >> 2;
    float4 v[VECS];
#pragma unroll
    for (int e = 0; e < VECS; ++e) {
        const int c = threadIdx.x + e * blockDim.x;
        v[e] = c < n_vec ? row[c] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    // The loads take clamped indices and no predicate (a slice past the last, or a piece past the
    // row, reads a valid one and is not added), so that ptxas issues them all before the adds.
    for (int s0 = 0; s0 < n_slices; s0 += SLICES) {
        float4 t[SLICES][VECS];
#pragma unroll
        for (int j = 0; j < SLICES; ++j)
#pragma unroll
            for (int e = 0; e < VECS; ++e) {
                const int c = min(threadIdx.x + e * blockDim.x, n_vec - 1), slice = min(s0 + j, n_slices - 1);
                t[j][e] = row_parts[(size_t)slice * vec_stride + c];
            }
#pragma unroll
        for (int j = 0; j < SLICES; ++j)                  // slice order: the sums do not depend on SLICES
#pragma unroll
            for (int e = 0; e < VECS; ++e)
                if (s0 + j < n_slices && threadIdx.x + e * blockDim.x < n_vec) {
                    v[e].x += t[j][e].x; v[e].y += t[j][e].y; v[e].z += t[j][e].z; v[e].w += t[j][e].w;
                }
    }
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < VECS; ++e) {
        const int c = threadIdx.x + e * blockDim.x;
        if (n_slices > 0 && c < n_vec) row[c] = v[e];
        ss += v[e].x * v[e].x + v[e].y * v[e].y + v[e].z * v[e].z + v[e].w * v[e].w;
    }
    const float factor = rsqrtf(block_sum(ss, scratch) / (float)dim + eps);
#pragma unroll
    for (int e = 0; e < VECS; ++e) {
        const int c = threadIdx.x + e * blockDim.x;
        if (c >= n_vec) continue;
        const float f[4] = {v[e].x, v[e].y, v[e].z, v[e].w};
        __half* o = out + (size_t)b * ldo + 4 * c;
#pragma unroll
        for (int i = 0; i < 4; ++i) o[i] = __float2half_rn(f[i] * factor * w[4 * c + i]);
    }
}

// Grid (B), block dim / 4 rounded up to warps (rows up to 4 * BR_THREADS elements).
extern "C" __global__ void __launch_bounds__(BR_THREADS) batch_rmsnorm(
    float* x, const float* parts, int n_slices, long long slice_stride,
    const float* __restrict__ w, int dim, float eps, __half* out, int ldo)
{
    rmsnorm_row<1>(x, parts, n_slices, slice_stride, w, dim, eps, out, ldo);
}

// Grid (B), block dim / 8 rounded up to warps (rows up to 8 * BR_THREADS elements).
extern "C" __global__ void __launch_bounds__(BR_THREADS) batch_rmsnorm_wide(
    float* x, const float* parts, int n_slices, long long slice_stride,
    const float* __restrict__ w, int dim, float eps, __half* out, int ldo)
{
    rmsnorm_row<2>(x, parts, n_slices, slice_stride, w, dim, eps, out, ldo);
}

// One head of row b per block (grid (B, n_heads + n_kv), block hd / 2 rounded to warps; thread d
// takes columns d and d + hd / 2): qkv = the slices' sum (+ bias, Qwen2's; nullptr: none); a query
// head rotated (rotate-half, tables [ctx][hd/2]) and times q_scale into q_out [B][n_heads][hd]
// float32; a KV head's k rotated and its v into the row's slot of this layer's cache
// [slots][ctx][n_kv][hd] at its position.
extern "C" __global__ void __launch_bounds__(64) batch_rope_store(
    const float* parts, int n_slices, long long slice_stride, const float* __restrict__ bias,
    const int* __restrict__ positions, const int* __restrict__ slots, int n_heads, int n_kv, int hd,
    const float* __restrict__ rope_cos, const float* __restrict__ rope_sin, float q_scale,
    float* q_out, __half* k_cache, __half* v_cache, long long slot_stride)
{
    pdl_launch_dependents();
    pdl_wait();
    const int b = blockIdx.x, head = blockIdx.y, d = threadIdx.x, half_hd = hd >> 1;
    if (d >= half_hd) return;
    const int pos = positions[b];
    const int width = (n_heads + 2 * n_kv) * hd;
    auto value = [&](int i) {
        const float v = slice_sum(parts, n_slices, (size_t)slice_stride, (size_t)b * width + i);
        return bias ? v + bias[i] : v;
    };
    const float cos_d = rope_cos[(size_t)pos * half_hd + d], sin_d = rope_sin[(size_t)pos * half_hd + d];
    if (head < n_heads) {
        const int i = head * hd + d;
        const float a = value(i), c = value(i + half_hd);
        float* q = q_out + (size_t)b * n_heads * hd;
        q[i] = (a * cos_d - c * sin_d) * q_scale;
        q[i + half_hd] = (c * cos_d + a * sin_d) * q_scale;
        return;
    }
    const int kv = head - n_heads;
    const int k_col = n_heads * hd + kv * hd + d, v_col = (n_heads + n_kv) * hd + kv * hd + d;
    const float a = value(k_col), c = value(k_col + half_hd);
    const float v_lo = value(v_col), v_hi = value(v_col + half_hd);
    const size_t at = (size_t)slots[b] * slot_stride + ((size_t)pos * n_kv + kv) * hd + d;
    k_cache[at] = __float2half_rn(a * cos_d - c * sin_d);
    k_cache[at + half_hd] = __float2half_rn(c * cos_d + a * sin_d);
    v_cache[at] = __float2half_rn(v_lo);
    v_cache[at + half_hd] = __float2half_rn(v_hi);
}

#define BA_MAX_GROUP 8     // query heads per KV head that batch_attention handles in one block
#define BA_WARPS 8         // warps of a batch_attention block (batch_attention_wide: 2 * BA_WARPS)
#define BA_UNROLL 4        // key rows whose 16-byte pieces each lane has in flight at once

// Eight fp16 of a 16-byte piece as floats.
TI_DEVICE void unpack_halves8(uint4 raw, float (&f)[8]) {
    const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const float2 pair = __half22float2(as_half2(words[e]));
        f[2 * e] = pair.x;
        f[2 * e + 1] = pair.y;
    }
}

// One (KV head, row) per block (grid (n_kv, B), block WARPS warps): for each of the KV head's
// `group` query heads, softmax(q K^T) V over the row's slot, cache rows first_key(pos, window)..pos,
// in float32 from the fp16 cache, so each K and V row is read once for the whole group.
// A key row is hd / 8 pieces of 16 bytes, one per lane of a lane group (lanes_per_key: hd / 8
// rounded up to a power of two), so a warp takes 32 / lanes_per_key keys at a time and every lane
// has BA_UNROLL pieces in flight: the block reads its keys in a few wide passes instead of one key
// per thread after another. Scores: each lane's 8 columns times q's (in registers, every head of
// the group), summed over the lane group by shuffles, kept in shared memory; softmax over them by
// the whole block; p . V: each lane adds p times its piece of V rows into 8 columns per head, the
// lane groups of a warp are added by shuffles and the warps in shared memory, in a fixed order.
// Dynamic shared memory: floats group * max_keys (scores) + WARPS * group * hd (p . V of warps).
template <int WARPS>
TI_DEVICE void attention_row(
    const float* q, const __half* k_cache, const __half* v_cache,
    long long slot_stride, const int* __restrict__ positions, const int* __restrict__ slots,
    int n_heads, int n_kv, int hd, int window, int max_keys, __half* out, int ldo)
{
    extern __shared__ __align__(16) float ba_smem[];
    __shared__ float warp_best[BA_MAX_GROUP][WARPS];
    __shared__ float warp_total[BA_MAX_GROUP][WARPS];
    const int kvh = blockIdx.x, b = blockIdx.y;
    const int group = n_heads / n_kv;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int pieces = hd >> 3;
    int lanes_per_key = 1;
    while (lanes_per_key < pieces) lanes_per_key <<= 1;
    const int keys_per_warp = 32 / lanes_per_key;
    const int piece = lane & (lanes_per_key - 1), sub = lane / lanes_per_key;
    const bool has_piece = piece < pieces;
    const int keys_per_round = WARPS * keys_per_warp;        // one piece of a row per lane
    const int my_key = warp * keys_per_warp + sub;           // the lane's key in each round
    const int pos = positions[b];                             // (the row table: written by the host)
    const int first = window > 0 ? max(0, pos - window + 1) : 0;
    const int n_keys = pos - first + 1;
    float* scores = ba_smem;                                  // [group][max_keys]
    float* pv = scores + group * max_keys;                    // [WARPS][group][hd]

    const size_t row_stride = (size_t)n_kv * hd;
    const size_t base = (size_t)slots[b] * slot_stride + (size_t)first * row_stride + (size_t)kvh * hd + 8 * piece;
    const __half* k_rows = k_cache + base;
    const __half* v_rows = v_cache + base;
    // The lane's piece of up to BA_UNROLL key (or value) rows of the pass starting at key `start`.
    auto load_pass = [&](const __half* rows, int start, uint4 (&raw)[BA_UNROLL]) {
#pragma unroll
        for (int u = 0; u < BA_UNROLL; ++u) {
            const int key = start + u * keys_per_round + my_key;
            const uint4* at = reinterpret_cast<const uint4*>(rows + (size_t)key * row_stride);
            raw[u] = !has_piece || key >= n_keys ? make_uint4(0u, 0u, 0u, 0u)
                     : key == n_keys - 1         ? __ldcg(at) : *at;   // the last row: never a line L1 holds
        }
    };
    // The first pass of K rows is prefetched into L1 before the wait, while the kernels before this
    // one still run: rows before the last were written by earlier steps or by prefill and stay as
    // they are for the whole step; the last, this step's from batch_rope_store, is not prefetched and
    // is read after the wait from L2 (__ldcg). A prefetch holds no registers (loads into registers
    // here spilled at two blocks per SM).
#pragma unroll
    for (int u = 0; u < BA_UNROLL; ++u) {
        const int key = u * keys_per_round + my_key;
        if (has_piece && key < n_keys - 1) {
            asm volatile("prefetch.global.L1 [%0];" :: "l"(k_rows + (size_t)key * row_stride));
            asm volatile("prefetch.global.L1 [%0];" :: "l"(v_rows + (size_t)key * row_stride));
        }
    }
    pdl_launch_dependents();
    pdl_wait();
    auto load_first_pass = [&](uint4 (&raw)[BA_UNROLL]) {
#pragma unroll
        for (int u = 0; u < BA_UNROLL; ++u) {
            const int key = u * keys_per_round + my_key;
            const uint4* at = reinterpret_cast<const uint4*>(k_rows + (size_t)key * row_stride);
            raw[u] = !has_piece || key >= n_keys ? make_uint4(0u, 0u, 0u, 0u)
                     : key == n_keys - 1         ? __ldcg(at) : __ldg(at);
        }
    };

    float qr[BA_MAX_GROUP][8];                                // q of the lane's 8 columns, per head
#pragma unroll
    for (int g = 0; g < BA_MAX_GROUP; ++g) {
        float4 lo = make_float4(0.f, 0.f, 0.f, 0.f), hi = lo;
        if (g < group && has_piece) {
            const float4* src = reinterpret_cast<const float4*>(q + ((size_t)b * n_heads + kvh * group + g) * hd
                                                                + 8 * piece);
            lo = src[0];
            hi = src[1];
        }
        unpack8(lo, hi, qr[g]);
    }

    float best[BA_MAX_GROUP];
#pragma unroll
    for (int g = 0; g < BA_MAX_GROUP; ++g) best[g] = -TI_INF;
    for (int start = 0; start < n_keys; start += BA_UNROLL * keys_per_round) {
        uint4 raw[BA_UNROLL];
        if (start == 0) load_first_pass(raw);
        else load_pass(k_rows, start, raw);
#pragma unroll
        for (int u = 0; u < BA_UNROLL; ++u) {
            const int key = start + u * keys_per_round + my_key;
            float kf[8];
            unpack_halves8(raw[u], kf);
#pragma unroll
            for (int g = 0; g < BA_MAX_GROUP; ++g) {
                if (g >= group) break;
                float s = 0.f;
#pragma unroll
                for (int j = 0; j < 8; ++j) s += qr[g][j] * kf[j];
                for (int o = lanes_per_key >> 1; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
                if (key < n_keys) {
                    if (piece == 0) scores[g * max_keys + key] = s;
                    best[g] = fmaxf(best[g], s);
                }
            }
        }
    }
    // Per head: the block's max, then exp and the block's sum (each thread its own keys).
#pragma unroll
    for (int g = 0; g < BA_MAX_GROUP; ++g) {
        const float m = warp_max(best[g]);
        if (lane == 0 && g < group) warp_best[g][warp] = m;
    }
    __syncthreads();                                          // (also publishes the scores)
    float sum[BA_MAX_GROUP];
#pragma unroll
    for (int g = 0; g < BA_MAX_GROUP; ++g) {
        float m = -TI_INF;
        if (g < group)
            for (int w = 0; w < WARPS; ++w) m = fmaxf(m, warp_best[g][w]);
        best[g] = m;
        sum[g] = 0.f;
    }
    for (int i = threadIdx.x; i < n_keys; i += blockDim.x) {
#pragma unroll
        for (int g = 0; g < BA_MAX_GROUP; ++g)
            if (g < group) {
                const float p = __expf(scores[g * max_keys + i] - best[g]);
                scores[g * max_keys + i] = p;
                sum[g] += p;
            }
    }
#pragma unroll
    for (int g = 0; g < BA_MAX_GROUP; ++g) {
        const float t = warp_sum(sum[g]);
        if (lane == 0 && g < group) warp_total[g][warp] = t;
    }
    __syncthreads();                                          // (also publishes the probabilities)

    float acc[BA_MAX_GROUP][8];
#pragma unroll
    for (int g = 0; g < BA_MAX_GROUP; ++g)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[g][j] = 0.f;
    for (int start = 0; start < n_keys; start += BA_UNROLL * keys_per_round) {
        uint4 raw[BA_UNROLL];
        load_pass(v_rows, start, raw);
#pragma unroll
        for (int u = 0; u < BA_UNROLL; ++u) {
            const int key = start + u * keys_per_round + my_key;
            if (key >= n_keys) continue;
            float vf[8];
            unpack_halves8(raw[u], vf);
#pragma unroll
            for (int g = 0; g < BA_MAX_GROUP; ++g) {
                if (g >= group) break;
                const float p = scores[g * max_keys + key];
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[g][j] += p * vf[j];
            }
        }
    }
    // The warp's lane groups (same piece, other keys) added, then each warp's sums to shared memory.
#pragma unroll
    for (int g = 0; g < BA_MAX_GROUP; ++g) {
        if (g >= group) break;
#pragma unroll
        for (int j = 0; j < 8; ++j)
            for (int o = lanes_per_key; o < 32; o <<= 1) acc[g][j] += __shfl_xor_sync(0xffffffffu, acc[g][j], o);
        if (sub == 0 && has_piece)
#pragma unroll
            for (int j = 0; j < 8; ++j) pv[(warp * group + g) * hd + 8 * piece + j] = acc[g][j];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < group * hd; i += blockDim.x) {
        const int g = i / hd, dd = i % hd;
        float o = 0.f, total = 0.f;
        for (int w = 0; w < WARPS; ++w) {
            o += pv[(w * group + g) * hd + dd];
            total += warp_total[g][w];
        }
        out[(size_t)b * ldo + (kvh * group + g) * hd + dd] = __float2half_rn(o / total);
    }
}

// Grid (n_kv, B), BA_WARPS warps, two blocks per SM: for grids of at least one block per SM.
extern "C" __global__ void __launch_bounds__(BA_WARPS * 32, 2) batch_attention(
    const float* q, const __half* k_cache, const __half* v_cache,
    long long slot_stride, const int* __restrict__ positions, const int* __restrict__ slots,
    int n_heads, int n_kv, int hd, int window, int max_keys, __half* out, int ldo)
{
    attention_row<BA_WARPS>(q, k_cache, v_cache, slot_stride, positions, slots, n_heads, n_kv, hd, window,
                            max_keys, out, ldo);
}

// The same with twice the warps (one pass covers twice the keys) and one block per SM: for grids of
// fewer blocks than SMs (grouped-query models at a few rows).
extern "C" __global__ void __launch_bounds__(2 * BA_WARPS * 32, 1) batch_attention_wide(
    const float* q, const __half* k_cache, const __half* v_cache,
    long long slot_stride, const int* __restrict__ positions, const int* __restrict__ slots,
    int n_heads, int n_kv, int hd, int window, int max_keys, __half* out, int ldo)
{
    attention_row<2 * BA_WARPS>(q, k_cache, v_cache, slot_stride, positions, slots, n_heads, n_kv, hd, window,
                                max_keys, out, ldo);
}

// ------------------------------------------------------------------------------- tensor cores
//
// batch_attention_mma: one (KV head, row) per block as batch_attention, the products on the tensor
// cores as attention.cu's attention_mma (its fragment layout and FlashAttention state per warp; see
// there): head g of the group is A's row g (q's fp16 value) and g + 8 (its rounding error), K and V
// rows are B operands held in registers, 16-byte loads, no scores in shared memory (so no bound on
// positions from it), warps merged through shared memory at the end. What differs from the batch-1
// kernel: q arrives rotated and times 1/sqrt(hd) from batch_rope_store (fp32 [B][n_heads][hd]) and
// this step's K/V row is already in the cache, so rows below pos of the first pass load before the
// PDL wait and row pos after it through L2; the output is fp16 [B][ldo]; no context split. WARPS
// warps a block: 8 where the grid has fewer blocks than SMs, else 4 (a block holds ~170 registers a
// thread, so 8 warps are one block an SM).
template <int HD, int WARPS>
TI_DEVICE void attention_row_mma(const float* q, const __half* k_cache, const __half* v_cache, long long slot_stride,
                                 const int* __restrict__ positions, const int* __restrict__ slots, int n_heads,
                                 int n_kv, int window, int max_keys, __half* out, int ldo)
{
    constexpr int PIECES = HD / 32;          // 16-byte pieces of a row per lane
    constexpr int BLOCKS = 128 / HD;         // 16-row blocks per warp per pass
    constexpr int WARP_ROWS = 16 * BLOCKS;
    constexpr int PASS_ROWS = WARPS * WARP_ROWS;
    constexpr int TILES = HD / 8;            // output tiles of p . V, tile 4 i + w
    __shared__ __align__(16) float warp_o[WARPS][BA_MAX_GROUP][HD];   // each warp's unnormalised output
    __shared__ float warp_ml[WARPS][BA_MAX_GROUP][2];                 // and its (max, sum) per head
    const int kvh = blockIdx.x, b = blockIdx.y, group = n_heads / n_kv;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const u32 row_stride = (u32)(n_kv * HD);
    const size_t slot_base = (size_t)slots[b] * slot_stride + kvh * HD + 8 * t;     // (the row table: host-written)
    const __half* k_src = k_cache + slot_base;
    const __half* v_src = v_cache + slot_base;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    auto row_of = [&](int first, int blk, int n) { return first + warp * WARP_ROWS + 16 * blk + 8 * n + g; };
    uint4 kr[BLOCKS][2][PIECES], vr[BLOCKS][2][PIECES];

    pdl_launch_dependents();
    const int pos = positions[b], len = pos + 1, lo = first_key(pos, window);
    // The first pass's rows below pos, before the wait (prefill or earlier steps wrote them). As in
    // attention_mma, the loads sit in branches of a loop with a bound ptxas cannot resolve and the wait
    // depends on the last row loaded, or ptxas predicates the loads and moves the wait above them.
    const int opaque_tiles = (max_keys + 7) >> 3;
    int last_loaded = -1;
#pragma unroll
    for (int blk = 0; blk < BLOCKS; ++blk)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int i = 0; i < PIECES; ++i) kr[blk][n][i] = vr[blk][n][i] = zero;
#pragma unroll
    for (int bn = 0; bn < 2 * BLOCKS; ++bn) {
        if (bn >= opaque_tiles) break;
        const int blk = bn >> 1, n = bn & 1, r = row_of(lo, blk, n);
        if (r < pos) {
#pragma unroll
            for (int i = 0; i < PIECES; ++i) {
                kr[blk][n][i] = load_cached_piece(k_src + (u32)r * row_stride + 32 * i);
                vr[blk][n][i] = load_cached_piece(v_src + (u32)r * row_stride + 32 * i);
            }
            last_loaded = r;
        }
    }
    asm volatile("" : "+r"(last_loaded));
    if (last_loaded != (int)0x80000000) pdl_wait();

    // Row pos (batch_rope_store's) where it falls in the first pass, and q of head g (zero rows past
    // the group) in log2 units.
    auto place_new_row = [&](int first) {
#pragma unroll
        for (int blk = 0; blk < BLOCKS; ++blk)
#pragma unroll
            for (int n = 0; n < 2; ++n)
                if (row_of(first, blk, n) == pos)
#pragma unroll
                    for (int i = 0; i < PIECES; ++i) {
                        kr[blk][n][i] = __ldcg(reinterpret_cast<const uint4*>(k_src + (u32)pos * row_stride + 32 * i));
                        vr[blk][n][i] = __ldcg(reinterpret_cast<const uint4*>(v_src + (u32)pos * row_stride + 32 * i));
                    }
    };
    place_new_row(lo);
    float qf[PIECES][8];
    const float* q_head = q + ((size_t)b * n_heads + kvh * group + min(g, group - 1)) * HD + 8 * t;
#pragma unroll
    for (int i = 0; i < PIECES; ++i) load8_activation(q_head + 32 * i, qf[i]);
    const float q_scale = g < group ? 1.4426950408889634f : 0.f;     // log2(e): scores in base 2
    u32 qa[PIECES][2][4];                    // A fragments of k step (i, h)
#pragma unroll
    for (int i = 0; i < PIECES; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            split_half2(qf[i][4 * h] * q_scale, qf[i][4 * h + 1] * q_scale, qa[i][h][0], qa[i][h][1]);
            split_half2(qf[i][4 * h + 2] * q_scale, qf[i][4 * h + 3] * q_scale, qa[i][h][2], qa[i][h][3]);
        }

    float m = -TI_INF, l = 0.f;              // head g: running max (log2 domain), this lane's share of the sum
    float o[TILES][4];                       // C fragments of p . V: rows g (P hi) and g + 8 (P lo)
#pragma unroll
    for (int j = 0; j < TILES; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    for (int first = lo; first < len; first += PASS_ROWS) {
        if (first + warp * WARP_ROWS >= len) break;               // (uniform across the warp)
        if (first != lo) {                    // later passes: rows below pos, then row pos if here
#pragma unroll
            for (int blk = 0; blk < BLOCKS; ++blk)
#pragma unroll
                for (int n = 0; n < 2; ++n) {
                    const int r = row_of(first, blk, n);
#pragma unroll
                    for (int i = 0; i < PIECES; ++i) {
                        kr[blk][n][i] = r < pos ? load_cached_piece(k_src + (u32)r * row_stride + 32 * i) : zero;
                        vr[blk][n][i] = r < pos ? load_cached_piece(v_src + (u32)r * row_stride + 32 * i) : zero;
                    }
                }
            place_new_row(first);
        }
        float p[BLOCKS][2][2];
        float top = -TI_INF;
#pragma unroll
        for (int blk = 0; blk < BLOCKS; ++blk)
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                float sc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int i = 0; i < PIECES; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        mma_16816(sc, qa[i][h][0], qa[i][h][1], qa[i][h][2], qa[i][h][3],
                                  word_of(kr[blk][n][i], 2 * h), word_of(kr[blk][n][i], 2 * h + 1));
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int r = first + warp * WARP_ROWS + 16 * blk + 8 * n + 2 * t + e;
                    p[blk][n][e] = r < len ? sc[e] + sc[2 + e] : -TI_INF;
                    top = fmaxf(top, p[blk][n][e]);
                }
            }
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));   // the four lanes of head g
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
        const float m_new = fmaxf(m, top);                        // finite: the warp has a row here
        const float corr = m == -TI_INF ? 0.f : exp2f(m - m_new);
        l *= corr;
#pragma unroll
        for (int j = 0; j < TILES; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[j][e] *= corr;
        m = m_new;
#pragma unroll
        for (int blk = 0; blk < BLOCKS; ++blk) {
            u32 pa[4];                       // A of p . V over the block's 16 rows
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                const float p0 = exp2f(p[blk][n][0] - m_new), p1 = exp2f(p[blk][n][1] - m_new);
                l += p0 + p1;
                split_half2(p0, p1, pa[2 * n], pa[2 * n + 1]);
            }
#pragma unroll
            for (int i = 0; i < PIECES; ++i)
#pragma unroll
                for (int w = 0; w < 4; ++w)
                    mma_16816(o[4 * i + w], pa[0], pa[1], pa[2], pa[3], transpose8x8(word_of(vr[blk][0][i], w)),
                              transpose8x8(word_of(vr[blk][1][i], w)));
        }
    }

    // The warps' states through shared memory, then each output merged over the warps in order.
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (g < group) {
#pragma unroll
        for (int i = 0; i < PIECES; ++i)
#pragma unroll
            for (int w = 0; w < 4; ++w)
                *reinterpret_cast<float2*>(&warp_o[warp][g][32 * i + 8 * t + 2 * w]) =
                    make_float2(o[4 * i + w][0] + o[4 * i + w][2], o[4 * i + w][1] + o[4 * i + w][3]);
        if (t == 0) {
            warp_ml[warp][g][0] = m;
            warp_ml[warp][g][1] = l;
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < group * HD; idx += blockDim.x) {
        const int h = idx / HD, d = idx % HD;
        float top = -TI_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) top = fmaxf(top, warp_ml[w][h][0]);
        float num = 0.f, den = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float mw = warp_ml[w][h][0];
            const float f = mw == -TI_INF ? 0.f : exp2f(mw - top);
            num += warp_o[w][h][d] * f;
            den += warp_ml[w][h][1] * f;
        }
        out[(size_t)b * ldo + (kvh * group + h) * HD + d] = __float2half_rn(num / den);
    }
}

// Grid (n_kv, B); HD 64 or 128, groups of at most BA_MAX_GROUP query heads.
#define TI_BATCH_ATTENTION_MMA(HD, WARPS)                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * WARPS, 1) batch_attention_mma##HD##_##WARPS(            \
        const float* q, const __half* k_cache, const __half* v_cache, long long slot_stride,                  \
        const int* __restrict__ positions, const int* __restrict__ slots, int n_heads, int n_kv, int hd,       \
        int window, int max_keys, __half* out, int ldo) {                                                     \
        attention_row_mma<HD, WARPS>(q, k_cache, v_cache, slot_stride, positions, slots, n_heads, n_kv, window, \
                                     max_keys, out, ldo);                                                     \
    }
TI_BATCH_ATTENTION_MMA(64, 4)
TI_BATCH_ATTENTION_MMA(64, 8)
TI_BATCH_ATTENTION_MMA(128, 4)
TI_BATCH_ATTENTION_MMA(128, 8)

// out[b][c] = silu(gate) * up as fp16, from the gate/up linear's slices (rows: ffn gate then ffn up).
// Grid-stride over B * ffn.
extern "C" __global__ void __launch_bounds__(256) batch_swiglu(
    const float* parts, int n_slices, long long slice_stride, int rows_b, int ffn, __half* out, int ldo)
{
    pdl_launch_dependents();
    pdl_wait();
    const size_t n = (size_t)rows_b * ffn;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t b = i / ffn, c = i % ffn;
        const float gate = slice_sum(parts, n_slices, (size_t)slice_stride, b * 2 * ffn + c);
        const float up = slice_sum(parts, n_slices, (size_t)slice_stride, b * 2 * ffn + ffn + c);
        out[b * ldo + c] = __float2half_rn(gate / (1.f + __expf(-gate)) * up);
    }
}

#define BL_UNROLL 8          // logits each batch_logits thread sums before it stores any

// Row b (grid (B), block 1024): logits[b] = the head's slices' sum, best[b] = its argmax (the lowest
// id among equal maxima, as np.argmax; NaN never wins). A thread sums BL_UNROLL logits, then stores
// them: a store may alias parts, so loads after it could not start before it.
extern "C" __global__ void __launch_bounds__(1024) batch_logits(
    const float* parts, int n_slices, long long slice_stride, int vocab, float* logits, int* best)
{
    __shared__ float warp_value[32];
    __shared__ int warp_id[32];
    pdl_launch_dependents();
    pdl_wait();
    const int b = blockIdx.x;
    float value = -TI_INF;
    int id = 0x7fffffff;
    for (int start = threadIdx.x; start < vocab; start += BL_UNROLL * blockDim.x) {
        float v[BL_UNROLL];
#pragma unroll
        for (int u = 0; u < BL_UNROLL; ++u) {
            const int i = start + u * blockDim.x;
            v[u] = i < vocab ? slice_sum(parts, n_slices, (size_t)slice_stride, (size_t)b * vocab + i) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < BL_UNROLL; ++u) {
            const int i = start + u * blockDim.x;
            if (i < vocab) {
                logits[(size_t)b * vocab + i] = v[u];
                if (v[u] > value) { value = v[u]; id = i; }    // ascending i: the first maximum stays
            }
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, value, o);
        const int oi = __shfl_xor_sync(0xffffffffu, id, o);
        if (ov > value || (ov == value && oi < id)) { value = ov; id = oi; }
    }
    if ((threadIdx.x & 31) == 0) { warp_value[threadIdx.x >> 5] = value; warp_id[threadIdx.x >> 5] = id; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
            if (warp_value[w] > value || (warp_value[w] == value && warp_id[w] < id)) {
                value = warp_value[w];
                id = warp_id[w];
            }
        best[b] = id == 0x7fffffff ? 0 : id;
    }
}
