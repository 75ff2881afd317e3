"""Backends that run graphc graphs: the NumPy interpreter (reference semantics) and more."""

from .contraction import contract, contract_pair, plan_matmul
from .inputs import check_inputs, random_inputs
from .numpy_interpreter import NumpyInterpreter, run_numpy

__all__ = ["NumpyInterpreter", "run_numpy", "check_inputs", "random_inputs", "contract", "contract_pair", "plan_matmul"]
