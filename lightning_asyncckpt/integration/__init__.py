"""The faces Lightning and Fabric call: ``AsyncCheckpointIO``, the finalizer callback, the strategies,
the logger relay, and the few places where Lightning's own behaviour is adjusted. The only subpackage
that imports Lightning.
"""
