"""The snapshot: a checkpoint dict as a skeleton and flat tensors, copied into reused host buffers.

Runs on the training side (the eager copy in the save call, the lazy copy in a background thread) and
in the writer (``staging.join`` rebuilds the dict). Imports torch only: no Lightning, no engine.

- ``tree``: a dict as skeleton plus ``{fqn: tensor}``, and the ranks' shares (structure, no copies).
- ``staging``: the copy into host buffers, and the dict rebuilt from them.
- ``buffer_pool``: the reused buffer sets, who holds them, and when one is free again.
- ``lazy``: which tensors may be copied after the save call returns, the background copy, and its proof.
- ``subclasses``: tensor subclasses: written as they are, taken apart for staging, or dequantized.
"""
