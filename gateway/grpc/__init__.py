"""The gRPC front door: KServe v2 / Triton `GRPCInferenceService`, TF Serving `PredictionService`
and `ModelService`, the standard health service and server reflection, on one `grpc.aio` server in
the gateway's own event loop (`server.grpc_port`).

The servicers are protocol adapters like the HTTP ones: each RPC becomes a `Call` (the bearer key
and the rest of the metadata) served by the same core (`gateway/core/service.py`), so a limit is one limit
whichever protocol spends it. The wire messages are the generated modules shipped by the clients'
own packages (`tritonclient.grpc`, `tensorflow-serving-api`), so what fleetgate accepts is exactly
what those clients send.
"""
