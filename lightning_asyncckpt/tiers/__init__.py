"""The local tier: frequent node-local checkpoints, replicated to peer ranks on other nodes, beside the
rare persistent ones that ``AsyncCheckpointIO`` writes; and recovery from the nearest complete tier.

One concern per module, lowest first:

- ``config``: :class:`LocalTier`, the user's settings, checked when made.
- ``cliques``: which ranks hold each other's shares (NVRx's clique layout).
- ``store``: one rank's files in the node-local directory: a share, its manifest (size and CRC32).
- ``shares``: a checkpoint as this rank's share, and back.
- ``replication``: the share as NVRx's ``TensorAwareStateDict``, replicated within its clique (NVRx's).
- ``exchange``: recovery transfers between nodes, point to point over gloo.
- ``checks``: refusing a missing, shared or too small directory at setup.
- ``recovery``: which step is complete in the local tier, and who sends each share (pure).
- ``preemption``: SIGTERM/SIGUSR1 set a flag, nothing more.
- ``writer``: the background thread that writes and replicates a share.
- ``run``: :class:`TierRun`, one run's local tier on one rank.

No Lightning here: ``integration`` connects it to the Trainer and to Fabric.
"""
