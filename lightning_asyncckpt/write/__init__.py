"""What runs inside the writer process: the jobs the engines' workers run, the ``torch.save`` file and
DCP shard writers, the fast aligned writes and their CRC32s, the lazy gate, and the watch that ends a
writer whose trainer is gone. Nothing here imports Lightning, so that a worker starts quickly.
"""
