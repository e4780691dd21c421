"""Every model fleetgate writes itself, in one place: for `fleetgate demo-models`, tests and benches.

- `digits`: the demo digits MLP, trained on scikit-learn's bundled digits and written as ONNX.
- `exports`: the same weights as an OpenVINO IR and a TensorFlow SavedModel (parity across runtimes).
- `cnn`: a small CNN on the same digits split, trained with torch (INT8 quantization tests and bench).
- `tiny_llama`: a random-weight Llama in the Hugging Face layout, for the torch_llm engine.

Nothing here is imported on the request path; heavy libraries are imported inside the writers.
"""
