"""Decoding: the generate loop and the KV-cache contract, with the NumPy backend's growable buffers.
"""
