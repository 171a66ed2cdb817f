"""Layer 3 and 4: graphs.  The graph-ops role every backend fills, capture spaces an
engine's own graph runner uses (:class:`GraphPool`), and :class:`GraphExecutor`, a
complete runner (buckets, persistent buffers, output copies) built on them.
"""
