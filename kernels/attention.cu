// Decode attention for one layer: RoPE, KV-cache append and causal softmax(q k^T) v, in one kernel
// (flash-decoding: the context is split over blocks, then over warps, then over lane row groups).
//
// Data: qkv [(n_heads + 2 n_kv) * hd] f32 (q heads, then k, then v); k_cache / v_cache
// [max_ctx][n_kv][hd] fp16; rope tables [max_ctx][hd/2] (rotate-half); out [n_heads * hd] f32.
//
// Grid (n_kv, S), ATT_WARPS warps per block. Block (kvh, s) serves the `group` query heads that share
// KV head kvh over slice s of the context. The slices are cut at run time from the current length
// pos+1 (read from device memory, so a captured graph stays valid as the context grows) in multiples
// of ATT_GRANULE positions, using only as many slices as that needs (`active`).
//
// Latency, not bandwidth, bounds decode attention at short contexts, so the kernel minimises the
// dependent memory round trips after pdl_wait() (each one waits behind the next kernel's weight
// prefetch): the slice's cached K/V rows are copied to shared memory (cp.async) before the wait,
// when the previous kernel may still run; only q/k/v of this token are read after it.
//
// Inside a block the heads are taken in chunks of HEADS (per pass, a K/V row in registers serves
// every head of the chunk) and the staged rows are cut into contiguous warp ranges: warp = (head
// chunk, range). In a warp, a row of hd fp16 values is read by `lpr` lanes (hd/8 rounded up to a
// power of two), 16 bytes = 8 dims per lane, so one load covers 32/lpr rows (a "row group" per row)
// and each lane takes ROWS rows per step. Scores are 8-dim partial dots summed across the row's
// lanes by shuffles; each row group keeps its own running (max, sum, 8 output dims) per head as in
// FlashAttention, in the log2 domain (q is pre-scaled by log2(e)/sqrt(hd)). Row groups merge by
// shuffles, warps through shared memory.
//
// Merging the slices. On Hopper and newer (ATT_USE_CLUSTER) the S = ATT_CLUSTER_SIZE blocks of a
// KV head form a thread-block cluster: each leaves its partial result in shared memory and, after a
// cluster barrier, merges a share of the outputs by reading its peers' shared memory (no global
// round trip, no counter). Before Hopper, each block writes its unnormalised partial result to
// global memory and the last block to finish for a KV head (an atomic counter, reset to 0 for the
// next launch) merges the slices.
//
//   TILE = true : grouped-query attention, HEADS = 4 query heads per pass over the K/V rows.
//   TILE = false: multi-head attention, HEADS = 1 (state for one head only, more rows per step).
//
// RoPE: q is rotated here; the block whose slice holds `pos` rotates k, writes k and v (fp16) to the
// cache and into its staged rows. No block reads a cache row at or beyond pos from global memory.
#include "common.cuh"

#define ATT_WARPS 4
#define ATT_GRANULE 16           // slice lengths are multiples of this many positions
#define ATT_MERGE_HEADS 8        // heads whose slice weights the merging block holds at once (global merge)
#define ATT_STAGE_HALVES 4096    // fp16 values of K (and as many of V) staged in shared memory at once:
                                 // more shared memory per block made the decode step slower (measured)
#define ATT_CLUSTER_SIZE 8       // slices per KV head on the cluster path

#ifndef ATT_USE_CLUSTER          // tests may force the global merge with -DATT_USE_CLUSTER=0
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

// The batch at p0 from the staged rows (k_s/v_s: [rows][hd] fp16 in shared memory; rows >= end read
// as zeros and are marked invalid).
template <int ROWS>
TI_DEVICE void read_batch(RowBatch<ROWS>& b, bool (&valid)[ROWS], const __half* k_s, const __half* v_s, int hd,
                          const RowLanes& r, int p0, int end) {
#pragma unroll
    for (int u = 0; u < ROWS; ++u) {
        const int p = batch_row(r, p0, u);
        valid[u] = p < end;
        b.k[u] = b.v[u] = make_uint4(0, 0, 0, 0);
        if (r.dims && valid[u]) {
            b.k[u] = reinterpret_cast<const uint4*>(k_s + (size_t)p * hd)[r.col];
            b.v[u] = reinterpret_cast<const uint4*>(v_s + (size_t)p * hd)[r.col];
        }
    }
}

// 16-byte global -> shared copy that does not hold registers until it lands (cp.async, sm_80+;
// Turing copies through registers).
TI_DEVICE void copy16_async(void* dst_shared, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const u32 dst = (u32)__cvta_generic_to_shared(dst_shared);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
#else
    *reinterpret_cast<uint4*>(dst_shared) = *reinterpret_cast<const uint4*>(src);
#endif
}

TI_DEVICE void copies_landed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// Start copying cache rows [r0, r1) of KV head kvh into k_s/v_s (row r0 at index 0). Row `pos` is
// skipped: this launch writes it (stage_new_row).
TI_DEVICE void stage_rows(__half* k_s, __half* v_s, const __half* k_cache, const __half* v_cache, int n_kv, int hd,
                          int kvh, int r0, int r1, int pos) {
    const int pieces = hd >> 3;                 // 16-byte pieces per row
    for (int i = threadIdx.x; i < (r1 - r0) * pieces; i += blockDim.x) {
        const int row = r0 + i / pieces, piece = i % pieces;
        if (row == pos) continue;
        const size_t src = ((size_t)row * n_kv + kvh) * hd + 8 * piece;
        copy16_async(k_s + (size_t)(row - r0) * hd + 8 * piece, k_cache + src);
        copy16_async(v_s + (size_t)(row - r0) * hd + 8 * piece, v_cache + src);
    }
}

// This step's K/V row (kv_new, fp16, written by rope_and_append) into its staged slot.
TI_DEVICE void stage_new_row(__half* k_s, __half* v_s, const __half* kv_new, int hd, int r0, int r1, int pos) {
    if (pos < r0 || pos >= r1) return;
    for (int i = threadIdx.x; i < (hd >> 3); i += blockDim.x) {
        reinterpret_cast<uint4*>(k_s + (size_t)(pos - r0) * hd)[i] = reinterpret_cast<const uint4*>(kv_new)[i];
        reinterpret_cast<uint4*>(v_s + (size_t)(pos - r0) * hd)[i] = reinterpret_cast<const uint4*>(kv_new + hd)[i];
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

// One warp, one chunk of heads (from h0) over staged rows [begin, end): running softmax per head,
// then the row groups merged and folded into the warp's result o_w[h][hd], ml_w[h][2] (written on
// the first staged chunk, merged into on later ones).
template <int HEADS, int ROWS>
TI_DEVICE void attend_staged(const __half* k_s, const __half* v_s, const RowLanes& r, int begin, int end,
                             const float* q_s, int hd, int h0, int group, bool first, float* o_w, float* ml_w) {
    const int lane = threadIdx.x & 31, batch = ROWS * r.rpw;
    const int nh = min(HEADS, group - h0);
    Softmax st[HEADS];
#pragma unroll
    for (int h = 0; h < HEADS; ++h) softmax_init(st[h]);
    for (int p0 = begin; p0 < end; p0 += batch) {
        RowBatch<ROWS> rows;
        bool valid[ROWS];
        read_batch(rows, valid, k_s, v_s, hd, r, p0, end);
        attend_batch(rows, valid, q_s + h0 * hd, hd, nh, r, st);
    }
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
        if (h >= nh) continue;
        merge_row_groups(st[h], r.lpr);
        float* o = o_w + (h0 + h) * hd + 8 * r.col;
        float* ml = ml_w + 2 * (h0 + h);
        if (!first) {                       // fold in the earlier chunks' result
            const float m_old = ml[0], l_old = ml[1];
            const float m_new = fmaxf(st[h].m, m_old);
            const float base = m_new == -TI_INF ? 0.f : m_new;
            const float mine = exp2f(st[h].m - base), theirs = exp2f(m_old - base);
            st[h].l = st[h].l * mine + l_old * theirs;
            if (r.dims) {
#pragma unroll
                for (int i = 0; i < 8; ++i) st[h].o[i] = st[h].o[i] * mine + o[i] * theirs;
            }
            st[h].m = m_new;
            __syncwarp();                   // every lane has read the old values
        }
        if (lane < r.lpr && r.dims) {
            reinterpret_cast<float4*>(o)[0] = make_float4(st[h].o[0], st[h].o[1], st[h].o[2], st[h].o[3]);
            reinterpret_cast<float4*>(o)[1] = make_float4(st[h].o[4], st[h].o[5], st[h].o[6], st[h].o[7]);
        }
        if (lane == 0) {
            ml[0] = st[h].m;
            ml[1] = st[h].l;
        }
    }
}

// Hopper thread-block clusters: barrier over the cluster's blocks, and the address of the same
// shared-memory variable in block `rank` of the cluster (distributed shared memory).
TI_DEVICE void cluster_sync() {
#if ATT_USE_CLUSTER
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

TI_DEVICE const float* peer_shared(const float* p, int rank) {
#if ATT_USE_CLUSTER
    u64 out;
    asm volatile("mapa.u64 %0, %1, %2;\n" : "=l"(out) : "l"(p), "r"(rank));
    return reinterpret_cast<const float*>(out);
#else
    return p;
#endif
}

// Cluster merge: output i (of the KV head's group * hd) from the partial results blk_o [group][hd]
// and blk_ml [group][2] of the `active` blocks; this block (rank s) takes every S-th share.
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
__global__ void __launch_bounds__(32 * ATT_WARPS, 3) ATT_CLUSTER_DIMS attention(
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
    float* __restrict__ out)              // [n_heads * hd]
{
    constexpr int HEADS = AttConfig<TILE>::HEADS, ROWS = AttConfig<TILE>::ROWS;
    extern __shared__ __align__(16) unsigned char smem[];
    const int kvh = blockIdx.x, s = blockIdx.y, S = gridDim.y;
    const int warp = threadIdx.x >> 5;
    const int group = n_heads / n_kv;
    // PDL: pos and the cached rows before it were written by earlier graph replays, so only qkv (the
    // previous kernel's output) waits; the staging copies overlap that kernel's tail.
    pdl_launch_dependents();
    const int pos = state[STATE_POS];
    const int len = pos + 1;

    // This block's slice [begin, end): empty for s >= active, which on the cluster path still takes
    // part in the merge.
    const int per_slice = ceil_div(ceil_div(len, S), ATT_GRANULE) * ATT_GRANULE;
    const int active = ceil_div(len, per_slice);
    if (!ATT_USE_CLUSTER && s >= active) return;
    const int begin = min(len, s * per_slice), end = min(len, begin + per_slice);
    const int stage = ATT_STAGE_HALVES / hd;                  // rows staged at once

    // This warp's work: head chunks chunk0, chunk0 + chunk_step, ... over a range of each staged chunk.
    const RowLanes r = row_lanes(hd);
    const int chunks = ceil_div(group, HEADS);
    const int parts = max(1, ATT_WARPS / chunks);             // warps sharing a head chunk
    const int part = warp % parts, chunk0 = warp / parts, chunk_step = ATT_WARPS / parts;

    // Shared memory (offsets in floats; every region 16-byte aligned since hd % 8 == 0).
    float* q_s = reinterpret_cast<float*>(smem);                      // [group][hd] rotated, scaled q
    float* o_w = q_s + group * hd;                                    // [parts][group][hd] warp results
    float* ml_w = o_w + parts * group * hd;                           // [parts][group][2]
    float* blk_o = ml_w + ((2 * parts * group + 3) & ~3);             // [group][hd] block result
    float* blk_ml = blk_o + group * hd;                               // [group][2]
    __half* kv_new = reinterpret_cast<__half*>(blk_ml + ((2 * group + 3) & ~3));   // [2][hd]
    float* merge_w = reinterpret_cast<float*>(kv_new + 2 * hd);       // [ATT_MERGE_HEADS][S] (global merge)
    __half* k_s = reinterpret_cast<__half*>(merge_w + ((ATT_MERGE_HEADS * S + 3) & ~3));   // [stage][hd]
    __half* v_s = k_s + (size_t)stage * hd;                            // [stage][hd]

    stage_rows(k_s, v_s, k_cache, v_cache, n_kv, hd, kvh, begin, min(end, begin + stage), pos);
    pdl_wait();
    if (begin < end)
        rope_and_append(qkv, k_cache, v_cache, rope_cos, rope_sin, n_heads, n_kv, hd, kvh, pos, end == len, q_s,
                        kv_new);

    for (int c0 = begin; c0 < end; c0 += stage) {
        const int c1 = min(end, c0 + stage);
        if (c0 != begin) {
            __syncthreads();                                         // every warp is done with the last chunk
            stage_rows(k_s, v_s, k_cache, v_cache, n_kv, hd, kvh, c0, c1, pos);
        }
        copies_landed();
        __syncthreads();                                             // kv_new and q_s written
        stage_new_row(k_s, v_s, kv_new, hd, c0, c1, pos);
        __syncthreads();
        const int per_part = ceil_div(ceil_div(c1 - c0, parts), r.rpw) * r.rpw;
        const int w_begin = min(c1 - c0, part * per_part), w_end = min(c1 - c0, w_begin + per_part);
        for (int chunk = chunk0; chunk < chunks; chunk += chunk_step)
            attend_staged<HEADS, ROWS>(k_s, v_s, r, w_begin, w_end, q_s, hd, chunk * HEADS, group, c0 == begin,
                                       o_w + part * group * hd, ml_w + 2 * part * group);
    }
    __syncthreads();

    // Combine the warps' ranges per head (a warp with no positions has m = -inf, weight 0); part 0
    // always has positions, so the block maximum is finite.
    if (begin < end) {
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
            } else if (ATT_USE_CLUSTER) {
                blk_o[i] = num;
                if (d == 0) {
                    blk_ml[2 * hg] = m_max;
                    blk_ml[2 * hg + 1] = den;
                }
            } else {
                part_o[(head * S + s) * hd + d] = num;
                if (d == 0) {
                    part_ml[(head * S + s) * 2] = m_max;
                    part_ml[(head * S + s) * 2 + 1] = den;
                }
            }
        }
    }
#if ATT_USE_CLUSTER
    if (active == 1) return;          // the same for every block of the cluster: no barrier waits alone
    cluster_sync();                   // every block's partial result is in its shared memory
    merge_cluster(blk_o, blk_ml, kvh, group, hd, s, S, active, out);
    cluster_sync();                   // peers keep their shared memory until everyone has read it
#else
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
#endif
}
