"""The compute backends tests run on: the PyTorch reference always, and the C kernels unless this run
turned them off (NANOSERVE_NO_KERNELS=1 or NANOSERVE_KERNELS=torch, as CI's kernel-off pass does) or
the machine has no C compiler. Where the kernels are on, a build failure fails the run: it is not a skip."""
import os
import shutil
import sysconfig

import pytest

from nanoserve.config import default_kernels
from nanoserve.kernels import TorchBackend, select_backend

_compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
HAS_C_COMPILER = shutil.which(_compiler) is not None
KERNELS_ON = default_kernels() != "torch" and HAS_C_COMPILER
TORCH = TorchBackend()
# NANOSERVE_KERNEL_TARGET=portable: the kernel tests on the portable build (CI runs them both ways).
C = select_backend("c", os.cpu_count() or 1, os.environ.get("NANOSERVE_KERNEL_TARGET") or None) if KERNELS_ON else None
DEFAULT = C or TORCH  # what an engine of this run picks with kernels="auto"
# These tests compare the C kernels with the PyTorch backend, or check properties only the C kernels
# promise; a run without the kernels has nothing to compare (and `make test` runs them with them on).
requires_kernels = pytest.mark.skipif(
    not KERNELS_ON, reason="tests the C kernels, which this run turned off (NANOSERVE_NO_KERNELS=1 or "
    "NANOSERVE_KERNELS=torch: the kernel-off pass of make test) or cannot build (no C compiler)")
