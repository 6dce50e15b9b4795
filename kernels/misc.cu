// Small kernels: embedding gather (for tokens the host feeds in; the sampler embeds the tokens it picks) and the measurement helpers
// used by autotuning and --bench (a read-bandwidth probe and a GPU-side wait).
#include "common.cuh"

// x[k] = table[token][k] as float32, token read from the decode state; also into the fixed-point
// residual of a fused step (mlp.cu `pending`), if any. A step fed from here starts with the output
// head's argmax key empty (`head_best`, sampling.cu), whatever ran the head alone before.
extern "C" __global__ void embed(const void* __restrict__ table, int encoding, int cols_pad, int dim,
                      const int* __restrict__ state, float* __restrict__ x, long long* __restrict__ pending,
                      u64* __restrict__ head_best)
{
    if (head_best != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *head_best = 0ull;
    const size_t row = (size_t)state[STATE_TOKEN] * cols_pad;
    for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < dim; k += gridDim.x * blockDim.x)
        store_embedding(table, encoding, row, k, x, pending);
}

// Read n16 16-byte words with a grid-stride loop; the xor is written only if `sink_if` matches,
// which never happens, so the loads cannot be optimised away. Its bandwidth is the ceiling that
// --bench compares against.
extern "C" __global__ void read_bandwidth(const uint4* __restrict__ data, u64 n16, u32 sink_if, u32* __restrict__ sink)
{
    u32 acc = 0;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {      // four loads in flight per thread
        const uint4 a = load_stream(data + i), b = load_stream(data + i + stride);
        const uint4 c = load_stream(data + i + 2 * stride), d = load_stream(data + i + 3 * stride);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n16; i += stride) {
        const uint4 a = load_stream(data + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (acc == sink_if) sink[0] = acc;
}

// Keep the GPU busy for about `ns` nanoseconds, so that launches queued behind it run back to
// back (timing without the host's launch cost in the measurement).
extern "C" __global__ void gpu_wait(long long ns)
{
    const long long start = clock64();
    const long long cycles = ns * 2;   // generous: clocks are at most ~2 GHz
    while (clock64() - start < cycles) {
    }
}
