// The last node of a decode step: pick the next token from the logits on the device, exactly as
// tinyinfer.runtime.sampling.sample() defines it, then feed it back (state[TOKEN]), append it to
// the output array and advance the position, so the next graph replay needs nothing from the host.
//
// One block of 1024 threads. Greedy without repetition penalty is one argmax pass, or none where the
// output head folded the argmax into `head_best` (gemv.cu OUT_STORE_ARGMAX: one 64-bit word, which this
// kernel reads and clears for the next step whatever it samples). Otherwise the
// steps of sample() run in float64 like the reference: penalty -> (greedy) -> / temperature ->
// top-k (radix select of the k-th largest value) -> softmax -> top-p (radix descent on the
// probabilities' bit patterns with per-bin probability sums; ties at the cut kept in id order) ->
// min-p -> inverse-CDF draw in ascending id order with the host-drawn uniform u for this step.
// Only the order of floating-point summation differs from NumPy's, so a different token needs a
// draw within ~1e-15 of a cumulative boundary.
//
// Both kernels run those steps through one device function, sample_row (one block, one row):
//
//   sample_token   batch-1 decode: one block; the history is a [vocab] byte set kept by the kernel,
//                  u is uniforms[state[STEP]]; it feeds the token back and embeds it (above).
//   batch_sample   batched decode (runtime/cuda_batch.py), the last kernel of the step: grid (rows),
//                  block b samples row b. Its arguments, rows = the step's bucket:
//                    logits    float  [rows][vocab]     batch_logits' output
//                    best      int    [rows]            batch_logits' argmax, or null
//                    params    double [rows][P_COUNT]   each row as sample_token's params
//                    uniforms  double [rows]            each row's u for this step
//                    positions int    [rows]            the row table's positions and slots:
//                    slots     int    [rows]            row b's history is history[slots[b]][0 .. positions[b]]
//                    history   int    [slots][max_context]  a slot's ids by position, prompt then generated
//                    xs        double [rows][vocab]     scratch
//                    tokens    int    [rows]            out
//                  Plain greedy rows (temperature 0, penalty 1) take best[b] when best is given, else
//                  scan; a penalised row first builds its history's id set as a bitmap in dynamic
//                  shared memory ((vocab + 31) / 32 words). Thread 0 writes tokens[b] and appends
//                  the token to the history at positions[b] + 1 (when < max_context), so the
//                  host writes only a prompt's ids, at submit. Rows of a step have distinct slots
//                  (padding rows, greedy, share the spare one and read no history).
//
// Programmatic dependent launch: both wait (pdl_wait) before reading anything and never call
// pdl_launch_dependents, so whatever follows starts only once the token is written. For
// sample_token that orders the next step's kernels after its state update (runtime/README.md, "The
// decode step"); batch_sample ends the batched step, whose tokens and history the host (a D2H copy)
// and the next step read, and an early trigger would let nothing useful overlap it.
#include "common.cuh"

#define SAMPLE_THREADS 1024
#define P_TEMPERATURE 0
#define P_TOP_P 1
#define P_MIN_P 2
#define P_PENALTY 3
#define P_TOP_K 4
#define P_COUNT 8

// Monotone maps from double to unsigned keys (larger value -> larger key).
__device__ __forceinline__ u64 order_key(double v) {
    const u64 bits = (u64)__double_as_longlong(v);
    return (bits >> 63) ? ~bits : (bits | 0x8000000000000000ull);
}

struct ArgBest {
    double value;
    int index;
};

__device__ __forceinline__ ArgBest better(ArgBest a, ArgBest b) {   // larger value, then lower index
    if (b.value > a.value || (b.value == a.value && b.index < a.index)) return b;
    return a;
}

__device__ __forceinline__ ArgBest warp_argmax(ArgBest v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        ArgBest other;
        other.value = __shfl_xor_sync(0xffffffffu, v.value, o);
        other.index = __shfl_xor_sync(0xffffffffu, v.index, o);
        v = better(v, other);
    }
    return v;
}

// Every thread gets the block's best: each warp's best into scratch, then every warp reduces the
// (at most 32) entries by shuffles, which is shorter than a serial scan of them.
__device__ ArgBest block_argmax(ArgBest v, ArgBest* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_argmax(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_argmax(lane < (int)(blockDim.x >> 5) ? scratch[lane] : ArgBest{-TI_INF, 0x7fffffff});
}

__device__ double block_sum_f64(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double total = 0.0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += scratch[w];
    return total;
}

// Exclusive prefix over threads (thread order = id order of the contiguous ranges).
__device__ double block_exclusive_f64(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    double inclusive = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const double up = __shfl_up_sync(0xffffffffu, inclusive, o);
        if (lane >= o) inclusive += up;
    }
    __syncthreads();
    if (lane == 31) scratch[warp] = inclusive;
    __syncthreads();
    double before = 0.0;
    for (int w = 0; w < warp; ++w) before += scratch[w];
    return before + inclusive - v;
}

struct Cut {          // which tokens survive top-k / top-p / min-p
    double kth;       // keep x >= kth (top-k); -inf when off
    double max_x;     // softmax shift
    double z;         // softmax denominator over the top-k survivors
    double tau;       // top-p: keep p > tau, and p == tau with id <= tie_id; -1 when off
    int tie_id;
    double min_p_floor;   // keep p >= this (min-p); 0 when off
};

__device__ __forceinline__ double prob_of(double x, const Cut& c) { return exp(x - c.max_x) / c.z; }

__device__ __forceinline__ bool kept(double x, int id, const Cut& c) {
    if (x < c.kth) return false;
    const double p = prob_of(x, c);
    if (c.tau >= 0.0 && !(p > c.tau || (p == c.tau && id <= c.tie_id))) return false;
    return p >= c.min_p_floor;
}

// k-th largest of xs[0..n) (k in 1..n): radix select on order keys, 8 bits per pass from the top.
__device__ double kth_largest(const double* xs, int n, int k, u32* hist, u64* shared_prefix, int* shared_k) {
    u64 prefix = 0, mask = 0;
    int remaining = k;
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const u64 key = order_key(xs[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int b = 255;
            while (b > 0 && (int)hist[b] < remaining) remaining -= hist[b--];
            *shared_prefix = prefix | ((u64)b << shift);
            *shared_k = remaining;
        }
        __syncthreads();
        prefix = *shared_prefix;
        remaining = *shared_k;
        mask |= (u64)255 << shift;
        __syncthreads();
    }
    const u64 key = prefix;
    const u64 bits = (key >> 63) ? (key & 0x7fffffffffffffffull) : ~key;
    return __longlong_as_double((long long)bits);
}

// One row's token, by one block (every thread returns it): sample()'s steps over logits[0..vocab)
// with params [P_COUNT]. seen(i): whether id i is in the history (read only with a repetition
// penalty); draw(): the row's uniform u (read only when sampling); xs: [vocab] float64 scratch;
// known: the greedy argmax where something before already found it (the output head's fold,
// batch_logits' best), else -1 (then plain greedy scans the logits).
template <typename Seen, typename Draw>
__device__ __forceinline__ int sample_row(const float* __restrict__ logits, int vocab,
                                          const double* __restrict__ params, Seen seen, Draw draw,
                                          double* __restrict__ xs, int known)
{
    __shared__ double scratch_d[32];
    __shared__ ArgBest scratch_a[32];
    __shared__ u32 hist[256];
    __shared__ double bin_sum[256];
    __shared__ u64 shared_prefix;
    __shared__ int shared_k;
    __shared__ double shared_d[2];
    __shared__ int shared_i;

    const double temperature = params[P_TEMPERATURE], top_p = params[P_TOP_P];
    const double min_p = params[P_MIN_P], penalty = params[P_PENALTY];
    const int top_k = (int)params[P_TOP_K];
    const bool penalise = penalty != 1.0;

    // 1. repetition penalty, 2. greedy, 3. temperature (values kept in xs for later passes).
    ArgBest best = {-TI_INF, 0x7fffffff};
    const bool greedy = temperature == 0.0 && !penalise;
    const bool folded = greedy && known >= 0;          // the head's fold (or the batch's argmax) holds it
    if (folded) {
        best.index = known;                      // no pass over the logits
    } else if (greedy && (vocab & 3) == 0) {
        // Plain greedy: an argmax with 16-byte loads, eight in flight per thread, compared as
        // float (exactly as in double, without a conversion per logit); a thread visits its ids in
        // increasing order, so the strict > keeps the lowest id of equal values.
        const float4* l4 = reinterpret_cast<const float4*>(logits);
        const int n4 = vocab >> 2;
        float best_value = -TI_INF;
        int best_index = 0x7fffffff;
        auto visit = [&](float v, int i) {
            if (v > best_value) {
                best_value = v;
                best_index = i;
            }
        };
        for (int i0 = threadIdx.x; i0 < n4; i0 += 8 * blockDim.x) {
            float4 v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u)
                if (i0 + u * (int)blockDim.x < n4) v[u] = l4[i0 + u * blockDim.x];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int i = 4 * (i0 + u * blockDim.x);
                if (i < vocab) {
                    visit(v[u].x, i);
                    visit(v[u].y, i + 1);
                    visit(v[u].z, i + 2);
                    visit(v[u].w, i + 3);
                }
            }
        }
        best = ArgBest{best_value, best_index};
    } else {
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            double x = (double)logits[i];
            if (penalise && seen(i)) x = x > 0.0 ? x / penalty : x * penalty;
            if (temperature > 0.0) {
                x = x / temperature;
                xs[i] = x;
            }
            best = better(best, ArgBest{x, i});
        }
    }
    if (!folded) best = block_argmax(best, scratch_a);
    TI_MARK(2);                            // the (penalised, scaled) argmax
    int token = best.index < vocab ? best.index : 0;

    if (temperature > 0.0) {
        __syncthreads();
        Cut cut;
        cut.max_x = best.value;
        cut.kth = -TI_INF;
        cut.tau = -1.0;
        cut.tie_id = vocab;
        cut.min_p_floor = 0.0;
        cut.z = 1.0;
        // 4. top-k
        if (top_k > 0 && top_k < vocab) cut.kth = kth_largest(xs, vocab, top_k, hist, &shared_prefix, &shared_k);
        // 5. softmax over the survivors
        double z = 0.0;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x)
            if (xs[i] >= cut.kth) z += exp(xs[i] - cut.max_x);
        cut.z = block_sum_f64(z, scratch_d);
        // top-p: find the probability tau of the token at which the sorted cumulative sum reaches top_p.
        if (top_p < 1.0) {
            u64 prefix = 0, mask = 0;
            double above = 0.0;              // sum of probabilities with key above the current prefix
            bool found = true;
            for (int shift = 56; shift >= 0 && found; shift -= 8) {
                for (int b = threadIdx.x; b < 256; b += blockDim.x) {
                    hist[b] = 0;
                    bin_sum[b] = 0.0;
                }
                __syncthreads();
                for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                    if (xs[i] < cut.kth) continue;
                    const double p = prob_of(xs[i], cut);
                    const u64 key = (u64)__double_as_longlong(p);     // p >= 0: bits are monotone
                    if ((key & mask) == prefix) {
                        atomicAdd(&hist[(key >> shift) & 255], 1u);
                        atomicAdd(&bin_sum[(key >> shift) & 255], p);
                    }
                }
                __syncthreads();
                if (threadIdx.x == 0) {
                    int b = 255;
                    double acc = above;
                    while (b >= 0 && !(hist[b] > 0 && acc + bin_sum[b] >= top_p)) acc += bin_sum[b--];
                    shared_i = b;
                    shared_d[0] = acc;
                }
                __syncthreads();
                const int b = shared_i;
                above = shared_d[0];
                __syncthreads();
                if (b < 0) {
                    found = false;           // rounding: the whole mass is below top_p, keep all
                } else {
                    prefix |= (u64)b << shift;
                    mask |= (u64)255 << shift;
                }
            }
            if (found) {
                const double tau = __longlong_as_double((long long)prefix);
                // Ties at tau are taken in ascending id order until the cumulative sum reaches top_p.
                const int per = (vocab + blockDim.x - 1) / blockDim.x;
                const int lo = threadIdx.x * per, hi = min(vocab, lo + per);
                int count = 0;
                for (int i = lo; i < hi; ++i)
                    if (xs[i] >= cut.kth && prob_of(xs[i], cut) == tau) ++count;
                const int before = (int)block_exclusive_f64((double)count, scratch_d);
                // Smallest r >= 1 with above + r * tau >= top_p, as the reference's cumulative sum.
                int need = 1;
                while (need < vocab && above + need * tau < top_p) ++need;
                if (threadIdx.x == 0) shared_i = vocab;
                __syncthreads();
                if (before < need && before + count >= need) {
                    int seen_ties = before;
                    for (int i = lo; i < hi; ++i)
                        if (xs[i] >= cut.kth && prob_of(xs[i], cut) == tau && ++seen_ties == need) shared_i = i;
                }
                __syncthreads();
                cut.tau = tau;
                cut.tie_id = shared_i;       // fewer ties than needed: all of them (vocab)
            }
        }
        // 6. min-p: the most likely token always survives, and its probability is exp(0) / z.
        if (min_p > 0.0) cut.min_p_floor = min_p * (1.0 / cut.z);
        // 7. inverse CDF over survivors in id order, probabilities renormalised.
        const int per = (vocab + blockDim.x - 1) / blockDim.x;
        const int lo = threadIdx.x * per, hi = min(vocab, lo + per);
        double mass = 0.0;
        int last_kept = -1;
        for (int i = lo; i < hi; ++i)
            if (kept(xs[i], i, cut)) {
                mass += prob_of(xs[i], cut);
                last_kept = i;
            }
        const double total = block_sum_f64(mass, scratch_d);
        double local = 0.0;
        for (int i = lo; i < hi; ++i)
            if (kept(xs[i], i, cut)) local += prob_of(xs[i], cut) / total;
        const double start = block_exclusive_f64(local, scratch_d);
        const double u = draw();
        ArgBest pick = {-TI_INF, 0};                  // value -id: the lowest id whose cumulative exceeds u
        ArgBest fallback = {-1.0, 0};                   // value id: the last kept id
        if (last_kept >= 0) fallback.value = (double)last_kept;
        double cum = start;
        if (start + local > u) {
            for (int i = lo; i < hi; ++i)
                if (kept(xs[i], i, cut)) {
                    cum += prob_of(xs[i], cut) / total;
                    if (cum > u) {
                        pick.value = -(double)i;
                        break;
                    }
                }
        }
        pick = block_argmax(pick, scratch_a);
        fallback = block_argmax(fallback, scratch_a);
        token = pick.value > -TI_INF ? (int)(-pick.value) : (int)fallback.value;
        if (token < 0) token = best.index;              // nothing kept cannot happen; stay defined
    }
    return token;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_token(
    const float* __restrict__ logits, int vocab,
    const double* __restrict__ params,     // [P_COUNT]: temperature, top_p, min_p, penalty, top_k
    const double* __restrict__ uniforms,   // [n] one draw per generated token, indexed by state[STEP]
    int n_uniforms,
    unsigned char* __restrict__ seen,      // [vocab] history set for the repetition penalty
    double* __restrict__ xs,               // [vocab] scratch
    int* __restrict__ state,
    int* __restrict__ out_tokens, int out_cap,  // [out_cap] by step; may be pinned host memory
    const void* __restrict__ emb_table, int emb_encoding, int emb_cols_pad, int dim,
    float* __restrict__ x,                 // the next step's input: the embedding of the chosen token
    long long* __restrict__ pending,       // the residual in fixed point (mlp.cu), set with x; or null
    u64* __restrict__ head_best)           // the output head's argmax key (common.cuh argmax_key); or null
{
    TI_PROBE;
    pdl_wait();                            // logits come from the output GEMV
    TI_MARK(1);
    __shared__ u64 best_key;
    if (threadIdx.x == 0) {
        best_key = head_best != nullptr ? __ldcg(head_best) : 0ull;
        if (head_best != nullptr) *head_best = 0ull;   // empty for the next step's head
    }
    __syncthreads();
    const int token = sample_row(logits, vocab, params, [&](int i) { return seen[i] != 0; },
                                 [&] { return uniforms[min(state[STATE_STEP], n_uniforms - 1)]; }, xs,
                                 best_key != 0ull ? argmax_key_row(best_key) : -1);
    if (threadIdx.x == 0) {
        const int step = state[STATE_STEP];
        state[STATE_TOKEN] = token;
        if (step < out_cap) out_tokens[step] = token;
        state[STATE_STEP] = step + 1;
        state[STATE_POS] += 1;
        if (params[P_PENALTY] != 1.0) seen[token] = 1;
    }
    // The next decode step starts from this token's embedding (no separate embedding launch).
    const size_t row = (size_t)token * emb_cols_pad;
    for (int k = threadIdx.x; k < dim; k += blockDim.x) store_embedding(emb_table, emb_encoding, row, k, x, pending);
}

// Row b of a batched decode step per block (the layout of its arguments: the top of this file).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) batch_sample(
    const float* logits, int vocab,        // [rows][vocab] (batch_logits)
    const int* best,                       // [rows] batch_logits' argmax, or null: greedy rows scan
    const double* params,                  // [rows][P_COUNT] as sample_token's
    const double* uniforms,                // [rows] this step's draw per row
    const int* positions, const int* slots,  // [rows] the row table's: history length positions[b] + 1
    int* history, int max_context,         // [slots][max_context] ids by position (prompt, generated)
    double* xs,                            // [rows][vocab] scratch
    int* tokens)                           // [rows] out
{
    extern __shared__ u32 seen_bits[];
    TI_PROBE;
    pdl_wait();                            // logits and best come from batch_logits
    TI_MARK(1);
    const int b = blockIdx.x;
    const double* row_params = params + (size_t)b * P_COUNT;
    const int pos = positions[b];
    int* row_history = history + (size_t)slots[b] * max_context;
    const bool penalise = row_params[P_PENALTY] != 1.0;
    const bool plain = row_params[P_TEMPERATURE] == 0.0 && !penalise;
    if (penalise) {                        // the set of ids in history[0 .. pos]
        const int words = (vocab + 31) >> 5, n = min(pos + 1, max_context);
        for (int w = threadIdx.x; w < words; w += blockDim.x) seen_bits[w] = 0u;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const int id = row_history[i];
            if (id >= 0 && id < vocab) atomicOr(&seen_bits[id >> 5], 1u << (id & 31));
        }
        __syncthreads();
    }
    const int token = sample_row(logits + (size_t)b * vocab, vocab, row_params,
                                 [&](int i) { return ((seen_bits[i >> 5] >> (i & 31)) & 1u) != 0u; },
                                 [&] { return uniforms[b]; }, xs + (size_t)b * vocab,
                                 plain && best != nullptr ? best[b] : -1);
    if (threadIdx.x == 0) {
        tokens[b] = token;
        if (pos + 1 < max_context) row_history[pos + 1] = token;
    }
}
