"""Fixtures for the region-compiler tests: a tiny Llama with O(1) activations (so greedy tokens are
decided by clear margins, not by rounding) and single-threaded torch on the shared CPU runner."""

import pytest
import torch

from tilevox.models.llama.config import LlamaConfig
from tilevox.models.llama.weights import random_llama


@pytest.fixture(scope="session")
def tiny_llama():
    """models.llama's "tiny" preset (GQA 4/2, llama3 rope with all three bands) in fp32, re-drawn as
    matrices N(0, 1/fan_in), embeddings N(0, 1), norm gains 1 + N(0, 0.1): the preset's N(0, 0.02)
    init gives near-uniform logits where greedy ties would test rounding, not the compiler."""
    model = random_llama(LlamaConfig.preset("tiny"), seed=0, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if param.dim() == 1:
                param.copy_(1.0 + 0.1 * noise)
            elif "embed" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / param.shape[1] ** 0.5)
    return model
