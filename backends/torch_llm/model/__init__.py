"""The network and its weights: the Llama-family model over a paged KV cache (`llama`), the attention
interface and its gather + SDPA implementation (`attention`), the parts of a Hugging Face
`config.json` it needs (`config`), reading the safetensors (`loader`), int8 weight-only linears
(`quantization`), and the bytes a decode step reads, for bandwidth bounds (`costs`).

`config` and `costs` import no torch."""
