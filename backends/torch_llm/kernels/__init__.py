"""The engine's fast paths: each replaces a torch path, is checked against it at load, and falls
back to it with one warning.

- CPU, C++ (`*.cpp`, built once per install by `build_kernels`, loaded by `cpu_extension`): paged
  decode attention (`attention_cpu`), fused norm/rotary/SiLU steps (`fused_cpu`), blocked float32
  linears (`blocked_linear`); oneDNN's packed linears (`packed_linear`).
- CUDA: the Triton paged-decode kernel (`triton_decode`, `attention_triton`) and decode steps replayed
  as CUDA graphs (`cuda_graphs`).
- `attention_select`: which attention a deployment runs (`attention_backend`), after its probe.
"""
