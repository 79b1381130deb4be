"""The snapshot: a checkpoint dict as a skeleton and flat tensors, copied into reused host buffers.

Runs on the training side (the eager copy in the save call, the lazy copy in a background thread) and
in the writer (``staging.join`` rebuilds the dict). Imports torch only: no Lightning, no engine.
"""
