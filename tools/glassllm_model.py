"""The small real pretrained model for kvflow's vLLM tests: glassllm's weights as a Hugging
Face Llama directory (nothing is downloaded: the weights ship inside the installed package).

    python tools/glassllm_model.py OUT_DIR [--check] [--split 2]

glassllm 0.1.0 (MIT) ships NumPy weights of a 4-layer Llama-style model (vocab 1024, d 128,
4 heads / 2 KV heads of 32, SwiGLU, RMSNorm, tied embeddings, 128 positions) and computes
``x @ W``; Hugging Face stores Linear weights as ``(out, in)``, so every matrix is transposed.
RoPE differs in layout only: glassllm rotates adjacent pairs ``(2j, 2j+1)``, Llama rotates
``(j, j + d/2)``; ordering each head's q and k output rows as ``[0, 2, 4, ..., 1, 3, 5, ...]``
turns one into the other (q and k get the same permutation, so q.k is unchanged). ``--check``
compares the logits with the package's own forward pass.

``--split N`` pads the MLP (341 units) with zero units up to a multiple of N, so that tensor
parallelism over N ranks can split it: a unit whose gate, up and down weights are all zero adds
``silu(0) * 0 = 0`` to the output, so the model computes the same function.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np


def _glass(lang: str = "en") -> Any:
    import glassllm

    model, _tokenizer = glassllm.load_pretrained(lang)
    return model


def _half_split_rows(heads: int, head_dim: int) -> np.ndarray:
    per_head = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    return np.concatenate([h * head_dim + per_head for h in range(heads)])


def write_model(out_dir: str | Path, lang: str = "en", split: int = 1) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of a LlamaForCausalLM; returns the dir.
    ``split``: the MLP padded with zero units to a multiple of it (tensor parallelism)."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = _glass(lang)
    cfg = model.cfg
    head_dim = cfg.d_model // cfg.n_heads
    w = {name: p.data.astype(np.float32) for name, p in model.named_parameters().items()}
    q_rows, k_rows = _half_split_rows(cfg.n_heads, head_dim), _half_split_rows(cfg.n_kv_heads, head_dim)
    tensors = {"model.embed_tokens.weight": w["E"], "model.norm.weight": w["norm_f.gamma"]}
    for i in range(cfg.n_layers):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        tensors[dst + "input_layernorm.weight"] = w[src + "norm1.gamma"]
        tensors[dst + "post_attention_layernorm.weight"] = w[src + "norm2.gamma"]
        tensors[dst + "self_attn.q_proj.weight"] = w[src + "attn.W_Q"].T[q_rows]
        tensors[dst + "self_attn.k_proj.weight"] = w[src + "attn.W_K"].T[k_rows]
        tensors[dst + "self_attn.v_proj.weight"] = w[src + "attn.W_V"].T
        tensors[dst + "self_attn.o_proj.weight"] = w[src + "attn.W_O"].T
        units = w[src + "ffn.W1"].shape[1]
        pad = -units % split
        tensors[dst + "mlp.gate_proj.weight"] = np.pad(w[src + "ffn.W1"].T, ((0, pad), (0, 0)))
        tensors[dst + "mlp.up_proj.weight"] = np.pad(w[src + "ffn.W3"].T, ((0, pad), (0, 0)))
        tensors[dst + "mlp.down_proj.weight"] = np.pad(w[src + "ffn.W2"].T, ((0, 0), (0, pad)))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": int(tensors["model.layers.0.mlp.gate_proj.weight"].shape[0]),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_len,
        "rms_norm_eps": cfg.eps,
        "rope_theta": cfg.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "bos_token_id": 2,
        "eos_token_id": 3,
        "pad_token_id": 0,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def max_logit_difference(model_dir: str | Path, lang: str = "en", seed: int = 0) -> float:
    """The largest |logit| difference between the Llama directory (transformers) and the
    package's own forward pass, over a few random token sequences up to the full context."""
    import glassllm
    import torch
    from transformers import LlamaForCausalLM

    glass = _glass(lang)
    hf = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    rng = np.random.default_rng(seed)
    worst = 0.0
    for length in (1, 7, 33, glass.cfg.max_len):
        ids = rng.integers(4, glass.cfg.vocab_size, size=(2, length))
        with glassllm.no_grad():
            ref = glass.forward(ids).data.astype(np.float64)
        with torch.no_grad():
            got = hf(torch.from_numpy(ids)).logits.double().numpy()
        worst = max(worst, float(np.abs(ref - got).max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--lang", default="en")
    parser.add_argument("--check", action="store_true", help="compare logits with glassllm's own forward")
    parser.add_argument("--split", type=int, default=1, help="pad the MLP to split over this many ranks")
    args = parser.parse_args()
    path = write_model(args.out_dir, args.lang, args.split)
    print(f"wrote {path}")
    if args.check:
        print(f"max |logit difference| vs glassllm: {max_logit_difference(path, args.lang):.3e}")


if __name__ == "__main__":
    main()
