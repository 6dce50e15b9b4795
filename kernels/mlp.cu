// A layer's whole MLP in one kernel (Hopper: thread-block clusters):
//
//     pending += W_down (silu(W_gate h) * (W_up h)),  h = rms_norm(x, norm, eps)
//
// with the weights as gemv.cu reads them (the fused [gate; up] matrix and the down matrix, both in
// 8-row blocks: kernels/layout.py) and gemv.cu's loads, arithmetic and input staging.
//
// Why. As two GEMVs, the down projection waits until every gate/up block has ended, then for its
// input's round trip and staging, and adds its own tail: on TinyLlama that costs about as much as
// streaming the down matrix (kernels/README.md, "Fused MLP"). Here each cluster of MLP_CLUSTER
// blocks owns a slice of 8 * T * MLP_CLUSTER columns of the FFN, so the products depend on each
// other only inside a cluster:
//
//   phase 1   block `rank` computes outputs slice0 + 8 T rank ... + 8 T of silu(gate) * up: T tiles
//             of 8 gate rows and the 8 matching up rows (gemv.cu's OUT_SWIGLU tiles), in groups of RT
//             tiles per item (as gemv.cu's R); P = NW / (T / RT) warps per group split its K (warp w:
//             group w % (T / RT), chunks w / (T / RT), + P, ...).
//   exchange  each block stores its 8 T values into every block of the cluster (distributed shared
//             memory); one cluster barrier.
//   phase 2   block `rank` multiplies rows rank * dim / MLP_CLUSTER ... of W_down, over the slice's
//             columns, by the slice (warp w: groups of RT 16-row tiles w, w + NW, ..., every chunk
//             of each), and adds each row's sum to pending[row] with one integer atomic.
//
// pending is the residual itself in int64 fixed point (common.cuh): atomics in any order give the
// same total, so decoding stays bit-for-bit repeatable. The embedding and the sampler set it with x,
// the o projection adds to it and stores the sum in both x (read here) and pending (gemv.cu
// OUT_ADD_PENDING), and the qkv GEMV and the output head normalise it (IN_RMSNORM_PENDING): they
// read 8 bytes per element instead of x and the MLP's sums, 12.
//
// x is staged by the warps that multiply it: phase 1's warps w of one chunk group (w / TG: the TG
// warps of the slice's tile groups read the same chunks) stage those chunks between them and meet at
// a barrier of their own (gemv.cu stage_own_chunks), not the whole block's; the norm factor is read
// after phase 1 (kernels/README.md, "Fused MLP"). q8 keeps the block-wide
// staging: with the factor read there nvcc spills its kernels (sm_90).
//
// Each warp's items (RT 16-row tiles x a chunk of CW columns, loaded as gemv.cu loads them) run
// through one ring of DEPTH register slots across both phases, so phase 2's first weights are in
// flight while phase 1 ends and while the cluster exchanges its values.
//
// With RT = 2 it beats the two GEMVs on TinyLlama; with RT = 1 it lost (phase 1 streamed slower
// than the tuned gate/up GEMV; kernels/README.md, "Fused MLP"). The grid is 8 blocks per slice of
// 256 columns; about 31 such clusters fit at once at two
// blocks per SM (cuOccupancyMaxActiveClusters), so Llama-2-7B's 43 would need a second round: the
// tuner tries the kernel only where the grid is at most two blocks per SM (CudaBackend.mlp_candidates).
#include "gemv.cu"

#define MLP_CLUSTER 8    // blocks per cluster (the portable maximum)

template <int WT, int G, int T, int RT, int DEPTH, int WIDE>
__global__ void __launch_bounds__(WIDE ? 512 : 256, WIDE ? 1 : 2) mlp(
    const unsigned char* __restrict__ w_gu,  // [gate; up]: 2 ffn rows of kpad_gu columns, BLOCKED
    const __half* __restrict__ s_gu,         // its scales (q8/q4), BLOCKED
    const unsigned char* __restrict__ w_dn,  // down: dim rows of kpad_dn columns, BLOCKED
    const __half* __restrict__ s_dn,
    int dim, int ffn, int kpad_gu, int kpad_dn,
    const float* __restrict__ x,             // [dim], the residual
    const float* __restrict__ norm,          // [dim], the FFN norm's weight
    float eps,
    long long* __restrict__ pending)         // [dim] += the MLP's output, fixed point
{
    constexpr int KPL = Weights<WT>::KPL;
    constexpr int CW = NL * 4 * KPL;                          // k per chunk
    constexpr int BYTES_PER_K2 = WT == W_Q4 ? 1 : WT == W_Q8 ? 2 : 4;
    constexpr int NW = WIDE ? 16 : 8;
    constexpr int TG = T / RT;                                // phase-1 tile groups (RT tiles each)
    constexpr int P = NW / TG;                                // warps per tile group
    constexpr int OUTS = 8 * T;                               // phase-1 outputs per block
    constexpr int SLICE = OUTS * MLP_CLUSTER;
    static_assert(WT == W_F16 || G % KPL == 0, "a 16-byte load must stay inside one quantization group");
    static_assert(T % RT == 0 && NW % TG == 0 && SLICE % CW == 0, "whole tile groups per warp group, whole chunks per slice");
    static_assert(DEPTH >= 1 && DEPTH <= 4, "ring depth: 1 to 4 items per warp");

    TI_PROBE;
    constexpr bool OWN = WT != W_Q8;   // the warps stage their own chunks (see above)
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int rank = (int)blockIdx.x % MLP_CLUSTER, slice0 = (int)blockIdx.x / MLP_CLUSTER * SLICE;
    cluster_arrive_relaxed();          // pairs with the wait before the first store into a peer

    // Shared memory (mlp.py shared_bytes): per-warp tile sums, the slice of silu(gate) * up, x
    // staged (hi, lo 32 bytes on, 64 zero bytes per warp, bias corrections), the slice staged
    // likewise, and the warps' sums of squares of x.
    const int kc1 = kpad_gu;                                  // a whole number of chunks (mlp.py)
    float* part = reinterpret_cast<float*>(smem);             // [NW][RT][16]
    float* slice = part + NW * RT * 16;                       // [SLICE]
    __half* xs = reinterpret_cast<__half*>(slice + SLICE);
    __half* xs_lo = xs + staged_index(kc1) + 16;
    uint4* zeros = reinterpret_cast<uint4*>(xs_lo + staged_index(kc1));
    uint4* x_zeros = zeros + (OWN ? 4 * warp : 0);            // each warp's own (OWN: no block barrier before use)
    float* corr1 = reinterpret_cast<float*>(zeros + 4 * NW);  // [kc1 / KPL]
    __half* hs = reinterpret_cast<__half*>(corr1 + kc1 / KPL);
    __half* hs_lo = hs + staged_index(SLICE) + 16;
    float* corr2 = reinterpret_cast<float*>(hs_lo + staged_index(SLICE));   // [SLICE / KPL]
    float* ss_warps = corr2 + SLICE / KPL;                    // [NW]: RMSNorm's sums of squares (stage_input)
    if ((OWN ? lane : (int)threadIdx.x) < 4) x_zeros[lane] = make_uint4(0u, 0u, 0u, 0u);

    // The warp's items: n1 of phase 1, then n2 of phase 2.
    const int n1 = kc1 / CW / P;
    const int chunks2 = SLICE / CW;
    const int rows2 = dim / MLP_CLUSTER, row2_0 = rank * rows2;
    const int groups2 = rows2 / (16 * RT), my_groups2 = warp < groups2 ? (groups2 - 1 - warp) / NW + 1 : 0;
    const int n = n1 + my_groups2 * chunks2;
    const int out1 = slice0 + rank * OUTS + (warp % TG) * RT * 8;   // phase-1 outputs: out1 + 8 rt + 0..7

    uint4 wv[DEPTH][RT][2][NL];        // rows g, g + 8 of each tile of the item
    unsigned short sc[DEPTH][RT][2][NL];   // their group scales (fp16 bits)

    // Row (tile rt of the item; h: 0 for g, 1 for g + 8) and first column of item i, and which matrix
    // it reads.
    auto item_row = [&](int i, int rt, int h) {
        if (i < n1) return h * ffn + out1 + 8 * rt + g;                 // gate row, or its up row
        return row2_0 + ((warp + (i - n1) / chunks2 * NW) * RT + rt) * 16 + 8 * h + g;
    };
    auto item_col = [&](int i) {
        return i < n1 ? (warp / TG + i * P) * CW : slice0 + (i - n1) % chunks2 * CW;
    };
    auto load_item = [&](int b, int i) {
        const bool second = i >= n1;
        const unsigned char* w = second ? w_dn : w_gu;
        const __half* scales = second ? s_dn : s_gu;
        const int kpad = second ? kpad_dn : kpad_gu;
        const u32 row_bytes32 = (u32)kpad * BYTES_PER_K2 / 2;
        const u32 ngroups = WT == W_F16 ? 1u : (u32)(kpad / G);
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u32 r = (u32)item_row(i, rt, h);
#pragma unroll
                for (int j = 0; j < NL; ++j) {
                    const u32 kc = (u32)(item_col(i) + j * 4 * KPL + t * KPL);
                    const u32 byte = kc * BYTES_PER_K2 / 2;
                    wv[b][rt][h][j] = load_stream(w + blocked_value_row(r, row_bytes32) + blocked_value_column(byte));
                    if (WT != W_F16)
                        sc[b][rt][h][j] = __half_as_ushort(scales[blocked_scale_row(r, ngroups) + kc / (G ? G : 1) * 8u]);
                }
            }
    };
    int loaded = 0;                    // the next item to load
    auto load_next = [&](int b) {
        if (loaded < n) load_item(b, loaded);
        ++loaded;
    };

    // Item i from ring slot b against the staged vector (hi, lo, corr) whose column 0 is
    // column `base` of the matrix: as gemv.cu's compute_item.
    auto compute = [&](int b, int i, const __half* hi, const __half* lo, const float* corr, int base,
                       float (&acc)[RT][2]) {
        const int kb = item_col(i) - base;
        const __half* mine = WT == W_Q4 ? hi + 16 * (g & 1) : (g & 1) ? lo : hi;
#pragma unroll
        for (int j = 0; j < NL; ++j) {
            if (WT == W_Q4) {
                // (the deepest rings, R = 1 at depth 4 and R = 2 at 2, have no room for a second
                // accumulator: nvcc spills, sm_90)
                add_piece_q4<RT, RT * DEPTH < 4>(wv[b], sc[b], j, mine, lo, x_zeros, (g >> 1) == t, kb / KPL + 4 * j + t,
                                                 true, acc);
                continue;
            }
            float d[RT][4];
            const uint4* xp = (g >> 1) == t ? reinterpret_cast<const uint4*>(mine + staged_index(kb + j * 4 * KPL + t * KPL))
                                            : x_zeros;
            piece_products<WT, RT>(wv[b], j, xp, d);
            const int section = kb / KPL + 4 * j + t;
            const float c = WT == W_F16 ? 0.f : corr[section];
#pragma unroll
            for (int rt = 0; rt < RT; ++rt) {
                const float s0 = WT == W_F16 ? 1.f : __half2float(__ushort_as_half(sc[b][rt][0][j]));
                const float s1 = WT == W_F16 ? 1.f : __half2float(__ushort_as_half(sc[b][rt][1][j]));
                acc[rt][0] = fmaf(section_sum(d[rt][0], d[rt][1], c), s0, acc[rt][0]);
                acc[rt][1] = fmaf(section_sum(d[rt][2], d[rt][3], c), s1, acc[rt][1]);
            }
        }
    };
    // Item i from whichever ring slot holds it; that slot then loads item i + DEPTH.
    int slot = 0;
    auto step = [&](int i, const __half* hi, const __half* lo, const float* corr, int base, float (&acc)[RT][2]) {
#pragma unroll
        for (int b = 0; b < DEPTH; ++b) {
            if (slot == b) {
                compute(b, i, hi, lo, corr, base, acc);
                load_next(b);
            }
        }
        slot = slot + 1 == DEPTH ? 0 : slot + 1;
    };
    // The sums of rows g and g + 8 of each tile in lanes t = 0.
    auto lane_sums = [&](float (&acc)[RT][2]) {
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                acc[rt][h] += __shfl_xor_sync(0xffffffffu, acc[rt][h], 1);
                acc[rt][h] += __shfl_xor_sync(0xffffffffu, acc[rt][h], 2);
            }
    };

    pdl_launch_dependents();
#pragma unroll
    for (int b = 0; b < DEPTH; ++b) load_next(b);
    pdl_wait();
    TI_MARK(1);
    float factor = 1.f;                // RMSNorm's: x is staged as x * norm (gemv.cu stage_input)
    if (OWN) {
        // Warp r = warp % TG of chunk group warp / TG stages the group's chunks r, r + TG, ... (of
        // warp / TG + i P, i < n1); the group's TG warps then meet (named barrier 1 + group).
        const int r = warp % TG;
        stage_own_chunks<WT, IN_RMSNORM, CW, 1>(xs, xs_lo, corr1, x, nullptr, norm, dim, warp / TG + r * P, P * TG,
                                                r < n1 ? (n1 - r + TG - 1) / TG : 0, kc1, ss_warps, [] {});
        if (TG > 1) asm volatile("bar.sync %0, %1;\n" ::"r"(1 + warp / TG), "r"(32 * TG) : "memory");
        else __syncwarp();
    } else {
        stage_input<WT, IN_RMSNORM>(xs, xs_lo, corr1, x, nullptr, norm, dim, 0, kc1, ss_warps);
        __syncthreads();
        factor = norm_factor(ss_warps, NW, dim, eps);
    }
    TI_MARK(3);                        // x staged (OWN: this warp's group's part of it)

    // Phase 1.
    float acc[RT][2] = {};
    for (int i = 0; i < n1; ++i) step(i, xs, xs_lo, corr1, 0, acc);
    TI_MARK(5);                        // phase 1 multiplied
    lane_sums(acc);
    if (t == 0) {
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
            part[(warp * RT + rt) * 16 + g] = acc[rt][0];
            part[(warp * RT + rt) * 16 + g + 8] = acc[rt][1];
        }
    }
    __syncthreads();
    cluster_wait();                    // every block of the cluster runs: its shared memory may be written
    if (OWN) factor = norm_factor(ss_warps, NW, dim, eps);     // every warp's sum of squares is in
    if (threadIdx.x < OUTS) {
        const int tile = threadIdx.x / 8, row = threadIdx.x % 8;    // tile = group * RT + rt
        const int group = tile / RT, rt = tile % RT;
        float gate = 0.f, up = 0.f;
#pragma unroll
        for (int p = 0; p < P; ++p) {  // the group's warps (group, + TG, ...), in a fixed order
            gate += part[((group + p * TG) * RT + rt) * 16 + row];
            up += part[((group + p * TG) * RT + rt) * 16 + row + 8];
        }
        const float value = swiglu(gate * factor, up * factor);
#pragma unroll
        for (int peer = 0; peer < MLP_CLUSTER; ++peer) *peer_shared(slice + rank * OUTS + threadIdx.x, peer) = value;
    }
    cluster_sync();                    // the whole slice has landed in every block
    TI_MARK(6);
    if (warp == 0) {                   // stage it as phase 2's input (full warps: stage_group shuffles)
        for (int base = 0; base < SLICE / 8; base += 32) {
            const int b = base + lane;
            float value[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) value[e] = b < SLICE / 8 ? slice[8 * b + e] : 0.f;
            stage_group<WT, IN_PLAIN>(hs, hs_lo, corr2, slice, nullptr, nullptr, SLICE, b, SLICE / 8, SLICE / 8, value);
        }
    }
    __syncthreads();

    // Phase 2: each tile's rows go to pending once its last chunk is multiplied.
    for (int first = n1; first < n; first += chunks2) {
        float acc2[RT][2] = {};
        for (int i = first; i < first + chunks2; ++i) step(i, hs, hs_lo, corr2, slice0, acc2);
        lane_sums(acc2);
        if (t == 0) {
#pragma unroll
            for (int rt = 0; rt < RT; ++rt) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    unsigned long long* to = reinterpret_cast<unsigned long long*>(pending + item_row(first, rt, h));
                    atomicAdd(to, (unsigned long long)to_pending(acc2[rt][h]));
                }
            }
        }
    }
    TI_MARK(7);
}
