"""Test-wide setup: Triton kernels run in the interpreter when no GPU is present.

TRITON_INTERPRET is read when a kernel is defined, so it is set here, before any test module
imports zpp_compile.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Each test rank compiles in its own process; a pool of compile workers per rank would only
# compete for the same cores.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
