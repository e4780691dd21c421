"""`backend: openvino_llm`: LLMs on OpenVINO GenAI's continuous-batching pipeline (Intel CPU, GPU,
NPU), exported from Hugging Face folders by `fleetgate export-llm` (backends/openvino_llm/export.py)."""
