"""Every target family vs transformers (PyTorch, CPU, fp32) on its tiny random config and a long
prompt, in each checkpoint layout (target_families.FAMILIES): logits, the final hidden state,
the features (raw outputs of the tapped layers, the last one before the final norm), the config's
shape and, for MoE families, the router load as the counts of transformers' own top-k choices."""

from __future__ import annotations

import numpy as np
import pytest
from hf_fixtures import prompt_ids
from target_families import (
    CASE_IDS,
    CASES,
    FAMILIES,
    PROMPT_LEN,
    assert_matches_reference,
    checkpoint,
    hf_reference,
    run_target,
)

import dflash_jax


@pytest.mark.parametrize("name, layout", CASES, ids=CASE_IDS)
def test_parity_with_transformers(name, layout, tmp_path_factory):
    family = FAMILIES[name]
    path, hf_model = checkpoint(tmp_path_factory, name, layout)
    hf_text = hf_model.config.get_text_config()
    ids = prompt_ids(PROMPT_LEN, hf_text.vocab_size, seed=1)
    ref, raw = hf_reference(hf_model, ids)
    target = dflash_jax.load_target(path)
    out = run_target(target, ids, family.layer_ids)
    assert_matches_reference(out, ref, raw, family.layer_ids)
    assert out.features.shape == (1, PROMPT_LEN, len(family.layer_ids) * hf_text.hidden_size)
    H = hf_text.hidden_size
    for j, layer in enumerate(family.layer_ids):
        ours = np.asarray(out.features[..., j * H : (j + 1) * H])
        # Raw output of layer i; equals hidden_states[i+1] except for the last (normed) one.
        if layer < hf_text.num_hidden_layers - 1:
            np.testing.assert_allclose(ours, ref.hidden_states[layer + 1].numpy(), atol=1e-4, rtol=0)
        else:
            assert np.abs(ours - ref.hidden_states[-1].numpy()).max() > 1e-2, (
                "last-layer tap must be pre-norm"
            )

    c = target.config
    assert (c.num_layers, c.hidden_size, c.vocab_size, c.model_type) == (
        hf_text.num_hidden_layers,
        hf_text.hidden_size,
        hf_text.vocab_size,
        family.model_type,
    )
    if c.num_experts:
        load = np.asarray(out.expert_load)
        assert load.shape == (len(c.moe_layers), c.num_experts)
        for row, layer in enumerate(c.moe_layers):
            want = np.bincount(raw[f"router{layer}"].reshape(-1), minlength=c.num_experts)
            np.testing.assert_array_equal(load[row], want, err_msg=f"load of layer {layer}")
