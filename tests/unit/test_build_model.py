"""engine/models.build_model makes the layers without drawing their random
weights (load_weights overwrites every one), and leaves torch's init
functions as they were."""
from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig

from tandem.engine.models import build_model


def test_building_a_model_draws_no_random_numbers_and_restores_torch_init():
    inits = (nn.init.kaiming_uniform_, nn.init.uniform_, nn.init.normal_)
    torch.manual_seed(0)
    state = torch.random.get_rng_state()
    model = build_model(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2))
    assert len(model.model.layers) > 0
    # nn.Linear and nn.Embedding would have advanced the generator drawing their weights
    assert torch.equal(torch.random.get_rng_state(), state)
    assert (nn.init.kaiming_uniform_, nn.init.uniform_, nn.init.normal_) == inits
    torch.manual_seed(0)
    drawn = nn.Linear(8, 8).weight.detach().clone()
    torch.manual_seed(0)
    assert torch.equal(nn.Linear(8, 8).weight, drawn) and drawn.abs().sum() > 0
