"""Kernel tests: on a host without CUDA they run the Triton interpreter (TRITON_INTERPRET=1,
set before Triton is imported); on CUDA the same tests run on the GPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else ["cpu"])
def device(request):
    return request.param
