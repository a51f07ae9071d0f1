"""A Hugging Face checkpoint directory (Llama, Mistral, Qwen2, Gemma 2) as the example's model.

    ckpt = load_checkpoint("path/to/dir", dtype="bfloat16")
    ckpt.config, ckpt.params   # jax_vmm.serving.model's ModelConfig and Params
    ckpt.tokenizer             # TextTokenizer, or None without tokenizer.json

The jobs are split by file: `hf_config` (config.json), `hf_weights` (safetensors),
`hf_tokenizer` (tokenizer.json). Everything that is wrong raises `CheckpointError`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

from .. import model as M
from .config import CheckpointError, HFModelSpec, read_config
from .tokenizer import TextTokenizer, load_tokenizer
from .weights import load_params

DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    path: Path
    spec: HFModelSpec
    params: M.Params
    tokenizer: TextTokenizer | None

    @property
    def config(self) -> M.ModelConfig:
        return self.spec.config


def load_checkpoint(
    model_dir: str | Path, *, dtype: str = "float32", device: jax.Device | None = None
) -> Checkpoint:
    """Config, weights (cast to `dtype`, on `device`) and tokenizer of `model_dir`."""
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(
            f"{path}: no such directory (expected a Hugging Face "
            "checkpoint: config.json, model*.safetensors, tokenizer.json)"
        )
    spec = read_config(path, dtype=dtype)
    tokenizer = load_tokenizer(path)  # before the weights: a broken file fails fast
    params = load_params(path, spec.config, device=device)
    return Checkpoint(path=path, spec=spec, params=params, tokenizer=tokenizer)


__all__ = ["Checkpoint", "CheckpointError", "DTYPES", "load_checkpoint"]
