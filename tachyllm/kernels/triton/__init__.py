"""Triton kernels of the cuda backend (backends/cuda_backend.py). Importing a module of this package
imports triton; the backend does so only once it is chosen, so tachyllm imports where triton is missing.
On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before they are imported):
that is how the tests check them without a GPU."""
