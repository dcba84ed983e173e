"""Drop-in buffers for training libraries (``shmbuf.integrations.sb3``, ...), each behind its own
optional extra. Nothing in ``shmbuf`` imports this package; import the submodule you need.
"""
