"""The KV-cache contract (:mod:`lowering.decode.kv_cache`) and the NumPy backend's growable buffers; the greedy loop
that drives them over any backend stands above the backends, in :mod:`lowering.generate`.
"""
