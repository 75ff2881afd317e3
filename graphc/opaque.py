"""``Opaque``: an ONNX node graphc does not model, carried through unchanged.

An imported model may hold ops graphc has no semantics for (a custom domain's
op, ``TopK``, ``ScatterND`` ...).  The importer keeps each as one ``Opaque``
node with the output types ONNX shape inference (or the model) declares.  The
optimizer treats it as a black box (never matched, never folded), the ONNX
export writes the node back as it was, and the NumPy interpreter runs
standard-domain ones through ONNX's reference evaluator; any other backend that
cannot run it raises an error naming the node, op type and domain.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .dims import Dim, dim_symbols, eval_dim, normalize_shape
from .errors import OpError
from .ops import Dims, Op, TensorType, check_dtype, register_op

__all__ = ["Opaque", "MAX_SLOT"]

MAX_SLOT = 1 << 16
"""One more than the highest ONNX input position an opaque node may name."""


@register_op
@dataclass(frozen=True)
class Opaque(Op):
    """An ONNX node kept as it was: ``domain::op_type`` with its attributes (a serialized ``NodeProto``) and declared outputs.

    ``slots[i]`` is the ONNX input position of graphc input ``i`` (omitted
    optional inputs leave gaps); ``opset`` is the version of ``domain`` the node
    was written for.
    """

    op_type: str
    domain: str
    opset: int
    proto: str
    output_shapes: tuple[tuple[Dim, ...], ...]
    output_dtypes: tuple[str, ...]
    slots: tuple[int, ...] = ()
    arity: ClassVar[int | None] = None

    def __post_init__(self) -> None:
        for name in ("op_type", "domain", "proto"):
            if not isinstance(getattr(self, name), str):
                raise OpError(f"Opaque: attribute {name!r} must be a string, got {getattr(self, name)!r}")
        if isinstance(self.opset, bool) or not isinstance(self.opset, (int, np.integer)) or self.opset < 1:
            raise OpError(f"Opaque: attribute 'opset' must be an int >= 1, got {self.opset!r}")
        object.__setattr__(self, "opset", int(self.opset))
        object.__setattr__(self, "output_shapes", tuple(normalize_shape(s) for s in self.output_shapes))
        object.__setattr__(self, "output_dtypes", tuple(check_dtype(d) for d in self.output_dtypes))
        if any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in self.slots):
            raise OpError(f"Opaque {self.qualified_name}: attribute 'slots' holds input positions (ints), got {self.slots!r}")
        object.__setattr__(self, "slots", tuple(int(s) for s in self.slots))
        bad = next((x for i, x in enumerate(self.slots) if not 0 <= x < MAX_SLOT or (i and x <= self.slots[i - 1])), None)
        if bad is not None:
            raise OpError(
                f"Opaque {self.qualified_name}: input slot {bad} is not an ONNX input position (increasing positions in 0..{MAX_SLOT - 1})"
            )
        if len(self.output_shapes) != len(self.output_dtypes) or not self.output_dtypes:
            raise OpError(f"Opaque {self.qualified_name}: needs one dtype per output shape and at least one output")
        self._check_proto()

    def _check_proto(self) -> None:
        """The serialized node must be the op this node names: what ``str(graph)`` prints is what runs and is exported."""
        import onnx

        node = onnx.NodeProto()
        try:
            node.ParseFromString(base64.b64decode(self.proto, validate=True))
        except Exception as e:  # noqa: BLE001 - bad base64 or protobuf: the attribute is at fault
            raise OpError(f"Opaque {self.qualified_name}: attribute 'proto' is not a base64 ONNX NodeProto ({type(e).__name__})") from None
        if node.op_type != self.op_type or (node.domain or "ai.onnx") != (self.domain or "ai.onnx"):
            raise OpError(
                f"Opaque {self.qualified_name}: attribute 'proto' holds a {(node.domain or 'ai.onnx')}::{node.op_type} node; "
                "op_type and domain must name the node the proto holds"
            )

    @property
    def qualified_name(self) -> str:
        """``domain::op_type`` (``ai.onnx`` for the standard domain)."""
        return f"{self.domain or 'ai.onnx'}::{self.op_type}"

    @property
    def num_outputs(self) -> int:  # type: ignore[override]
        """As many outputs as the node declares."""
        return len(self.output_dtypes)

    def check_arity(self, n: int) -> None:
        if self.slots and len(self.slots) != n:
            raise OpError(f"Opaque {self.qualified_name}: declared {len(self.slots)} input slot(s), got {n} input(s)")

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        return self.infer_all(ins)[0]

    def infer_all(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        self._check_operands([t.shape for t in ins])
        return tuple(TensorType(s, d) for s, d in zip(self.output_shapes, self.output_dtypes))

    def _check_operands(self, shapes: Sequence[Sequence[Dim]], arrays: Sequence[np.ndarray] | None = None) -> None:
        """The shape rules of the scatter ops' schemas (onnxruntime refuses what they forbid; ONNX's reference
        evaluator does not), on the dims known here; with ``arrays``, the indices' range too."""
        if self.domain not in ("", "ai.onnx") or self.op_type not in ("ScatterElements", "Scatter", "ScatterND") or len(shapes) != 3:
            return
        data, indices, updates = (tuple(s) for s in shapes)
        where = f"{self.qualified_name}"
        if self.op_type == "ScatterND":
            k = indices[-1] if indices else None
            if not indices or (isinstance(k, int) and k > len(data)):
                raise OpError(f"{where}: indices {list(indices)} must end in an axis of at most the data's rank {len(data)}")
            if isinstance(k, int) and not _same_shape(updates, indices[:-1] + data[k:]):
                raise OpError(f"{where}: updates {list(updates)} must be indices[:-1] + data[{k}:] = {list(indices[:-1] + data[k:])}")
            return
        axis = self._int_attribute("axis", 0)
        if len(indices) != len(data) or not _same_shape(indices, updates):
            raise OpError(f"{where}: indices {list(indices)} and updates {list(updates)} must have one shape, of the data's rank {len(data)}")
        if not -len(data) <= axis < len(data):
            raise OpError(f"{where}: axis {axis} is out of range for data of rank {len(data)}")
        if arrays is not None and arrays[1].size:
            n = arrays[0].shape[axis]
            lo, hi = int(arrays[1].min()), int(arrays[1].max())
            if lo < -n or hi >= n:
                raise OpError(f"{where}: indices span {lo}..{hi}, outside [-{n}, {n}) of data axis {axis % len(data)}")

    def _int_attribute(self, name: str, default: int) -> int:
        import onnx

        node = onnx.NodeProto()
        node.ParseFromString(base64.b64decode(self.proto))
        found = next((a for a in node.attribute if a.name == name), None)
        return int(found.i) if found is not None else default

    def node_proto(self, inputs: Sequence[str], outputs: Sequence[str], name: str) -> Any:
        """The ONNX ``NodeProto`` with the given value names (omitted inputs as ``""``)."""
        import onnx

        node = onnx.NodeProto()
        node.ParseFromString(base64.b64decode(self.proto))
        slots = self.slots or tuple(range(len(inputs)))
        names = [""] * (max(slots) + 1 if slots else 0)
        for slot, value in zip(slots, inputs):
            names[slot] = value
        del node.input[:]
        del node.output[:]
        node.input.extend(names)
        node.output.extend(outputs)
        node.name = name
        return node

    def evaluate_all(self, args: Sequence[np.ndarray], dims: Dims) -> tuple[np.ndarray, ...]:
        if self.domain not in ("", "ai.onnx"):
            raise OpError(
                f"Opaque {self.qualified_name}: graphc has no NumPy semantics for this op; run it on onnxruntime (ort-cpu) or export the model"
            )
        import onnx
        from onnx import helper
        from onnx.reference import ReferenceEvaluator

        self._check_operands([a.shape for a in args], args)
        in_names = [f"in{i}" for i in range(len(args))]
        out_names = [f"out{i}" for i in range(self.num_outputs)]
        node = self.node_proto(in_names, out_names, "opaque")
        g = helper.make_graph(
            [node],
            "opaque",
            [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape)) for n, a in zip(in_names, args)],
            [helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in out_names],
        )
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)])
        try:
            results = ReferenceEvaluator(model).run(None, {n: np.array(a, copy=True, order="C") for n, a in zip(in_names, args)})  # owned, contiguous
        except Exception as e:  # noqa: BLE001 - onnx's evaluator raises anything; report it on the op
            raise OpError(f"Opaque {self.qualified_name}: ONNX's reference evaluator failed: {type(e).__name__}: {e}") from None
        outs = tuple(np.asarray(r).astype(d, copy=False) for r, d in zip(results, self.output_dtypes))
        self._check_results(outs, dims)
        return outs

    def _check_results(self, outs: Sequence[np.ndarray], dims: Dims) -> None:
        """The node must return the outputs it declares (their number, and every dim that is known here)."""
        if len(outs) != self.num_outputs:
            raise OpError(f"Opaque {self.qualified_name}: declares {self.num_outputs} output(s), the node returned {len(outs)}")
        for i, (out, shape) in enumerate(zip(outs, self.output_shapes)):
            known = [eval_dim(d, dims) if dim_symbols(d) <= dims.keys() else None for d in shape]
            if out.ndim != len(shape) or any(k is not None and k != n for k, n in zip(known, out.shape)):
                raise OpError(
                    f"Opaque {self.qualified_name}: output {i} is declared {list(shape)}{' with ' + str(dict(dims)) if dims else ''}, "
                    f"the node returned {list(out.shape)}"
                )

    def __str__(self) -> str:
        outs = ", ".join(str(TensorType(s, d)) for s, d in zip(self.output_shapes, self.output_dtypes))
        return f"Opaque[{self.qualified_name}, opset={self.opset}, outputs=({outs})]"


def _same_shape(a: Sequence[Dim], b: Sequence[Dim]) -> bool:
    """Whether two shapes can be equal: one rank, and no two known dims that differ."""
    return len(a) == len(b) and all(x == y or not (isinstance(x, int) and isinstance(y, int)) for x, y in zip(a, b))
