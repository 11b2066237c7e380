"""Triton kernels of the cuda backend (backends/cuda_backend.py). Importing a module of this package
imports triton; the backend does so only once it is chosen, so tachyllm imports where triton is missing.

Every kernel also runs on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported: tests/conftest.py does it where no GPU is present), which is how the tests check them without
a GPU."""

import os


def interpreting() -> bool:
    """Whether kernels run in Triton's interpreter (its bf16 tl.dot is wrong in triton 3.7.1, so dot
    paths upcast bf16 tiles to fp32 there)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
