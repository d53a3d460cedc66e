"""pytest plugin for the GPU checklist: tensors created without a device go to CUDA, so that the suite's models,
batches and oracles run on the GPU with real Triton kernels (`-p benchmarks.gpu.on_cuda`)."""

import torch


def pytest_configure(config) -> None:
    torch.set_default_device("cuda")
