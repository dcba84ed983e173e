"""Adapters that let training libraries use shmbuf buffers as their own (``torchrl``, ``sb3``).

Each submodule imports its library on import; install the matching extra (``shmbuf[torchrl]``).
"""
