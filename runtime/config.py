"""Model and engine configuration: small frozen objects that validate and do no I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from scheduler.cost_model import CostModel


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A Llama-family decoder's shape (Llama 2/3, SmolLM2, Qwen2), read from an HF config.json."""

    architecture: str  # "LlamaForCausalLM" | "Qwen2ForCausalLM" | ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # < num_heads: grouped-query attention
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None  # HF rope_scaling dict (e.g. rope_type "llama3"), or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} attention heads are not a multiple of "
                             f"{self.num_kv_heads} KV heads")

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids: tuple[int, ...] = (
            () if eos is None else tuple(eos) if isinstance(eos, Sequence) else (int(eos),)
        )
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        # transformers 5 moves rope settings into "rope_parameters".
        params = cfg.get("rope_parameters")
        if isinstance(params, Mapping):
            rope_theta = rope_theta or params.get("rope_theta")
            if rope_scaling is None and params.get("rope_type", "default") != "default":
                rope_scaling = dict(params)
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """The shape as an HF config dict (what `scheduler.cost_model.ModelShape` reads)."""
        return {
            "architectures": [self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": torch_dtype,
        }

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, in bf16/fp16 (2 bytes)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


class Tokenizer(Protocol):
    """What the runtime needs from a tokenizer (runtime/tokenizer.py implements it)."""

    eos_token_ids: frozenset[int]
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]: ...

    def token_text(self, token_id: int) -> str: ...


@dataclass(slots=True)
class LoadedModel:
    """Weights and tokenizer ready for the engine (runtime/loader.py builds these)."""

    name: str  # served model name, e.g. "smollm2-135m-instruct"
    config: ModelConfig
    tokenizer: Tokenizer
    # HF Llama parameter names -> tensors; None for dummy:<shape> (the engine initialises at random)
    weights: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    path: str | None = None  # the HF folder the weights came from, when there is one


def unmeasured_cost_model(config: ModelConfig, dtype: torch.dtype) -> CostModel:
    """The served model's shape on a nominal device with no overlap: good for ratios (ρ, KV
    need) and the planner's no-overlap mode, not for predicting seconds."""
    from scheduler.cost_model import CostModel, HardwareProfile, ModelShape

    shape = ModelShape.from_hf_config(config.to_hf(str(dtype).removeprefix("torch.")),
                                      name="served")
    return CostModel(shape, HardwareProfile("unmeasured", flops=1e11, bandwidth=2e10,
                                            batch_multiple=1, overlap=0.0))
