"""Drop-in storage and buffers for training libraries (``shmbuf.integrations.sb3``,
``shmbuf.integrations.torchrl``), each behind its own optional extra (``shmbuf[sb3]``,
``shmbuf[torchrl]``). Nothing in ``shmbuf`` imports this package; import the submodule you need.
"""
