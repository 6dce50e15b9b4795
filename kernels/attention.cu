// Decode attention for one layer: RoPE, KV-cache append and causal softmax(q k^T) v, in one kernel
// (flash-decoding: the context is split over blocks, then over warps, then over lane row groups).
//
// Data: qkv [(n_heads + 2 n_kv) * hd] f32 (q heads, then k, then v); k_cache / v_cache
// [max_ctx][n_kv][hd] fp16; rope tables [max_ctx][hd/2] (rotate-half); out [n_heads * hd] f32.
//
// Grid (n_kv, S), ATT_WARPS warps per block. Block (kvh, s) serves the `group` query heads that share
// KV head kvh over slice s of the context. The slices are cut at run time from the current length
// pos+1 (read from device memory, so a captured graph stays valid as the context grows) in multiples
// of ATT_GRANULE positions, using only as many slices as that needs; the other blocks exit at once.
//
// Inside a block the heads are taken in chunks of HEADS (per pass, a K/V row in registers serves
// every head of the chunk; warps of other chunks of the same group read it again, from L1/L2, not
// HBM) and the slice is cut into contiguous warp ranges: warp = (head chunk, range). In a warp, a row of hd fp16 values is read by `lpr` lanes
// (hd/8 rounded up to a power of two), 16 bytes = 8 dims per lane, so one load instruction covers
// 32/lpr rows (a "row group" per row) and each lane keeps ROWS rows of K and V in flight. Scores are
// 8-dim partial dots summed across the row's lanes by shuffles; each row group keeps its own running
// (max, sum, 8 output dims) per head as in FlashAttention, in the log2 domain (q is pre-scaled by
// log2(e)/sqrt(hd)). At the end row groups merge by shuffles, warps through shared memory, and with
// more than one active slice each block writes its unnormalised partial result; the last block to
// finish for a KV head (an atomic counter, reset to 0 for the next launch) merges the slices.
//
//   TILE = true : grouped-query attention, HEADS = 4 query heads per pass over the K/V rows.
//   TILE = false: multi-head attention, HEADS = 1 (state for one head only, more rows in flight).
// Each lane's 8 dims of q are read from shared memory per batch, so registers go to rows and state.
//
// RoPE: q is rotated here; the block whose slice holds `pos` rotates k, writes k and v (fp16) to the
// cache and uses the same fp16 values (from shared memory) for this step. No block reads a cache
// row at or beyond pos from global memory.
#include "common.cuh"

#define ATT_WARPS 4
#define ATT_GRANULE 16        // slice lengths are multiples of this many positions
#define ATT_MERGE_HEADS 8     // heads whose slice weights the merging block holds at once

template <bool TILE>
struct AttConfig {
    static constexpr int HEADS = TILE ? 4 : 1;   // query heads per pass over the K/V rows
    static constexpr int ROWS = TILE ? 2 : 4;    // K/V rows in flight per lane
};

TI_DEVICE int ceil_div(int a, int b) {
    return (a + b - 1) / b;
}

// Where this lane sits in the row layout of a warp.
struct RowLanes {
    int lpr;      // lanes per row: hd/8 rounded up to a power of two
    int rpw;      // rows per warp load: 32 / lpr
    int group;    // this lane's row group (which of the rpw rows)
    int col;      // this lane's dims are 8*col .. 8*col+7
    bool dims;    // 8*col < hd (lanes of a padded row have none)
};

TI_DEVICE RowLanes row_lanes(int hd) {
    RowLanes r;
    const int lane = threadIdx.x & 31;
    r.lpr = 1 << (32 - __clz((hd >> 3) - 1));
    r.rpw = 32 / r.lpr;
    r.group = lane / r.lpr;
    r.col = lane % r.lpr;
    r.dims = 8 * r.col < hd;
    return r;
}

// Running softmax of one head over the rows one row group has seen: max and sum (log2 domain) and
// the unnormalised output for this lane's 8 dims.
struct Softmax {
    float m, l, o[8];
};

TI_DEVICE void softmax_init(Softmax& st) {
    st.m = -TI_INF;
    st.l = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) st.o[i] = 0.f;
}

// ROWS rows of K and V for one lane: row u of the batch at p0 is p0 + u*rpw + row group.
template <int ROWS>
struct RowBatch {
    uint4 k[ROWS], v[ROWS];
};

TI_DEVICE int batch_row(const RowLanes& r, int p0, int u) {
    return p0 + u * r.rpw + r.group;
}

// Issue the loads of the batch at p0 (rows < end). Row `pos` is left for patch_new_row: its cache
// entry is being written by this launch.
template <int ROWS>
TI_DEVICE void load_batch(RowBatch<ROWS>& b, const __half* k_lane, const __half* v_lane, size_t row_stride,
                          const RowLanes& r, int p0, int end, int pos) {
#pragma unroll
    for (int u = 0; u < ROWS; ++u) {
        const int p = batch_row(r, p0, u);
        b.k[u] = b.v[u] = make_uint4(0, 0, 0, 0);
        if (r.dims && p < end && p != pos) {
            b.k[u] = *reinterpret_cast<const uint4*>(k_lane + (size_t)p * row_stride);
            b.v[u] = *reinterpret_cast<const uint4*>(v_lane + (size_t)p * row_stride);
        }
    }
}

// This step's K/V row, rounded to fp16 by the block that appends it, from shared memory (only a
// range that holds pos: elsewhere kv_new is not written).
template <int ROWS>
TI_DEVICE void patch_new_row(RowBatch<ROWS>& b, const __half* kv_new, int hd, const RowLanes& r, int p0, int end,
                             int pos) {
#pragma unroll
    for (int u = 0; u < ROWS; ++u) {
        if (r.dims && pos < end && batch_row(r, p0, u) == pos) {
            b.k[u] = reinterpret_cast<const uint4*>(kv_new)[r.col];
            b.v[u] = reinterpret_cast<const uint4*>(kv_new + hd)[r.col];
        }
    }
}

TI_DEVICE float dot8(const float (&q)[8], uint4 k) {
    const u32 w[4] = {k.x, k.y, k.z, k.w};
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 kf = __half22float2(as_half2(w[i]));
        acc = fmaf(q[2 * i], kf.x, acc);
        acc = fmaf(q[2 * i + 1], kf.y, acc);
    }
    return acc;
}

TI_DEVICE void add_scaled8(float (&o)[8], float p, uint4 v) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 vf = __half22float2(as_half2(w[i]));
        o[2 * i] = fmaf(p, vf.x, o[2 * i]);
        o[2 * i + 1] = fmaf(p, vf.y, o[2 * i + 1]);
    }
}

// Sum over the lanes of one row (lpr is uniform, so every lane takes part in every shuffle).
TI_DEVICE float row_sum(float v, int lpr) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        if (o < lpr) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// This lane's 8 dims of a rotated, scaled q row in shared memory (zeros for a lane without dims).
TI_DEVICE void load_q8(const float* q_row, const RowLanes& r, float (&q)[8]) {
    float4 lo = make_float4(0.f, 0.f, 0.f, 0.f), hi = lo;
    if (r.dims) {
        lo = reinterpret_cast<const float4*>(q_row + 8 * r.col)[0];
        hi = reinterpret_cast<const float4*>(q_row + 8 * r.col)[1];
    }
    q[0] = lo.x; q[1] = lo.y; q[2] = lo.z; q[3] = lo.w;
    q[4] = hi.x; q[5] = hi.y; q[6] = hi.z; q[7] = hi.w;
}

// Fold one batch of rows into the running softmax of the chunk's heads (nh of HEADS are real; their
// q rows start at q_s). q is re-read from shared memory per batch: registers go to rows and state.
template <int HEADS, int ROWS>
TI_DEVICE void attend_batch(const RowBatch<ROWS>& b, const bool (&valid)[ROWS], const float* q_s, int hd, int nh,
                            const RowLanes& r, Softmax (&st)[HEADS]) {
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
        if (h >= nh) continue;
        float q[8];
        load_q8(q_s + h * hd, r, q);
        float score[ROWS];
        float m_new = st[h].m;
#pragma unroll
        for (int u = 0; u < ROWS; ++u) {
            score[u] = row_sum(dot8(q, b.k[u]), r.lpr);
            if (valid[u]) m_new = fmaxf(m_new, score[u]);
        }
        const float base = m_new == -TI_INF ? 0.f : m_new;     // no row yet: keep everything at 0
        const float correction = exp2f(st[h].m - base);
        st[h].l *= correction;
#pragma unroll
        for (int i = 0; i < 8; ++i) st[h].o[i] *= correction;
#pragma unroll
        for (int u = 0; u < ROWS; ++u) {
            const float p = valid[u] ? exp2f(score[u] - base) : 0.f;
            st[h].l += p;
            add_scaled8(st[h].o, p, b.v[u]);
        }
        st[h].m = m_new;
    }
}

// Merge the row groups' states (xor butterfly over the lanes that hold the same dims).
TI_DEVICE void merge_row_groups(Softmax& st, int lpr) {
    for (int off = lpr; off < 32; off <<= 1) {
        const float m_other = __shfl_xor_sync(0xffffffffu, st.m, off);
        const float l_other = __shfl_xor_sync(0xffffffffu, st.l, off);
        const float m_new = fmaxf(st.m, m_other);
        const float base = m_new == -TI_INF ? 0.f : m_new;
        const float mine = exp2f(st.m - base), theirs = exp2f(m_other - base);
        st.l = st.l * mine + l_other * theirs;
#pragma unroll
        for (int i = 0; i < 8; ++i) st.o[i] = st.o[i] * mine + __shfl_xor_sync(0xffffffffu, st.o[i], off) * theirs;
        st.m = m_new;
    }
}

// Slice weights for one head, in one warp: w[j] = 2^(m_j - M) / sum_j l_j 2^(m_j - M).
TI_DEVICE void slice_weights(const float* part_ml_head, int active, float* w) {
    const int lane = threadIdx.x & 31;
    float m_lane = -TI_INF, l_lane = 0.f;
    for (int j = lane; j < active; j += 32) {
        const float2 ml = __ldcg(reinterpret_cast<const float2*>(part_ml_head) + j);
        w[j] = ml.x;
        const float m_new = fmaxf(m_lane, ml.x);
        l_lane = l_lane * exp2f(m_lane - m_new) + ml.y * exp2f(ml.x - m_new);
        m_lane = m_new;
    }
    const float m_all = warp_max(m_lane);
    const float inv_l = 1.f / warp_sum(l_lane * exp2f(m_lane - m_all));
    for (int j = lane; j < active; j += 32) w[j] = exp2f(w[j] - m_all) * inv_l;   // w[j]: this lane's own
}

// q of the group's heads, rotated and pre-scaled, to shared memory; the appending block also writes
// this step's k (rotated) and v rows to the cache and to kv_new as fp16.
TI_DEVICE void rope_and_append(const float* qkv, __half* k_cache, __half* v_cache, const float* rope_cos,
                               const float* rope_sin, int n_heads, int n_kv, int hd, int kvh, int pos, bool appends,
                               float* q_s, __half* kv_new) {
    const int group = n_heads / n_kv, half_hd = hd >> 1;
    const float* cos_p = rope_cos + (size_t)pos * half_hd;
    const float* sin_p = rope_sin + (size_t)pos * half_hd;
    const float q_scale = 1.4426950408889634f * rsqrtf((float)hd);    // log2(e) / sqrt(hd)
    for (int i = threadIdx.x; i < group * half_hd; i += blockDim.x) {
        const int hg = i / half_hd, d = i % half_hd;
        const float* q = qkv + (size_t)(kvh * group + hg) * hd;
        const float a = q[d], b = q[d + half_hd];
        q_s[hg * hd + d] = (a * cos_p[d] - b * sin_p[d]) * q_scale;
        q_s[hg * hd + d + half_hd] = (b * cos_p[d] + a * sin_p[d]) * q_scale;
    }
    if (!appends) return;
    const float* k = qkv + (size_t)(n_heads + kvh) * hd;
    const float* v = qkv + (size_t)(n_heads + n_kv + kvh) * hd;
    __half* k_row = k_cache + ((size_t)pos * n_kv + kvh) * hd;
    __half* v_row = v_cache + ((size_t)pos * n_kv + kvh) * hd;
    for (int d = threadIdx.x; d < half_hd; d += blockDim.x) {
        const float a = k[d], b = k[d + half_hd];
        const __half lo = __float2half_rn(a * cos_p[d] - b * sin_p[d]);
        const __half hi = __float2half_rn(b * cos_p[d] + a * sin_p[d]);
        k_row[d] = kv_new[d] = lo;
        k_row[d + half_hd] = kv_new[d + half_hd] = hi;
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) v_row[d] = kv_new[hd + d] = __float2half_rn(v[d]);
}

// One warp, one chunk of heads (from h0) over positions [begin, end): running softmax per head,
// then the row groups merged and the result stored to o_w[h][hd], ml_w[h][2]. `rows` holds the
// first batch's loads already.
template <int HEADS, int ROWS>
TI_DEVICE void attend_chunk(RowBatch<ROWS>& rows, const __half* k_lane, const __half* v_lane, size_t row_stride,
                            const RowLanes& r, int begin, int end, int pos, const __half* kv_new, const float* q_s,
                            int hd, int h0, int group, float* o_w, float* ml_w) {
    const int lane = threadIdx.x & 31, batch = ROWS * r.rpw;
    const int nh = min(HEADS, group - h0);
    Softmax st[HEADS];
#pragma unroll
    for (int h = 0; h < HEADS; ++h) softmax_init(st[h]);
    for (int p0 = begin; p0 < end; p0 += batch) {
        bool valid[ROWS];
#pragma unroll
        for (int u = 0; u < ROWS; ++u) valid[u] = batch_row(r, p0, u) < end;
        patch_new_row(rows, kv_new, hd, r, p0, end, pos);
        attend_batch(rows, valid, q_s + h0 * hd, hd, nh, r, st);
        if (p0 + batch < end) load_batch(rows, k_lane, v_lane, row_stride, r, p0 + batch, end, pos);
    }
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
        if (h >= nh) continue;
        merge_row_groups(st[h], r.lpr);
        if (lane < r.lpr && r.dims) {
            float4* dst = reinterpret_cast<float4*>(o_w + (h0 + h) * hd + 8 * r.col);
            dst[0] = make_float4(st[h].o[0], st[h].o[1], st[h].o[2], st[h].o[3]);
            dst[1] = make_float4(st[h].o[4], st[h].o[5], st[h].o[6], st[h].o[7]);
        }
        if (lane == 0) {
            ml_w[2 * (h0 + h)] = st[h].m;
            ml_w[2 * (h0 + h) + 1] = st[h].l;
        }
    }
}

// The last block of KV head kvh merges the slices, ATT_MERGE_HEADS heads at a time: a warp per head
// computes the slice weights, then every thread takes 4 output dims of one head and sums its slices
// (independent L2 loads; __ldcg because other blocks wrote them).
TI_DEVICE void merge_slices(const float* part_o, const float* part_ml, int kvh, int group, int hd, int S, int active,
                            float* merge_w, float* out) {
    const int warp = threadIdx.x >> 5;
    const int quads = hd >> 2;
    for (int h0 = 0; h0 < group; h0 += ATT_MERGE_HEADS) {
        const int nh = min(ATT_MERGE_HEADS, group - h0);
        for (int hg = warp; hg < nh; hg += ATT_WARPS)
            slice_weights(part_ml + ((size_t)kvh * group + h0 + hg) * S * 2, active, merge_w + hg * S);
        __syncthreads();
        for (int i = threadIdx.x; i < nh * quads; i += blockDim.x) {
            const int hg = i / quads, d = 4 * (i % quads);
            const size_t head = (size_t)kvh * group + h0 + hg;
            const float* w = merge_w + hg * S;
            const float4* src = reinterpret_cast<const float4*>(part_o + head * S * hd + d);
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
            for (int j = 0; j < active; ++j) {
                const float4 x = __ldcg(src + (size_t)j * quads);
                acc.x += w[j] * x.x;
                acc.y += w[j] * x.y;
                acc.z += w[j] * x.z;
                acc.w += w[j] * x.w;
            }
            *reinterpret_cast<float4*>(out + head * hd + d) = acc;
        }
        __syncthreads();             // merge_w is rewritten for the next heads
    }
}

template <bool TILE>
__global__ void __launch_bounds__(32 * ATT_WARPS, 4) attention(   // 4 blocks/SM: <= 128 registers
    const float* __restrict__ qkv,        // [(n_heads + 2 n_kv) * hd] this token's projections
    __half* __restrict__ k_cache,         // [max_ctx][n_kv][hd] this layer
    __half* __restrict__ v_cache,
    const int* __restrict__ state,        // state[STATE_POS] = pos
    const float* __restrict__ rope_cos,   // [max_ctx][hd/2]
    const float* __restrict__ rope_sin,
    int n_heads, int n_kv, int hd,
    float* __restrict__ part_o,           // [n_heads][S][hd] unnormalised partial outputs
    float* __restrict__ part_ml,          // [n_heads][S][2] partial (max, sum), log2 domain
    unsigned int* __restrict__ counters,  // [n_kv] zero between launches
    float* __restrict__ out)              // [n_heads * hd]
{
    constexpr int HEADS = AttConfig<TILE>::HEADS, ROWS = AttConfig<TILE>::ROWS;
    extern __shared__ __align__(16) unsigned char smem[];
    const int kvh = blockIdx.x, s = blockIdx.y, S = gridDim.y;
    const int warp = threadIdx.x >> 5;
    const int group = n_heads / n_kv;
    // PDL: pos and the cached rows before it were written by earlier graph replays, so only qkv (the
    // previous kernel's output) waits; the first K/V loads overlap that kernel's tail.
    pdl_launch_dependents();
    const int pos = state[STATE_POS];
    const int len = pos + 1;

    // This block's slice [begin, end).
    const int per_slice = ceil_div(ceil_div(len, S), ATT_GRANULE) * ATT_GRANULE;
    const int active = ceil_div(len, per_slice);
    if (s >= active) return;
    const int begin = s * per_slice, end = min(len, begin + per_slice);

    // This warp's work: head chunks chunk0, chunk0 + chunk_step, ... over positions [w_begin, w_end).
    const RowLanes r = row_lanes(hd);
    const int chunks = ceil_div(group, HEADS);
    const int parts = max(1, ATT_WARPS / chunks);             // warps sharing a head chunk
    const int part = warp % parts, chunk0 = warp / parts, chunk_step = ATT_WARPS / parts;
    const int per_part = ceil_div(ceil_div(end - begin, parts), r.rpw) * r.rpw;
    const int w_begin = begin + part * per_part, w_end = min(end, w_begin + per_part);

    // Shared memory (offsets in floats; every region 16-byte aligned since hd % 8 == 0).
    float* q_s = reinterpret_cast<float*>(smem);                      // [group][hd] rotated, scaled q
    float* o_w = q_s + group * hd;                                    // [parts][group][hd] warp results
    float* ml_w = o_w + parts * group * hd;                           // [parts][group][2]
    __half* kv_new = reinterpret_cast<__half*>(ml_w + ((2 * parts * group + 3) & ~3));   // [2][hd]
    float* merge_w = reinterpret_cast<float*>(kv_new + 2 * hd);       // [ATT_MERGE_HEADS][S]

    // The first batch of K/V loads is in flight while q is rotated.
    const size_t row_stride = (size_t)n_kv * hd;
    const __half* k_lane = k_cache + (size_t)kvh * hd + 8 * r.col;
    const __half* v_lane = v_cache + (size_t)kvh * hd + 8 * r.col;
    RowBatch<ROWS> rows;
    if (chunk0 < chunks) load_batch(rows, k_lane, v_lane, row_stride, r, w_begin, w_end, pos);
    pdl_wait();
    rope_and_append(qkv, k_cache, v_cache, rope_cos, rope_sin, n_heads, n_kv, hd, kvh, pos, end == len, q_s, kv_new);
    __syncthreads();

    for (int chunk = chunk0; chunk < chunks; chunk += chunk_step) {
        if (chunk != chunk0) load_batch(rows, k_lane, v_lane, row_stride, r, w_begin, w_end, pos);
        attend_chunk<HEADS>(rows, k_lane, v_lane, row_stride, r, w_begin, w_end, pos, kv_new, q_s, hd,
                            chunk * HEADS, group, o_w + part * group * hd, ml_w + 2 * part * group);
    }
    __syncthreads();

    // Combine the warps' ranges per head (a warp with no positions has m = -inf, weight 0); part 0
    // always has positions, so the block maximum is finite.
    for (int i = threadIdx.x; i < group * hd; i += blockDim.x) {
        const int hg = i / hd, d = i % hd;
        float m_max = -TI_INF;
        for (int p = 0; p < parts; ++p) m_max = fmaxf(m_max, ml_w[2 * (p * group + hg)]);
        float num = 0.f, den = 0.f;
        for (int p = 0; p < parts; ++p) {
            const float f = exp2f(ml_w[2 * (p * group + hg)] - m_max);
            num += o_w[(p * group + hg) * hd + d] * f;
            den += ml_w[2 * (p * group + hg) + 1] * f;
        }
        const size_t head = (size_t)kvh * group + hg;
        if (active == 1) {            // the whole context in one slice: normalise and finish
            out[head * hd + d] = num / den;
        } else {
            part_o[(head * S + s) * hd + d] = num;
            if (d == 0) {
                part_ml[(head * S + s) * 2] = m_max;
                part_ml[(head * S + s) * 2 + 1] = den;
            }
        }
    }
    if (active == 1) return;
    __threadfence();                 // partials visible to whichever block merges
    __syncthreads();
    __shared__ bool is_last;
    if (threadIdx.x == 0) is_last = atomicAdd(&counters[kvh], 1u) == (unsigned)(active - 1);
    __syncthreads();
    if (!is_last) return;
    __threadfence();

    merge_slices(part_o, part_ml, kvh, group, hd, S, active, merge_w, out);
    if (threadIdx.x == 0) counters[kvh] = 0u;
}
