"""Hugging Face safetensors weights -> the example's `Params`.

The checkpoint is `model.safetensors`, or shards listed by `model.safetensors.index.json`
(its `weight_map`: tensor name -> shard file). Files are opened memory-mapped; every
tensor's name, shape and dtype is checked against the config from the headers alone
before any data is read, so a wrong checkpoint fails fast, naming the file and the
tensor. Weights are cast to the model dtype on the host and then placed on the device.

Name mapping (HF tensors are `(out_features, in_features)`; the example computes
`x @ w`, so projection weights are transposed; see docs/example.md):

    model.embed_tokens.weight                 (V, d)       -> embed
    model.layers.N.input_layernorm.weight     (d,)         -> layers[N].attn_norm
    model.layers.N.self_attn.q_proj.weight    (Hq*D, d)    -> layers[N].wq  (d, Hq*D)
    model.layers.N.self_attn.{k,v}_proj.weight (Hkv*D, d)  -> layers[N].wk, wv
    model.layers.N.self_attn.{q,k,v}_proj.bias             -> layers[N].bq, bk, bv (Qwen2)
    model.layers.N.self_attn.o_proj.weight    (d, Hq*D)    -> layers[N].wo  (Hq*D, d)
    model.layers.N.post_attention_layernorm.weight         -> layers[N].mlp_norm
      Gemma 2: post_attention_layernorm                    -> layers[N].post_attn_norm,
      pre_feedforward_layernorm -> mlp_norm, post_feedforward_layernorm -> post_mlp_norm
    model.layers.N.mlp.{gate,up}_proj.weight  (F, d)       -> layers[N].w_gate, w_up (d, F)
    model.layers.N.mlp.down_proj.weight       (d, F)       -> layers[N].w_down (F, d)
    model.norm.weight                         (d,)         -> final_norm
    lm_head.weight                            (V, d)       -> unembed (d, V); tied: absent
                                                              or ignored, logits use embed
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .. import model as M
from .._optional import require
from .config import CheckpointError

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_FLOAT_DTYPES = ("F32", "F16", "BF16")
# Tensors some checkpoints carry that the model does not use: RoPE tables that older
# exports saved (recomputed from the config).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str  # Hugging Face tensor name
    shape: tuple[int, ...]  # as stored
    transpose: bool  # stored (out, in); the model wants (in, out)


def expected_tensors(cfg: M.ModelConfig) -> dict[tuple, TensorSpec]:
    """Where each parameter of the model comes from: {params path: TensorSpec}; path is
    ("embed",), ("final_norm",), ("unembed",) or ("layers", N, field)."""
    d, v, f = cfg.d_model, cfg.vocab, cfg.ffn_dim
    q, kv = cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out: dict[tuple, TensorSpec] = {
        ("embed",): TensorSpec("model.embed_tokens.weight", (v, d), False),
        ("final_norm",): TensorSpec("model.norm.weight", (d,), False),
    }
    if not cfg.tie_embeddings:
        out[("unembed",)] = TensorSpec("lm_head.weight", (v, d), True)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        layer = {
            "attn_norm": (p + "input_layernorm.weight", (d,), False),
            "wq": (p + "self_attn.q_proj.weight", (q, d), True),
            "wk": (p + "self_attn.k_proj.weight", (kv, d), True),
            "wv": (p + "self_attn.v_proj.weight", (kv, d), True),
            "wo": (p + "self_attn.o_proj.weight", (d, q), True),
            "mlp_norm": (p + "post_attention_layernorm.weight", (d,), False),
            "w_gate": (p + "mlp.gate_proj.weight", (f, d), True),
            "w_up": (p + "mlp.up_proj.weight", (f, d), True),
            "w_down": (p + "mlp.down_proj.weight", (d, f), True),
        }
        if cfg.post_norms:  # Gemma 2: HF's post_attention_layernorm is after attention
            layer.update(
                post_attn_norm=(p + "post_attention_layernorm.weight", (d,), False),
                mlp_norm=(p + "pre_feedforward_layernorm.weight", (d,), False),
                post_mlp_norm=(p + "post_feedforward_layernorm.weight", (d,), False),
            )
        if cfg.qkv_bias:
            layer.update(
                bq=(p + "self_attn.q_proj.bias", (q,), False),
                bk=(p + "self_attn.k_proj.bias", (kv,), False),
                bv=(p + "self_attn.v_proj.bias", (kv,), False),
            )
        out.update({("layers", n, k): TensorSpec(*s) for k, s in layer.items()})
    return out


def weight_files(model_dir: str | Path) -> dict[str, Path]:
    """{tensor name: file} of the checkpoint: the single file, else the index's map.
    Raises CheckpointError naming what is missing."""
    model_dir = Path(model_dir)
    single, index = model_dir / WEIGHTS_FILE, model_dir / INDEX_FILE
    if single.is_file():
        return {name: single for name in _header(single)}
    if not index.is_file():
        other = sorted(p.name for p in model_dir.glob("*.bin")) if model_dir.is_dir() else []
        hint = (
            (
                f" (found {', '.join(other)}: PyTorch pickles are not read; save the "
                "model with safe_serialization=True)"
            )
            if other
            else ""
        )
        raise CheckpointError(f"{model_dir}: neither {WEIGHTS_FILE} nor {INDEX_FILE} exists{hint}")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: cannot read its weight_map ({e!r})") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
    files: dict[str, Path] = {}
    headers: dict[str, set[str]] = {}
    for name, file_name in weight_map.items():
        path = model_dir / file_name
        if file_name not in headers:
            if Path(file_name).name != file_name or not path.is_file():
                raise CheckpointError(
                    f"{index}: tensor {name} is in {file_name}, but {path} does not exist"
                )
            headers[file_name] = set(_header(path))
        if name not in headers[file_name]:
            raise CheckpointError(
                f"{index}: tensor {name} is said to be in {path}, which has no such tensor"
            )
        files[name] = path
    return files


def _missing(model_dir: Path, name: str, files: dict[str, Path], cfg: M.ModelConfig) -> str:
    """Why ``name`` is not among ``files``: a single file lacks it, or the index does not
    map it (then say whether a shard holds it anyway: the index is incomplete)."""
    asks = f"(the config asks for it: {M.config_summary(cfg)})"
    shards = sorted(set(files.values()))
    index = model_dir / INDEX_FILE
    if not index.is_file() or (model_dir / WEIGHTS_FILE).is_file():
        where = ", ".join(str(p) for p in shards)
        return f"tensor {name} is missing: it is in none of {where} {asks}"
    # Every safetensors file beside the index, listed by it or not.
    holders = [p.name for p in sorted(model_dir.glob("*.safetensors")) if name in _header(p)]
    if holders:
        return (
            f"{index}: tensor {name} is not in its weight_map, but {', '.join(holders)} "
            f"holds it: the index is incomplete; add it to the weight_map {asks}"
        )
    return (
        f"tensor {name} is missing: {index} does not map it, and none of the "
        f"{len(shards)} shards it lists ({', '.join(p.name for p in shards)}) holds it {asks}"
    )


def load_params(
    model_dir: str | Path, cfg: M.ModelConfig, device: jax.Device | None = None
) -> M.Params:
    """Reads and checks every tensor `cfg` needs, casts to cfg.dtype and places them on
    `device` (default: JAX's default device)."""
    files = weight_files(model_dir)
    wanted = expected_tensors(cfg)
    with _open_all(set(files.values())) as handles:
        for spec in wanted.values():  # headers only: fail before reading any data
            if spec.name not in files:
                raise CheckpointError(_missing(Path(model_dir), spec.name, files, cfg))
            path = files[spec.name]
            sl = handles[path].get_slice(spec.name)
            shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
            if shape != spec.shape:
                raise CheckpointError(
                    f"{path}: tensor {spec.name} has shape {shape}, the config "
                    f"(config.json) needs {spec.shape}"
                )
            if dtype not in _FLOAT_DTYPES:
                raise CheckpointError(
                    f"{path}: tensor {spec.name} is {dtype}; expected one of {_FLOAT_DTYPES}"
                )
        _refuse_unused(files, {s.name for s in wanted.values()}, cfg)
        dtype = cfg.jnp_dtype
        arrays: dict[tuple, jax.Array] = {}
        for path_key, spec in wanted.items():
            host = handles[files[spec.name]].get_tensor(spec.name)
            if spec.transpose:
                host = host.T
            host = np.ascontiguousarray(host.astype(dtype, copy=False))
            arrays[path_key] = jax.device_put(host, device)
    return _assemble(arrays, cfg)


def _assemble(arrays: dict[tuple, jax.Array], cfg: M.ModelConfig) -> M.Params:
    layers = tuple(
        M.LayerParams(
            **{key[2]: a for key, a in arrays.items() if key[0] == "layers" and key[1] == n}
        )
        for n in range(cfg.num_layers)
    )
    return M.Params(
        embed=arrays[("embed",)],
        layers=layers,
        final_norm=arrays[("final_norm",)],
        unembed=arrays.get(("unembed",)),
    )


def _refuse_unused(files: dict[str, Path], used: set[str], cfg: M.ModelConfig) -> None:
    """A tensor the model would not use means the config does not describe these
    weights (a bias the architecture lacks, more layers, ...): loading the rest would
    compute something else than the checkpoint's model, silently."""
    ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()  # transformers ties it
    extra = sorted(
        n for n in files if n not in used and n not in ignored and not n.endswith(_IGNORED_SUFFIXES)
    )
    if extra:
        shown = ", ".join(f"{n} ({files[n].name})" for n in extra[:5])
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise CheckpointError(
            f"the checkpoint has tensors the config does not account for: {shown}{more} "
            f"(config: {M.config_summary(cfg)}); is config.json the one of these weights?"
        )


def _safetensors() -> Any:
    return require("safetensors", "reading checkpoint weights")


def _header(path: Path) -> list[str]:
    with _open(path) as f:
        return list(f.keys())


@contextlib.contextmanager
def _open(path: Path) -> Iterator[Any]:
    try:
        handle = _safetensors().safe_open(str(path), framework="numpy")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    with handle as f:
        yield f


@contextlib.contextmanager
def _open_all(paths: set[Path]) -> Iterator[dict[Path, Any]]:
    with contextlib.ExitStack() as stack:
        yield {p: stack.enter_context(_open(p)) for p in sorted(paths)}
