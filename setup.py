"""The one part of the build pyproject.toml does not hold (its ext-modules table is still experimental in
setuptools): the front in C (worker/serve/_front*.c, used by worker/serve/native.py), on two well-kept libraries
installed from the system's packages, never copied into this project:

- libnghttp2 (Debian's libnghttp2-dev): HTTP/2 for the gRPC port, found with pkg-config (or NGHTTP2_CFLAGS and
  NGHTTP2_LIBS);
- llhttp (Debian's node-llhttp ships its C sources and header, not a library): HTTP/1.1 for the HTTP port, its
  sources compiled into the extension from LLHTTP_DIR (default /usr/share/llhttp) with the header from
  LLHTTP_INCLUDE (default /usr/share/include/llhttp).

Optional: where it cannot be built (no C compiler, no epoll, the libraries missing), the package installs without it
and `tandem serve` serves every request in Python, saying why in its log. TANDEM_REQUIRE_FRONT=1 makes a failed
build an error instead (`make setup` and the worker image ask for it)."""

import os
import shlex
import subprocess
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

LLHTTP_DIR = Path(os.environ.get("LLHTTP_DIR", "/usr/share/llhttp"))
LLHTTP_INCLUDE = Path(os.environ.get("LLHTTP_INCLUDE", "/usr/share/include/llhttp"))
LLHTTP_SOURCES = [LLHTTP_DIR / name for name in ("llhttp.c", "api.c", "http.c")]


def pkg_config(package: str, flag: str, override: str) -> list[str]:
    """pkg-config's `flag` for `package`, or the environment's `override`; nothing when neither is there (the
    compiler's default paths then)."""
    if override in os.environ:
        return shlex.split(os.environ[override])
    try:
        found = subprocess.run(["pkg-config", flag, package], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return []
    return shlex.split(found.stdout)


def front() -> Extension:
    nghttp2_cflags = pkg_config("libnghttp2", "--cflags", "NGHTTP2_CFLAGS")
    nghttp2_libs = pkg_config("libnghttp2", "--libs", "NGHTTP2_LIBS") or ["-lnghttp2"]
    return Extension(
        "tandem.worker.serve._front",
        ["worker/serve/_front.c", "worker/serve/_front_grpc.c", "worker/serve/_front_parse.c",
         "worker/serve/_front_infer.c"],
        depends=["worker/serve/_front.h", "worker/serve/_front_parse.h", "worker/serve/_front_infer.h",
                 "worker/serve/_front_answer.h"],
        include_dirs=[str(LLHTTP_INCLUDE)],
        optional=os.environ.get("TANDEM_REQUIRE_FRONT") != "1",
        extra_compile_args=["-O2", "-fvisibility=hidden", *nghttp2_cflags],
        extra_link_args=nghttp2_libs,
    )


class BuildWithLlhttp(build_ext):
    """Compiles llhttp's sources from where the system keeps them. They are added for the compilation only:
    setuptools lists an Extension's sources among the project's files, which must be paths inside it."""

    def build_extension(self, ext: Extension) -> None:
        own = ext.sources
        ext.sources = [*own, *map(str, LLHTTP_SOURCES)]
        try:
            super().build_extension(ext)
        finally:
            ext.sources = own


setup(ext_modules=[front()], cmdclass={"build_ext": BuildWithLlhttp})
