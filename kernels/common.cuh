// Helpers shared by every tinyinfer kernel: fp16 bit tricks, warp/block reductions, the mma wrapper.
//
// Kernels are compiled at run time by NVRTC (through CuPy) and in CI by nvcc; both see this file.
// No C++ standard library headers: NVRTC does not ship them.
#pragma once
#include <cuda_fp16.h>

typedef unsigned int u32;
typedef unsigned long long u64;

#define TI_DEVICE __device__ __forceinline__
#define TI_INF __int_as_float(0x7f800000)   // NVRTC has no math.h, so no INFINITY

TI_DEVICE __half2 as_half2(u32 bits) {
    return *reinterpret_cast<__half2*>(&bits);
}

TI_DEVICE u32 as_u32(__half2 h) {
    return *reinterpret_cast<u32*>(&h);
}

TI_DEVICE u32 pack_half2(float lo, float hi) {
    return as_u32(__floats2half2_rn(lo, hi));
}

// Two float4 into eight floats.
TI_DEVICE void unpack8(float4 a, float4 b, float (&v)[8]) {
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

TI_DEVICE float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

TI_DEVICE float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Part of a block sum: the warp's total to out[warp] (read after a barrier by sum_of_warps).
TI_DEVICE void store_warp_sum(float v, float* out) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) out[threadIdx.x >> 5] = v;
}

// The warps' totals (store_warp_sum) added in a fixed order, so that every thread and every block
// gets the same value.
TI_DEVICE float sum_of_warps(const float* totals, int nwarps) {
    float total = 0.f;
    for (int w = 0; w < nwarps; ++w) total += totals[w];
    return total;
}

// Sum over the whole block; `scratch` holds at least 32 floats. Every thread gets the total.
TI_DEVICE float block_sum(float v, float* scratch) {
    __syncthreads();                  // scratch may still be read by a previous call
    store_warp_sum(v, scratch);
    __syncthreads();
    return sum_of_warps(scratch, (blockDim.x + 31) >> 5);
}

// RMSNorm's factor rsqrt(mean(x^2) + eps) from the warps' sums of squares (store_warp_sum).
TI_DEVICE float norm_factor(const float* ss_warps, int nwarps, int K, float eps) {
    return rsqrtf(sum_of_warps(ss_warps, nwarps) / (float)K + eps);
}

// D += A * B with A 16x16 fp16 (row-major fragments), B 16x8 fp16, D 16x8 fp32.
// Turing has only the k8 shape, so there it is two k8 products (same fragment registers).
TI_DEVICE void mma_16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(b0));
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a2), "r"(a3), "r"(b1));
#endif
}

// D += A * B with A 16x32 unsigned bytes (row-major fragments: a0 rows 0-7 and a1 rows 8-15 at k
// 4t..4t+3, a2 / a3 at k 16+4t..), B 32x8 signed bytes (b0 at k 4t.., b1 at k 16+4t..), D 16x8
// int32, exact. Turing has only the m8n8k16 shape: there it is four of those (same registers).
TI_DEVICE void mma_16832_u8s8(int (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    const u32 a[4] = {a0, a2, a1, a3}, b[2] = {b0, b1};
#pragma unroll
    for (int i = 0; i < 4; ++i) {      // rows 0-7 then 8-15, each over k 0-15 then 16-31
        int& d0 = d[(i >> 1) * 2];
        int& d1 = d[(i >> 1) * 2 + 1];
        asm volatile("mma.sync.aligned.m8n8k16.row.col.s32.u8.s8.s32 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
                     : "+r"(d0), "+r"(d1)
                     : "r"(a[i]), "r"(b[i & 1]));
    }
#endif
}

// Programmatic dependent launch (sm_90+, see kernels/pdl.py). A kernel launched early may read
// weights, but must pdl_wait() before it touches activations the previous kernel writes or reads;
// pdl_launch_dependents() lets the next kernel start as soon as every block of this one runs.
// Without the launch attribute (and before Hopper) both are no-ops.
TI_DEVICE void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

TI_DEVICE void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Thread-block clusters (sm_90+; kernels are launched in clusters only there, so before Hopper
// these are never reached and compile to nothing). Every thread of every block of the cluster
// calls the barriers, the same number of times.
TI_DEVICE void cluster_sync() {           // arrive (release) and wait (acquire)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// The two halves of a barrier: arrive (release: this thread's stores, shared memory of other
// blocks included, are seen by whoever waits for the phase), and wait (acquire). A block may exit
// after arriving; the barrier's phase still completes.
TI_DEVICE void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}

// Arrive without ordering, for a phase that completes long before anyone waits on it.
TI_DEVICE void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#endif
}

TI_DEVICE void cluster_wait() {             // (acquire: barrier.cluster.wait's only semantics)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
#endif
}

// The address of the same shared-memory variable in block `rank` of the cluster (distributed
// shared memory), as a generic pointer.
template <typename T>
TI_DEVICE T* peer_shared(T* p, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    u64 out;
    asm volatile("mapa.u64 %0, %1, %2;\n" : "=l"(out) : "l"(p), "r"(rank));
    return reinterpret_cast<T*>(out);
#else
    return p;
#endif
}

// Weights are read once per token: stream them past L1.
TI_DEVICE uint4 load_stream(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// load_stream where `pred` holds; else v keeps its value. A predicate instead of a branch leaves
// the code around it one basic block, which the scheduler may interleave freely (the GEMV refills
// its ring this way between two chains of products).
TI_DEVICE void load_stream_if(uint4& v, const void* p, bool pred) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
                 " @p ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n}\n"
                 : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
                 : "l"(p), "r"((int)pred));
}

// A 16-bit weight (a group scale), predicated like load_stream_if.
TI_DEVICE void load_u16_if(unsigned short& v, const void* p, bool pred) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p ld.global.nc.u16 %0, [%1];\n}\n"
                 : "+h"(v) : "l"(p), "r"((int)pred));
}

// A coherent load of an activation (what the previous kernel writes), for reads after pdl_wait()
// that sit close to weight loads issued before it: ptxas treats ld.global.nc data as read-only for
// the whole kernel and may move such a load above griddepcontrol.wait, i.e. before the previous
// kernel has written it (it did, in a GEMV staging variant). tests/test_cuda_compile.py checks
// the machine code of every kernel launched with PDL for loads before the wait.
TI_DEVICE float4 load_activation4(const float* p) {
    return __ldcg(reinterpret_cast<const float4*>(p));      // ld.global.cg: coherent at L2
}

// Eight floats of an activation, coherent (load_activation4).
TI_DEVICE void load8_activation(const float* p, float (&v)[8]) {
    unpack8(load_activation4(p), load_activation4(p + 4), v);
}

// The residual in fixed point where the MLP is fused (mlp.cu's `pending`): int64 with 32 fraction
// bits, which blocks add to with integer atomics, so the total does not depend on their order
// (decoding stays bit-for-bit repeatable, which float atomics would not). Range +-2^31, resolution
// 2^-32.
#define PENDING_ONE 4294967296.0f   // 2^32

TI_DEVICE float pending_value(long long v) {
    return __ll2float_rn(v) * (1.0f / PENDING_ONE);
}

TI_DEVICE long long to_pending(float v) {
    return __float2ll_rn(v * PENDING_ONE);        // exact scaling by 2^32, one rounding to an integer
}

// v[i] = pending[i] for eight values (16-byte aligned), after the PDL wait: plain loads, as x (the
// GEMV readers cost twice as much with ld.global.cg), or coherent ones where a plain load
// could be moved above the wait (load_activation4).
TI_DEVICE void load_pending8(const long long* pending, float (&v)[8], bool coherent) {
    const longlong2* p = reinterpret_cast<const longlong2*>(pending);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const longlong2 a = coherent ? __ldcg(p + q) : p[q];
        v[2 * q] = pending_value(a.x);
        v[2 * q + 1] = pending_value(a.y);
    }
}

// The first cached row the query at pos attends to: 0, or with a sliding window of `window` > 0
// positions (Mistral, Qwen2) pos - window + 1 (runtime/reference.py first_key). Every kernel walks
// rows first_key .. pos, so a windowed step reads at most `window` rows however long the context.
TI_DEVICE int first_key(int pos, int window) {
    return window > 0 ? max(0, pos - window + 1) : 0;
}

// One 16-byte piece of a cached K or V row, loaded before the PDL wait: rows below pos are not
// written while this kernel runs.
TI_DEVICE uint4 load_cached_piece(const __half* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// movmatrix: lane (g, t) holding M[g][2t .. 2t+1] of an 8x8 fp16 matrix gets M[2t .. 2t+1][g].
TI_DEVICE u32 transpose8x8(u32 v) {
    u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(v));
    return r;
}

TI_DEVICE u32 word_of(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// (a, b) = hi + lo / lo_scale in two fp16 pairs: hi the rounded pair, lo its rounding error times
// lo_scale. Products with both (as mma operands, fp32 accumulation) are as exact as with the fp32
// values. The rounding error is at most 2^-11 of the value, so lo_scale = 2^11 keeps lo within the
// value's own magnitude (no overflow) and out of fp16's subnormals down to values of ~3e-5.
TI_DEVICE void split_half2(float a, float b, u32& hi, u32& lo, float lo_scale = 1.f) {
    const __half2 h = __floats2half2_rn(a, b);
    const float2 back = __half22float2(h);
    hi = as_u32(h);
    lo = pack_half2((a - back.x) * lo_scale, (b - back.y) * lo_scale);
}

// 16-byte global -> shared copy that holds no registers until it lands (cp.async, sm_80+; Turing
// copies through registers).
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

// cp.async groups: close the copies issued so far into a group; wait until at most N groups are
// still in flight (no-ops on Turing, whose copies are synchronous).
TI_DEVICE void copies_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
TI_DEVICE void copies_landed_but() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Four 8x8 fp16 matrices from shared memory, transposed (sm_75+): lane L gives the address of row
// L % 8 of matrix L / 8 (16 contiguous bytes) and receives in register m the pair (rows 2 (L % 4)
// and 2 (L % 4) + 1, column L / 4) of matrix m: the B fragment of mma.m16n8k16 when the matrix rows
// are its k index.
TI_DEVICE void ldmatrix_x4_trans(u32& r0, u32& r1, u32& r2, u32& r3, const __half* row) {
    const u32 address = (u32)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(address));
}

// Offsets in a matrix held in 8-row blocks (kernels/layout.py): byte b of row r of the values lies at
// blocked_value_row(r, row_bytes) + blocked_value_column(b), scale j of row r (of `groups` per row)
// at blocked_scale_row(r, groups) + 8 j. In two parts because the GEMV computes a row's part once for
// all the pieces it loads from that row.
template <typename T>
TI_DEVICE T blocked_value_row(T r, T row_bytes) {
    return (r & ~(T)7) * row_bytes + (r & 7) * 64;
}

template <typename T>
TI_DEVICE T blocked_value_column(T byte) {
    return (byte >> 6) * 512 + (byte & 63);
}

template <typename T>
TI_DEVICE T blocked_scale_row(T r, T groups) {
    return (r & ~(T)7) * groups + (r & 7);
}

// Embedding tables are read as stored: f32 (0), f16 (1) or bf16 (2).
#define EMB_F32 0
#define EMB_F16 1
#define EMB_BF16 2

TI_DEVICE float embedding_value(const void* table, int encoding, size_t index) {
    if (encoding == EMB_F16) return __half2float(reinterpret_cast<const __half*>(table)[index]);
    if (encoding == EMB_BF16) return __uint_as_float((u32)reinterpret_cast<const unsigned short*>(table)[index] << 16);
    return reinterpret_cast<const float*>(table)[index];
}

// Column k of a token's embedding (table row starting at `row`) as the decode step's input: into x
// and, in a fused step, into the fixed-point residual (pending, else null).
TI_DEVICE void store_embedding(const void* table, int encoding, size_t row, int k, float* x, long long* pending) {
    const float value = embedding_value(table, encoding, row + k);
    x[k] = value;
    if (pending != nullptr) pending[k] = to_pending(value);
}

// Greedy decoding's argmax folded into the output head (gemv.cu OUT_STORE_ARGMAX): a logit and its
// row as one 64-bit key whose unsigned order is the sampler's choice, the larger value and then the
// lower row, so blocks can fold their bests into one word with atomicMax in any order. -0 counts as
// +0 (they compare equal); NaN is 0, the empty key, and never chosen, as the sampler's scan skips it.
TI_DEVICE u64 argmax_key(float v, int row) {
    if (v != v) return 0ull;
    const u32 bits = v == 0.f ? 0u : __float_as_uint(v);
    const u32 ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    return ((u64)ordered << 32) | (u64)(~(u32)row);
}

TI_DEVICE int argmax_key_row(u64 key) {
    return (int)~(u32)key;
}

TI_DEVICE u64 warp_max_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(0xffffffffu, v, o);
        v = other > v ? other : v;
    }
    return v;
}

// Decode-step state shared by the kernels of one CUDA graph (read from device memory on every
// replay, never baked into kernel arguments).
#define STATE_POS 0      // position of the token being processed
#define STATE_TOKEN 1    // token being processed (the sampler writes the next one here)
#define STATE_STEP 2     // index into the output token array
#define STATE_SIZE 4

// Decode timeline: a diagnostic compiled in only with -DTI_TIMELINE (TINYINFER_TIMELINE=1 at load;
// read by tests/perf/timeline.py). Thread 0 of every block writes one record of TI_TIMELINE_WORDS
// u64: the launch (%gridid), (SM << 32 | linear block index), then the global timer (ns) at
// TI_MARKS marks and the SM's clock at the same marks. Mark 0 is the block's start, 1 the return
// from pdl_wait, the last one its end; the kernels place the others (see their TI_MARK calls,
// allowed in any function the kernel calls). A mark never reached stays 0. TI_TOUCH(v) makes
// thread 0 wait until register v has its value (a load has landed) before the next mark. Without
// the define all of this is empty.
#ifdef TI_TIMELINE
#define TI_TIMELINE_CAPACITY (1 << 17)
#define TI_MARKS 10
#define TI_TIMELINE_WORDS (2 + 2 * TI_MARKS)
extern "C" {
__device__ u64 ti_timeline[TI_TIMELINE_CAPACITY * TI_TIMELINE_WORDS];
__device__ u32 ti_timeline_count;
}

TI_DEVICE u64* ti_marks() {              // [2][TI_MARKS]: global time, SM clock (thread 0's)
    __shared__ u64 marks[2 * TI_MARKS + 1];
    return marks;
}

TI_DEVICE void ti_mark(int i) {
    if (threadIdx.x != 0) return;
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    ti_marks()[i] = t;
    ti_marks()[TI_MARKS + i] = clock64();
}

TI_DEVICE void ti_touch(u32 v) {
    if (threadIdx.x != 0) return;
    u32 sink = (u32)ti_marks()[2 * TI_MARKS];
    asm volatile("xor.b32 %0, %0, %1;\n" : "+r"(sink) : "r"(v));
    ti_marks()[2 * TI_MARKS] = sink;
}

struct TimelineProbe {
    u32 slot;

    TI_DEVICE TimelineProbe() {
        if (threadIdx.x != 0) return;
        for (int i = 1; i < 2 * TI_MARKS + 1; ++i) ti_marks()[i] = 0;
        ti_mark(0);
        slot = atomicAdd(&ti_timeline_count, 1u);      // its latency overlaps the block's work
    }

    TI_DEVICE ~TimelineProbe() {
        if (threadIdx.x != 0) return;
        ti_mark(TI_MARKS - 1);
        if (slot >= TI_TIMELINE_CAPACITY) return;
        u64 grid, sm;
        asm volatile("mov.u64 %0, %%gridid;\n" : "=l"(grid));
        asm volatile("{ .reg .u32 s; mov.u32 s, %%smid; cvt.u64.u32 %0, s; }\n" : "=l"(sm));
        u64* r = ti_timeline + (size_t)slot * TI_TIMELINE_WORDS;
        r[0] = grid;
        r[1] = (sm << 32) | ((blockIdx.x + (u64)blockIdx.y * gridDim.x) & 0xffffff) |
               ((ti_marks()[2 * TI_MARKS] & 0xff) << 24);
        for (int i = 0; i < 2 * TI_MARKS; ++i) r[2 + i] = ti_marks()[i];
    }
};
#define TI_PROBE TimelineProbe ti_probe
#define TI_MARK(i) ti_mark(i)
#define TI_TOUCH(v) ti_touch(v)
#else
#define TI_PROBE
#define TI_MARK(i)
#define TI_TOUCH(v)
#endif
