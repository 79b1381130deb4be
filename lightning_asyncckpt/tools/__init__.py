"""Reading checkpoints back for people: ``inspect``, ``verify``, ``convert`` and ``clean`` as library
code, and the command line that only parses and prints.
"""
