"""Tokenizers, shared by the API (counting, validation, /tokenize) and the CPU engine.

`LlamaVocab` wraps a llama.cpp vocabulary. The API loads a GGUF with `vocab_only` (a few MB, no
weights), so it can count prompt tokens and refuse what cannot fit before anything is stored.
"""

from __future__ import annotations

import ctypes
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from core.config import get_settings
from core.generation.tokenizer import Tokenizer, context_length

__all__ = ["LlamaVocab", "Tokenizer", "context_length", "tokenizer_for"]
from core.registry import tokenizer_source


class LlamaVocab:
    """A llama.cpp vocabulary (from a full model in the worker, or vocab-only in the API)."""

    _model: Any = None  # the model that owns the vocabulary, kept alive with it

    def __init__(self, vocab: Any, train_context: int) -> None:
        import llama_cpp as llc

        self._llc = llc
        self.vocab = vocab
        self.n_vocab = llc.llama_vocab_n_tokens(vocab)
        self.train_context = train_context
        self.add_bos = bool(llc.llama_vocab_get_add_bos(vocab))
        self.eos = llc.llama_vocab_eos(vocab)
        self._pieces: dict[int, bytes] = {}
        self._eog = {t for t in range(self.n_vocab) if llc.llama_vocab_is_eog(vocab, t)}

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        llc = self._llc
        raw = text.encode()
        cap = len(raw) + 8
        buf = (llc.llama_token * cap)()
        n = llc.llama_tokenize(self.vocab, raw, len(raw), buf, cap, add_special and self.add_bos, True)
        if n < 0:  # buffer too small: -n is the size needed
            cap = -n
            buf = (llc.llama_token * cap)()
            n = llc.llama_tokenize(self.vocab, raw, len(raw), buf, cap, add_special and self.add_bos, True)
        return list(buf[:n])

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token contributes to generated text (special tokens contribute nothing)."""
        piece = self._pieces.get(token_id)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = self._llc.llama_token_to_piece(self.vocab, token_id, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = self._llc.llama_token_to_piece(self.vocab, token_id, buf, -n, 0, False)
            piece = buf.raw[:n]
            self._pieces[token_id] = piece
        return piece

    def token_text(self, token_id: int) -> str:
        """A token as text for logprobs and /tokenize: special tokens by their name."""
        piece = self.token_bytes(token_id)
        if not piece and token_id in self._eog | self.specials():
            return self._llc.llama_vocab_get_text(self.vocab, token_id).decode(errors="replace")
        return piece.decode(errors="replace")

    @lru_cache(maxsize=1)  # noqa: B019 - one vocab object per model for the process lifetime
    def specials(self) -> frozenset[int]:
        control = self._llc.LLAMA_TOKEN_ATTR_CONTROL
        return frozenset(t for t in range(self.n_vocab) if self._llc.llama_vocab_get_attr(self.vocab, t) & control)

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(t) for t in ids).decode(errors="replace")

    def is_eog(self, token_id: int) -> bool:
        return token_id in self._eog

    @property
    def eog_tokens(self) -> frozenset[int]:
        return frozenset(self._eog)

    def chat_template(self) -> str | None:
        return _meta_str(self._model, "tokenizer.chat_template") if self._model is not None else None

    def special_text(self) -> tuple[str, str]:
        llc = self._llc
        bos = llc.llama_vocab_bos(self.vocab)
        return (self.token_text(bos) if bos >= 0 else "", self.token_text(self.eos) if self.eos >= 0 else "")

    def fim_tokens(self) -> tuple[int, int, int] | None:
        llc = self._llc
        ids = (
            llc.llama_vocab_fim_pre(self.vocab),
            llc.llama_vocab_fim_suf(self.vocab),
            llc.llama_vocab_fim_mid(self.vocab),
        )
        return None if min(ids) < 0 else ids


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (the `tokenizers` library), for model folders without a GGUF
    (EXL2/EXL3 folders): the chat template, BOS/EOS and whether BOS is added come from
    `tokenizer_config.json` (or `chat_template.jinja`) beside it, as `transformers` reads them."""

    def __init__(self, folder: Path, train_context: int = 0) -> None:
        from tokenizers import Tokenizer as _HF

        self.folder = folder
        self._tok = _HF.from_file(str(folder / "tokenizer.json"))
        config = _json(folder / "tokenizer_config.json")
        model_config = _json(folder / "config.json")
        self.train_context = train_context or int(model_config.get("max_position_embeddings") or 0)
        self.n_vocab = max(self._tok.get_vocab_size(with_added_tokens=True), int(model_config.get("vocab_size") or 0))
        self._bos_text = _token_str(config.get("bos_token"))
        self._eos_text = _token_str(config.get("eos_token"))
        self.add_bos = bool(config.get("add_bos_token", False)) and self._bos_text is not None
        self.eos = self._tok.token_to_id(self._eos_text) if self._eos_text else 0
        self._template = config.get("chat_template")
        if isinstance(self._template, list):  # named templates: the default one
            self._template = next((t["template"] for t in self._template if t.get("name") == "default"), None)
        jinja = folder / "chat_template.jinja"
        if jinja.exists():
            self._template = jinja.read_text()
        self._specials = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        self._pieces: dict[int, bytes] = {}
        self._byte_level = '"ByteLevel"' in self._tok.to_str()

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self._bos_text:
            bos = self._tok.token_to_id(self._bos_text)
            ids = [bos, *ids] if bos is not None else ids
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token adds to generated text (special tokens add nothing): a token may hold part
        of a UTF-8 character, so these are read from the vocabulary, never from decoded text."""
        piece = self._pieces.get(token_id)
        if piece is None:
            raw = self._tok.id_to_token(token_id)
            if token_id in self._specials or raw is None:
                piece = b""
            elif self._byte_level:  # GPT-2's byte-to-unicode alphabet
                piece = bytes(_BYTE_OF.get(c, 0) for c in raw)
            elif len(raw) == 6 and raw.startswith("<0x") and raw.endswith(">"):  # SentencePiece byte fallback
                piece = bytes([int(raw[3:5], 16)])
            else:  # SentencePiece/Metaspace: U+2581 is a space
                piece = raw.replace("\u2581", " ").encode()
            self._pieces[token_id] = piece
        return piece

    def token_text(self, token_id: int) -> str:
        if token_id in self._specials:
            return self._tok.id_to_token(token_id) or ""
        return self.token_bytes(token_id).decode(errors="replace")

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def chat_template(self) -> str | None:
        return self._template

    def special_text(self) -> tuple[str, str]:
        return (self._bos_text or "", self._eos_text or "")

    def fim_tokens(self) -> tuple[int, int, int] | None:
        ids = [self._tok.token_to_id(t) for t in ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")]
        return None if any(i is None for i in ids) else (ids[0], ids[1], ids[2])  # type: ignore[return-value]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of bytes to printable characters (what byte-level BPE vocabularies hold)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars), strict=True))


_BYTE_OF = {c: b for b, c in _bytes_to_unicode().items()}


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):  # transformers' AddedToken serialisation
        v = v.get("content")
    return v if isinstance(v, str) else None


def _meta_str(model: Any, key: str) -> str | None:
    import llama_cpp as llc

    n = llc.llama_model_meta_val_str(model, key.encode(), None, 0)  # the length it needs
    if n < 0:
        return None
    buf = ctypes.create_string_buffer(n + 1)
    llc.llama_model_meta_val_str(model, key.encode(), buf, n + 1)
    return buf.value.decode(errors="replace")


def _load_vocab_only(path: str) -> Any:
    import llama_cpp as llc

    from core.infra.llamalog import quiet_llama_logs

    quiet_llama_logs()
    params = llc.llama_model_default_params()
    params.vocab_only = True
    model = llc.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise RuntimeError(f"could not read the vocabulary of {path}")
    return model


def _meta_int(model: Any, key: str) -> int:
    import llama_cpp as llc

    buf = ctypes.create_string_buffer(32)
    n = llc.llama_model_meta_val_str(model, key.encode(), buf, 32)
    return int(buf.value) if n > 0 and buf.value.isdigit() else 0


@lru_cache
def tokenizer_for(model_id: str) -> Tokenizer:
    """The tokenizer of a served model (cached for the process): a folder's tokenizer.json, or the
    vocabulary of a GGUF (loaded vocab-only: a few MB, no weights)."""
    settings = get_settings()
    source = tokenizer_source(settings, model_id)
    if not source.exists():
        # A registry entry whose weights this host lacks (not downloaded yet): a 503 for that model only.
        from core.errors import DomainError, ErrorKind

        raise DomainError(
            ErrorKind.unavailable, f"model '{model_id}' is not available on this host: {source} does not exist"
        )
    if source.is_dir():
        return HFTokenizer(source)
    import llama_cpp as llc  # only for a GGUF: the GPU image has no llama.cpp

    model = _load_vocab_only(str(source))
    # A vocab-only load skips the hyper-parameters; read the context length from the metadata.
    buf = ctypes.create_string_buffer(64)
    llc.llama_model_meta_val_str(model, b"general.architecture", buf, 64)
    train_ctx = _meta_int(model, f"{buf.value.decode()}.context_length")
    vocab = LlamaVocab(llc.llama_model_get_vocab(model), train_ctx)
    vocab._model = model  # keep the model (owner of the vocab) alive
    return vocab
