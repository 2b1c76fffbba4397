"""Builds the native extension angel_ptm._native from native/*.cpp (C++17, pybind11, pthreads only)."""

import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ParallelCompile("ANGEL_BUILD_JOBS", default=0).install()  # 0 = one job per core

ext = Pybind11Extension(
    "angel_ptm._native",
    sorted(glob.glob("native/*.cpp")),
    include_dirs=["native"],
    depends=sorted(glob.glob("native/*.h")),  # a header change rebuilds the extension
    cxx_std=17,
    extra_compile_args=["-O3", "-pthread", "-fvisibility=hidden"],
    extra_link_args=["-pthread"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
