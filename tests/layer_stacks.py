"""What the tests of layers compiled once (Config.compile_layers_once) share: a small HF Llama, a
layer of one MLP, and the three techniques' settings."""

from __future__ import annotations

import torch
import torch.nn as nn
from distributed import device

LAYERS = 3
PER_RANK = 2
VOCAB = 61


def llama(transformers, layers: int = LAYERS, use_cache: bool = False, tied: bool = False) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=72, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, use_cache=use_cache, tie_word_embeddings=tied,
    )
    return transformers.LlamaForCausalLM(config).to(device())


class MlpLayer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)) * torch.sigmoid(x).repeat(1, 2))


ALL_THREE = {"quantized_weights": True, "weight_block_size": 32, "hpz_partition_size": 1,
             "quantized_gradients": True, "gradient_block_size": 32, "ranks_per_node": 1}
