"""The local tier: frequent node-local checkpoints, replicated to peer ranks on other nodes, beside the
rare persistent ones that ``AsyncCheckpointIO`` writes; and recovery from the nearest complete tier.

One concern per module, lowest first:

- ``config``: :class:`LocalTier`, the user's settings, checked when made.
- ``cliques``: which ranks hold each other's shares (NVRx's clique layout).
- ``mapped``: files mapped into memory and reused from save to save (the save's copy is the write).
- ``pinning``: those files registered with CUDA, so that a GPU state's copy runs at pinned speed.
- ``huge_pages``: whether the directory is a tmpfs with huge pages, and the hint to use one.
- ``store``: one rank's files in the node-local directory: a share, its header, its manifest (CRC32s).
- ``shares``: a checkpoint as this rank's share, and back.
- ``packing``: a share's tensors in one flat buffer and its header; CRC32s.
- ``local_replicas``: a replicated (DDP) state's replicas, copied locally and proven by checksums.
- ``replication``: a sharded share as NVRx's ``TensorAwareStateDict``, replicated within its clique (NVRx's).
- ``exchange``: recovery transfers between nodes, point to point over gloo.
- ``trusted_dirs``: which directories the tier trusts (its own user's alone), made 0700 without following a link.
- ``checks``: refusing a missing, shared, untrusted or too small directory at setup.
- ``job_lock``: one job at a time in a session directory (an exclusive lock for the run's life).
- ``run_identity``: which run a local step belongs to; only that run restores it.
- ``recovery``: which step is complete in the local tier, and who sends each share (pure).
- ``persistent_step``: a persistent checkpoint's step, read from its pickle alone (local or on an object store).
- ``preemption``: SIGTERM/SIGUSR1 set a flag, nothing more.
- ``writer``: the background thread that settles the replicas and commits a save.
- ``restore``: refill, check and read the newest complete step on every rank (one try).
- ``deferred_refill``: the replicas a sharded restore leaves for later, sent from the writer's thread.
- ``restore_key``: the name a resume from the local tier goes by (``restore-step-N``).
- ``tier_groups``: the tier's ranks, nodes, cliques and process groups, made once at setup.
- ``boundary``: the step boundary's agreement (preemption, a failed save, the newest complete step).
- ``saving``: one rank's local save: its shares copied into mapped files, handed to the writer.
- ``resuming``: which tier to resume from, and the local restore tried again without a bad copy.
- ``hook``: :class:`LocalTierHook`, the interface the plugin and Lightning's side drive the tier through.
- ``tier_run``: :class:`TierRun`, one run's local tier on one rank: the parts above, composed.
- ``setup``: :func:`open_tier`, which makes the groups, runs the setup checks, takes the lock, then a ``TierRun``.

Its collectives (the step boundary's agreement, its gathers and transfers, its gloo groups) go through
:mod:`lightning_asyncckpt.collectives`. No Lightning here: ``integration`` connects it to the Trainer and to Fabric.
"""
