"""GPU timing for the hand-run experiments (tests/gpu_exp_*.py): launches replayed in a CUDA graph."""
import cupy as cp


def graph_us_per_launch(launches, repeats: int) -> float:
    """GPU microseconds per launch of `launches` (callables taking a stream), captured `repeats`
    times into one CUDA graph and timed on its second replay (the first warms up)."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for _ in range(repeats):
            for launch in launches:
                launch(stream)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) * 1e3 / (repeats * len(launches))
