"""The one thing pyproject.toml cannot say: the optional compiled helpers.

``shmbuf.sampling._sumtree_c`` speeds up prioritized sampling's per-batch walks, and
``shmbuf._stream_c`` a writer's stores of large rows. They are built when a C compiler and the
Python headers are at hand and skipped (``optional=True``) when not: shmbuf then runs its
NumPy code, which gives the same trees and the same rows.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension(
        "shmbuf.sampling._sumtree_c", ["shmbuf/sampling/_sumtree_c.c"], optional=True,
        # No contraction into fused multiply-adds: sums must round as NumPy's do.
        extra_compile_args=["-O3", "-ffp-contract=off"],
    ),
    Extension("shmbuf._stream_c", ["shmbuf/_stream_c.c"], optional=True,
              extra_compile_args=["-O2"]),
])
