"""Whether this machine has a C compiler, for tests of the C kernels: only a machine without one may
skip them (there the PyTorch paths serve); where one exists, a kernel that fails to build is a
failure, not a skip."""
import shutil
import sysconfig

import pytest

_compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
HAS_C_COMPILER = shutil.which(_compiler) is not None or shutil.which("cc") is not None
requires_c_compiler = pytest.mark.skipif(not HAS_C_COMPILER,
                                         reason="no C compiler on this machine: nanoserve uses the PyTorch path")
