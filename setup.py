"""Build of the optional C accelerator ``kvflow._native`` (everything else is in pyproject.toml).

The extension is optional: without a C compiler the install still succeeds and kvflow runs
its pure-Python core (same results, slower). ``kvflow --version`` says which core is active.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvflow._native",
            sources=["csrc/module.c", "csrc/evolve.c", "csrc/decide.c"],
            depends=["csrc/native.h"],
            extra_compile_args=["-O2", "-Wall", "-Wno-unused-function"],
            optional=True,
        )
    ]
)
