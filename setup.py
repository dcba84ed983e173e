"""The one thing pyproject.toml cannot say: the optional compiled helpers.

``shmbuf.sampling._sumtree_c`` speeds up prioritized sampling's per-batch walks,
``shmbuf._stream_c`` a writer's stores of large rows, ``shmbuf._add_c`` (built against
NumPy's headers) ``Writer.add``'s check and stores of one row, and ``workers._take_c`` the
learner's common case of ``SamplerPool.next()``. They are built when a C compiler and the
Python headers are at hand and skipped (``optional=True``) when not: shmbuf then runs its
NumPy code, which gives the same trees and the same rows.
"""

from setuptools import Extension, setup


def numpy_include() -> list[str]:
    """NumPy's C headers, for ``_add_c`` (pyproject's build requirements install NumPy)."""
    try:
        import numpy
    except ImportError:  # a build without NumPy: _add_c is skipped (optional)
        return []
    return [numpy.get_include()]


setup(ext_modules=[
    Extension(
        "shmbuf.sampling._sumtree_c", ["shmbuf/sampling/_sumtree_c.c"], optional=True,
        # No contraction into fused multiply-adds: sums must round as NumPy's do.
        extra_compile_args=["-O3", "-ffp-contract=off"],
    ),
    Extension("shmbuf._stream_c", ["shmbuf/_stream_c.c"], depends=["shmbuf/_stream_copy.h"],
              optional=True, extra_compile_args=["-O2"]),
    Extension("shmbuf._add_c", ["shmbuf/_add_c.c"], depends=["shmbuf/_stream_copy.h"],
              include_dirs=numpy_include(), optional=True, extra_compile_args=["-O3"]),
    Extension("workers._take_c", ["workers/_take_c.c"], optional=True,
              extra_compile_args=["-O2"]),
])
