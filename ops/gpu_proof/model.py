"""The proof kit's model: a random-weight FP16 Llama with SmolLM2's vocabulary, small enough to write
in seconds on the GPU machine (its weights never travel: ~110 MB), loaded unquantized by both
exllamav2 (FP16 folders) and exllamav3 (`LinearFP16`). Head dim 128: every attention path of both.

    python -m ops.gpu_proof.model FOLDER   # FOLDER holds tokenizer.json; writes config.json + weights
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

VOCAB = 49152  # SmolLM2's
DIMS = {"hidden": 512, "ffn": 1536, "heads": 4, "kv_heads": 2, "layers": 4}
CONTEXT = 2048


def config() -> dict[str, Any]:
    h, f, heads, kv, layers = (DIMS[k] for k in ("hidden", "ffn", "heads", "kv_heads", "layers"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": f,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": h // heads,
        "num_hidden_layers": layers,
        "vocab_size": VOCAB,
        "max_position_embeddings": CONTEXT,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "bos_token_id": 1,  # SmolLM2: <|im_start|>
        "eos_token_id": 2,  # <|im_end|>
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    }


def write_weights(folder: Path, seed: int = 0) -> Path:
    """model.safetensors for `config()`: normal(0, 0.02) matrices, unit norms."""
    import torch
    from safetensors.torch import save_file

    h, f, heads, kv, layers = (DIMS[k] for k in ("hidden", "ffn", "heads", "kv_heads", "layers"))
    hd = h // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> Any:
        return (torch.randn(*shape, generator=gen) * 0.02).half()

    def ones(n: int) -> Any:
        return torch.ones(n).half()

    t = {"model.embed_tokens.weight": rand(VOCAB, h), "model.norm.weight": ones(h), "lm_head.weight": rand(VOCAB, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {
            p + "self_attn.q_proj.weight": rand(heads * hd, h),
            p + "self_attn.k_proj.weight": rand(kv * hd, h),
            p + "self_attn.v_proj.weight": rand(kv * hd, h),
            p + "self_attn.o_proj.weight": rand(h, heads * hd),
            p + "mlp.gate_proj.weight": rand(f, h),
            p + "mlp.up_proj.weight": rand(f, h),
            p + "mlp.down_proj.weight": rand(h, f),
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
        }
    out = folder / "model.safetensors"
    save_file(t, str(out), metadata={"format": "pt"})
    return out


def write(folder: Path) -> Path:
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{folder}/tokenizer.json: the kit's tokenizer (bash ops/gpu_proof.sh bundle)")
    (folder / "config.json").write_text(json.dumps(config(), indent=2))
    return write_weights(folder)


if __name__ == "__main__":
    print(write(Path(sys.argv[1])))
