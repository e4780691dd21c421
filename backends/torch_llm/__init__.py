"""fleetgate's PyTorch LLM engine: paged KV cache, prefix caching and continuous batching.

The core loop, one concept per module:

- `options`: the deployment's `options:` decoded into a Struct (validated, names the bad option).
- `sequence`: one request's token state as the scheduler sees it.
- `block_manager`: the pool of KV blocks, ref counts, prefix caching, LRU eviction (pure Python).
- `scheduler`: continuous batching with a token budget, chunked prefill and preemption (pure Python).
- `sampler`, `detokenizer`, `tokenizer`: token choice and text.
- `runner`, `engine`, `async_engine`: one step of the engine, and the thread that drives it;
  `factory` assembles them from a model folder.
- `kv_waste`, `metrics`: KV waste accounting; the Prometheus metrics.
- `backend`: the `Backend` adapter the gateway talks to; `requests`: a request's checks, prompt ids,
  logprob entries and stream failures.

Subpackages, one concept each: `model/` (the Llama-family network over a paged KV cache, its
attention interface, config, loader, int8 quantization, step costs), `kernels/` (the fast paths
checked against the torch path at load: C++ CPU kernels, oneDNN linears, the Triton decode kernel,
CUDA graphs, the attention choice), `lora/` (multi-LoRA) and `structured/` (constrained decoding).

Only `options`, `sequence`, `block_manager`, `scheduler`, `kv_waste`, `requests`, `model.config` and
`model.costs` are importable without torch.
"""
