"""Import ONNX models as graphc graphs: :func:`from_onnx`.

Shape computations fold into symbolic dims, fused ops (``Attention``,
``RotaryEmbedding``, the norms) decompose into einsums with ONNX's reference
semantics, and ops graphc does not model pass through as opaque nodes.
"""

from .importer import ATTENTION_SEMANTICS, from_onnx, supported_ops
from .loading import MAX_DIM, load_model, read_model

__all__ = ["ATTENTION_SEMANTICS", "from_onnx", "supported_ops", "load_model", "read_model", "MAX_DIM"]
