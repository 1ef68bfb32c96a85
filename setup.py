"""Builds the optional C kernels of ps_server (everything else is in pyproject.toml).

``ps_server/core/_kernels*.c`` speeds up the sparse table's lookup and push; without a C compiler the
build is skipped with a warning and ps_server uses its numpy code (same results, slower).
"""

from __future__ import annotations

import logging

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

log = logging.getLogger("fleetrun.setup")


class OptionalBuildExt(build_ext):
    """Build extensions, but let the install succeed without them."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as err:  # noqa: BLE001 - any compiler failure means "use numpy"
            log.warning("ps_server C kernels not built (%s); using the numpy path", err)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as err:  # noqa: BLE001
            log.warning("ps_server C kernels not built (%s); using the numpy path", err)


setup(
    ext_modules=[
        Extension(
            "ps_server.core._kernels",
            ["ps_server/core/_kernels.c", "ps_server/core/_kernels_rows.c"],
            depends=["ps_server/core/_kernels_common.h"],
            # -fno-math-errno: sqrtf without the errno branch, so the optimizers' row loops
            # vectorise (Adagrad dim 16: 2x faster); IEEE sqrt is exact either way, the rows
            # are bit for bit the same
            extra_compile_args=["-O3", "-std=c99", "-fno-fast-math", "-fno-math-errno"],
            optional=True,
        ),
        # the graph tables' edge-file parser, CSR sort and sampler (graph_kernels.py: numpy otherwise)
        Extension(
            "ps_server.core._graph_kernels",
            ["ps_server/core/_graph_kernels.c"],
            depends=["ps_server/core/_kernels_common.h"],
            extra_compile_args=["-O3", "-std=c99", "-fno-fast-math"],
            optional=True,
        ),
        # fleet.data's MultiSlot text parser (fleet/data/parser.py falls back to Python)
        Extension(
            "fleet.data._parser",
            ["fleet/data/_parser.c", "fleet/data/_parser_columns.c"],
            depends=["fleet/data/_parser_common.h"],
            extra_compile_args=["-O3", "-std=c99", "-fno-fast-math"],
            optional=True,
        ),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
