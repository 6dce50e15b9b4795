// Prefill: a chunk of T prompt tokens through one layer at a time, as matrix-matrix work.
//
// The linear layers are cuBLAS fp16 GEMMs (fp32 accumulation and output), launched from Python;
// the kernels here feed and connect them:
//
//   embed_rows      token ids -> x [T][dim] float32 (the residual stream stays float32)
//   rmsnorm_rows    x -> rms_norm(x) * w as fp16 [T][dim]            (GEMM input)
//   dequant_q4/q8   a quantized matrix (row-major or in 8-row blocks) -> fp16 [rows][kpad]
//                   (GEMM weight, once per chunk)
//   rope_store      qkv [T][(nh + 2 nkv) hd] float32 (+ Qwen2's Q/K/V bias) -> q fp16 [nh][T][hd]
//                   (rotated, pre-scaled), rotated k and v written to the fp16 KV cache at positions
//                   start..start+T-1
//   attention       causal flash attention of the chunk's queries against the cache (within the
//                   sliding window, where the model has one) -> fp16 [T][nh hd]
//   swiglu_rows     gate_up [T][2 ffn] float32 -> silu(gate) * up as fp16 [T][ffn]
//
// Rounding matches the decode path: GEMM inputs and the KV cache are fp16, everything else fp32.
// Plain kernels are extern "C" (looked up by name); the attention template through NVRTC name expressions.
#include "common.cuh"

// x[t][k] = table[ids[t]][k] as float32. Grid (T), any block size.
extern "C" __global__ void embed_rows(const void* __restrict__ table, int encoding, int cols_pad, int dim,
                                      const int* __restrict__ ids, float* __restrict__ x)
{
    const size_t row = (size_t)ids[blockIdx.x] * cols_pad;
    float* out = x + (size_t)blockIdx.x * dim;
    for (int k = threadIdx.x; k < dim; k += blockDim.x) out[k] = embedding_value(table, encoding, row + k);
}

// out[t][k] = x[t][k] * rsqrt(mean_k x[t]^2 + eps) * w[k], rounded to fp16. Grid (T), block 256.
extern "C" __global__ void __launch_bounds__(256) rmsnorm_rows(const float* __restrict__ x, const float* __restrict__ w,
                                                    int dim, float eps, __half* __restrict__ out)
{
    __shared__ float scratch[32];
    const float* row = x + (size_t)blockIdx.x * dim;
    float ss = 0.f;
    for (int k = threadIdx.x; k < dim; k += blockDim.x) ss += row[k] * row[k];
    ss = block_sum(ss, scratch);
    const float scale = rsqrtf(ss / (float)dim + eps);
    __half* o = out + (size_t)blockIdx.x * dim;
    for (int k = threadIdx.x; k < dim; k += blockDim.x) o[k] = __float2half_rn(row[k] * scale * w[k]);
}

// out[t][k] = silu(gu[t][k]) * gu[t][ffn + k] as fp16, over n = T * ffn elements (grid-stride).
extern "C" __global__ void swiglu_rows(const float* __restrict__ gu, int ffn, size_t n, __half* __restrict__ out)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / ffn, k = i % ffn;
        const float gate = gu[t * 2 * ffn + k];
        out[i] = __float2half_rn(gate / (1.f + expf(-gate)) * gu[t * 2 * ffn + ffn + k]);
    }
}

// Column c (0 .. COLS-1) of the 16 stored bytes `words` of one row, as the integer the file
// stores: q4 packs 32 columns as nibble pairs (low nibble first, stored as q + 8), q8 16 signed bytes.
template <int COLS>
__device__ __forceinline__ int stored_int(const u32 (&words)[4], int c) {
    if (COLS == 32) return (int)((words[c >> 3] >> (4 * (c & 7))) & 0xF) - 8;
    return (int)(signed char)(words[c >> 2] >> (8 * (c & 3)));
}

// A q4 (COLS = 32) or q8 (COLS = 16) matrix, rows x kpad with one fp16 scale per G columns -> fp16
// rows x kpad. One thread per 16 stored bytes = COLS columns of one row, all in one group (G is a
// multiple of COLS). Each weight is q * scale computed in float32 and rounded once to fp16.
// `blocked`: values and scales in the CUDA backend's 8-row blocks (kernels/layout.py).
template <int COLS>
__device__ __forceinline__ void dequant(const unsigned char* __restrict__ w, const __half* __restrict__ scales,
                                        int rows, int kpad, int group, int blocked, __half* __restrict__ out)
{
    const size_t per_row = (size_t)kpad / COLS, row_bytes = per_row * 16, groups = kpad / group;
    const size_t n = (size_t)rows * per_row;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / per_row, piece = i % per_row, col0 = piece * COLS, byte = piece * 16;
        const size_t scale_at = blocked ? blocked_scale_row(r, groups) + col0 / group * 8 : r * groups + col0 / group;
        const size_t value_at = blocked ? blocked_value_row(r, row_bytes) + blocked_value_column(byte) : r * row_bytes + byte;
        const float s = __half2float(scales[scale_at]);
        const uint4 packed = *reinterpret_cast<const uint4*>(w + value_at);
        const u32 words[4] = {packed.x, packed.y, packed.z, packed.w};
        uint4* dst = reinterpret_cast<uint4*>(out + r * (size_t)kpad + col0);
#pragma unroll
        for (int q = 0; q < COLS / 8; ++q) {   // 8 columns per output uint4
            float v[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = (float)stored_int<COLS>(words, 8 * q + e) * s;
            dst[q] = make_uint4(pack_half2(v[0], v[1]), pack_half2(v[2], v[3]), pack_half2(v[4], v[5]),
                                pack_half2(v[6], v[7]));
        }
    }
}

extern "C" __global__ void dequant_q4(const unsigned char* __restrict__ w, const __half* __restrict__ scales,
                                      int rows, int kpad, int group, int blocked, __half* __restrict__ out)
{
    dequant<32>(w, scales, rows, kpad, group, blocked, out);
}

extern "C" __global__ void dequant_q8(const unsigned char* __restrict__ w, const __half* __restrict__ scales,
                                      int rows, int kpad, int group, int blocked, __half* __restrict__ out)
{
    dequant<16>(w, scales, rows, kpad, group, blocked, out);
}

// RoPE (rotate-half, tables [ctx][hd/2]) for the chunk's q and k, the cache append of k and v,
// and q as fp16 [n_heads][T][hd] multiplied by q_scale = log2(e)/sqrt(hd) (the attention kernel
// works in base 2). `bias` (nullptr: none) is added to q, k and v first: the GEMM before has no
// epilogue of ours, and this kernel reads every value anyway. Grid (T), block 256. The k rotation
// is the decode kernel's expression.
extern "C" __global__ void __launch_bounds__(256) rope_store(
    const float* __restrict__ qkv, const float* __restrict__ bias, int T, int start, int n_heads, int n_kv, int hd,
    const float* __restrict__ rope_cos, const float* __restrict__ rope_sin, float q_scale,
    __half* __restrict__ q_out, __half* __restrict__ k_cache, __half* __restrict__ v_cache)
{
    const int t = blockIdx.x, pos = start + t, half_hd = hd >> 1;
    const float* row = qkv + (size_t)t * (n_heads + 2 * n_kv) * hd;
    auto value = [&](int i) { return bias ? row[i] + bias[i] : row[i]; };   // column i of the row
    const float* cos_p = rope_cos + (size_t)pos * half_hd;
    const float* sin_p = rope_sin + (size_t)pos * half_hd;
    for (int i = threadIdx.x; i < n_heads * half_hd; i += blockDim.x) {
        const int h = i / half_hd, d = i % half_hd;
        const float a = value(h * hd + d), b = value(h * hd + d + half_hd);
        __half* q = q_out + ((size_t)h * T + t) * hd;
        q[d] = __float2half_rn((a * cos_p[d] - b * sin_p[d]) * q_scale);
        q[d + half_hd] = __float2half_rn((b * cos_p[d] + a * sin_p[d]) * q_scale);
    }
    const size_t cache_row = (size_t)pos * n_kv * hd;
    const int k0 = n_heads * hd, v0 = (n_heads + n_kv) * hd;     // columns of k and v in the row
    for (int i = threadIdx.x; i < n_kv * half_hd; i += blockDim.x) {
        const int h = i / half_hd, d = i % half_hd;
        const float a = value(k0 + h * hd + d), b = value(k0 + h * hd + d + half_hd);
        k_cache[cache_row + h * hd + d] = __float2half_rn(a * cos_p[d] - b * sin_p[d]);
        k_cache[cache_row + h * hd + d + half_hd] = __float2half_rn(b * cos_p[d] + a * sin_p[d]);
    }
    for (int i = threadIdx.x; i < n_kv * hd; i += blockDim.x) v_cache[cache_row + i] = __float2half_rn(value(v0 + i));
}

// Causal attention of a chunk's queries against the KV cache, FlashAttention-2 style.
//
// Block (query tile, head): 4 warps x 16 query rows. The block walks the key positions
// 0 .. start + (its last query) in tiles of 64 (with a sliding window of W positions, from the tile
// holding its first query's first key, start + q0 - W + 1; keys before a row's window are masked).
// K and V tiles are copied row-major into shared
// memory with cp.async, the next tile's copies in flight while the current one is used (two
// buffers, dynamic shared memory: attention_shared_bytes in prefill.py). S = Q K^T and O += P V run
// on the tensor cores (mma m16n8k16, fp32 accumulation; two k8 halves on Turing): K's B fragments
// are 32-bit loads, V's come from ldmatrix.trans. Each row keeps a running max and sum (base 2: q is
// pre-scaled by log2(e)/sqrt(hd)). P is rounded to fp16 for its mma. Query tiles are visited
// last-first so the longest blocks start first.
//
// Fragment layout (lane = 4 g + t): A rows g / g+8, columns 2t,2t+1 (+8); B column g, rows
// 2t,2t+1 (+8); C rows g / g+8, columns 2t, 2t+1.
#define FA_BQ 64
#define FA_BK 64
#define FA_WARPS 4

template <int HD>
__global__ void __launch_bounds__(FA_WARPS * 32) attention_prefill(
    const __half* __restrict__ q,         // [n_heads][T][HD]
    const __half* __restrict__ k_cache,   // [ctx][n_kv][HD] this layer, positions < start + T valid
    const __half* __restrict__ v_cache,
    int T, int start, int n_heads, int n_kv,
    int window,                           // sliding window (positions), 0: full causal attention
    __half* __restrict__ out)             // [T][n_heads * HD]
{
    static_assert(HD % 16 == 0 && HD <= 128, "head_dim must be a multiple of 16, at most 128");
    constexpr int KSTEPS = HD / 16;       // mma k-steps over the head dimension (S = Q K^T)
    constexpr int DTILES = HD / 8;        // 8-wide output column tiles (O = P V)
    constexpr int NTILES = FA_BK / 8;     // 8-wide key tiles of S
    constexpr int KS = HD + 8;            // padded smem row stride (halves): conflict-free loads and ldmatrix
    extern __shared__ __align__(16) unsigned char fa_smem[];
    __half* k_s = reinterpret_cast<__half*>(fa_smem);  // [2][FA_BK][KS]: [buffer][key][dim]
    __half* v_s = k_s + 2 * FA_BK * KS;                // [2][FA_BK][KS]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int head = blockIdx.y, kvh = head / (n_heads / n_kv);
    const int q0 = (gridDim.x - 1 - blockIdx.x) * FA_BQ;
    const int q_last = min(q0 + FA_BQ, T) - 1;            // last real query row of the block
    const int key_end = start + q_last + 1;               // keys [key_begin, key_end) are needed
    const int key_begin = window > 0 ? max(0, start + q0 - window + 1) : 0;
    const int row0 = q0 + warp * 16;                      // this warp's first query row
    const int pos_lo = start + row0 + g, pos_hi = pos_lo + 8;   // positions of this lane's two rows
    const size_t cache_stride = (size_t)n_kv * HD;

    // Q fragments for the warp's 16 rows (rows >= T read as zero).
    u32 qa[KSTEPS][4];
    {
        const __half* q_head = q + (size_t)head * T * HD;
        const int r_lo = row0 + g, r_hi = r_lo + 8;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            const int c = kk * 16 + 2 * t4;
            qa[kk][0] = r_lo < T ? *reinterpret_cast<const u32*>(q_head + (size_t)r_lo * HD + c) : 0u;
            qa[kk][1] = r_hi < T ? *reinterpret_cast<const u32*>(q_head + (size_t)r_hi * HD + c) : 0u;
            qa[kk][2] = r_lo < T ? *reinterpret_cast<const u32*>(q_head + (size_t)r_lo * HD + c + 8) : 0u;
            qa[kk][3] = r_hi < T ? *reinterpret_cast<const u32*>(q_head + (size_t)r_hi * HD + c + 8) : 0u;
        }
    }

    float o[DTILES][4];
#pragma unroll
    for (int j = 0; j < DTILES; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m_lo = -TI_INF, m_hi = -TI_INF, l_lo = 0.f, l_hi = 0.f;

    const __half* k_head = k_cache + (size_t)kvh * HD;
    const __half* v_head = v_cache + (size_t)kvh * HD;
    // Copy key tile `tile` into buffer `buf`; keys past key_end are zero (finite, and masked below).
    auto load_tile = [&](int tile, int buf) {
        const int k0 = tile * FA_BK;
        for (int i = threadIdx.x; i < FA_BK * HD / 8; i += blockDim.x) {
            const int r = i / (HD / 8), c = (i % (HD / 8)) * 8;
            __half* kd = k_s + (buf * FA_BK + r) * KS + c;
            __half* vd = v_s + (buf * FA_BK + r) * KS + c;
            if (k0 + r < key_end) {
                copy16_async(kd, k_head + (size_t)(k0 + r) * cache_stride + c);
                copy16_async(vd, v_head + (size_t)(k0 + r) * cache_stride + c);
            } else {
                *reinterpret_cast<uint4*>(kd) = make_uint4(0u, 0u, 0u, 0u);
                *reinterpret_cast<uint4*>(vd) = make_uint4(0u, 0u, 0u, 0u);
            }
        }
        copies_commit();
    };
    const int first_tile = key_begin / FA_BK, n_tiles = (key_end + FA_BK - 1) / FA_BK;
    const int warp_first = start + row0, warp_last = warp_first + 15;   // positions of the warp's rows
    load_tile(first_tile, first_tile & 1);
    for (int tile = first_tile; tile < n_tiles; ++tile) {
        const int k0 = tile * FA_BK, buf = tile & 1;
        if (tile + 1 < n_tiles) {
            load_tile(tile + 1, buf ^ 1);     // that buffer's last reader finished before the barrier below
            copies_landed_but<1>();
        } else {
            copies_landed_but<0>();
        }
        __syncthreads();
        const __half* kb = k_s + buf * FA_BK * KS;
        const __half* vb = v_s + buf * FA_BK * KS;
        // Else every key is after every row of this warp, or before every row's window.
        if (k0 <= warp_last && (window == 0 || k0 + FA_BK - 1 > warp_first - window)) {
            // S = Q K^T for 16 rows x 64 keys.
            float s[NTILES][4];
#pragma unroll
            for (int j = 0; j < NTILES; ++j) {
                s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
                const __half* kr = kb + (j * 8 + g) * KS + 2 * t4;
#pragma unroll
                for (int kk = 0; kk < KSTEPS; ++kk) {
                    const u32 b0 = *reinterpret_cast<const u32*>(kr + kk * 16);
                    const u32 b1 = *reinterpret_cast<const u32*>(kr + kk * 16 + 8);
                    mma_16816(s[j], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b0, b1);
                }
            }
            // Causal mask where the tile reaches past the warp's first row.
            if (k0 + FA_BK - 1 > start + row0) {
#pragma unroll
                for (int j = 0; j < NTILES; ++j) {
                    const int key = k0 + j * 8 + 2 * t4;
                    if (key > pos_lo) s[j][0] = -TI_INF;
                    if (key + 1 > pos_lo) s[j][1] = -TI_INF;
                    if (key > pos_hi) s[j][2] = -TI_INF;
                    if (key + 1 > pos_hi) s[j][3] = -TI_INF;
                }
            }
            // Sliding window where the tile starts before the window of the warp's last row.
            if (window > 0 && k0 <= warp_last - window) {
                const int lo_lo = pos_lo - window + 1, lo_hi = pos_hi - window + 1;   // first keys of the two rows
#pragma unroll
                for (int j = 0; j < NTILES; ++j) {
                    const int key = k0 + j * 8 + 2 * t4;
                    if (key < lo_lo) s[j][0] = -TI_INF;
                    if (key + 1 < lo_lo) s[j][1] = -TI_INF;
                    if (key < lo_hi) s[j][2] = -TI_INF;
                    if (key + 1 < lo_hi) s[j][3] = -TI_INF;
                }
            }
            // Online softmax: the four lanes t4 = 0..3 of a row hold its 64 scores between them.
            float mx_lo = -TI_INF, mx_hi = -TI_INF;
#pragma unroll
            for (int j = 0; j < NTILES; ++j) {
                mx_lo = fmaxf(mx_lo, fmaxf(s[j][0], s[j][1]));
                mx_hi = fmaxf(mx_hi, fmaxf(s[j][2], s[j][3]));
            }
            mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
            mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
            mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
            mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
            const float new_lo = fmaxf(m_lo, mx_lo), new_hi = fmaxf(m_hi, mx_hi);
            const float base_lo = new_lo == -TI_INF ? 0.f : new_lo;   // a row with no key yet stays at zero
            const float base_hi = new_hi == -TI_INF ? 0.f : new_hi;
            const float corr_lo = exp2f(m_lo - base_lo), corr_hi = exp2f(m_hi - base_hi);
            m_lo = new_lo;
            m_hi = new_hi;
            float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
            for (int j = 0; j < NTILES; ++j) {
                s[j][0] = exp2f(s[j][0] - base_lo);
                s[j][1] = exp2f(s[j][1] - base_lo);
                s[j][2] = exp2f(s[j][2] - base_hi);
                s[j][3] = exp2f(s[j][3] - base_hi);
                sum_lo += s[j][0] + s[j][1];
                sum_hi += s[j][2] + s[j][3];
            }
            l_lo = l_lo * corr_lo + sum_lo;                   // per-lane partial sums, reduced at the end
            l_hi = l_hi * corr_hi + sum_hi;
#pragma unroll
            for (int j = 0; j < DTILES; ++j) {
                o[j][0] *= corr_lo;
                o[j][1] *= corr_lo;
                o[j][2] *= corr_hi;
                o[j][3] *= corr_hi;
            }
            // O += P V: P's C-fragments of key tiles 2kk, 2kk+1 are exactly the A-fragment of k-step kk.
#pragma unroll
            for (int kk = 0; kk < FA_BK / 16; ++kk) {
                const u32 a0 = pack_half2(s[2 * kk][0], s[2 * kk][1]);
                const u32 a1 = pack_half2(s[2 * kk][2], s[2 * kk][3]);
                const u32 a2 = pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                const u32 a3 = pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
                // ldmatrix.trans: lane L points at key kk*16 + 8 (m & 1) + L % 8 (m = L / 8) of dim tile
                // j + (m >> 1), so registers 0/1 are dim tile j's B fragment and 2/3 tile j+1's.
                const int m = lane >> 3;
                const __half* vrow = vb + (kk * 16 + (m & 1) * 8 + (lane & 7)) * KS + (m >> 1) * 8;
#pragma unroll
                for (int j = 0; j < DTILES; j += 2) {
                    u32 b0, b1, b2, b3;
                    ldmatrix_x4_trans(b0, b1, b2, b3, vrow + j * 8);
                    mma_16816(o[j], a0, a1, a2, a3, b0, b1);
                    mma_16816(o[j + 1], a0, a1, a2, a3, b2, b3);
                }
            }
        }
        __syncthreads();                                  // buffer buf is refilled two tiles on
    }

    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
    const int r_lo = row0 + g, r_hi = r_lo + 8;
    const size_t out_stride = (size_t)n_heads * HD;
#pragma unroll
    for (int j = 0; j < DTILES; ++j) {
        const int c = head * HD + j * 8 + 2 * t4;
        if (r_lo < T)
            *reinterpret_cast<u32*>(out + (size_t)r_lo * out_stride + c) = pack_half2(o[j][0] / l_lo, o[j][1] / l_lo);
        if (r_hi < T)
            *reinterpret_cast<u32*>(out + (size_t)r_hi * out_stride + c) = pack_half2(o[j][2] / l_hi, o[j][3] / l_hi);
    }
}

// The head sizes of the Llama family, compiled ahead so an offline nvcc build checks them;
// others are instantiated at run time through NVRTC name expressions.
template __global__ void attention_prefill<64>(const __half*, const __half*, const __half*, int, int, int, int, int,
                                               __half*);
template __global__ void attention_prefill<128>(const __half*, const __half*, const __half*, int, int, int, int, int,
                                                __half*);
