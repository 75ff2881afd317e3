"""The backends: the registry (``run``, ``prepare``, ``register_backend``), the runner contract, input checks, and one
module per backend (NumPy interpreter, onnxruntime and its weight placement, ONNX's reference evaluator, torch).
"""
