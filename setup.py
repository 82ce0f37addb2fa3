"""The package build compiles the native run copy (``kvxferd/datapath/runcopy.c``) where a C compiler
exists, so every install of kvxferd (``pip install``, ``pip install -e``, a wheel from
``python -m build``) carries the fast copy path. The library is loaded with ctypes, not
imported, and is optional: without a compiler the build says so and the package installs
with the torch copy path (``kvxferd status`` and the daemon's start-up log say which runs).
Everything else about the package is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvxferd.datapath._runcopy", ["kvxferd/datapath/runcopy.c"],
                             extra_compile_args=["-O2", "-std=c99"], optional=True)])
