"""Fixtures for the region-compiler tests: a tiny Llama with O(1) activations (so greedy tokens are
decided by clear margins, not by rounding) and single-threaded torch on the shared CPU runner."""

import pytest
import torch

from tilevox.models.llama.config import LlamaConfig
from tilevox.models.llama.weights import o1_random_llama


@pytest.fixture(scope="session")
def tiny_llama():
    """models.llama's "tiny" preset (GQA 4/2, llama3 rope with all three bands) in fp32 with O(1)
    activations (`o1_random_llama`): the preset's N(0, 0.02) init gives near-uniform logits where greedy
    ties would test rounding, not the compiler."""
    return o1_random_llama(LlamaConfig.preset("tiny"), seed=1, device="cpu", dtype=torch.float32)
