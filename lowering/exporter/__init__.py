"""ONNX export: the model builder, each op's emitter, the attention forms per target (the ONNX Attention op,
onnxruntime's GroupQueryAttention, chunked) and the attention targets of every backend.
"""
