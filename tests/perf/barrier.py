"""Run by hand on a GPU (`python3 tests/perf/barrier.py`): what one dependent step costs as a kernel boundary
inside a CUDA graph with programmatic dependent launch (what the decode step does now), as a grid-wide barrier
inside one persistent kernel (what a per-layer or per-step kernel would do instead), and as a wait for one
producer block's flag (what a kernel with per-tile dependencies would do). Each step, every block writes one
value and, after the step's synchronisation, reads a value another block wrote: a producer-to-consumer
hand-off.

Prints us per step for 132 and 264 blocks of 256 threads (one and two per SM on an H200)."""
import cupy as cp
import numpy as np

from tinyinfer.kernels.build import Launch, compile_options

SRC = r"""
typedef unsigned int u32;

// One step of a PDL chain: start early, wait for the previous kernel, hand a value on.
extern "C" __global__ void pdl_step(float* data, int step) {
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    if (threadIdx.x == 0) {
        const float got = __ldcg(data + (blockIdx.x + 1) % gridDim.x);
        data[gridDim.x + blockIdx.x] = got;           // keep the read
        data[blockIdx.x] = (float)step;
    }
}

// n steps in one kernel: write, grid barrier (release add, acquire spin), read another block's value.
extern "C" __global__ void barrier_steps(u32* counter, float* data, int n) {
    u32 target = 0;
    float acc = 0.f;
    for (int i = 0; i < n; ++i) {
        if (threadIdx.x == 0) data[blockIdx.x] = (float)i;
        __syncthreads();
        target += gridDim.x;
        if (threadIdx.x == 0) {
            asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(counter) : "memory");
            u32 seen;
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(counter) : "memory");
            } while (seen < target);
            acc += __ldcg(data + (blockIdx.x + 1) % gridDim.x);
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) data[gridDim.x + blockIdx.x] = acc;
}

// n steps in one kernel, each block waiting only for the one block whose value it reads: a flag per
// block (release store, acquire spin), the dataflow hand-off of a kernel without grid barriers.
extern "C" __global__ void flag_steps(u32* flags, float* data, int n) {
    const int from = (blockIdx.x + 1) % gridDim.x;
    float acc = 0.f;
    for (int i = 1; i <= n; ++i) {
        if (threadIdx.x == 0) {
            data[blockIdx.x] = (float)i;
            asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(flags + blockIdx.x), "r"((u32)i) : "memory");
            u32 seen;
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(flags + from) : "memory");
            } while (seen < (u32)i);
            acc += __ldcg(data + from);
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) data[gridDim.x + blockIdx.x] = acc;
}
"""


def timed(fn, stream, repeats=5) -> float:
    times = []
    for _ in range(repeats):
        start = stream.record()
        fn()
        end = stream.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1000.0)
    return float(np.median(times))


def pdl_chain_us(module, stream, blocks: int, steps: int, early: bool) -> float:
    data = cp.zeros(2 * blocks, cp.float32)
    kernel = module.get_function("pdl_step")
    launches = [Launch("step", kernel, (blocks,), (256,), (data, np.int32(i)), waits=True) for i in range(steps)]
    stream.begin_capture()
    for launch in launches:
        launch(stream, early=early)
    graph = stream.end_capture()
    graph.upload(stream)
    graph.launch(stream)
    return timed(lambda: graph.launch(stream), stream) / steps


def in_kernel_us(module, stream, name: str, blocks: int, steps: int) -> float:
    """us per step of barrier_steps / flag_steps: n steps timed against none. Their synchronisation
    words (one counter, or a flag per block) start at zero."""
    sync = cp.zeros(blocks, cp.uint32)
    data = cp.zeros(2 * blocks, cp.float32)
    kernel = module.get_function(name)

    def run(n):
        sync.fill(0)
        kernel((blocks,), (256,), (sync, data, np.int32(n)), stream=stream)

    with stream:
        run(steps)
        whole = timed(lambda: run(steps), stream)
        none = timed(lambda: run(0), stream)
    return (whole - none) / steps


def main() -> None:
    cc = int(cp.cuda.Device().compute_capability)
    module = cp.RawModule(code=SRC, options=compile_options(cc))
    stream = cp.cuda.Stream(non_blocking=True)
    sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    for blocks in (sms, 2 * sms):
        with stream:
            pdl = pdl_chain_us(module, stream, blocks, 200, early=True)
            plain = pdl_chain_us(module, stream, blocks, 200, early=False)
        grid = in_kernel_us(module, stream, "barrier_steps", blocks, 1000)
        flag = in_kernel_us(module, stream, "flag_steps", blocks, 1000)
        print(f"{blocks} blocks x 256 threads, us per dependent step: graph node with PDL {pdl:.2f}, "
              f"graph node without PDL {plain:.2f}, grid barrier in one kernel {grid:.2f}, "
              f"one producer's flag in one kernel {flag:.2f}", flush=True)


if __name__ == "__main__":
    main()
