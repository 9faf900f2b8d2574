"""Optional build of the native accelerator ``fastckpt._native`` (metadata lives in pyproject.toml).

The extension needs a C compiler and the xxHash header and library (Debian/Ubuntu: ``libxxhash-dev``,
Fedora: ``xxhash-devel``, Homebrew: ``xxhash``). Without them, or with ``FASTCKPT_NO_NATIVE_BUILD=1``,
the build warns and installs pure Python; fastckpt then hashes through the ``xxhash`` package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError

BUILD_ERRORS = (CCompilerError, CompileError, ExecError, LinkError, PlatformError, OSError)
DISPATCH_PROBE = "#include <xxh_x86dispatch.h>\nint main(void) { return (int)XXH3_128bits_dispatch(\"\", 0).low64; }\n"


def _warn(message: str) -> None:
    print(f"WARNING: fastckpt native accelerator not built: {message}; using the pure-Python fallback", flush=True)


def _pkg_config(ext: Extension) -> None:
    """Add xxHash's include / library dirs from pkg-config when it knows them (e.g. Homebrew)."""
    if shutil.which("pkg-config") is None:
        return
    try:
        out = subprocess.run(["pkg-config", "--cflags-only-I", "--libs-only-L", "libxxhash"],
                             capture_output=True, text=True, check=True).stdout.split()
    except subprocess.CalledProcessError:
        return
    ext.include_dirs += [flag[2:] for flag in out if flag.startswith("-I")]
    ext.library_dirs += [flag[2:] for flag in out if flag.startswith("-L")]


class OptionalBuildExt(build_ext):
    """build_ext that skips the extension, with a warning, when it cannot be compiled."""

    def run(self) -> None:
        if os.environ.get("FASTCKPT_NO_NATIVE_BUILD", "0") not in ("", "0"):
            _warn("FASTCKPT_NO_NATIVE_BUILD is set")
            self._drop_stale()
            return
        try:
            super().run()
        except BUILD_ERRORS as exc:  # no usable compiler at all (e.g. no MSVC on Windows)
            _warn(str(exc))
            self._drop_stale()

    def build_extension(self, ext: Extension) -> None:
        _pkg_config(ext)
        if self._links(DISPATCH_PROBE, ext):
            ext.define_macros.append(("FASTCKPT_XXH_DISPATCH", "1"))
        try:
            super().build_extension(ext)
        except BUILD_ERRORS as exc:
            _warn(f"{exc} (needs a C compiler and the xxHash header and library, e.g. libxxhash-dev)")
            self._drop_stale()

    def _drop_stale(self) -> None:
        """Remove extension files left in the build dir by an earlier build, so none gets installed."""
        for ext in self.extensions:
            path = self.get_ext_fullpath(ext.name)
            if os.path.exists(path):
                os.remove(path)

    def _links(self, source: str, ext: Extension) -> bool:
        """Whether ``source`` compiles and links against ``ext``'s libraries (quietly)."""
        tmp = tempfile.mkdtemp(prefix="fastckpt-probe-")
        try:
            path = os.path.join(tmp, "probe.c")
            with open(path, "w") as f:
                f.write(source)
            objects = self.compiler.compile([path], output_dir=tmp, include_dirs=ext.include_dirs)
            self.compiler.link_executable(objects, os.path.join(tmp, "probe"), libraries=ext.libraries,
                                          library_dirs=ext.library_dirs)
            return True
        except BUILD_ERRORS:
            return False
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


setup(
    ext_modules=[
        Extension(
            "fastckpt._native",
            sources=["native/_native.c"],
            libraries=["xxhash"],
            extra_compile_args=["-O3"] if os.name == "posix" else [],
            optional=True,
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
