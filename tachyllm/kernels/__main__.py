"""`python -m tachyllm.kernels`: compile the C++ kernels ahead of time (`make install` runs it)."""

import logging
import sys

from tachyllm.kernels.native import build, build_dir

logging.basicConfig(level=logging.INFO, format="%(message)s")
build(verbose="-v" in sys.argv)
print(f"tachyllm C++ kernels ready: {build_dir()}")
