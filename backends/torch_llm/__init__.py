"""fleetgate's PyTorch LLM engine: paged KV cache, prefix caching and continuous batching.

Modules, one concept each:

- `options`: the deployment's `options:` decoded into a Struct (validated, names the bad option).
- `model_config`: the parts of a Hugging Face `config.json` the model needs.
- `sequence`: one request's token state as the scheduler sees it.
- `block_manager`: the pool of KV blocks, ref counts, prefix caching, LRU eviction (pure Python).
- `scheduler`: continuous batching with a token budget, chunked prefill and preemption (pure Python).
- `model`, `attention`, `loader`: the Llama-family network over a paged KV cache (torch).
- `attention_select`, `attention_triton`, `triton_decode`: the CUDA fast path (a Triton paged-decode
  kernel, probed at load, falling back to gather + SDPA).
- `sampler`, `detokenizer`, `tokenizer`: token choice and text.
- `runner`, `engine`, `async_engine`: one step of the engine, and the thread that drives it.
- `kv_waste`, `costs`: KV waste accounting; bytes a decode step reads (for bandwidth bounds).
- `backend`: the `Backend` adapter the gateway talks to; `demo`: writes a tiny random-weight Llama.

Only `options`, `model_config`, `sequence`, `block_manager`, `scheduler`, `kv_waste` and `costs` are
importable without torch.
"""
