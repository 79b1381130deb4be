"""The faces Lightning and Fabric call: ``AsyncCheckpointIO``, the finalizer callback, the strategies,
the logger relay, and the few places where Lightning's own behaviour is adjusted. ``contract`` names the one
interface through which they reach the plugin's save session, and the strategies' capabilities. The only
subpackage that imports Lightning.
"""
