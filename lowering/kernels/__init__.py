"""Kernels the backends call: the NumPy attention kernel and its compiled (numba) forms, contraction plans, low-
precision weights read as stored, and graphc's worker threads.
"""
