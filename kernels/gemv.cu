// Matrix-vector products y = W x for decode (batch 1), W encoded as in the .tinf file: f16, q8 or q4
// rows padded to `kpad` columns, with one fp16 scale per `G` columns for q8/q4. Laid out as in the
// file (row-major values, then row-major scales) or, with BLOCKED, in blocks of 8 rows
// (kernels/layout.py, where the CUDA backend rearranges the matrices after upload): then one warp's
// 16-byte loads of 8 rows read 512 contiguous bytes instead of eight 64-byte runs a row apart.
//
// Work split. A row tile is 16*RT consecutive rows; the block's warps split K into chunks (warp w
// takes chunks w, w+nwarps, ...). Per chunk a lane issues 2*NL*RT independent 16-byte loads (rows
// g and g+8 of each 16-row tile). Blocks are persistent and walk several tiles (see gemv below).
//
// Arithmetic (f16, q8). Weights are turned into fp16 values with one LOP3 per pair (q8: byte | 0x6400
// is 1024+u), their constant bias corrected once per section of x (see weight_bias), and multiplied
// on the tensor cores with mma.m16n8k16 (fp32 accumulation). The input vector x is staged once per
// block (each warp its own chunks: stage_own_chunks) in shared memory as two fp16 vectors, hi + lo
// (lo = the rounding error of hi, times LO_SCALE), in the order the mma fragments want it. The
// mma's 8 output columns hold (section, hi/lo) pairs: each lane's 16-byte load is one "section" of
// columns inside one quantization group, and B column 2t / 2t+1 carries x_hi / x_lo of section t
// only (see gemv below), so one mma yields each lane's own section's dot product, as exact as with
// fp32 x, which the lane scales by its group's scale in fp32.
//
// Arithmetic (q4): integer tensor cores. The nibbles n = q + 8 stay as they are, masked into bytes
// (low nibbles n, high ones 16 n in place: one LOP3 per 4 weights each, see tile_sums_q4), and x is
// staged per section of 32 columns as 16-bit integers x = s * (256 hi + lo) in two signed byte
// limbs with one fp32 scale s (stage_group_q4). One mma.m16n8k32 (u8 x s8, int32 accumulation,
// exact) then covers 32 columns of 16 rows where the fp16 path's covers 16, with fewer conversion
// instructions per weight; B columns 2t / 2t+1 carry the hi / lo limbs of section t, as above. The
// section's sum is put together in integers (16 times it), less the bias 16 * 8 sum(x), and scaled
// once in fp32 (add_piece_q4). x's rounding to 16 bits of its section's largest |x| (half of 2^-15
// of it) is the only approximation: ~1e-5 of a result, unless one value of a section is hundreds of
// times its neighbours.

// Fusions. RMSNorm (x * rsqrt(mean(x^2)+eps) * w): the input stage stages x * w and the sums of
// squares, and the epilogue multiplies each output by the factor (see stage_input). The epilogue
// stores y, adds it into a residual, or (for the fused [gate; up] matrix) stores
// silu(gate) * up: a tile then holds gate rows and the up rows of the same outputs (tile_row), so
// the down projection reads its input as is. One thread owns each output, so the in-place residual
// add is race-free. Where the MLP is fused (mlp.cu), the residual is also held in int64 fixed point,
// `pending`, which the fused MLP adds to with integer atomics: the input stage then normalises
// pending instead of x (IN_RMSNORM_PENDING), and the o projection's epilogue adds to pending and
// stores the sum both in x (which the fused MLP normalises) and in pending (OUT_ADD_PENDING).
// The output head also folds greedy decoding's argmax into one 64-bit word (OUT_STORE_ARGMAX,
// common.cuh argmax_key): each block keeps its best logit in warp 0 and ends with one atomicMax, so
// the sampler reads one word instead of scanning the vocabulary (the sampler clears it). Qwen2's
// Q/K/V projection adds its bias as it stores (OUT_STORE_BIAS).
#include "common.cuh"

#define W_F16 0
#define W_Q8 1
#define W_Q4 2

#define IN_PLAIN 0     // x as is
#define IN_RMSNORM 1   // rms_norm(x, aux, eps)
#define IN_RMSNORM_PENDING 2   // rms_norm(pending, aux, eps): the residual in fixed point, x unread

#define OUT_STORE 0    // y[row] = W x
#define OUT_ADD 1      // y[row] += W x
#define OUT_ADD_PENDING 3   // y[row] = pending[row] + W x, and pending[row] = y[row] in fixed point (mlp.cu)
#define OUT_SWIGLU 2   // W = [gate; up] (rows = 2F): y[i] = silu(gate_i x) * (up_i x), i < F
#define OUT_STORE_ARGMAX 4  // y[row] = W x, and *best = max(*best, argmax_key(y[row], row)) (the output head)
#define OUT_STORE_BIAS 5    // y[row] = W x + bias[row] (Qwen2's fused Q/K/V projection)

#define NL 2           // 16-byte loads per lane per row per chunk
#define MAX_WARPS 16   // warps of a wide block (gemv.py WIDE_WARPS); one float each of RMSNorm's sums, 64 zero bytes each
#define LO_SCALE 2048.f   // x's low halves are staged times this (common.cuh split_half2)

// k values covered by one 16-byte load of a row.
template <int WT> struct Weights;
template <> struct Weights<W_F16> { static constexpr int KPL = 8; };
template <> struct Weights<W_Q8>  { static constexpr int KPL = 16; };
template <> struct Weights<W_Q4>  { static constexpr int KPL = 32; };

// Staged position of column k (f16, q8): 8 halves of padding after every 64 keep the four lanes of
// a row on different shared-memory banks.
__device__ __forceinline__ int staged_index(int k) { return k + ((k >> 6) << 3); }

// A-fragment pair (k pair a0, k pair a2) for mma number `i` (0 .. KPL/4-1) of a 16-byte load.
template <int WT>
__device__ __forceinline__ void a_pair(const uint4& v, int i, u32& lo, u32& hi) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    if (WT == W_F16) {
        lo = w[2 * i];
        hi = w[2 * i + 1];
    } else {                                 // q8: 1024 + (b + 128) = 1152 + q, the bias corrected later
        const u32 u = w[i] ^ 0x80808080u;    // signed byte b -> unsigned b + 128
        lo = __byte_perm(u, 0x64646464u, 0x4140);
        hi = __byte_perm(u, 0x64646464u, 0x4342);
    }
}

// Weight bias. The q8 A fragments are the raw fp16 values of the bit trick, 1152 + q, without
// subtracting the bias: every product is q x + 1152 x, and the kernel subtracts, per section of KPL
// columns, corr = sum 1152 x computed once here. The raw products stay exact in fp32 and the sums
// carry about 2^-24 * 1152 * sum|x| of rounding, ~1e-5 of the result.
template <int WT>
__device__ __forceinline__ float weight_bias() {
    return WT == W_Q8 ? 1152.f : 0.f;
}

// Convert the input vector into fp16 shared memory, and write the bias correction of each section
// to corr. kc >= K is the staged length (a whole number of chunks); columns K..kc-1 are zero.
//
// RMSNorm is staged as x * w, without its factor rsqrt(mean(x^2) + eps): each warp writes its part of
// the sum of squares to ss_warps, and the epilogue multiplies the products by the factor
// (norm_factor). The block-wide sum (a chain of shuffles, two barriers, shared-memory reads) is
// then off the path from x's arrival to the first mma. The hi + lo split keeps about 2^-22 of each value of x * w down
// to ~3e-5 (LO_SCALE); fp16's range holds |x * w| up to 65504.
//
// Staging sits on the critical path of every GEMV (it runs after the PDL wait), and each dependent
// global round trip there costs ~0.5 us while the DRAM queue is full of weight loads. So:
// - x is loaded in batches of groups of 8 columns, every load of a batch before any use;
// - RMSNorm over at most one group per thread loads x and its norm weight in one round trip, and
//   takes the sum of squares from the same registers (stage_input);
// - when x is two groups per thread (norm_two_groups), RMSNorm's weight is copied into
//   the staging area with cp.async before the PDL wait (it is a weight, not an activation) and the
//   sum of squares comes from the same registers as the conversion: one round trip in all. The
//   area is overwritten by the staged x afterwards (a barrier orders the reads of the weight before
//   those writes), so this costs no shared memory.
// Registers are the limit: the ring of weights loaded before the wait is live here, and larger
// batches make the q4 kernels spill. (The gemv kernel stages x one warp at a time, each warp its own
// chunks: stage_own_chunks. The fused MLP, whose warps share chunks, stages it together.)
template <int IN>
__device__ __forceinline__ float input_at(const float* __restrict__ x, const long long* __restrict__ pending, int k) {
    return IN == IN_RMSNORM_PENDING ? pending_value(pending[k]) : x[k];
}

template <int IN>
__device__ __forceinline__ float stage_value(const float* __restrict__ x, const long long* __restrict__ pending,
                                             const float* __restrict__ aux, int K, int k) {
    if (k >= K) return 0.f;
    if (IN == IN_PLAIN) return x[k];
    return input_at<IN>(x, pending, k) * aux[k];
}

// Eight floats (x or the norm weight) with plain loads, after the PDL wait.
__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
    unpack8(*reinterpret_cast<const float4*>(p), *reinterpret_cast<const float4*>(p + 4), v);
}

// The input's columns k .. k+7: x, or with IN_RMSNORM_PENDING the residual in fixed point.
template <int IN>
__device__ __forceinline__ void load8_input(const float* __restrict__ x, const long long* __restrict__ pending, int k,
                                            float (&v)[8], bool coherent = false) {
    if (IN == IN_RMSNORM_PENDING) load_pending8(pending + k, v, coherent);
    else if (coherent) load8_activation(x + k, v);
    else load8(x + k, v);
}


// RMSNorm inputs of two groups of 8 per thread stage through stage_normed_early; the rest through
// stage_input.
template <int IN>
__device__ __forceinline__ bool norm_two_groups(int K) {
    return IN != IN_PLAIN && (K & 7) == 0 && K > 8 * (int)blockDim.x && K <= 16 * (int)blockDim.x;
}

// Before the PDL wait: start copying the norm weight [K] into the staging area (16-byte pieces).
__device__ __forceinline__ void prefetch_norm_weight(float* area, const float* __restrict__ aux, int K) {
    for (int i = threadIdx.x; i < (K >> 2); i += blockDim.x) copy16_async(area + 4 * i, aux + 4 * i);
}

// q4's staged input (gemv's xs and xs_lo, as the fp16 path lays them out, reused): section s (32
// columns) is 64 bytes at xs + 64 s, the hi limbs then the lo limbs, each in the order of
// mma.m16n8k32's B fragments: per 16 columns (m = 0, 1), the even columns of both 8-groups, then
// their odd columns (the order in which the nibble masks produce A bytes, see tile_sums_q4).
// Its scale / 16 and the bias 16 * 8 sum(x) (as int bits) are the float2 at xs_lo[s]: the products
// come out 16 times sum(q x) (tile_sums_q4). |16 * 8 sum(x)| <= 128 * 32 * 32512 < 2^31.
#define Q4_SECTION_BYTES 64
#define Q4_RANGE 32512.f       // 127 * 256: the hi limb (x + 128) >> 8 stays within a signed byte
#define Q4_ROUNDER 12582912.f  // 1.5 * 2^23: v + Q4_ROUNDER rounds v to an integer (stage_group_q4)

__device__ __forceinline__ float2* q4_sections(__half* xs_lo) { return reinterpret_cast<float2*>(xs_lo); }
__device__ __forceinline__ const float2* q4_sections(const __half* xs_lo) { return reinterpret_cast<const float2*>(xs_lo); }

// Value i (0..7) of group b (columns 8b .. 8b+7): `value` holds it when b < full, else the column is
// read alone (K not a multiple of 8) or is zero padding.
template <int IN>
__device__ __forceinline__ float group_value(const float* __restrict__ x, const long long* __restrict__ pending,
                                             const float* __restrict__ aux, int K, int b, int full, int groups,
                                             const float (&value)[8], int i) {
    if (b < full) return value[i];
    return b < groups ? stage_value<IN>(x, pending, aux, K, b * 8 + i) : 0.f;
}

// Group b of a q4 input to shared memory (the layout above). The four lanes of a section agree on
// its scale (the largest |x| / Q4_RANGE) and sum its integers by shuffles.
//
// This runs on every q4 GEMV's critical path (after the PDL wait), so its integer part avoids slow
// instructions: each value is rounded to an integer by adding Q4_ROUNDER, whose float sum holds
// round-to-nearest-even(v) in its low mantissa bits (exact for |v| < 2^22; here |v| <= 32512), on
// the FMA pipe instead of the conversion unit (F2I), and the limbs come out of those bits with byte
// permutes instead of a shift, mask and or per value (kernels/README.md, "q4 on integer tensor cores").
template <int IN>
__device__ __forceinline__ void stage_group_q4(__half* xs, __half* xs_lo, const float* __restrict__ x,
                                               const long long* __restrict__ pending, const float* __restrict__ aux,
                                               int K, int b, int full, int groups, const float (&value)[8]) {
    float v[8], largest = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        v[i] = group_value<IN>(x, pending, aux, K, b, full, groups, value, i);
        largest = fmaxf(largest, fabsf(v[i]));
    }
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, o));
    const float to_int = largest > 0.f ? Q4_RANGE / largest : 0.f;
    // Each value times to_int, rounded to an integer q (|q| <= 32512) by adding Q4_ROUNDER, leaves
    // the float's bits at bias + q, bias the bits of Q4_ROUNDER (0x4B400000). These have none in the low
    // 16, so the low byte of those bits is the lo limb's (q - 256 h), and byte 1 of them plus 128 is the
    // hi limb h = (q + 128) >> 8.
    u32 biased[8], total = 0u;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        biased[i] = __float_as_uint(__fmul_rn(v[i], to_int) + Q4_ROUNDER);
        total += biased[i];
    }
    int sum = (int)(total - 8u * __float_as_uint(Q4_ROUNDER));
    u32 hi[2], lo[2];      // [even columns, odd columns]: byte k holds column 2k (+ 1)
#pragma unroll
    for (int p = 0; p < 2; ++p) {
        lo[p] = __byte_perm(__byte_perm(biased[p], biased[p + 2], 0x0040),
                            __byte_perm(biased[p + 4], biased[p + 6], 0x0040), 0x5410);
        hi[p] = __byte_perm(__byte_perm(biased[p] + 128u, biased[p + 2] + 128u, 0x0051),
                            __byte_perm(biased[p + 4] + 128u, biased[p + 6] + 128u, 0x0051), 0x5410);
    }
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (b >= groups) return;
    const int section = b >> 2, in_section = b & 3;
    unsigned char* at = reinterpret_cast<unsigned char*>(xs) + Q4_SECTION_BYTES * section
                        + 16 * (in_section >> 1) + 4 * (in_section & 1);
#pragma unroll
    for (int p = 0; p < 2; ++p) {                // p: even / odd columns
        *reinterpret_cast<u32*>(at + 8 * p) = hi[p];
        *reinterpret_cast<u32*>(at + 32 + 8 * p) = lo[p];
    }
    if (in_section == 0) q4_sections(xs_lo)[section] = make_float2(largest / (16.f * Q4_RANGE), __int_as_float(128 * sum));
}

// Group b (columns 8b .. 8b+7) to shared memory: `value` holds the staged values when b < full,
// else the columns are read one by one (K not a multiple of 8) or are zero padding. Every thread
// of a warp calls this together (the section sums shuffle across lanes).
template <int WT, int IN>
__device__ __forceinline__ void stage_group(__half* xs, __half* xs_lo, float* corr, const float* __restrict__ x,
                                            const long long* __restrict__ pending, const float* __restrict__ aux,
                                            int K, int b, int full, int groups, const float (&value)[8]) {
    if (WT == W_Q4) {
        stage_group_q4<IN>(xs, xs_lo, x, pending, aux, K, b, full, groups, value);
        return;
    }
    constexpr int GROUPS_PER_SECTION = Weights<WT>::KPL / 8;
    float out[8], bias_sum = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {      // group_value written out: through it, nvcc schedules f16 and q8 differently
        float v = value[i];
        if (b >= full) v = b < groups ? stage_value<IN>(x, pending, aux, K, b * 8 + i) : 0.f;
        bias_sum += weight_bias<WT>() * v;
        out[i] = v;
    }
    // A section is GROUPS_PER_SECTION consecutive groups, held by consecutive lanes.
#pragma unroll
    for (int o = 1; o < GROUPS_PER_SECTION; o <<= 1) bias_sum += __shfl_xor_sync(0xffffffffu, bias_sum, o);
    if (b >= groups) return;
    if (WT != W_F16 && b % GROUPS_PER_SECTION == 0) corr[b / GROUPS_PER_SECTION] = bias_sum;
    // x = hi + lo / LO_SCALE, both fp16: B columns for both make the product as exact as fp32
    // inputs would (section_sum).
    u32 hi[4], lo[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) split_half2(out[2 * i], out[2 * i + 1], hi[i], lo[i], LO_SCALE);
    *reinterpret_cast<uint4*>(xs + staged_index(b * 8)) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    *reinterpret_cast<uint4*>(xs_lo + staged_index(b * 8)) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
}

// Groups [first, groups) of an RMSNorm input whose x groups all lie before `first`: zero padding.
template <int WT, int IN>
__device__ __forceinline__ void stage_padding(__half* xs, __half* xs_lo, float* corr, const float* __restrict__ x,
                                              const long long* __restrict__ pending, const float* __restrict__ aux,
                                              int K, int first, int full, int groups) {
    const float zeros[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int base = first; base < groups; base += blockDim.x)       // uniform across the block
        stage_group<WT, IN>(xs, xs_lo, corr, x, pending, aux, K, base + (int)threadIdx.x, full, groups, zeros);
}

// RMSNorm with the norm weight already in shared memory (norm_two_groups): one round trip for x.
template <int WT, int IN>
__device__ __forceinline__ void stage_normed_early(__half* xs, __half* xs_lo, float* corr, const float* __restrict__ x,
                                                   const long long* __restrict__ pending, const float* __restrict__ aux,
                                                   int K, int groups, float* ss_warps) {
    const int threads = blockDim.x, full = K >> 3;
    const float* w_s = reinterpret_cast<const float*>(xs);      // the weight, until the writes below
    float v[2][8] = {};
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int b = i * threads + (int)threadIdx.x;
        if (b < full) load8_input<IN>(x, pending, 8 * b, v[i], true);   // coherent: see load_activation4
    }
    TI_TOUCH(__float_as_uint(v[0][0]));
    TI_MARK(2);                                                 // x has landed (thread 0)
    copies_landed();
    __syncthreads();                                            // every thread's copies of the weight
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int b = i * threads + (int)threadIdx.x;
        if (b >= full) continue;
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += v[i][e] * v[i][e];
#pragma unroll
        for (int q = 0; q < 2; ++q) {          // 4 values at a time: registers are tight here
            const float4 w = reinterpret_cast<const float4*>(w_s + 8 * b)[q];
            v[i][4 * q] *= w.x;
            v[i][4 * q + 1] *= w.y;
            v[i][4 * q + 2] *= w.z;
            v[i][4 * q + 3] *= w.w;
        }
    }
    __syncthreads();                                            // every read of w_s before the writes
#pragma unroll
    for (int i = 0; i < 2; ++i)
        stage_group<WT, IN>(xs, xs_lo, corr, x, pending, aux, K, i * threads + (int)threadIdx.x, full, groups, v[i]);
    stage_padding<WT, IN>(xs, xs_lo, corr, x, pending, aux, K, 2 * threads, full, groups);
    store_warp_sum(ss, ss_warps);
}

// Group b's input (x, or the fixed-point residual) and, for RMSNorm, its norm weight, when b is a
// whole group (b < full); one round trip (stage_input, stage_own_chunks).
template <int IN>
__device__ __forceinline__ void load_group(const float* __restrict__ x, const long long* __restrict__ pending,
                                           const float* __restrict__ aux, int b, int full, float (&v)[8], float (&w)[8]) {
    if (b < full) {
        load8_input<IN>(x, pending, 8 * b, v);
        if (IN != IN_PLAIN) load8(aux + 8 * b, w);
    }
}

// The values to stage from a loaded group (x, or x * w for RMSNorm), adding the group's squares to
// RMSNorm's sum when it was loaded.
template <int IN>
__device__ __forceinline__ void input_values(const float (&v)[8], const float (&w)[8], bool loaded, float& ss,
                                             float (&value)[8]) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        if (IN != IN_PLAIN && loaded) ss += v[e] * v[e];
        value[e] = IN == IN_PLAIN ? v[e] : v[e] * w[e];
    }
}

// Groups [first, kc / 8) of x, i.e. columns [8 first, kc); first > 0 (a block of a split-K cluster
// staging its part) only for plain inputs, whose groups are independent.
template <int WT, int IN>
__device__ __forceinline__ void stage_input(__half* xs, __half* xs_lo, float* corr, const float* __restrict__ x,
                                            const long long* __restrict__ pending, const float* __restrict__ aux,
                                            int K, int first, int kc, float* ss_warps) {
    // Groups per thread per round trip: x and the norm weight of one group, or x of two. More
    // makes the q4 kernels spill (the ring of weights in flight is live here).
    constexpr int BATCH = IN != IN_PLAIN ? 1 : 2;
    const bool vector = (K & 7) == 0;          // whole, 16-byte aligned groups of 8 (buffers are aligned)
    const int groups = kc >> 3, full = vector ? (K >> 3) : 0;
    const int threads = blockDim.x, per_round = BATCH * threads;
    float v[BATCH][8], w[BATCH][8];
    auto load_batch = [&](int base) {          // every load of the batch before any use
#pragma unroll
        for (int i = 0; i < BATCH; ++i)
            load_group<IN>(x, pending, aux, base + i * threads + (int)threadIdx.x, full, v[i], w[i]);
    };
    float ss = 0.f;                            // RMSNorm: this thread's part of the sum of squares
    if (IN != IN_PLAIN && !vector) {
        for (int k = threadIdx.x; k < K; k += threads) {
            const float xk = input_at<IN>(x, pending, k);
            ss += xk * xk;
        }
    }
    for (int base = first; base < groups; base += per_round) {
        load_batch(base);
        if (base == first) {
            TI_TOUCH(__float_as_uint(v[0][0]));
            TI_MARK(2);                        // x has landed (thread 0)
        }
#pragma unroll
        for (int i = 0; i < BATCH; ++i) {
            float value[8];
            input_values<IN>(v[i], w[i], base + i * threads + (int)threadIdx.x < full, ss, value);
            stage_group<WT, IN>(xs, xs_lo, corr, x, pending, aux, K, base + i * threads + (int)threadIdx.x, full, groups,
                                value);
        }
    }
    if (IN != IN_PLAIN) store_warp_sum(ss, ss_warps);
}

// The groups of x that one warp multiplies: its chunks first_chunk, + chunk_step, ... (my_chunks of
// them; gemv's warps each keep the same chunks for every tile), staged as stage_input stages them,
// by the warp alone. The warp then needs only __syncwarp before its products: no block barrier, so
// it starts as soon as its own part of x has landed instead of waiting for every warp's
// (kernels/README.md, "Input staging"). RMSNorm's sum of
// squares covers the warp's columns; the warps' sums (ss_warps) cover x once, read after the first
// tile's barrier. The warp's groups go to its lanes in rounds of BATCH per lane; a chunk is 8, 16 or
// 32 groups (CW / 8), so a section's groups always sit on consecutive lanes of one round, as
// stage_group's shuffles need. x_landed() runs once the lane's first group is staged, i.e. once x's
// first round trip is over (gemv's STAGGER issues the rest of its first ring item there).
template <int WT, int IN, int CW, int BATCH, typename XLanded>
__device__ __forceinline__ void stage_own_chunks(__half* xs, __half* xs_lo, float* corr, const float* __restrict__ x,
                                                 const long long* __restrict__ pending, const float* __restrict__ aux,
                                                 int K, int first_chunk, int chunk_step, int my_chunks, int kc,
                                                 float* ss_warps, XLanded x_landed) {
    constexpr int GROUPS_PER_CHUNK = CW / 8;
    const int lane = threadIdx.x & 31;
    const bool vector = (K & 7) == 0;          // whole, 16-byte aligned groups of 8 (buffers are aligned)
    const int groups = kc >> 3, full = vector ? (K >> 3) : 0;
    const int total = my_chunks * GROUPS_PER_CHUNK;
    // The i-th group of the warp's list, or `groups` (nothing to stage) past its end.
    auto group_of = [&](int i) {
        return i < total ? (first_chunk + i / GROUPS_PER_CHUNK * chunk_step) * GROUPS_PER_CHUNK + i % GROUPS_PER_CHUNK
                         : groups;
    };
    float ss = 0.f;                            // RMSNorm: this lane's part of the sum of squares
    if (IN != IN_PLAIN && !vector) {
        for (int k = 0; k < my_chunks; ++k) {
            const int c0 = (first_chunk + k * chunk_step) * CW;
            for (int col = c0 + lane; col < c0 + CW && col < K; col += 32) {
                const float xk = input_at<IN>(x, pending, col);
                ss += xk * xk;
            }
        }
    }
    float v[BATCH][8], w[BATCH][8];
    for (int base = 0; base < total; base += 32 * BATCH) {      // uniform across the warp
#pragma unroll
        for (int i = 0; i < BATCH; ++i)        // every load of the round before any use
            load_group<IN>(x, pending, aux, group_of(base + i * 32 + lane), full, v[i], w[i]);
        if (base == 0) {
            TI_TOUCH(__float_as_uint(v[0][0]));
            TI_MARK(2);                        // x has landed (thread 0)
        }
#pragma unroll
        for (int i = 0; i < BATCH; ++i) {
            if (base + i * 32 >= total) break;  // uniform: the round's later slots are empty
            const int b = group_of(base + i * 32 + lane);
            float value[8];
            input_values<IN>(v[i], w[i], b < full, ss, value);
            stage_group<WT, IN>(xs, xs_lo, corr, x, pending, aux, K, b, full, groups, value);
            if (base == 0 && i == 0) x_landed();
        }
    }
    if (IN != IN_PLAIN) store_warp_sum(ss, ss_warps);
}

// Bytes reserved in front of the staged vector for the cross-warp reduction (double-buffered), in a
// split-K cluster the peer block's sums (double-buffered), and RMSNorm's per-warp sums of squares.
__device__ __forceinline__ int gemv_scratch_bytes(int nwarps, int rt, int split) {
    const int floats = (2 * nwarps * 16 * rt > 32 ? 2 * nwarps * 16 * rt : 32) + (split > 1 ? 2 * 16 * rt : 0) + MAX_WARPS;
    return (floats * 4 + 15) & ~15;
}

// A split-K block's cluster, and the clusters in the grid (see gemv). Written out at each use rather
// than held in variables: held, they changed the register allocation of the SPLIT = 1 kernels and
// slowed the step (kernels/README.md, "Split-K"); written out, their machine code is the same as it
// was before split-K existed.
template <int SPLIT>
__device__ __forceinline__ int cluster_of_block() { return (int)blockIdx.x / SPLIT; }

template <int SPLIT>
__device__ __forceinline__ int clusters_in_grid() { return (int)gridDim.x / SPLIT; }

// Row loaded by lane group g for half h of 16-row unit rt of a tile. Usually a tile is 16*RT
// consecutive rows; with OUT_SWIGLU it is 8*RT outputs, gate rows in h = 0 and the matching up rows
// (rows/2 further on) in h = 1, so the epilogue has both halves of each output.
template <int RT, int OUT>
__device__ __forceinline__ int tile_row(int tile, int rt, int h, int g, int rows) {
    if (OUT == OUT_SWIGLU) return h * (rows >> 1) + (tile * RT + rt) * 8 + g;
    return (tile * RT + rt) * 16 + 8 * h + g;
}

// Outputs of one tile.
template <int RT, int OUT>
__device__ __forceinline__ int tile_outputs() {
    return OUT == OUT_SWIGLU ? 8 * RT : 16 * RT;
}

// The products of a ring slot's piece j (the lanes' j-th 16-byte loads of rows g and g + 8 of each
// of the RT tiles) with the staged x at xp: d[rt] = A B, two mmas per 8 staged halves (see gemv).
// Each mma waits for the previous one's accumulator (~30 cycles on Hopper), so a piece's mmas in one
// chain take as many such latencies before its loads' registers are free. With one row tile the two
// mmas of each 8 halves of q8 therefore go to two accumulators, summed at the end (chains of KPL / 8
// mmas; this was measured on q4's former fp16 path, whose pieces were chains of 8); with two, the
// tiles' chains already interleave, and the second accumulator made nvcc spill. (q4 has its own,
// shorter chains: piece_products_q4.)
template <int WT, int RT>
__device__ __forceinline__ void piece_products(const uint4 (&slot)[RT][2][NL], int j, const uint4* xp,
                                               float (&d)[RT][4]) {
    constexpr bool TWO_CHAINS = WT != W_F16 && RT == 1;
    float e[RT][4];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int i = 0; i < 4; ++i) d[rt][i] = e[rt][i] = 0.f;
#pragma unroll
    for (int q = 0; q < Weights<WT>::KPL / 8; ++q) {
        const uint4 xv = xp[q];
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
            u32 g_lo, g_hi, g8_lo, g8_hi;
            a_pair<WT>(slot[rt][0][j], 2 * q, g_lo, g_hi);
            a_pair<WT>(slot[rt][1][j], 2 * q, g8_lo, g8_hi);
            mma_16816(d[rt], g_lo, g8_lo, g_hi, g8_hi, xv.x, xv.y);
            a_pair<WT>(slot[rt][0][j], 2 * q + 1, g_lo, g_hi);
            a_pair<WT>(slot[rt][1][j], 2 * q + 1, g8_lo, g8_hi);
            mma_16816(TWO_CHAINS ? e[rt] : d[rt], g_lo, g8_lo, g_hi, g8_hi, xv.z, xv.w);
        }
    }
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int i = 0; i < 4; ++i) d[rt][i] += TWO_CHAINS ? e[rt][i] : 0.f;
}

// A row's product over a section from its x_hi and x_lo columns (D[g][2t], D[g][2t+1]), less the
// weights' bias correction c.
__device__ __forceinline__ float section_sum(float d_hi, float d_lo, float c) {
    return fmaf(d_lo, 1.f / LO_SCALE, d_hi) - c;
}

// q4: one row tile's products over a section of piece j (rows g and g + 8: r0 and r8) with the staged
// limbs at xp (two uint4, m = 0, 1: {even columns of 8-groups 2m, 2m+1; their odd columns}), as
// integers (mma.m16n8k32, see the arithmetic above): 16 sum(q x_int) of each row (h = 0: row g,
// 1: g + 8), less the staged bias 16 * 8 sum(x_int); |sum| <= 16 * 15 * 32 * 32640 < 2^28. The even
// columns' nibbles n are masked down to bytes (low nibbles) and multiplied into d; the odd columns'
// are masked where they are (high nibbles: bytes of 16 n, one LOP3 per 4 weights instead of a shift
// and a LOP3) and multiplied into a second accumulator e, which then holds 16 times their products.
// The two accumulators are also two shorter mma chains (kernels/README.md, "q4 on integer tensor
// cores").
__device__ __forceinline__ void tile_sums_q4(const uint4& r0, const uint4& r8, const uint4* xp, int bias, int (&sum)[2]) {
    int d[4] = {0, 0, 0, 0}, e[4] = {0, 0, 0, 0};
    constexpr u32 LOW = 0x0F0F0F0Fu, HIGH = 0xF0F0F0F0u;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
        const uint4 xv = xp[m];
        const u32 g0 = m ? r0.z : r0.x, g1 = m ? r0.w : r0.y, h0 = m ? r8.z : r8.x, h1 = m ? r8.w : r8.y;
        mma_16832_u8s8(d, g0 & LOW, h0 & LOW, g1 & LOW, h1 & LOW, xv.x, xv.y);
        mma_16832_u8s8(e, g0 & HIGH, h0 & HIGH, g1 & HIGH, h1 & HIGH, xv.z, xv.w);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)      // D columns 2t, 2t + 1: the hi and lo limbs
        sum[h] = (((d[2 * h] << 8) + d[2 * h + 1]) << 4) + (e[2 * h] << 8) + e[2 * h + 1] - bias;
}

// q4, the register-tightest kernels (no room for tile_sums_q4's second accumulator: nvcc spills): the
// products of piece j of every row tile, the high nibbles shifted down, into one accumulator per
// tile: d[rt] = sum(n x_int) of the limb columns (D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]).
template <int RT>
__device__ __forceinline__ void piece_products_q4(const uint4 (&slot)[RT][2][NL], int j, const uint4* xp,
                                                  int (&d)[RT][4]) {
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int i = 0; i < 4; ++i) d[rt][i] = 0;
    constexpr u32 NIBBLES = 0x0F0F0F0Fu;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
        const uint4 xv = xp[m];
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
            const uint4 r0 = slot[rt][0][j], r8 = slot[rt][1][j];   // rows g, g + 8: 8-groups 0..3
            const u32 g0 = m ? r0.z : r0.x, g1 = m ? r0.w : r0.y, h0 = m ? r8.z : r8.x, h1 = m ? r8.w : r8.y;
            mma_16832_u8s8(d[rt], g0 & NIBBLES, h0 & NIBBLES, g1 & NIBBLES, h1 & NIBBLES, xv.x, xv.y);
            mma_16832_u8s8(d[rt], (g0 >> 4) & NIBBLES, (h0 >> 4) & NIBBLES, (g1 >> 4) & NIBBLES, (h1 >> 4) & NIBBLES,
                           xv.z, xv.w);
        }
    }
}

// q4: adds piece j of a ring slot (weights and their raw fp16 scales) to acc: acc[rt][h] += row's
// product over the lane's section `section` of the staged input, times its scale. mine: the
// staged input plus 32 bytes for odd g (the lo limbs; see stage_group_q4); lo: its section data.
// `feeds`: the lane feeds B (g / 2 == t), the others read the zeros at x_zeros (the same bytes for
// all: a broadcast, no branch). `inside`: false for a section past the row's end, a reload counted
// as zero. TWO_ACC: tile_sums_q4, else piece_products_q4. (f16 and q8 do the same inline in gemv and
// mlp: their machine code stays as it was.)
template <int RT, bool TWO_ACC>
__device__ __forceinline__ void add_piece_q4(const uint4 (&slot)[RT][2][NL], const unsigned short (&sc)[RT][2][NL], int j,
                                             const __half* mine, const __half* lo, const uint4* x_zeros, bool feeds,
                                             int section, bool inside, float (&acc)[RT][2]) {
    const uint4* xp = feeds ? reinterpret_cast<const uint4*>(mine + Q4_SECTION_BYTES / 2 * section) : x_zeros;
    const float2 data = q4_sections(lo)[section];
    const float x_scale = inside ? data.x : 0.f;     // (the section's scale / 16)
    const int bias = __float_as_int(data.y);         // 16 * 8 sum(x_int)
    if (TWO_ACC) {
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
            int sum[2];
            tile_sums_q4(slot[rt][0][j], slot[rt][1][j], xp, bias, sum);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float w_scale = __half2float(__ushort_as_half(sc[rt][h][j]));
                acc[rt][h] = fmaf((float)sum[h], w_scale * x_scale, acc[rt][h]);
            }
        }
        return;
    }
    int d[RT][4];
    piece_products_q4<RT>(slot, j, xp, d);
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float w_scale = __half2float(__ushort_as_half(sc[rt][h][j]));
            const int sum = (d[rt][2 * h] << 8) + d[rt][2 * h + 1] - (bias >> 4);
            acc[rt][h] = fmaf((float)sum, w_scale * (16.f * x_scale), acc[rt][h]);
        }
}

// silu(gate) * up, one output of the fused [gate; up] matrix (runtime/reference.py swiglu).
__device__ __forceinline__ float swiglu(float gate, float up) {
    return gate / (1.f + __expf(-gate)) * up;
}

// The residual that OUT_ADD(_PENDING) adds to: y[o], or with OUT_ADD_PENDING the fixed-point residual
// pending[o] (the thread that stores y[o] stores the sum back into pending[o]).
template <int OUT>
__device__ __forceinline__ float residual_at(const float* y, const long long* pending, int o) {
    return OUT == OUT_ADD_PENDING ? pending_value(__ldcg(pending + o)) : __ldcg(y + o);
}

// Persistent blocks: the grid is sized to what stays resident on the GPU, each block stages x once
// (each warp the chunks it multiplies) and then walks its row tiles (tile = blockIdx.x, + gridDim.x,
// ...). Every warp's work is the list of (tile, chunk) items; a ring of DEPTH register buffers keeps
// the loads of the next DEPTH-1 items (also across tile boundaries) in flight while the current one
// is multiplied, so the DRAM queue never drains while a block reduces a tile.
//
// Ring depth (DEPTH, 1 to 4, tuned in the decode step; the first DEPTH items load before the PDL
// wait). Timed alone, the depths barely differ; in the step a shallow ring wins for q4 and q8 while
// f16 keeps 4, so the tuner chooses the depth per role in the step. Why is not pinned down: loading
// fewer items before the wait at the same depth did not help, so it is not only the loads' place
// ahead of the input's reads; a shallow ring also holds fewer registers and keeps fewer loads in
// flight per SM while other kernels' blocks run (kernels/README.md, "Ring depth").
//
// Refill (REFILL = 1, chosen in the decode step like the depth): the ring slot just multiplied is
// reloaded inside the item, piece by piece, with predicated loads rather than after it. It wins on
// the f16 GEMVs that stream many items per warp and loses on the q4 ones with few, so the tuner
// keeps it per role (kernels/README.md, "Refill").
//
// B operand. Lane (g, t) holds A's k positions of "section" t: the 32 (q4) / 16 (q8) / 8 (f16)
// columns of its own 16-byte load, which lie in one quantization group. B column n carries x for
// section n/2 only, x_hi in even and x_lo in odd columns, so the lanes with g/2 == t feed B and
// the others feed zeros. Then D[g][2t] + D[g][2t+1] is row g's exact dot product over section t,
// held by the lane that loaded that section and knows its group scale: one mma per 16 columns.
//
// Split-K (SPLIT = 2, plain inputs, Hopper: launched in clusters of two consecutive blocks). Both
// blocks of a cluster walk the same tiles, block `rank` over its half of the chunks, and stage only
// that half of x: a long input (the down projection) then takes half the items per warp and half
// the staging per block. Block 1 stores each tile's sums into block 0's shared memory (distributed
// shared memory), and after a cluster barrier block 0 adds them to its own, always in that order,
// so the result does not depend on timing.
//
// Staggered first item (STAGGER = 1, chosen in the decode step like the depth; RMSNorm inputs whose
// warps stage their own part of x, at ring depth 1: gemv.can_stagger). Global loads land in order,
// even a load that hits L2 behind cold ones (kernels/README.md, "Staggered first item"), so x, read
// after the PDL wait, lands only after the ring loaded before it. A block that
// starts when the previous kernel has already ended (on Llama-2-7B most blocks of the RMSNorm-input
// GEMVs, whose predecessors hold every SM) then waits for its whole ring before it can stage x. With
// STAGGER only the first piece (j = 0) of the ring's first item is loaded before the wait, and its
// other pieces once x has landed (stage_own_chunks' x_landed): x waits for half an item, and the
// second half's round trip overlaps the staging. Blocks that start early lose the second half's
// head start, so the tuner decides per role (it wins on Llama-2-7B q4 and loses on TinyLlama).
//
// Block width (WIDE = 1: 16 warps, one block per SM; else at most 8 warps, two blocks per SM, the
// same 128-register cap either way). A wide block splits K over twice the warps, as a split-K
// cluster does, but sums the warps in its own shared memory. Its bounds are a separate
// instantiation: compiled for 512 threads, the 256-thread kernels measured slower in the step
// (kernels/README.md, "Block width").

template <int WT, int G, int RT, int IN, int OUT, int SPLIT, int DEPTH, int REFILL, int BLOCKED, int WIDE, int STAGGER = 0>
__global__ void __launch_bounds__(WIDE ? 512 : 256, WIDE ? 1 : 2) gemv(
    const unsigned char* __restrict__ w,     // tensor start: values, kpad columns, row-major or BLOCKED
    const __half* __restrict__ scales,       // q8/q4: [rows][kpad/G] or BLOCKED; f16: unused
    int rows, int kpad, int K,               // K: logical input length (x has K valid values)
    const float* __restrict__ x,             // input [K]
    const float* __restrict__ aux,           // IN_RMSNORM(_PENDING): norm weight [K]
    float eps,
    float* __restrict__ y,                   // output [rows] (OUT_SWIGLU: [rows / 2])
    long long* __restrict__ pending,         // IN_RMSNORM_PENDING: [K]; OUT_ADD_PENDING: [rows]; else unused
    u64* __restrict__ best,                  // OUT_STORE_ARGMAX: the running argmax key; else unused
    const float* __restrict__ bias)          // OUT_STORE_BIAS: [rows]; else unused
{
    constexpr int KPL = Weights<WT>::KPL;
    constexpr int CW = NL * 4 * KPL;                          // k per chunk
    constexpr int BYTES_PER_K2 = WT == W_Q4 ? 1 : WT == W_Q8 ? 2 : 4;   // bytes per 2 columns
    static_assert(WT == W_F16 || G % KPL == 0, "a 16-byte load must stay inside one quantization group");
    static_assert(SPLIT == 1 || (SPLIT == 2 && IN == IN_PLAIN && OUT != OUT_SWIGLU), "split-K: plain inputs, 2 blocks");
    static_assert(DEPTH >= 1 && DEPTH <= 4, "ring depth: 1 to 4 items per warp");
    static_assert(OUT != OUT_STORE_ARGMAX || RT <= 2, "the argmax: a tile's outputs in warp 0, one per lane");

    TI_PROBE;
    // Each warp stages its own part of x (stage_own_chunks), except in the kernels whose ring leaves no
    // registers for that: q4 rings refilled at depth 2 or more with an RMSNorm input (nvcc spills,
    // sm_90), which stage x together (stage_input, stage_normed_early) behind a block barrier.
    constexpr bool OWN = !(WT == W_Q4 && IN != IN_PLAIN && REFILL && DEPTH > 1);
    static_assert(!STAGGER || (OWN && IN != IN_PLAIN), "a staggered first item: RMSNorm inputs staged by each warp");
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    float* red = reinterpret_cast<float*>(smem);
    float* peer_sums = red + 2 * nwarps * 16 * RT;             // SPLIT = 2: [2][16 RT], filled by block 1
    float* ss_warps = peer_sums + (SPLIT > 1 ? 2 * 16 * RT : 0);   // RMSNorm: [nwarps] (stage_input)
    __half* xs = reinterpret_cast<__half*>(smem + gemv_scratch_bytes(nwarps, RT, SPLIT));
    if (SPLIT > 1) cluster_arrive_relaxed();   // pairs with the wait before block 1's first store into block 0

    const int nchunks = (kpad + CW - 1) / CW;
    // The block's place: its cluster walks tiles cluster, + clusters, ... (cluster_of_block,
    // clusters_in_grid) and the block, `rank` in its cluster, takes chunks [chunk0, chunk_end).
    const int rank = SPLIT > 1 ? (int)blockIdx.x % SPLIT : 0;
    const int per_rank = (nchunks + SPLIT - 1) / SPLIT;
    const int chunk0 = SPLIT > 1 ? min(rank * per_rank, nchunks) : 0;
    const int chunk_end = SPLIT > 1 ? min(chunk0 + per_rank, nchunks) : nchunks;
    // The low halves of x, same layout, 32 bytes further on so that a warp's reads of hi (even g)
    // and lo (odd g) fall on different banks.
    __half* xs_lo = xs + staged_index(nchunks * CW) + 16;
    const int ngroups = WT == W_F16 ? 1 : kpad / G;
    const u32 row_bytes32 = (u32)kpad * BYTES_PER_K2 / 2;
    const int outputs = OUT == OUT_SWIGLU ? rows >> 1 : rows;
    const int n_tiles = (outputs + tile_outputs<RT, OUT>() - 1) / tile_outputs<RT, OUT>();
    const int my_tiles = cluster_of_block<SPLIT>() < n_tiles
                             ? (n_tiles - 1 - cluster_of_block<SPLIT>()) / clusters_in_grid<SPLIT>() + 1 : 0;
    const int rank_chunks = chunk_end - chunk0;
    const int my_chunks = warp < rank_chunks ? (rank_chunks - 1 - warp) / nwarps + 1 : 0;
    const int n_items = my_tiles * my_chunks;

    const bool feeds_b = (g >> 1) == t;        // lanes that feed B (see the arithmetic above)
    const __half* x_mine = WT == W_Q4 ? xs + 16 * (g & 1) : (g & 1) ? xs_lo : xs;   // the B plane this lane reads
    // 64 zero bytes per warp (MAX_WARPS of them), which each warp writes for itself when it stages
    // its own part of x (no barrier orders another warp's writes before its reads); shared otherwise.
    uint4* zeros = reinterpret_cast<uint4*>(xs_lo + staged_index(nchunks * CW));
    uint4* x_zeros = zeros + (OWN ? 4 * warp : 0);
    if ((OWN ? lane : (int)threadIdx.x) < 4) x_zeros[lane] = make_uint4(0u, 0u, 0u, 0u);
    float* corr = reinterpret_cast<float*>(zeros + 4 * MAX_WARPS);   // [nchunks * CW / KPL] bias corrections

    uint4 wv[DEPTH][RT][2][NL];     // weights of rows g, g+8 of each 16-row tile
    unsigned short sc[DEPTH][RT][2][NL];   // their group scales (fp16 bits), raw: converting here would wait for the load

    // Where an item's loads read: value_at / scale_at [rt][h][j] for piece j (the lane's j-th 16-byte
    // load) of each row. 32-bit offsets from the tensor's start (tensors are far below 4 GB): one
    // IMAD per row and one add per load instead of 64-bit address arithmetic for each. A section
    // past the row end (the last chunk may be partial) reloads the row's last section, counted with
    // scale 0: no branch, no zero fill; rows are clamped, so loads stay in bounds. BLOCKED: the
    // offsets of kernels/layout.py (a lane's 16 bytes never cross a 64-byte piece).
    auto item_offsets = [&](int tile, int chunk, u32 (&value_at)[RT][2][NL], u32 (&scale_at)[RT][2][NL]) {
        u32 col[NL], group[NL];
#pragma unroll
        for (int j = 0; j < NL; ++j) {
            const int kc = min(chunk * CW + j * 4 * KPL + t * KPL, kpad - KPL);
            const u32 byte = (u32)kc * BYTES_PER_K2 / 2;
            col[j] = BLOCKED ? blocked_value_column(byte) : byte;
            group[j] = WT == W_F16 ? 0u : (u32)kc / G * (BLOCKED ? 8u : 1u);
        }
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u32 r = min(tile_row<RT, OUT>(tile, rt, h, g, rows), rows - 1);
                const u32 row = BLOCKED ? blocked_value_row(r, row_bytes32) : r * row_bytes32;
                const u32 srow = BLOCKED ? blocked_scale_row(r, (u32)ngroups) : r * (u32)ngroups;
#pragma unroll
                for (int j = 0; j < NL; ++j) {
                    value_at[rt][h][j] = row + col[j];
                    scale_at[rt][h][j] = srow + group[j];
                }
            }
    };
    // Pieces [j0, j1) of an item into ring slot b (load_item: all of them).
    auto load_pieces = [&](int b, int tile, int chunk, int j0, int j1) {
        u32 value_at[RT][2][NL], scale_at[RT][2][NL];
        item_offsets(tile, chunk, value_at, scale_at);
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int j = j0; j < j1; ++j) {
                    wv[b][rt][h][j] = load_stream(w + value_at[rt][h][j]);
                    // (REFILL: the scale through the same ld.global.nc as refill_piece's; a plain
                    // load of it then compiled to a coherent one.)
                    if (WT == W_F16) continue;
                    if (REFILL) load_u16_if(sc[b][rt][h][j], scales + scale_at[rt][h][j], true);
                    else sc[b][rt][h][j] = __half_as_ushort(scales[scale_at[rt][h][j]]);   // converted when used
                }
    };
    auto load_item = [&](int b, int tile, int chunk) { load_pieces(b, tile, chunk, 0, NL); };
    // REFILL: piece j of an item where `pred` holds, as predicates rather than a branch (see
    // compute_item).
    auto refill_piece = [&](int b, int j, int tile, int chunk, bool pred) {
        u32 value_at[RT][2][NL], scale_at[RT][2][NL];
        item_offsets(tile, chunk, value_at, scale_at);
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                load_stream_if(wv[b][rt][h][j], w + value_at[rt][h][j], pred);
                if (WT != W_F16) load_u16_if(sc[b][rt][h][j], scales + scale_at[rt][h][j], pred);
            }
    };

    // Multiplies the item in ring slot b. With REFILL and `refill`, each piece's registers take the
    // next item's piece (tile `next_tile`, chunk `next_chunk`) once they are used, as predicated loads
    // in the same basic block as the products: the scheduler then converts the weights first and
    // issues the next item's loads right after the first mma, so they are in flight during the
    // products (at the cost of registers, kernels/README.md "Refill"). Without REFILL the slot is
    // loaded after the item, as a separate step (load_next).
    auto compute_item = [&](int b, int chunk, float (&acc)[RT][2], bool refill, int next_tile, int next_chunk) {
        const int kb = chunk * CW;
#pragma unroll
        for (int j = 0; j < NL; ++j) {
            if (WT == W_Q4) {
                const int section = kb / KPL + 4 * j + t;
                // (R = 1 at depth 4 has no room for a second accumulator: nvcc spills, sm_90)
                add_piece_q4<RT, !(RT == 1 && DEPTH == 4)>(wv[b], sc[b], j, x_mine, xs_lo, x_zeros, feeds_b, section,
                                                           section * KPL < kpad, acc);
            } else {
                float d[RT][4];
                // Lanes that feed no B column read zeros (the same bytes for all: a broadcast, no branch).
                const uint4* xp = feeds_b ? reinterpret_cast<const uint4*>(x_mine + staged_index(kb + j * 4 * KPL + t * KPL))
                                          : x_zeros;
                piece_products<WT, RT>(wv[b], j, xp, d);
                // d[rt] = {D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]}: x_hi and x_lo parts of section t
                const int section = kb / KPL + 4 * j + t;
                const bool inside = section * KPL < kpad;                   // else the section was a reload
                const float c = WT == W_F16 ? 0.f : corr[section];
#pragma unroll
                for (int rt = 0; rt < RT; ++rt) {
                    const float s0 = WT == W_F16 ? 1.f : __half2float(__ushort_as_half(sc[b][rt][0][j]));
                    const float s1 = WT == W_F16 ? 1.f : __half2float(__ushort_as_half(sc[b][rt][1][j]));
                    acc[rt][0] = fmaf(section_sum(d[rt][0], d[rt][1], c), inside ? s0 : 0.f, acc[rt][0]);
                    acc[rt][1] = fmaf(section_sum(d[rt][2], d[rt][3], c), inside ? s1 : 0.f, acc[rt][1]);
                }
            }
            if (REFILL) refill_piece(b, j, next_tile, next_chunk, refill);
        }
    };

    // The first DEPTH items' weights are in flight while the previous kernel finishes (PDL) and
    // while the input is staged. When RMSNorm's weight goes through shared memory, the last ring
    // slot is loaded after staging instead: holding two groups of x per thread then fits in the
    // registers (the two paths are separate so that the slot is not live during that staging).
    // That is only done when a warp has more items than the ring holds anyway: with fewer, all of
    // them in flight before the wait is worth more (measured: TinyLlama's gate/up, 2 items a warp).
    pdl_launch_dependents();
    // OUT_ADD: the residual under the block's first tile is read right after the PDL wait, beside
    // the input's staging, instead of by a dependent round trip in the epilogue (thread i holds
    // output i of the tile; the model's shapes give every block at most one tile).
    const int first_out = cluster_of_block<SPLIT>() * tile_outputs<RT, OUT>() + (int)threadIdx.x;
    constexpr bool ADDS = OUT == OUT_ADD || OUT == OUT_ADD_PENDING;
    const bool holds_residual = ADDS && rank == 0 && my_tiles > 0 &&
                                (int)threadIdx.x < tile_outputs<RT, OUT>() && first_out < outputs;
    float residual = 0.f;
    // OUT_STORE_BIAS: the bias under the first tile is a weight, so it is loaded before the PDL wait.
    const bool holds_bias = OUT == OUT_STORE_BIAS && rank == 0 && my_tiles > 0 &&
                            (int)threadIdx.x < tile_outputs<RT, OUT>() && first_out < outputs;
    const float first_bias = holds_bias ? __ldg(bias + first_out) : 0.f;
    int next_ti = 0, next_k = 0;       // the next item to load: tile index ti, chunk index k
    auto next_tile = [&]() { return cluster_of_block<SPLIT>() + next_ti * clusters_in_grid<SPLIT>(); };
    auto next_chunk = [&]() { return chunk0 + warp + next_k * nwarps; };
    auto advance = [&]() {
        if (++next_k == my_chunks) {
            next_k = 0;
            ++next_ti;
        }
    };
    auto load_next = [&](int b) {
        load_item(b, next_tile(), next_chunk());
        advance();
    };
    if (!OWN && norm_two_groups<IN>(K) && my_tiles * ((nchunks + nwarps - 1) / nwarps) > DEPTH) {
#pragma unroll
        for (int b = 0; b < DEPTH - 1; ++b)
            if (b < n_items) load_next(b);
        prefetch_norm_weight(reinterpret_cast<float*>(xs), aux, K);
        pdl_wait();
        TI_MARK(1);
        if (holds_residual) residual = residual_at<OUT>(y, pending, first_out);
        stage_normed_early<WT, IN>(xs, xs_lo, corr, x, pending, aux, K, nchunks * CW / 8, ss_warps);
        if (DEPTH - 1 < n_items) load_next(DEPTH - 1);
    } else {
        const int first_tile = next_tile(), first_chunk = next_chunk();    // (STAGGER) slot 0's item
#pragma unroll
        for (int b = 0; b < DEPTH; ++b)
            if (b < n_items) {
                if (STAGGER && b == 0) {
                    load_pieces(0, first_tile, first_chunk, 0, 1);
                    advance();
                } else {
                    load_next(b);
                }
            }
        pdl_wait();
        TI_MARK(1);
        if (holds_residual) residual = residual_at<OUT>(y, pending, first_out);
        if (OWN) {
            // Groups per lane per round trip: x and the norm weight of one group, or x of three (two
            // where the ring is deeper: nvcc spills three there). Three take Llama-2-7B's down
            // projection (3 chunks a warp) in one round trip (kernels/README.md, "Input staging").
            stage_own_chunks<WT, IN, CW, IN != IN_PLAIN ? 1 : DEPTH == 1 ? 3 : 2>(xs, xs_lo, corr, x, pending, aux, K,
                                                                                  chunk0 + warp, nwarps, my_chunks,
                                                                                  chunk_end * CW, ss_warps, [&] {
                if (STAGGER && n_items > 0) load_pieces(0, first_tile, first_chunk, 1, NL);
            });
            __syncwarp();
        } else {
            stage_input<WT, IN>(xs, xs_lo, corr, x, pending, aux, K, chunk0 * CW / 8, chunk_end * CW, ss_warps);
        }
    }
    if (!OWN) __syncthreads();
    TI_MARK(3);                        // input staged (OWN: this warp's part of it)
    TI_TOUCH(wv[0][0][0][0].x);
    TI_MARK(4);                        // the first ring slot's weights have landed (thread 0)

    int it = 0, slot = 0;      // items multiplied; the ring slot of the next one
    u64 best_key = 0;          // OUT_STORE_ARGMAX: the best of this thread's outputs so far
    float norm = 1.f;          // RMSNorm's factor, read at the first epilogue (off the path to the first mma)
    for (int ti = 0; ti < my_tiles; ++ti) {
        float acc[RT][2];
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) acc[rt][0] = acc[rt][1] = 0.f;
        for (int k = 0; k < my_chunks; ++k, ++it) {
            // Register arrays need constant indices: one unrolled copy per ring slot. (Selected by
            // it % DEPTH, nvcc put the f16 depth-2 and the refilled depth-2 rings in local memory, and
            // selected by the slot counter, depths 3 and 4 measured slower in the step: each where it
            // works.)
            const int current = REFILL || DEPTH == 2 ? slot : it % DEPTH;
#pragma unroll
            for (int b = 0; b < DEPTH; ++b) {
                if (current == b) {
                    const bool refill = it + DEPTH < n_items;
                    compute_item(b, chunk0 + warp + k * nwarps, acc, refill, next_tile(), next_chunk());
                    if (it == 0) TI_MARK(5);   // the first item multiplied
                    if (refill) {
                        if (REFILL) advance();
                        else load_next(b);
                    }
                }
            }
            slot = slot + 1 == DEPTH ? 0 : slot + 1;
        }
        // Sum the four lanes of each row, then the warps (red is double-buffered by tile parity, so
        // one barrier per tile suffices).
        if (ti == my_tiles - 1) TI_MARK(6);   // the last item multiplied
        float* part = red + (ti & 1) * nwarps * 16 * RT;
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float v = acc[rt][h];
                v += __shfl_xor_sync(0xffffffffu, v, 1);
                v += __shfl_xor_sync(0xffffffffu, v, 2);
                if (t == 0) part[(warp * RT + rt) * 16 + g + 8 * h] = v;
            }
        __syncthreads();
        if (ti == my_tiles - 1) TI_MARK(7);   // the last tile's partial sums in shared memory
        const int out0 = (cluster_of_block<SPLIT>() + ti * clusters_in_grid<SPLIT>()) * tile_outputs<RT, OUT>();
        if (IN != IN_PLAIN && ti == 0) norm = norm_factor(ss_warps, nwarps, K, eps);
        // Double-buffered: block 1 may store tile ti + 1's sums while block 0 still reads tile ti's.
        float* peer_tile = peer_sums + (ti & 1) * 16 * RT;
        if (SPLIT > 1) {
            if (ti == 0) cluster_wait();       // block 0 runs: its shared memory may be written
            if (rank > 0) {
                for (int i = threadIdx.x; i < tile_outputs<RT, OUT>(); i += blockDim.x) {
                    float total = 0.f;
                    for (int wi = 0; wi < nwarps; ++wi) total += part[wi * 16 * RT + i];
                    *peer_shared(peer_tile + i, 0) = total;
                }
            }
            cluster_sync();                    // block 1's sums have landed in block 0
            if (rank > 0) continue;
        }
        for (int i = threadIdx.x; i < tile_outputs<RT, OUT>(); i += blockDim.x) {
            if (out0 + i >= outputs) continue;
            // Slot of output i in part: row g + 8h of unit rt is slot 16 rt + 8 h + g.
            const int slot = OUT == OUT_SWIGLU ? (i >> 3) * 16 + (i & 7) : i;
            float total = 0.f, up = 0.f;
            for (int wi = 0; wi < nwarps; ++wi) {
                total += part[wi * 16 * RT + slot];
                if (OUT == OUT_SWIGLU) up += part[wi * 16 * RT + slot + 8];
            }
            if (SPLIT > 1) total += peer_tile[i];
            if (IN != IN_PLAIN) {
                total *= norm;
                up *= norm;
            }
            if (ADDS) {
                const int o = out0 + i;
                const float sum = (ti == 0 && i == (int)threadIdx.x ? residual : residual_at<OUT>(y, pending, o)) + total;
                y[o] = sum;
                if (OUT == OUT_ADD_PENDING) pending[o] = to_pending(sum);   // the fused MLP adds to it
            }
            else if (OUT == OUT_SWIGLU) y[out0 + i] = swiglu(total, up);
            else if (OUT == OUT_STORE_BIAS)
                y[out0 + i] = total + (ti == 0 && i == (int)threadIdx.x ? first_bias : __ldg(bias + out0 + i));
            else y[out0 + i] = total;
            if (OUT == OUT_STORE_ARGMAX) {
                const u64 key = argmax_key(total, out0 + i);
                best_key = key > best_key ? key : best_key;
            }
        }
    }
    if (SPLIT > 1 && my_tiles == 0) cluster_wait();   // (the grid gives every cluster a tile)
    if (OUT == OUT_STORE_ARGMAX && warp == 0) {
        best_key = warp_max_u64(best_key);
        if (lane == 0 && best_key != 0) atomicMax(best, best_key);
    }
}
