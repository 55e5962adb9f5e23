"""What the two GPU engines (exllamav2.py, exllamav3.py) share: the scheduling around the libraries'
generators, which have one shape (`enqueue` a job per sequence, `iterate()` advances every active job
by one token, `cancel` drops one, `pending_jobs` wait for cache pages), and the checks and sizing
their constructors start with.

`ExLlamaEngine` keeps our own queue of sequences waiting for batch room (so interactive ones start
first: the generators queue without limit, in order), a map of the live ones (key -> job and the
state that turns its results into events, exl2_mapping.collect), and hands waiting sequences to the
generator as room frees. Each engine supplies the rest: what it refuses (`_check`), how a sequence
becomes a job (`_start`), and its loading. Imports neither torch nor an ExLlama library at import;
the CI checks of this code run through the engines (tests/unit/test_gpu_promises.py, on the
libraries' own generators with their CUDA extensions stubbed). Needs a GPU to verify:
tests/gpu/test_exllama_engines.py.
"""

from __future__ import annotations

import collections
import json
import logging
import shutil
import subprocess
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any, ClassVar

from workers.engine.base import ExLlamaTokens, PromptEvent, SeqSpec, TokenEvent, check_spec
from workers.engine.exl2_mapping import SeqState, collect, dry_breaker_ids
from workers.engine.gpu_plan import CachePlan, cuda_problem, kv_bytes_per_token, plan_cache, weights_bytes

log = logging.getLogger(__name__)


def load_ll_tokenizer(folder: Path, n_vocab: int, eos_ids: list[int]) -> Any:
    """llguidance's tokenizer for a model folder. Through transformers when it is installed (it also
    folds in tokens that only tokenizer_config.json lists); otherwise from tokenizer.json directly,
    which is what `llguidance.hf.from_tokenizer` hands to LLTokenizer in the end."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        from llguidance import LLTokenizer

        text = (folder / "tokenizer.json").read_text(encoding="utf-8")
        return LLTokenizer(text, n_vocab=n_vocab, eos_token=eos_ids)
    from llguidance.hf import from_tokenizer

    hf: Any = AutoTokenizer.from_pretrained(str(folder))  # llguidance accepts the fast tokenizer it returns
    return from_tokenizer(hf, n_vocab=n_vocab, eos_token=eos_ids)


def nvidia_driver() -> str | None:
    """The NVIDIA driver's version (nvidia-smi's), or None where there is no driver or device."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


class ExLlamaEngine(ExLlamaTokens):
    library: ClassVar[str]  # "exllamav2" | "exllamav3": in messages and logs
    model_id: str
    n_ctx: int
    max_batch: int
    n_vocab: int

    # -- construction ---------------------------------------------------------------------------
    def _model_folder(self, path: Path) -> Path:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(
                f"the {self.library} engine needs a model folder with config.json (SPOOL_MODEL_PATH): {path}"
            )
        return path

    def _require_cuda(self) -> Any:
        """torch, if this host can run the engine; else why not (gpu_plan.cuda_problem: an old driver
        says so, and names the driver it needs)."""
        import torch

        problem = cuda_problem(self.library, torch.version.cuda, nvidia_driver(), torch.cuda.is_available())
        if problem:
            raise RuntimeError(problem)
        return torch

    def _fit_cache(
        self, path: Path, max_batch: int, requested_tokens: int | None, bytes_per_value: int = 2
    ) -> CachePlan:
        """Cache tokens and batch for `self.n_ctx` in the free GPU memory (gpu_plan.plan_cache: raises
        DoesNotFit with the numbers before anything is loaded)."""
        import torch

        free, _total = torch.cuda.mem_get_info()
        return plan_cache(
            free_bytes=free,
            weights_bytes=weights_bytes(path),
            kv_bytes_per_token=kv_bytes_per_token(json.loads((path / "config.json").read_text()), bytes_per_value),
            n_ctx=self.n_ctx,
            max_batch=max_batch,
            requested_tokens=requested_tokens,
        )

    def attach(self, gen: Any, tok: Any, stop_ids: list[int], n_vocab: int) -> None:
        """The engine's state around a built generator (the constructor's last step; the CI tests build
        the library's own generator over a stand-in model and attach it here)."""
        self._gen, self._tok, self._stop_ids, self.n_vocab = gen, tok, stop_ids, n_vocab
        self._waiting: collections.deque[SeqSpec] = collections.deque()
        self._live: dict[Hashable, tuple[Any, SeqState]] = {}
        self._breakers: dict[tuple[str, ...], frozenset[int]] = {}
        self._bytes: dict[int, bytes] = {}

    # -- sequences ------------------------------------------------------------------------------
    def add(self, spec: SeqSpec) -> None:
        check_spec(spec, self.n_ctx, self.n_vocab)
        self._check(spec)
        self._waiting.append(spec)

    def _check(self, spec: SeqSpec) -> None:
        """Raise ValueError for what this engine cannot do (the runner turns it into a job error)."""
        raise NotImplementedError

    def cancel(self, key: Hashable) -> None:
        self._waiting = collections.deque(s for s in self._waiting if s.key != key)
        live = self._live.pop(key, None)
        if live is not None:
            try:
                self._gen.cancel(live[0])
            except Exception:  # the loop calls cancel from its own error path: never raise here
                log.exception("%s could not cancel %s", self.library, key)

    def has_work(self) -> bool:
        return bool(self._waiting or self._live)

    def waiting_keys(self) -> set[Hashable]:
        """Sequences waiting for a slot (here, or in the generator's queue for cache pages) or still in
        the library's prefill: the engine loop's watchdog does not count their wait as a stall. A
        prefilling job reports no token (its "prefill" results carry none), and exllamav3 defers the
        prefill passes of its jobs while others generate (`prefill_cooldown`, one prompt a pass in
        turn), so under load a job could sit out many steps without an event and read as stalled."""
        pending = {id(job) for job in self._gen.pending_jobs}
        return {s.key for s in self._waiting} | {
            k for k, (job, _) in self._live.items() if id(job) in pending or not job.is_prefill_done()
        }

    def step(self) -> list[TokenEvent | PromptEvent]:
        out = self._admit()
        if not self._live and not self._gen.num_remaining_jobs():
            return out
        try:
            results = self._gen.iterate()
        except Exception:
            self._drop_all()
            raise
        return out + collect(results, self._live, self._gen, self.n_vocab)

    def _drop_all(self) -> None:
        """After a failed iterate() the generator's jobs are in an unknown state: forget them all."""
        self._live.clear()
        try:
            self._gen.clear_queue()
        except Exception:
            log.exception("%s could not clear its queue", self.library)

    def _admit(self) -> list[TokenEvent | PromptEvent]:
        """Hand waiting sequences to the generator while it has batch room, interactive ones first.
        The generator queues without limit; keeping the queue here keeps the priority ours."""
        out: list[TokenEvent | PromptEvent] = []
        while self._waiting and self._gen.num_remaining_jobs() < self.max_batch:
            spec = next((w for w in self._waiting if w.interactive), self._waiting[0])
            self._waiting.remove(spec)
            try:
                out.extend(self._start(spec))
            except Exception as exc:  # a sequence that cannot start fails alone
                log.exception("could not start sequence %s", spec.key)
                out.append(TokenEvent.failed(spec.key, str(exc), time.monotonic()))
        return out

    def _start(self, spec: SeqSpec) -> list[TokenEvent | PromptEvent]:
        """Enqueue the sequence's job and enter it in `_live`, or return the events of a sequence
        that needs no job (prefill only)."""
        raise NotImplementedError

    def _breaker_ids(self, breakers: tuple[str, ...]) -> frozenset[int]:
        """DRY's sequence breakers as token ids (once per distinct set: it scans the vocabulary)."""
        if breakers not in self._breakers:
            pieces = self._tok.get_id_to_piece_list(True)
            self._breakers[breakers] = dry_breaker_ids(breakers, pieces)
        return self._breakers[breakers]
