"""The package's version, in a module of its own so that any layer (the writer included) can name it
without importing the package's public faces."""

__version__ = "0.1.0.dev0"
