// Decode attention for one layer: RoPE, KV-cache append and causal softmax(q k^T) v, in one kernel.
// Three kernels, chosen by shape in attention.py (plan): `attention` (flash-decoding: the context
// is split over the blocks of a KV head, and each block walks its slice in chunks staged in shared
// memory), further down `attention_rows` (a block per query head, its rows in registers) and, at
// the end of this file, `attention_mma64/128` (a block per KV head, rows in registers, products on
// the tensor cores: the default where it fits). The notes below up to the second section are about
// `attention`.
//
// Data: qkv [(n_heads + 2 n_kv) * hd] f32 (q heads, then k, then v); k_cache / v_cache
// [max_ctx][n_kv][hd] fp16; rope tables [max_ctx][hd/2] (rotate-half); out [n_heads * hd] f32.
// The query at pos attends to the cached rows first_key(pos, window) .. pos: all of them, or with a
// sliding window (Mistral, Qwen2) the last `window`; each kernel lays its rows out from there.
//
// Grid (n_kv, S), up to ATT_THREADS threads per block (threads_for in attention.py). Block (kvh, s) serves the `group` query heads that
// share KV head kvh over slice s of the context, so every K/V row is read once for all heads of its
// group (grouped-query attention), and multi-head attention is the case group = 1. The slices are
// cut at run time from the current length pos+1 (read from device memory, so a captured graph stays
// valid as the context grows) in multiples of ATT_GRANULE positions, using only as many slices as
// that needs (`active`).
//
// Latency, not bandwidth, bounds decode attention at the contexts of a chat, so the kernel keeps the
// dependent steps after pdl_wait() few and short: the slice's cached K/V rows are copied to shared
// memory (cp.async) before the wait, while the previous kernel may still run, and only this token's
// q/k/v are read after it. Per staged chunk of rows, three block-wide phases, each a few independent
// shared-memory loads and FMAs per thread (no shuffle chains):
//   scores  (head, row) items, each one thread (or `lanes` adjacent threads for short chunks) doing
//           the full q . k dot product from shared memory; K rows are padded by 16 bytes so a warp
//           reading 32 different rows hits every bank once;
//   softmax one warp per head: chunk max, the running max/sum update (FlashAttention, in the log2
//           domain: q is pre-scaled by log2(e)/sqrt(hd)), probabilities written over the scores;
//   p . V   (head, 8 dims, row part) items accumulate in registers across chunks, rescaled by the
//           running max's correction; the row parts are summed at the end.
// Shared memory per block stays small (ATT_STAGE_HALVES): measured on an H200, kernels that need a
// large shared-memory carve-out make the whole decode step slower.
//
// Merging the slices. With ATT_USE_CLUSTER (Hopper and newer) the S = ATT_CLUSTER_SIZE blocks of a KV head form a thread-block
// cluster: each leaves its partial result in shared memory and, after a cluster barrier, merges a
// share of the outputs by reading its peers' shared memory (no global round trip, no counter).
// Otherwise each block writes its unnormalised partial result to global memory and the last block
// to finish for a KV head (an atomic counter, reset to 0 for the next launch) merges the slices.
//
// RoPE: q is rotated here; the block whose slice holds `pos` rotates k, writes k and v (fp16) to the
// cache and into its staged rows. No block reads a cache row at or beyond pos from global memory.
#include "common.cuh"

#define ATT_THREADS 256
#define ATT_GRANULE 16           // slice lengths are multiples of this many positions
#define ATT_MERGE_HEADS 8        // heads whose slice weights the merging block holds at once (global merge)
#define ATT_STAGE_HALVES 4096    // fp16 values of K (and as many of V) staged in shared memory at once
#define ATT_MAX_ITEMS 4          // p . V items per thread: group * hd / 8 <= ATT_MAX_ITEMS * ATT_THREADS
#define ATT_CLUSTER_SIZE 8       // slices per KV head on the cluster path

#ifndef ATT_USE_CLUSTER          // the host passes -DATT_USE_CLUSTER=0/1 (kernels/attention.py uses_cluster)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define ATT_USE_CLUSTER 1
#else
#define ATT_USE_CLUSTER 0
#endif
#endif
#if ATT_USE_CLUSTER
#define ATT_CLUSTER_DIMS __cluster_dims__(1, ATT_CLUSTER_SIZE, 1)
#else
#define ATT_CLUSTER_DIMS
#endif

TI_DEVICE int ceil_div(int a, int b) {
    return (a + b - 1) / b;
}

// ------------------------------------------------------------------------------- staging rows

// Start copying cache rows [r0, r1) of KV head kvh into k_s/v_s (row r0 at index 0, `stride` halves
// per row). Row `pos` is skipped: this launch writes it (stage_new_row).
TI_DEVICE void stage_rows(__half* k_s, __half* v_s, int stride, const __half* k_cache, const __half* v_cache,
                          int n_kv, int hd, int kvh, int r0, int r1, int pos) {
    const int pieces = hd >> 3;                 // 16-byte pieces per row
    for (int i = threadIdx.x; i < (r1 - r0) * pieces; i += blockDim.x) {
        const int row = r0 + i / pieces, piece = i % pieces;
        if (row == pos) continue;
        const size_t src = ((size_t)row * n_kv + kvh) * hd + 8 * piece;
        copy16_async(k_s + (row - r0) * stride + 8 * piece, k_cache + src);
        copy16_async(v_s + (row - r0) * stride + 8 * piece, v_cache + src);
    }
}

// This step's K/V row (kv_new, fp16, written by rope_and_append) into its staged slot.
TI_DEVICE void stage_new_row(__half* k_s, __half* v_s, int stride, const __half* kv_new, int hd, int r0, int r1,
                             int pos) {
    if (pos < r0 || pos >= r1) return;
    for (int i = threadIdx.x; i < (hd >> 3); i += blockDim.x) {
        reinterpret_cast<uint4*>(k_s + (pos - r0) * stride)[i] = reinterpret_cast<const uint4*>(kv_new)[i];
        reinterpret_cast<uint4*>(v_s + (pos - r0) * stride)[i] = reinterpret_cast<const uint4*>(kv_new + hd)[i];
    }
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

// ------------------------------------------------------------------------------- one chunk

TI_DEVICE void unpack8(uint4 v, float (&f)[8]) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 p = __half22float2(as_half2(w[i]));
        f[2 * i] = p.x;
        f[2 * i + 1] = p.y;
    }
}

// Scores of the n staged rows for every head: sc[h][row] = q_h . k_row. `lanes` adjacent threads
// share one dot product when rows are few (uniform across the block, so every thread takes part
// in every shuffle).
TI_DEVICE void chunk_scores(const float* q_s, const __half* k_s, int stride, int hd, int group, int n, int stage,
                            float* sc) {
    const int pieces = hd >> 3;
    int lanes = 1;
    while (lanes < pieces && lanes < 32 && group * n * lanes * 2 <= (int)blockDim.x) lanes <<= 1;
    const int items = group * n * lanes;
    for (int base = 0; base < items; base += blockDim.x) {
        const int item = base + threadIdx.x;
        const int part = item % lanes, head_row = item / lanes;
        const int row = head_row % n, h = head_row / n;
        float dot = 0.f;
        if (item < items) {
            const __half* k = k_s + row * stride;
            const float* q = q_s + h * hd;
            for (int p = part; p < pieces; p += lanes) {
                float kf[8];
                unpack8(reinterpret_cast<const uint4*>(k)[p], kf);
                const float4 qa = reinterpret_cast<const float4*>(q)[2 * p];
                const float4 qb = reinterpret_cast<const float4*>(q)[2 * p + 1];
                dot = fmaf(qa.x, kf[0], dot); dot = fmaf(qa.y, kf[1], dot);
                dot = fmaf(qa.z, kf[2], dot); dot = fmaf(qa.w, kf[3], dot);
                dot = fmaf(qb.x, kf[4], dot); dot = fmaf(qb.y, kf[5], dot);
                dot = fmaf(qb.z, kf[6], dot); dot = fmaf(qb.w, kf[7], dot);
            }
        }
        for (int o = 1; o < lanes; o <<= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        if (item < items && part == 0) sc[h * stage + row] = dot;
    }
}

// Per head (a warp each): fold the chunk's scores into the running max m and sum l, replace them by
// probabilities exp2(score - m), and leave the factor that rescales earlier chunks in corr.
TI_DEVICE void chunk_softmax(float* sc, int group, int n, int stage, float* head_m, float* head_l,
                             float* head_corr) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int h = warp; h < group; h += nwarps) {
        float* s = sc + h * stage;
        float m_chunk = -TI_INF;
        for (int r = lane; r < n; r += 32) m_chunk = fmaxf(m_chunk, s[r]);
        const float m_old = head_m[h], m_new = fmaxf(m_old, warp_max(m_chunk));
        float sum = 0.f;
        for (int r = lane; r < n; r += 32) {
            const float p = exp2f(s[r] - m_new);
            s[r] = p;
            sum += p;
        }
        sum = warp_sum(sum);
        __syncwarp();                      // every lane has read head_m before lane 0 rewrites it
        if (lane == 0) {
            const float corr = exp2f(m_old - m_new);      // 0 for the first chunk (m_old = -inf)
            head_m[h] = m_new;
            head_l[h] = head_l[h] * corr + sum;
            head_corr[h] = corr;
        }
    }
}

// p . V: item i of P * group * hd/8 is 8 output dims (d8) of head h over the staged rows
// part, part + P, ...; consecutive threads take consecutive d8 of one row (16-byte loads that fill
// the banks once, and a broadcast of the row's probability). A thread holds up to ATT_MAX_ITEMS.
struct PvItem {
    int h, d8, part;
    bool live;
};

TI_DEVICE PvItem pv_item(int index, int hd, int group, int parts) {
    const int pieces = hd >> 3;
    PvItem it;
    it.d8 = index % pieces;
    it.h = (index / pieces) % group;
    it.part = index / (pieces * group);
    it.live = it.part < parts;
    return it;
}

TI_DEVICE void chunk_pv(const PvItem& it, int parts, const float* sc, const __half* v_s, int stride, int n,
                        int stage, const float* head_corr, float (&acc)[8]) {
    if (!it.live) return;
    const float corr = head_corr[it.h];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] *= corr;
    const float* p = sc + it.h * stage;
    for (int r = it.part; r < n; r += parts) {
        float vf[8];
        unpack8(reinterpret_cast<const uint4*>(v_s + r * stride)[it.d8], vf);
        const float pr = p[r];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = fmaf(pr, vf[i], acc[i]);
    }
}

// ------------------------------------------------------------------------------- merging slices

// Cluster merge (cluster_sync and peer_shared: common.cuh): output i (of the KV head's group * hd)
// from the partial results blk_o [group][hd] and blk_ml [group][2] of the `active` blocks; block s
// takes every S-th share.
TI_DEVICE void merge_cluster(const float* blk_o, const float* blk_ml, int kvh, int group, int hd, int s, int S,
                             int active, float* out) {
    for (int i = s * blockDim.x + threadIdx.x; i < group * hd; i += S * blockDim.x) {
        const int hg = i / hd;
        float m[ATT_CLUSTER_SIZE];
        float m_max = -TI_INF;
#pragma unroll
        for (int j = 0; j < ATT_CLUSTER_SIZE; ++j) {
            m[j] = j < active ? peer_shared(blk_ml, j)[2 * hg] : -TI_INF;
            m_max = fmaxf(m_max, m[j]);
        }
        float num = 0.f, den = 0.f;
#pragma unroll
        for (int j = 0; j < ATT_CLUSTER_SIZE; ++j) {
            if (j >= active) continue;
            const float f = exp2f(m[j] - m_max);
            num += peer_shared(blk_o, j)[i] * f;
            den += peer_shared(blk_ml, j)[2 * hg + 1] * f;
        }
        out[(size_t)kvh * group * hd + i] = num / den;
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

// Global merge: the last block of KV head kvh merges the slices, ATT_MERGE_HEADS heads at a time:
// a warp per head computes the slice weights, then every thread takes 4 output dims of one head and
// sums its slices (independent L2 loads; __ldcg because other blocks wrote them).
TI_DEVICE void merge_slices(const float* part_o, const float* part_ml, int kvh, int group, int hd, int S, int active,
                            float* merge_w, float* out) {
    const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int quads = hd >> 2;
    for (int h0 = 0; h0 < group; h0 += ATT_MERGE_HEADS) {
        const int nh = min(ATT_MERGE_HEADS, group - h0);
        for (int hg = warp; hg < nh; hg += nwarps)
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

// ------------------------------------------------------------------------------- the kernel

extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) ATT_CLUSTER_DIMS attention(
    const float* __restrict__ qkv,        // [(n_heads + 2 n_kv) * hd] this token's projections
    __half* __restrict__ k_cache,         // [max_ctx][n_kv][hd] this layer
    __half* __restrict__ v_cache,
    const int* __restrict__ state,        // state[STATE_POS] = pos
    const float* __restrict__ rope_cos,   // [max_ctx][hd/2]
    const float* __restrict__ rope_sin,
    int n_heads, int n_kv, int hd,
    float* __restrict__ part_o,           // global merge: [n_heads][S][hd] unnormalised partial outputs
    float* __restrict__ part_ml,          // global merge: [n_heads][S][2] partial (max, sum), log2 domain
    unsigned int* __restrict__ counters,  // global merge: [n_kv] zero between launches
    int window,                           // sliding window (positions), 0: full causal attention
    float* __restrict__ out)              // [n_heads * hd]
{
    TI_PROBE;
    extern __shared__ __align__(16) unsigned char smem[];
    const int kvh = blockIdx.x, s = blockIdx.y, S = gridDim.y;
    const int group = n_heads / n_kv;
    // PDL: pos and the cached rows before it were written by earlier graph replays, so only qkv (the
    // previous kernel's output) waits; the staging copies overlap that kernel's tail.
    pdl_launch_dependents();
    const int pos = state[STATE_POS];
    const int len = pos + 1, lo = first_key(pos, window);

    // This block's slice [begin, end) of the rows lo .. pos: empty for s >= active, which on the
    // cluster path still takes part in the merge.
    const int per_slice = ceil_div(ceil_div(len - lo, S), ATT_GRANULE) * ATT_GRANULE;
    const int active = ceil_div(len - lo, per_slice);
    if (!ATT_USE_CLUSTER && s >= active) return;
    const int begin = min(len, lo + s * per_slice), end = min(len, begin + per_slice);
    const int stage = ATT_STAGE_HALVES / hd;                  // rows staged at once
    const int stride = hd + 8;                                // staged row length (halves), bank padding
    const int pieces = hd >> 3;
    const int parts = max(1, (int)blockDim.x / (group * pieces));   // p . V row parts

    // Shared memory (offsets in floats, every region 16-byte aligned). Mirrored by shared_bytes in
    // attention.py.
    float* q_s = reinterpret_cast<float*>(smem);                      // [group][hd] rotated, scaled q
    float* sc = q_s + group * hd;                                     // [group][stage] scores, probabilities
    float* head_m = sc + ((group * stage + 3) & ~3);                  // [group] running max
    float* head_l = head_m + group;                                   // [group] running sum
    float* head_corr = head_l + group;                                // [group] this chunk's rescale
    float* blk_o = head_m + ((3 * group + 3) & ~3);                   // [group][hd] block result (cluster)
    float* blk_ml = blk_o + group * hd;                               // [group][2]
    float* merge_w = blk_ml + ((2 * group + 3) & ~3);                 // [ATT_MERGE_HEADS][S] (global merge)
    __half* kv_new = reinterpret_cast<__half*>(merge_w + ((ATT_MERGE_HEADS * S + 3) & ~3));   // [2][hd]
    __half* k_s = kv_new + 2 * hd;                                    // [stage][stride]
    __half* v_s = k_s + stage * stride;                               // [stage][stride]
    float* part_sum = reinterpret_cast<float*>(k_s);                  // [parts][group][hd] after the last chunk
                                                                      // (the host sizes the region for both)

    stage_rows(k_s, v_s, stride, k_cache, v_cache, n_kv, hd, kvh, begin, min(end, begin + stage), pos);
    pdl_wait();
    TI_MARK(1);
    if (begin < end) {
        rope_and_append(qkv, k_cache, v_cache, rope_cos, rope_sin, n_heads, n_kv, hd, kvh, pos, end == len, q_s,
                        kv_new);
        TI_MARK(2);                                                  // q rotated (thread 0's part)
        for (int h = threadIdx.x; h < group; h += blockDim.x) {
            head_m[h] = -TI_INF;
            head_l[h] = 0.f;
        }
        PvItem items[ATT_MAX_ITEMS];
        float acc[ATT_MAX_ITEMS][8];
#pragma unroll
        for (int k = 0; k < ATT_MAX_ITEMS; ++k) {
            items[k] = pv_item(threadIdx.x + k * blockDim.x, hd, group, parts);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[k][i] = 0.f;
        }
        for (int c0 = begin; c0 < end; c0 += stage) {
            const int c1 = min(end, c0 + stage), n = c1 - c0;
            if (c0 != begin) {
                __syncthreads();                                     // everyone is done with the last chunk
                stage_rows(k_s, v_s, stride, k_cache, v_cache, n_kv, hd, kvh, c0, c1, pos);
            }
            copies_landed();
            __syncthreads();                                         // kv_new, q_s, head_m/l written
            if (c0 == begin) TI_MARK(3);                             // the first chunk staged
            stage_new_row(k_s, v_s, stride, kv_new, hd, c0, c1, pos);
            __syncthreads();
            chunk_scores(q_s, k_s, stride, hd, group, n, stage, sc);
            __syncthreads();
            chunk_softmax(sc, group, n, stage, head_m, head_l, head_corr);
            __syncthreads();
#pragma unroll
            for (int k = 0; k < ATT_MAX_ITEMS; ++k) chunk_pv(items[k], parts, sc, v_s, stride, n, stage, head_corr, acc[k]);
        }
        TI_MARK(4);                                                  // the slice's chunks done
        __syncthreads();                                             // the staging area becomes part_sum
#pragma unroll
        for (int k = 0; k < ATT_MAX_ITEMS; ++k) {
            if (!items[k].live) continue;
            float4* dst = reinterpret_cast<float4*>(part_sum + (items[k].part * group + items[k].h) * hd + 8 * items[k].d8);
            dst[0] = make_float4(acc[k][0], acc[k][1], acc[k][2], acc[k][3]);
            dst[1] = make_float4(acc[k][4], acc[k][5], acc[k][6], acc[k][7]);
        }
        __syncthreads();
        // The block's result per (head, dim): unnormalised sum, with the head's running max and sum.
        for (int i = threadIdx.x; i < group * hd; i += blockDim.x) {
            const int hg = i / hd, d = i % hd;
            float num = 0.f;
            for (int p = 0; p < parts; ++p) num += part_sum[p * group * hd + i];
            const size_t head = (size_t)kvh * group + hg;
            if (active == 1) {            // the whole context in one slice: normalise and finish
                out[head * hd + d] = num / head_l[hg];
            } else if (ATT_USE_CLUSTER) {
                blk_o[i] = num;
                if (d == 0) {
                    blk_ml[2 * hg] = head_m[hg];
                    blk_ml[2 * hg + 1] = head_l[hg];
                }
            } else {
                part_o[(head * S + s) * hd + d] = num;
                if (d == 0) {
                    part_ml[(head * S + s) * 2] = head_m[hg];
                    part_ml[(head * S + s) * 2 + 1] = head_l[hg];
                }
            }
        }
    }
    TI_MARK(5);                       // the block's result written; what follows is the merge (to mark 9)
#if ATT_USE_CLUSTER
    if (active == 1) return;          // the same for every block of the cluster: no barrier waits alone
    cluster_sync();                   // every block's partial result is in its shared memory
    merge_cluster(blk_o, blk_ml, kvh, group, hd, s, S, active, out);
    cluster_sync();                   // peers keep their shared memory until everyone has read it
#else
    if (active == 1) return;
    __threadfence();                  // partials visible to whichever block merges
    __syncthreads();
    __shared__ bool is_last;
    if (threadIdx.x == 0) is_last = atomicAdd(&counters[kvh], 1u) == (unsigned)(active - 1);
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    merge_slices(part_o, part_ml, kvh, group, hd, S, active, merge_w, out);
    if (threadIdx.x == 0) counters[kvh] = 0u;
#endif
}

// ------------------------------------------------------------------------------- rows in registers
//
// attention_rows: the same step (RoPE, KV append, causal softmax(q k^T) v) with one block per
// QUERY head over the whole context, grid (n_kv, group). Each K/V row is then read by the `group`
// blocks of its KV head (from L2 after the first) instead of once per group, and in exchange
// nothing goes through shared memory until the end, no barrier separates scores, softmax and
// p . V, and no slices are merged (the chunked kernel above pays ~5 block-wide phases per chunk and
// a cluster merge; for TinyLlama's 8 heads per KV head this kernel makes the step faster,
// kernels/README.md "Attention kernels"):
// - a row belongs to a lane group of L lanes (L = hd/8 rounded up to a power of two; lane `piece`
//   holds dims 8 piece .. 8 piece + 7, one 16-byte load of K and one of V), the rows dealt
//   round-robin to the block's RG lane groups;
// - each pass holds `group_rows` (<= ATT_ROW_REGS, from the host) rows per lane group in
//   registers; the first pass's rows below pos are loaded before the PDL wait (cached rows are
//   written by earlier steps), later passes after it;
// - each lane group keeps its own FlashAttention state (max m and sum l in the log2 domain, 8
//   unnormalised output dims) over its rows; the lane groups of a warp merge by shuffles, then the
//   warps through shared memory.
// Row pos is this step's: every block rotates k itself (no block waits for another), and the
// block of the group's first head writes it to the cache.
#define ATT_ROW_REGS 8          // K/V rows per lane group per pass, held in registers

// Dims 8 piece .. 8 piece + 7 of x (hd values, an activation: coherent loads) after rotate-half
// RoPE with the tables of one position. hd is a multiple of 8, so hd/2 is one of 4 and each half
// of the piece lies on one side of hd/2, its partners and table entries 4 contiguous, aligned
// values: four dims at a time (which also keeps registers low).
TI_DEVICE void rope_piece(const float* x, const float* cos_p, const float* sin_p, int hd, int piece,
                          float (&out)[8]) {
    const int half = hd >> 1;
#pragma unroll
    for (int j = 0; j < 8; j += 4) {
        const int d = 8 * piece + j;
        const bool lower = d < half;
        const int i = lower ? d : d - half, partner = lower ? d + half : d - half;
        const float sign = lower ? -1.f : 1.f;
        const float4 a = load_activation4(x + d), b = load_activation4(x + partner);
        const float4 c = load_activation4(cos_p + i), s = load_activation4(sin_p + i);
        out[j] = a.x * c.x + sign * b.x * s.x;
        out[j + 1] = a.y * c.y + sign * b.y * s.y;
        out[j + 2] = a.z * c.z + sign * b.z * s.z;
        out[j + 3] = a.w * c.w + sign * b.w * s.w;
    }
}

TI_DEVICE uint4 pack8(const float (&v)[8]) {
    return make_uint4(pack_half2(v[0], v[1]), pack_half2(v[2], v[3]), pack_half2(v[4], v[5]), pack_half2(v[6], v[7]));
}

// FlashAttention state (m, l, o) += (m2, l2, o2); m = -inf marks an empty state.
TI_DEVICE void flash_merge(float& m, float& l, float (&o)[8], float m2, float l2, const float (&o2)[8]) {
    const float top = fmaxf(m, m2);
    const float f1 = m == -TI_INF ? 0.f : exp2f(m - top);
    const float f2 = m2 == -TI_INF ? 0.f : exp2f(m2 - top);
    l = l * f1 + l2 * f2;
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = o[e] * f1 + o2[e] * f2;
    m = top;
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) attention_rows(
    const float* __restrict__ qkv,        // [(n_heads + 2 n_kv) * hd] this token's projections
    __half* __restrict__ k_cache,         // [max_ctx][n_kv][hd] this layer
    __half* __restrict__ v_cache,
    const int* __restrict__ state,        // state[STATE_POS] = pos
    const float* __restrict__ rope_cos,   // [max_ctx][hd/2]
    const float* __restrict__ rope_sin,
    int n_heads, int n_kv, int hd, int max_ctx,
    int group_rows,                       // rows per lane group per pass, <= ATT_ROW_REGS
    int window,                           // sliding window (positions), 0: full causal attention
    float* __restrict__ out)              // [n_heads * hd]
{
    TI_PROBE;
    __shared__ float warp_o[ATT_THREADS / 32][256];      // each warp's state: output dims, (m, l)
    __shared__ float warp_ml[ATT_THREADS / 32][2];
    const int kvh = blockIdx.x, group = n_heads / n_kv, head = kvh * group + blockIdx.y;
    const int pieces = hd >> 3;
    int L = 1;
    while (L < pieces) L <<= 1;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int piece = threadIdx.x & (L - 1), lg = threadIdx.x / L, RG = blockDim.x / L;
    const bool has_piece = piece < pieces;

    // Lane group lg of a pass starting at row `first` holds rows first + lg + i RG, i < group_rows.
    // Lanes past the head's pieces load its last piece; later passes clamp rows past the cache to
    // its end (never used).
    const u32 row_stride = (u32)(n_kv * hd);               // halves; one layer's cache < 4 G values
    const int src_piece = min(piece, pieces - 1);
    const __half* k_src = k_cache + kvh * hd + 8 * src_piece;
    const __half* v_src = v_cache + kvh * hd + 8 * src_piece;
    uint4 kr[ATT_ROW_REGS], vr[ATT_ROW_REGS];
    auto load_rows = [&](int first) {
#pragma unroll
        for (int i = 0; i < ATT_ROW_REGS; ++i) {
            if (i >= group_rows) break;
            const u32 r = (u32)min(first + lg + i * RG, max_ctx - 1);
            kr[i] = load_cached_piece(k_src + r * row_stride);
            vr[i] = load_cached_piece(v_src + r * row_stride);
        }
    };
    pdl_launch_dependents();
    const int pos = state[STATE_POS], len = pos + 1, lo = first_key(pos, window);
    // The first pass (from row lo): cached rows below pos only. The wait is made to depend (by a
    // branch no compiler can resolve, always taken) on the last row loaded: else ptxas schedules
    // griddepcontrol.wait right after the load of pos, above these loads, whose addresses need
    // pos (seen in the SASS; tests/test_cuda_compile.py checks it).
    int last_loaded = -1;
#pragma unroll
    for (int i = 0; i < ATT_ROW_REGS; ++i) {
        if (i >= group_rows) break;
        const int r = lo + lg + i * RG;
        if (r < pos) {
            kr[i] = load_cached_piece(k_src + (u32)r * row_stride);
            vr[i] = load_cached_piece(v_src + (u32)r * row_stride);
            last_loaded = r;
        }
    }
    asm volatile("" : "+r"(last_loaded));                    // opaque: the branch below stays
    if (last_loaded != (int)0x80000000) pdl_wait();
    TI_MARK(1);

    // This step's k (rotated) and v, rounded to fp16 as the cache stores them (the block of the
    // group's first head writes them there, last), and q, rotated and scaled to the log2 domain:
    // their loads go out together, one round trip (with the cache store before the q loads, ptxas
    // kept those below it: two round trips; staging them through shared memory was slower still).
    const float* cos_p = rope_cos + (size_t)pos * (hd >> 1);
    const float* sin_p = rope_sin + (size_t)pos * (hd >> 1);
    float q[8] = {};
    uint4 k_new = make_uint4(0u, 0u, 0u, 0u), v_new = k_new;
    if (has_piece) {
        float kv[8];
        rope_piece(qkv + (size_t)(n_heads + kvh) * hd, cos_p, sin_p, hd, piece, kv);
        k_new = pack8(kv);
        const float* v_now = qkv + (size_t)(n_heads + n_kv + kvh) * hd + 8 * piece;
        unpack8(load_activation4(v_now), load_activation4(v_now + 4), kv);
        v_new = pack8(kv);
        rope_piece(qkv + (size_t)head * hd, cos_p, sin_p, hd, piece, q);
        const float q_scale = 1.4426950408889634f * rsqrtf((float)hd);
#pragma unroll
        for (int e = 0; e < 8; ++e) q[e] *= q_scale;
        if (blockIdx.y == 0) {
            *reinterpret_cast<uint4*>(k_cache + (size_t)pos * row_stride + kvh * hd + 8 * piece) = k_new;
            *reinterpret_cast<uint4*>(v_cache + (size_t)pos * row_stride + kvh * hd + 8 * piece) = v_new;
        }
    }
    // Row pos into its register slot, in whichever pass holds it.
    auto place_new_row = [&](int first) {
#pragma unroll
        for (int i = 0; i < ATT_ROW_REGS; ++i)
            if (i < group_rows && pos == first + lg + i * RG) {
                kr[i] = k_new;
                vr[i] = v_new;
            }
    };
    place_new_row(lo);
    TI_TOUCH(__float_as_uint(q[0]));
    TI_MARK(2);                                                   // q has landed (thread 0)
#ifdef TI_TIMELINE
    {   // diagnostic: every thread waits for its first-pass rows, then the block meets
        u32 sink = 0u;
#pragma unroll
        for (int i = 0; i < ATT_ROW_REGS; ++i)
            if (i < group_rows && lo + lg + i * RG < pos) sink ^= kr[i].x ^ vr[i].w;
        asm volatile("" ::"r"(sink));
        __syncthreads();
    }
#endif
    TI_MARK(3);                                                   // every first-pass row has landed

    float m = -TI_INF, l = 0.f, o[8] = {};
    bool later = false;                  // a pass after the first (a predicate: lo held in a register spilled)
    for (int first = lo; first < len; first += group_rows * RG, later = true) {
        if (later) {
            load_rows(first);
            place_new_row(first);
        }
        float sc[ATT_ROW_REGS];
#pragma unroll
        for (int i = 0; i < ATT_ROW_REGS; ++i) {
            const int r = i < group_rows ? first + lg + i * RG : len;
            float dot = 0.f;
            if (has_piece && r < len) {
                float kf[8];
                unpack8(kr[i], kf);
#pragma unroll
                for (int e = 0; e < 8; ++e) dot = fmaf(q[e], kf[e], dot);
            }
            sc[i] = dot;
        }
        // The lane group's sums, one shuffle level for all rows at a time: the rows' shuffles are
        // independent, so they overlap instead of forming one chain per row.
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            if (off >= L) break;
#pragma unroll
            for (int i = 0; i < ATT_ROW_REGS; ++i) sc[i] += __shfl_xor_sync(0xffffffffu, sc[i], off);
        }
#pragma unroll
        for (int i = 0; i < ATT_ROW_REGS; ++i)
            if ((i < group_rows ? first + lg + i * RG : len) >= len) sc[i] = -TI_INF;
        float top = m;
#pragma unroll
        for (int i = 0; i < ATT_ROW_REGS; ++i) top = fmaxf(top, sc[i]);
        if (top == -TI_INF) continue;                             // this lane group has no rows here
        const float corr = m == -TI_INF ? 0.f : exp2f(m - top);
        l *= corr;
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] *= corr;
#pragma unroll
        for (int i = 0; i < ATT_ROW_REGS; ++i) {
            if (sc[i] == -TI_INF) continue;
            const float p = exp2f(sc[i] - top);
            l += p;
            if (!has_piece) continue;
            float vf[8];
            unpack8(vr[i], vf);
#pragma unroll
            for (int e = 0; e < 8; ++e) o[e] = fmaf(p, vf[e], o[e]);
        }
        m = top;
    }
    TI_MARK(4);                                                   // the rows done (thread 0's lane group)

    // Lane groups of a warp, then the warps.
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        if (off < L) continue;
        float o2[8];
        const float m2 = __shfl_xor_sync(0xffffffffu, m, off), l2 = __shfl_xor_sync(0xffffffffu, l, off);
#pragma unroll
        for (int e = 0; e < 8; ++e) o2[e] = __shfl_xor_sync(0xffffffffu, o[e], off);
        flash_merge(m, l, o, m2, l2, o2);
    }
    if (lane < L && has_piece)
#pragma unroll
        for (int e = 0; e < 8; ++e) warp_o[warp][8 * piece + e] = o[e];
    if (lane == 0) {
        warp_ml[warp][0] = m;
        warp_ml[warp][1] = l;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        // Unrolled over the most warps a block has, so the shared-memory reads go out together.
        float top = -TI_INF;
#pragma unroll
        for (int w = 0; w < ATT_THREADS / 32; ++w)
            if (w < nwarps) top = fmaxf(top, warp_ml[w][0]);
        float num = 0.f, den = 0.f;
#pragma unroll
        for (int w = 0; w < ATT_THREADS / 32; ++w) {
            if (w >= nwarps) break;
            const float f = warp_ml[w][0] == -TI_INF ? 0.f : exp2f(warp_ml[w][0] - top);
            num += warp_o[w][d] * f;
            den += warp_ml[w][1] * f;
        }
        out[(size_t)head * hd + d] = num / den;
    }
}

// ------------------------------------------------------------------------------- tensor cores
//
// attention_mma: the same step (RoPE, KV append, causal softmax(q k^T) v) with one block per KV
// HEAD for groups of at most 8 query heads and head_dim 64 or 128, its products on the tensor
// cores (mma.m16n8k16, fp32 accumulation). Each K/V row is read once for the whole group (as in
// the chunked kernel), and as in attention_rows the rows stay in registers, every global load is
// 16 bytes and nothing goes through shared memory until the warps merge at the end.
//
// Work. Warp w holds, per pass, BLOCKS blocks of 16 rows (PASS_ROWS a block: 256 for head_dim 64,
// 128 for 128); the first pass's rows below pos and the position's RoPE rows are loaded before the
// PDL wait. Each warp keeps a FlashAttention state per head over its rows; the warps merge through
// shared memory.
//
// Context split (Hopper and newer: the grid is n_kv * S blocks launched in clusters of S along x,
// S = gridDim.x / n_kv; the backend runs it from attention.py's long_from on). The S blocks of a
// KV head share its rows: warp w of block `slice` is warp w S + slice of the KV head, so consecutive
// row blocks go to different blocks and a shorter context still spreads over them. A pass then
// covers S * PASS_ROWS rows, all loaded before the PDL wait: each later pass costs a dependent round
// trip, which is what made long contexts slow (kernels/README.md, "Context split"). Block 0 merges
// the blocks' states (at the end of the kernel), unless it holds every row.
//
// Fragments (lane (g, t) of a warp, g = lane / 4, t = lane % 4):
// - A (16 rows) holds each head twice: row h the fp16 value of its rotated, scaled q, row h + 8 the
//   rounding error of that value (q = hi + lo), so the score C[h] + C[h + 8] is as exact as with
//   fp32 q. The probabilities P (A of p . V) are split the same way.
// - K and V rows are B operands. For row g of each 8-row tile, lane t loads the 16-byte pieces at
//   dims 32 i + 8 t (i < hd / 32), and the mma's k index is permuted to match:
//   scores: k step (i, h) (hd / 16 of them) takes words 2h and 2h + 1 of piece i: logical k 2t, 2t+1
//           is dim 32 i + 8 t + 4 h + {0, 1}, and 2t+8, 2t+9 is + {2, 3}. q is permuted alike, so
//           q . k is unchanged.
//   p . V:  word w of piece i of the 8 rows, transposed by movmatrix, is the B fragment of output
//           tile (i, w) (rows 2t, 2t+1, dim 32 i + 8 (g / 2) + 2 w + g % 2), so lane (g, t) ends
//           with dims 32 i + 8 t + 2 w + {0, 1} of head g.
// Row pos is this step's: every lane rotates its dims of k (RoPE pairs d and d + hd/2 lie in the
// same lane), and the lanes of warp 0 with g = 0 write the row to the cache.
#define MMA_WARPS 8             // warps per block
#define MMA_MAX_GROUP 8         // query heads per KV head (A rows 8-15 carry the low halves)

// Dims 8 t + 32 i .. + 7 (i < PIECES / 2) of one row of a RoPE table (cos or sin of one position),
// which the backend writes once: read-only for the kernel's life, so they may load before the PDL wait.
template <int PIECES>
TI_DEVICE void load_rope_row(const float* row, int t, float (&out)[PIECES / 2][8]) {
#pragma unroll
    for (int i = 0; i < PIECES / 2; ++i) {
        const float4* p = reinterpret_cast<const float4*>(row + 32 * i + 8 * t);
        unpack8(__ldg(p), __ldg(p + 1), out[i]);
    }
}

// Dims 32 i + 8 t + e (e < 8) of one head's vector x after rotate-half RoPE with the tables of one
// position, for every piece i: the partner of piece i is piece i +- PIECES/2 of the same lane.
template <int PIECES>
TI_DEVICE void rope_pieces(const float (&x)[PIECES][8], const float (&c)[PIECES / 2][8],
                           const float (&s)[PIECES / 2][8], float (&out)[PIECES][8]) {
#pragma unroll
    for (int i = 0; i < PIECES; ++i) {
        const bool lower = i < PIECES / 2;
        const int partner = lower ? i + PIECES / 2 : i - PIECES / 2, ti = lower ? i : partner;
#pragma unroll
        for (int e = 0; e < 8; ++e)
            out[i][e] = lower ? x[i][e] * c[ti][e] - x[partner][e] * s[ti][e]
                              : x[i][e] * c[ti][e] + x[partner][e] * s[ti][e];
    }
}

template <int HD>
TI_DEVICE void attention_mma_body(const float* __restrict__ qkv, __half* __restrict__ k_cache,
                                  __half* __restrict__ v_cache, const int* __restrict__ state,
                                  const float* __restrict__ rope_cos, const float* __restrict__ rope_sin,
                                  int n_heads, int n_kv, int max_ctx, int window, float* __restrict__ out) {
    constexpr int PIECES = HD / 32;          // 16-byte pieces of a row per lane
    constexpr int BLOCKS = 128 / HD;         // 16-row blocks per warp per pass
    constexpr int WARP_ROWS = 16 * BLOCKS;
    constexpr int PASS_ROWS = MMA_WARPS * WARP_ROWS;
    constexpr int TILES = HD / 8;            // output tiles of p . V, tile 4 i + w
    // (Aligned for its float2 stores: declared 4-byte aligned, it was 8-byte aligned only by being
    // placed first; in an experimental kernel a one-byte shared flag went first and they faulted.)
    __shared__ __align__(16) float warp_o[MMA_WARPS][MMA_MAX_GROUP][HD];   // each warp's unnormalised output
    __shared__ float warp_ml[MMA_WARPS][MMA_MAX_GROUP][2];   // and its (max, sum) per head
    TI_PROBE;
    extern __shared__ __align__(16) float gathered[];          // context split, block 0: the blocks' states
    const int S = gridDim.x / n_kv, kvh = blockIdx.x / S, slice = blockIdx.x % S, group = n_heads / n_kv;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int kv_warp = warp * S + slice;                     // this warp's place among the KV head's
    const u32 row_stride = (u32)(n_kv * HD);               // halves; one layer's cache < 4 G values
    const __half* k_src = k_cache + kvh * HD + 8 * t;
    const __half* v_src = v_cache + kvh * HD + 8 * t;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

    // Rows of this warp in a pass from `first`: block b, tile n (8 rows), lane row g.
    auto row_of = [&](int first, int b, int n) { return first + kv_warp * WARP_ROWS + 16 * b + 8 * n + g; };
    uint4 kr[BLOCKS][2][PIECES], vr[BLOCKS][2][PIECES];

    pdl_launch_dependents();
    const int pos = state[STATE_POS], len = pos + 1, lo = first_key(pos, window);
    // The first pass (from row lo): cached rows below pos (the others are zeros: 0 * NaN would poison the
    // products; row pos is this step's, placed below). As in attention_rows, the loads sit in
    // branches of a loop with a bound the compiler cannot resolve (never reached: rows past the
    // cache are not below pos) and the wait depends on the last row loaded: else ptxas predicates
    // the loads and schedules griddepcontrol.wait above them (seen in the SASS;
    // tests/test_cuda_compile.py checks it).
    const int opaque_tiles = (max_ctx + 7) >> 3;
    int last_loaded = -1;
#pragma unroll
    for (int b = 0; b < BLOCKS; ++b)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int i = 0; i < PIECES; ++i) kr[b][n][i] = vr[b][n][i] = zero;
#pragma unroll
    for (int bn = 0; bn < 2 * BLOCKS; ++bn) {
        if (bn >= opaque_tiles) break;
        const int b = bn >> 1, n = bn & 1, r = row_of(lo, b, n);
        if (r < pos) {
#pragma unroll
            for (int i = 0; i < PIECES; ++i) {
                kr[b][n][i] = load_cached_piece(k_src + (u32)r * row_stride + 32 * i);
                vr[b][n][i] = load_cached_piece(v_src + (u32)r * row_stride + 32 * i);
            }
            last_loaded = r;
        }
    }
    asm volatile("" : "+r"(last_loaded));                    // opaque: the branch below stays
    // Blocks holding rows (block `slice` holds row block `slice`): one alone writes the output as
    // without the split; else all S meet in the merge (every block of a cluster calls its barriers).
    const int active = min(S, (len - lo + WARP_ROWS - 1) / WARP_ROWS);
    if (active == 1 && slice > 0) return;
    // The position's RoPE rows, before the wait too (read-only tables): after it, only this step's
    // q, k and v are read (kernels/README.md, "Attention kernels").
    float c[PIECES / 2][8], s[PIECES / 2][8];
    load_rope_row<PIECES>(rope_cos + (size_t)pos * (HD / 2), t, c);
    load_rope_row<PIECES>(rope_sin + (size_t)pos * (HD / 2), t, s);
    if (active > 1) cluster_arrive_relaxed();                 // pairs with the wait before the merge's stores
    if (last_loaded != (int)0x80000000) pdl_wait();
    TI_MARK(1);

    // This step's q (head g; zero rows for heads past the group), k and v: every load first, one
    // round trip.
    float q[PIECES][8], k[PIECES][8], v[PIECES][8];
    const float* q_head = qkv + (size_t)(kvh * group + min(g, group - 1)) * HD + 8 * t;
    const float* k_now = qkv + (size_t)(n_heads + kvh) * HD + 8 * t;
    const float* v_now = qkv + (size_t)(n_heads + n_kv + kvh) * HD + 8 * t;
#pragma unroll
    for (int i = 0; i < PIECES; ++i) {
        load8_activation(q_head + 32 * i, q[i]);
        load8_activation(k_now + 32 * i, k[i]);
        load8_activation(v_now + 32 * i, v[i]);
    }
    float rotated[PIECES][8];
    uint4 k_new[PIECES], v_new[PIECES];
    rope_pieces<PIECES>(k, c, s, rotated);
#pragma unroll
    for (int i = 0; i < PIECES; ++i) {
        k_new[i] = pack8(rotated[i]);
        v_new[i] = pack8(v[i]);
    }
    rope_pieces<PIECES>(q, c, s, rotated);
    const float q_scale = g < group ? 1.4426950408889634f * rsqrtf((float)HD) : 0.f;   // log2(e) / sqrt(hd)
    u32 qa[PIECES][2][4];                    // A fragments of k step (i, h)
#pragma unroll
    for (int i = 0; i < PIECES; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            split_half2(rotated[i][4 * h] * q_scale, rotated[i][4 * h + 1] * q_scale, qa[i][h][0], qa[i][h][1]);
            split_half2(rotated[i][4 * h + 2] * q_scale, rotated[i][4 * h + 3] * q_scale, qa[i][h][2], qa[i][h][3]);
        }
    if (slice == 0 && warp == 0 && g == 0) {     // the cache row, after every load (one round trip)
#pragma unroll
        for (int i = 0; i < PIECES; ++i) {
            *reinterpret_cast<uint4*>(k_cache + (size_t)pos * row_stride + kvh * HD + 32 * i + 8 * t) = k_new[i];
            *reinterpret_cast<uint4*>(v_cache + (size_t)pos * row_stride + kvh * HD + 32 * i + 8 * t) = v_new[i];
        }
    }
    auto place_new_row = [&](int first) {
#pragma unroll
        for (int b = 0; b < BLOCKS; ++b)
#pragma unroll
            for (int n = 0; n < 2; ++n)
                if (row_of(first, b, n) == pos)
#pragma unroll
                    for (int i = 0; i < PIECES; ++i) {
                        kr[b][n][i] = k_new[i];
                        vr[b][n][i] = v_new[i];
                    }
    };
    place_new_row(lo);
    TI_MARK(2);                                                   // q has landed (thread 0)
    TI_MARK(3);

    float m = -TI_INF, l = 0.f;              // head g: running max (log2 domain), this lane's share of the sum
    float o[TILES][4];                       // C fragments of p . V: rows g (P hi) and g + 8 (P lo)
#pragma unroll
    for (int j = 0; j < TILES; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    for (int first = lo; first < len; first += S * PASS_ROWS) {
        if (first + kv_warp * WARP_ROWS >= len) break;            // (uniform across the warp)
        if (first != lo) {                    // later passes: rows below len except pos (this step's)
#pragma unroll
            for (int b = 0; b < BLOCKS; ++b)
#pragma unroll
                for (int n = 0; n < 2; ++n) {
                    const int r = row_of(first, b, n);
                    const bool cached = r < len && r != pos;
#pragma unroll
                    for (int i = 0; i < PIECES; ++i) {
                        kr[b][n][i] = cached ? load_cached_piece(k_src + (u32)r * row_stride + 32 * i) : zero;
                        vr[b][n][i] = cached ? load_cached_piece(v_src + (u32)r * row_stride + 32 * i) : zero;
                    }
                }
            place_new_row(first);
        }
        // Scores: sc[b][n] = C of tile n (rows 2t, 2t+1 of the tile for head g: hi + lo parts).
        float p[BLOCKS][2][2];
        float top = -TI_INF;
#pragma unroll
        for (int b = 0; b < BLOCKS; ++b)
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                float sc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int i = 0; i < PIECES; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        mma_16816(sc, qa[i][h][0], qa[i][h][1], qa[i][h][2], qa[i][h][3],
                                  word_of(kr[b][n][i], 2 * h), word_of(kr[b][n][i], 2 * h + 1));
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int r = first + kv_warp * WARP_ROWS + 16 * b + 8 * n + 2 * t + e;
                    p[b][n][e] = r < len ? sc[e] + sc[2 + e] : -TI_INF;
                    top = fmaxf(top, p[b][n][e]);
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
        for (int b = 0; b < BLOCKS; ++b) {
            u32 pa[4];                       // A of p . V over the block's 16 rows
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                const float p0 = exp2f(p[b][n][0] - m_new), p1 = exp2f(p[b][n][1] - m_new);
                l += p0 + p1;
                split_half2(p0, p1, pa[2 * n], pa[2 * n + 1]);
            }
#pragma unroll
            for (int i = 0; i < PIECES; ++i)
#pragma unroll
                for (int w = 0; w < 4; ++w)
                    mma_16816(o[4 * i + w], pa[0], pa[1], pa[2], pa[3], transpose8x8(word_of(vr[b][0][i], w)),
                              transpose8x8(word_of(vr[b][1][i], w)));
        }
    }
    TI_MARK(4);                                                   // the rows done (thread 0's warp)

    // The warps' states through shared memory, then each output merged over the warps.
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
    // Split: every block's state (sum, max and denominator per head) goes into block 0's shared
    // memory, `gathered` [S][group * hd] then [S][group][2], where block 0 alone waits for it and
    // merges. (A merge where each block read its peers' states took two cluster barriers, the second
    // to keep the states alive until read, and was slower: kernels/README.md, "Context split".)
    float* gathered_ml = gathered + S * group * HD;
    if (active > 1) cluster_wait();                           // every block of the cluster runs
    for (int idx = threadIdx.x; idx < group * HD; idx += blockDim.x) {
        const int h = idx / HD, d = idx % HD;
        float top = -TI_INF;
#pragma unroll
        for (int w = 0; w < MMA_WARPS; ++w) top = fmaxf(top, warp_ml[w][h][0]);
        float num = 0.f, den = 0.f;
#pragma unroll
        for (int w = 0; w < MMA_WARPS; ++w) {
            const float mw = warp_ml[w][h][0];
            const float f = mw == -TI_INF ? 0.f : exp2f(mw - top);
            num += warp_o[w][h][d] * f;
            den += warp_ml[w][h][1] * f;
        }
        if (active == 1) {
            out[(size_t)(kvh * group + h) * HD + d] = num / den;
        } else if (slice < active) {         // (blocks past `active` hold no rows)
            *peer_shared(gathered + slice * group * HD + idx, 0) = num;
            if (d == 0) {
                *peer_shared(gathered_ml + (slice * group + h) * 2, 0) = top;
                *peer_shared(gathered_ml + (slice * group + h) * 2 + 1, 0) = den;
            }
        }
    }
    if (active == 1) return;                 // the same for every block of the cluster
    cluster_arrive();                        // (release) this block's stores into block 0
    if (slice > 0) return;
    cluster_wait();                          // (acquire) every block's state has landed
    for (int idx = threadIdx.x; idx < group * HD; idx += blockDim.x) {
        const int h = idx / HD;
        float top = -TI_INF;
        for (int j = 0; j < active; ++j) top = fmaxf(top, gathered_ml[(j * group + h) * 2]);
        float num = 0.f, den = 0.f;
        for (int j = 0; j < active; ++j) {   // every active block has rows: its max is finite
            const float f = exp2f(gathered_ml[(j * group + h) * 2] - top);
            num += gathered[j * group * HD + idx] * f;
            den += gathered_ml[(j * group + h) * 2 + 1] * f;
        }
        out[(size_t)kvh * group * HD + idx] = num / den;
    }
}

#define TI_ATTENTION_MMA(HD)                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, 1) attention_mma##HD(                        \
        const float* __restrict__ qkv, __half* __restrict__ k_cache, __half* __restrict__ v_cache,            \
        const int* __restrict__ state, const float* __restrict__ rope_cos, const float* __restrict__ rope_sin, \
        int n_heads, int n_kv, int max_ctx, int window, float* __restrict__ out) {                            \
        attention_mma_body<HD>(qkv, k_cache, v_cache, state, rope_cos, rope_sin, n_heads, n_kv, max_ctx,      \
                               window, out);                                                                  \
    }
TI_ATTENTION_MMA(64)
TI_ATTENTION_MMA(128)
