"""Warnings that importing and building AReaL 1.0.4 raise, filtered one by one (everything
else stays an error), and the coordinator the actor tests share per module."""

import pytest

AREAL_IMPORT_WARNINGS = (
    # AReaL on CPU: NVIDIA's Transformer Engine and Apex are absent, it falls back.
    "ignore:Transformer Engine and Apex are not installed:UserWarning",
    # AReaL imports torch._inductor, whose mkldnn module uses torch.jit.script_method.
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning",
    # swanlab, a logger AReaL imports, defines a class inside an Enum.
    "ignore:In 3.13 classes created inside an enum:DeprecationWarning",
    # AReaL's FSDP engine slices a flattened dimension of its device mesh (torch 2.13).
    "ignore:Slicing a flattened dim from root mesh:UserWarning",
)


def pytest_configure(config: pytest.Config) -> None:
    for line in AREAL_IMPORT_WARNINGS:
        config.addinivalue_line("filterwarnings", line)
