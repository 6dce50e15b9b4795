"""CUDA kernels (compiled at run time by NVRTC through CuPy) and their launch wrappers.

build.py loads and compiles the .cu sources; gemv.py, attention.py, sampling.py and misc.py (decode)
and prefill.py (prompt processing) build launches and hold each kernel family's NumPy reference.
Importing never requires CuPy.
"""
