"""The real small target: SmolLM2-135M-Instruct through load_target vs transformers on a chat prompt."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import dflash_jax
from convert.smollm2 import smollm2_dir

CHAT = [
    {"role": "system", "content": "You are a careful assistant who explains things step by step."},
    {
        "role": "user",
        "content": (
            "I am planning a three-day trip to Lisbon in early spring. I like museums, long walks, "
            "old tram lines and small family restaurants, but I do not enjoy crowded tourist traps. "
            "Could you suggest an itinerary for each day, with a rough budget in euros for food and "
            "transport, and tell me which neighbourhoods are best to stay in for a quiet night's sleep? "
            "Please also mention one day trip outside the city that is easy to do by train, and what "
            "I should pack given the weather at that time of year."
        ),
    },
    {
        "role": "assistant",
        "content": (
            "Day one: start in Alfama with a slow walk up to the castle, then ride tram 28 towards "
            "Graça for the viewpoints. Lunch at a small tasca costs about 12 euros. In the afternoon "
            "visit the tile museum, and in the evening have dinner in a family restaurant near the "
            "river. Day two: Belém for the monastery and the coach museum, then walk back along the "
            "waterfront, stopping for custard tarts and a coffee in a quiet garden."
        ),
    },
    {
        "role": "user",
        "content": "That sounds lovely. What about day three, the train trip, and where to eat on the last evening?",
    },
]


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_dir()


def test_smollm2_logits_match_transformers(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert len(ids) >= 256, len(ids)
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()

    target = dflash_jax.load_target(smollm2)
    assert target.config.model_type == "llama" and target.config.num_layers == 30
    out = nnx.jit(lambda m, x: m(x))(target, jnp.asarray([ids], jnp.int32))
    ours = np.asarray(out.logits[0])
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))
    assert np.abs(ours - ref).max() <= 1e-3
