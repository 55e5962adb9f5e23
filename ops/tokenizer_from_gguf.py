"""Write a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json, config.json) from a
GGUF's vocabulary, with no hub access: for clients that tokenize with `transformers` (the
lm-evaluation-harness's `local-completions`) and for serving a model folder without a GGUF.

    python -m ops.tokenizer_from_gguf OUT_DIR [--gguf PATH]   # default: the bundled SmolLM2

Byte-level BPE vocabularies (GGUF `tokenizer.ggml.model = gpt2`) with the pre-tokenizers verified
here: `smollm` (digits split one by one, then GPT-2's byte-level regex) and `gpt2`. The result is
checked against llama.cpp's own tokenization in tests/integration/test_tokenizers.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

PRE_TOKENIZERS = ("smollm", "gpt2", "default")


def _field(reader: Any, name: str) -> Any:
    """A scalar metadata value (string or number); None when absent."""
    from gguf import GGUFValueType

    f = reader.fields.get(name)
    if f is None:
        return None
    part = f.parts[f.data[0]]
    if f.types[0] == GGUFValueType.STRING:
        return bytes(part).decode()
    return part.tolist()[0]


def export(gguf_path: Path, out: Path) -> Path:
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    r = GGUFReader(str(gguf_path))
    kind, pre = _field(r, "tokenizer.ggml.model"), _field(r, "tokenizer.ggml.pre") or "default"
    if kind != "gpt2" or pre not in PRE_TOKENIZERS:
        raise SystemExit(f"unsupported GGUF tokenizer {kind}/{pre}: byte-level BPE ({PRE_TOKENIZERS}) only")
    toks = r.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(toks.parts[i]).decode() for i in toks.data]
    mf = r.fields["tokenizer.ggml.merges"]
    merges: list[tuple[str, str]] = []
    for i in mf.data:
        left, right = bytes(mf.parts[i]).decode().split(" ", 1)
        merges.append((left, right))
    tf = r.fields["tokenizer.ggml.token_type"]
    types = [int(tf.parts[i][0]) for i in tf.data]

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if pre == "smollm"
        else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=True) if ty == 3]
    )

    def token(key: str) -> str | None:
        i = _field(r, key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    arch = _field(r, "general.architecture")
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(r, "tokenizer.ggml.add_bos_token")),
        "model_max_length": int(_field(r, f"{arch}.context_length") or 0) or None,
        "chat_template": _field(r, "tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "config.json").write_text(
        json.dumps({"vocab_size": len(tokens), "max_position_embeddings": config["model_max_length"]}, indent=2)
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--gguf", type=Path, default=None)
    args = ap.parse_args()
    if args.gguf is None:
        from core.registry import smollm2_gguf

        args.gguf = smollm2_gguf()
    print(export(args.gguf, args.out))


if __name__ == "__main__":
    main()
