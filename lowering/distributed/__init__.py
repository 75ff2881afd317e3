"""Tensor-parallel runs: the sharded runner and its Dask executor.
"""
