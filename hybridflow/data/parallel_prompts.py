"""Chat templates and tokenization of a dataset's prompts, in worker processes when asked
(veRL's ``data.filter_overlong_prompts_workers``).

Rendering a chat template is Python (jinja) work, one prompt at a time under the GIL, and the tokenizer's batch encoder
runs on one thread when ``TOKENIZERS_PARALLELISM`` is off. With ``workers > 1`` and at least `PARALLEL_MIN_ROWS`
prompts, `PromptWork` hands contiguous chunks to a pool of spawned processes (each receives the tokenizer once, when
it starts) and joins the results in order, so the dataset is the same as the serial path's, row for row. Smaller
datasets are done in-process: starting the processes would cost more than it saves. A template error in a worker is
raised in the caller as it would be serially, naming the file and row.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from hybridflow.data.schema import DataConfigError

__all__ = ["PARALLEL_MIN_ROWS", "PromptWork", "encode_texts", "render_texts"]

PARALLEL_MIN_ROWS = 1000
_CHUNKS_PER_WORKER = 4  # a few chunks each, so a slow chunk (long chats) does not hold the others up

_worker_state: dict[str, Any] = {}  # in a pool process: the tokenizer and template settings, set once


def render_texts(tokenizer: Any, chats: list, origins: list, apply_chat_template: bool, kwargs: dict) -> list[str]:
    """Each prompt's chat as the text the model reads (the chat template applied, or the contents joined)."""
    texts = []
    for chat, (path, i) in zip(chats, origins):
        if apply_chat_template:
            try:
                text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, **kwargs)
            except Exception as e:  # jinja errors (e.g. a template rejecting a role) name neither file nor row
                raise DataConfigError(f"data file {path!r}, row {i}: the chat template failed on this prompt: {e}") from e
        else:
            # Without a template the messages' contents are joined; the model sees plain text.
            text = "\n".join(m["content"] for m in chat)
        texts.append(text)
    return texts


def encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added (the template already wrote them as text)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if hasattr(backend, "encode_batch"):  # the Rust tokenizer directly: half the time of the Python wrapper
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _start(tokenizer: Any, apply_chat_template: bool, kwargs: dict) -> None:
    _worker_state.update(tokenizer=tokenizer, apply_chat_template=apply_chat_template, kwargs=kwargs)


def _render_chunk(chunk: tuple[list, list]) -> tuple[int, list[str]]:
    s = _worker_state
    return os.getpid(), render_texts(s["tokenizer"], chunk[0], chunk[1], s["apply_chat_template"], s["kwargs"])


def _encode_chunk(texts: list[str]) -> tuple[int, list[list[int]]]:
    return os.getpid(), encode_texts(_worker_state["tokenizer"], texts)


class PromptWork:
    """render / encode, in `workers` processes when there are enough rows, else in this process.

    ``with PromptWork(tokenizer, n_rows, workers, ...) as work: texts = work.render(chats, origins)``;
    ``work.workers``: the pool's processes (1: this process does the work); ``work.pids``: those that did some.
    """

    def __init__(self, tokenizer: Any, n_rows: int, workers: int, apply_chat_template: bool, kwargs: dict) -> None:
        if workers < 1:
            raise DataConfigError(f"data.filter_overlong_prompts_workers={workers} must be >= 1 (1: in this process)")
        self.tokenizer, self.apply_chat_template, self.kwargs = tokenizer, apply_chat_template, kwargs
        self.workers = workers if n_rows >= PARALLEL_MIN_ROWS else 1
        self._pool: ProcessPoolExecutor | None = None
        self.pids: set[int] = set()

    def __enter__(self) -> PromptWork:
        if self.workers > 1:
            # spawn, not fork: the driver may already hold Ray's and torch's threads, which a fork would copy mid-state
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_start,
                                             initargs=(self.tokenizer, self.apply_chat_template, self.kwargs))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def _chunks(self, n: int) -> list[slice]:
        size = -(-n // (self.workers * _CHUNKS_PER_WORKER)) or 1
        return [slice(lo, lo + size) for lo in range(0, n, size)]

    def render(self, chats: list, origins: list) -> list[str]:
        if self._pool is None:
            return render_texts(self.tokenizer, chats, origins, self.apply_chat_template, self.kwargs)
        jobs = [(chats[s], origins[s]) for s in self._chunks(len(chats))]
        return self._joined(self._pool.map(_render_chunk, jobs))

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self._pool is None:
            return encode_texts(self.tokenizer, texts)
        return self._joined(self._pool.map(_encode_chunk, [texts[s] for s in self._chunks(len(texts))]))

    def _joined(self, results) -> list:
        out: list = []
        for pid, part in results:  # map keeps the chunks' order
            self.pids.add(pid)
            out.extend(part)
        return out
