// Decode attention for one layer: RoPE, KV-cache append and causal softmax(q k^T) v, in one kernel.
//
// Grid (n_kv_heads, S). Block (kvh, s) serves the `group` query heads that share KV head kvh over
// a slice of the context; the slices are cut at run time from the current length pos+1 (read from
// device memory, so a captured graph stays valid as the context grows), and blocks whose slice is
// empty exit at once. Scores use one lane per position of a 32-position tile and a running
// (max, sum, output) per head as in FlashAttention, in the log2 domain.
//
// Two ways to get K/V rows, chosen by the host from the shape:
//   TILE = true : grouped-query attention. The block copies each 32-row K/V tile to shared memory
//                 once (16-byte loads) and every head of the group reads it there: one HBM read
//                 serves `group` heads. Warps take heads.
//   TILE = false: multi-head attention, where a row serves one head and staging it would be pure
//                 overhead. Warps take tiles (split-K inside the block) and read K/V rows straight
//                 from global memory; their partial results are combined in shared memory.
// With more than one active slice, each block writes its unnormalised partial result and the last
// block to finish for a KV head (an atomic counter) merges the slices: no separate merge launch.
//
// RoPE: q is rotated here; the block whose slice holds `pos` rotates k, writes k and v (fp16) to
// the cache and uses the same fp16 values for this step. Rotation is rotate-half with cos/sin
// tables [max_context][hd/2].
#include "common.cuh"

#define ATT_TILE 32
#define ATT_MAX_DPL 8   // head_dim / 32 rounded up: head_dim <= 256

// q . k for one cached row (fp16 pairs), two accumulators to halve the dependency chain.
__device__ __forceinline__ float row_dot(const float* q, const __half2* kr, int half_hd) {
    float even = 0.f, odd = 0.f;
#pragma unroll 8
    for (int d2 = 0; d2 < half_hd; ++d2) {
        const float2 kf = __half22float2(kr[d2]);
        even += q[2 * d2] * kf.x;
        odd += q[2 * d2 + 1] * kf.y;
    }
    return even + odd;
}

// One tile of positions for one head, in one warp: update (m, l) and this lane's output dims.
// key_row(j) / value_row(j) give the fp16 rows of tile position j (j < n_valid).
template <typename KeyRow, typename ValueRow>
__device__ __forceinline__ void attend_tile(const float* q, int hd, int n_valid, KeyRow key_row, ValueRow value_row,
                                            float& m, float& l, float (&o)[ATT_MAX_DPL]) {
    const int lane = threadIdx.x & 31;
    const float score = lane < n_valid ? row_dot(q, key_row(lane), hd >> 1) : -TI_INF;
    const float m_new = fmaxf(m, warp_max(score));
    const float p = lane < n_valid ? exp2f(score - m_new) : 0.f;
    const float correction = exp2f(m - m_new);     // 0 on the first tile (m = -inf)
    l = l * correction + warp_sum(p);
    m = m_new;
#pragma unroll
    for (int i = 0; i < ATT_MAX_DPL; ++i) o[i] *= correction;
#pragma unroll 8
    for (int j = 0; j < n_valid; ++j) {
        const float pj = __shfl_sync(0xffffffffu, p, j);
        const __half* vr = value_row(j);
#pragma unroll
        for (int i = 0; i < ATT_MAX_DPL; ++i) {
            const int d = lane + 32 * i;
            if (d < hd) o[i] += pj * __half2float(vr[d]);
        }
    }
}

template <bool TILE>
__global__ void __launch_bounds__(256) attention(
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
    extern __shared__ __align__(16) unsigned char smem[];
    const int kvh = blockIdx.x, s = blockIdx.y, S = gridDim.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int group = n_heads / n_kv, half_hd = hd >> 1;
    const int pos = state[STATE_POS];
    const int len = pos + 1;

    // Slice of the context for this block.
    const int n_tiles = (len + ATT_TILE - 1) / ATT_TILE;
    const int tiles_per_slice = (n_tiles + S - 1) / S;
    const int active = (n_tiles + tiles_per_slice - 1) / tiles_per_slice;
    if (s >= active) return;
    const int tile_begin = s * tiles_per_slice;
    const int tile_end = min(n_tiles, tile_begin + tiles_per_slice);

    // Shared memory (offsets in floats; every region 16-byte aligned).
    float* q_s = reinterpret_cast<float*>(smem);                      // [group][hd] rotated, scaled q
    float* o_s = q_s + group * hd;                                    // [group][hd] block result
    float* ml_s = o_s + group * hd;                                   // [group][2]
    __half* kv_new = reinterpret_cast<__half*>(ml_s + ((2 * group + 3) & ~3));   // [2][hd] this step's k, v
    float* rest = reinterpret_cast<float*>(kv_new + ((2 * hd + 7) & ~7));
    float* merge_w = rest;                                            // [nwarps][S] merge weights
    float* var = merge_w + ((nwarps * S + 3) & ~3);                   // variant-specific area

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
    const size_t row_stride = (size_t)n_kv * hd;          // cache elements per position
    const bool appends = pos >= tile_begin * ATT_TILE && pos < tile_end * ATT_TILE;
    if (appends) {                                         // this block appends the new K/V row
        const float* k = qkv + (size_t)(n_heads + kvh) * hd;
        const float* v = qkv + (size_t)(n_heads + n_kv + kvh) * hd;
        __half* k_row = k_cache + (size_t)pos * row_stride + (size_t)kvh * hd;
        __half* v_row = v_cache + (size_t)pos * row_stride + (size_t)kvh * hd;
        for (int d = threadIdx.x; d < half_hd; d += blockDim.x) {
            const float a = k[d], b = k[d + half_hd];
            const __half lo = __float2half_rn(a * cos_p[d] - b * sin_p[d]);
            const __half hi = __float2half_rn(b * cos_p[d] + a * sin_p[d]);
            k_row[d] = kv_new[d] = lo;
            k_row[d + half_hd] = kv_new[d + half_hd] = hi;
        }
        for (int d = threadIdx.x; d < hd; d += blockDim.x) v_row[d] = kv_new[hd + d] = __float2half_rn(v[d]);
    }
    __syncthreads();

    const __half* k_base = k_cache + (size_t)kvh * hd;
    const __half* v_base = v_cache + (size_t)kvh * hd;
    // Row j of a tile starting at p0: the cache, or this step's new row (read back from shared memory).
    auto cache_row = [&](const __half* base, int which, int p) -> const __half* {
        return p == pos ? kv_new + which * hd : base + (size_t)p * row_stride;
    };

    if (TILE) {
        __half2* k_tile = reinterpret_cast<__half2*>(var);                       // [32][hd/2 + 1]
        __half* v_tile = reinterpret_cast<__half*>(k_tile + ATT_TILE * (half_hd + 1));   // [32][hd]
        const int k_stride = half_hd + 1;                  // odd stride: lane-per-row reads hit 32 banks
        for (int i = threadIdx.x; i < group * hd; i += blockDim.x) o_s[i] = 0.f;
        for (int i = threadIdx.x; i < group; i += blockDim.x) {
            ml_s[2 * i] = -TI_INF;
            ml_s[2 * i + 1] = 0.f;
        }
        for (int tile = tile_begin; tile < tile_end; ++tile) {
            const int p0 = tile * ATT_TILE, n_valid = min(ATT_TILE, len - p0);
            // 16-byte copies; rows past the context are zeros.
            const int per_row = hd >> 3;
            for (int i = threadIdx.x; i < ATT_TILE * per_row; i += blockDim.x) {
                const int r = i / per_row, c8 = i % per_row;
                uint4 kv = make_uint4(0, 0, 0, 0), vv = kv;
                if (r < n_valid) {
                    kv = *reinterpret_cast<const uint4*>(cache_row(k_base, 0, p0 + r) + 8 * c8);
                    vv = *reinterpret_cast<const uint4*>(cache_row(v_base, 1, p0 + r) + 8 * c8);
                }
                u32* kd = reinterpret_cast<u32*>(k_tile + r * k_stride + 4 * c8);
                kd[0] = kv.x; kd[1] = kv.y; kd[2] = kv.z; kd[3] = kv.w;
                *reinterpret_cast<uint4*>(v_tile + r * hd + 8 * c8) = vv;
            }
            __syncthreads();
            for (int hg = warp; hg < group; hg += nwarps) {
                float o[ATT_MAX_DPL];
#pragma unroll
                for (int i = 0; i < ATT_MAX_DPL; ++i) {
                    const int d = lane + 32 * i;
                    o[i] = d < hd ? o_s[hg * hd + d] : 0.f;
                }
                float mh = ml_s[2 * hg], lh = ml_s[2 * hg + 1];
                attend_tile(q_s + hg * hd, hd, n_valid,
                            [&](int j) { return k_tile + j * k_stride; },
                            [&](int j) -> const __half* { return v_tile + j * hd; }, mh, lh, o);
#pragma unroll
                for (int i = 0; i < ATT_MAX_DPL; ++i) {
                    const int d = lane + 32 * i;
                    if (d < hd) o_s[hg * hd + d] = o[i];
                }
                __syncwarp();
                if (lane == 0) {
                    ml_s[2 * hg] = mh;
                    ml_s[2 * hg + 1] = lh;
                }
            }
            __syncthreads();   // the next tile overwrites k_tile / v_tile
        }
    } else {
        // Each warp takes tiles tile_begin + warp, + nwarps, ... for every head of the group, with
        // its own running state per head; then the warps' states are combined per head.
        float* o_w = var;                                   // [nwarps][group][hd]
        float* ml_w = o_w + nwarps * group * hd;            // [nwarps][group][2]
        for (int hg = 0; hg < group; ++hg) {
            float o[ATT_MAX_DPL];
#pragma unroll
            for (int i = 0; i < ATT_MAX_DPL; ++i) o[i] = 0.f;
            float mh = -TI_INF, lh = 0.f;
            for (int tile = tile_begin + warp; tile < tile_end; tile += nwarps) {
                const int p0 = tile * ATT_TILE, n_valid = min(ATT_TILE, len - p0);
                attend_tile(q_s + hg * hd, hd, n_valid,
                            [&](int j) { return reinterpret_cast<const __half2*>(cache_row(k_base, 0, p0 + j)); },
                            [&](int j) { return cache_row(v_base, 1, p0 + j); }, mh, lh, o);
            }
#pragma unroll
            for (int i = 0; i < ATT_MAX_DPL; ++i) {
                const int d = lane + 32 * i;
                if (d < hd) o_w[(warp * group + hg) * hd + d] = o[i];
            }
            if (lane == 0) {
                ml_w[(warp * group + hg) * 2] = mh;
                ml_w[(warp * group + hg) * 2 + 1] = lh;
            }
        }
        __syncthreads();
        for (int i = threadIdx.x; i < group * hd; i += blockDim.x) {
            const int hg = i / hd, d = i % hd;
            float m_max = -TI_INF;
            for (int w = 0; w < nwarps; ++w) m_max = fmaxf(m_max, ml_w[(w * group + hg) * 2]);
            float num = 0.f, den = 0.f;
            for (int w = 0; w < nwarps; ++w) {
                const float mw = ml_w[(w * group + hg) * 2];
                if (mw == -TI_INF) continue;              // a warp with no tile
                const float f = exp2f(mw - m_max);
                num += o_w[(w * group + hg) * hd + d] * f;
                den += ml_w[(w * group + hg) * 2 + 1] * f;
            }
            o_s[i] = num;
            if (d == 0) {
                ml_s[2 * hg] = m_max;
                ml_s[2 * hg + 1] = den;
            }
        }
    }
    __syncthreads();

    if (active == 1) {               // the whole context in one slice: normalise and finish
        for (int i = threadIdx.x; i < group * hd; i += blockDim.x) {
            const int hg = i / hd;
            out[(size_t)(kvh * group) * hd + i] = o_s[i] / ml_s[2 * hg + 1];
        }
        return;
    }
    for (int i = threadIdx.x; i < group * hd; i += blockDim.x) {
        const int hg = i / hd, d = i % hd;
        part_o[((size_t)(kvh * group + hg) * S + s) * hd + d] = o_s[i];
    }
    for (int hg = threadIdx.x; hg < group; hg += blockDim.x) {
        part_ml[((size_t)(kvh * group + hg) * S + s) * 2] = ml_s[2 * hg];
        part_ml[((size_t)(kvh * group + hg) * S + s) * 2 + 1] = ml_s[2 * hg + 1];
    }
    __threadfence();                 // partials visible to whichever block merges
    __syncthreads();
    __shared__ bool is_last;
    if (threadIdx.x == 0) is_last = atomicAdd(&counters[kvh], 1u) == (unsigned)(active - 1);
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // Merge the slices of each head (one warp per head): out = sum_s o_s w_s / sum_s l_s w_s with
    // w_s = 2^(m_s - M). Lanes load the slices' (m, l) in parallel; the weights go through shared memory.
    for (int hg = warp; hg < group; hg += nwarps) {
        const size_t head = (size_t)(kvh * group + hg);
        float* w = merge_w + warp * S;
        float m_lane = -TI_INF;
        for (int j = lane; j < active; j += 32) m_lane = fmaxf(m_lane, __ldcg(&part_ml[(head * S + j) * 2]));
        const float m_max = warp_max(m_lane);
        float l_lane = 0.f;
        for (int j = lane; j < active; j += 32) {
            const float f = exp2f(__ldcg(&part_ml[(head * S + j) * 2]) - m_max);
            w[j] = f;
            l_lane += __ldcg(&part_ml[(head * S + j) * 2 + 1]) * f;
        }
        const float inv_l = 1.f / warp_sum(l_lane);
        __syncwarp();
        for (int d = lane; d < hd; d += 32) {
            float num = 0.f;
#pragma unroll 4
            for (int j = 0; j < active; ++j) num += w[j] * __ldcg(&part_o[(head * S + j) * hd + d]);
            out[head * hd + d] = num * inv_l;
        }
        __syncwarp();
    }
    if (threadIdx.x == 0) counters[kvh] = 0u;
}
