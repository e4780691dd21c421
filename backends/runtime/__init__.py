"""Runtime helpers the tensor adapters share: the dynamic batcher, inline runs on the event loop's
thread, devices (names, CUDA discovery), lazy imports of optional runtimes, request validation and
slicing, model signatures read from files, and JSON decode errors in one wording.

The adapters themselves (onnxruntime, openvino/, tfserving/, remote/, torch_llm/) and the Backend
protocol (`backends/base.py`) stand beside this package, not in it.
"""
