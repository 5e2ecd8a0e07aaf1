"""The one part of the build pyproject.toml does not hold (its ext-modules table is still experimental in
setuptools): the HTTP front in C (worker/serve/_front.c, used by worker/serve/native.py). Optional: where it cannot be
built (no C compiler, no epoll), the package installs without it and `tandem serve` serves every request in Python,
saying why in its log."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("tandem.worker.serve._front", ["worker/serve/_front.c", "worker/serve/_front_grpc.c"],
                             depends=["worker/serve/_front.h", "worker/serve/_front_tables.h"], optional=True,
                             extra_compile_args=["-O2", "-fvisibility=hidden"])])
