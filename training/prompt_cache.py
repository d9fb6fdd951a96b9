"""The update's encoded prompts: each step's prompt encoded once per update and reused by the
update's other passes, and on a GPU encoded ahead, on a thread, while the GPU works.

The image processor is the costly part of a prompt (resizing and cutting five 1920x1080
screenshots into patches takes about half a second of CPU), and the GPU waits for it unless
the next steps are ready before they are asked for.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from functools import partial

from core.encoding import ImageCache, PromptParts, prompt_parts
from core.policy import Policy
from core.samples import TrainSample


class PromptCache:
    """The prompts of the update in progress, encoded once and reused by its other passes;
    the least recently used are dropped past `max_bytes`, and everything when the update ends.
    Keyed by step id: a step's prompt never changes.

    `prefetch` encodes the update's steps in order on a thread, at most `ahead` steps beyond
    the last one asked for, so the next micro-batch is ready when the GPU finishes this one.
    One prompt is encoded at a time (the tokenizer is not shared between threads).

    `max_bytes` 0 keeps nothing and prefetches nothing."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._parts: OrderedDict[int, PromptParts] = OrderedDict()
        self._bytes = 0
        self.seconds = 0.0  # the update waited this long on encoding since the last clear
        self.reused = 0  # encodings served from the cache since the last clear
        # Screenshots encoded, by content; none when nothing is kept (max_bytes 0).
        self._screens = ImageCache() if max_bytes > 0 else None
        self._lock = threading.Condition()
        self._encoding = threading.Lock()  # one prompt at a time
        self._served: set[int] = set()  # step ids asked for since the last clear
        self._busy: set[int] = set()  # step ids being encoded now
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def prefetch(self, policy: Policy, samples: Sequence[TrainSample], *, ahead: int = 2) -> None:
        """Encode `samples` in order on a thread, `ahead` steps beyond the last asked for."""
        if self.max_bytes <= 0 or not samples:
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._prefetch,
            args=(policy, list(samples), ahead),
            name="prompt-prefetch",
            daemon=True,
        )
        self._thread.start()

    def _prefetch(self, policy: Policy, samples: list[TrainSample], ahead: int) -> None:
        for index, sample in enumerate(samples):
            with self._lock:
                self._lock.wait_for(partial(self._may_encode, index, ahead))
                if self._stop.is_set():
                    return
                if sample.step_id in self._parts or sample.step_id in self._busy:
                    continue
                self._busy.add(sample.step_id)
            try:
                with self._encoding:
                    parts = self._encode(policy, sample)
            except Exception:  # the update encodes it again and meets the error on its own thread
                with self._lock:
                    self._busy.discard(sample.step_id)
                    self._lock.notify_all()
                return
            with self._lock:
                self._busy.discard(sample.step_id)
                self._insert(sample.step_id, parts)
                self._lock.notify_all()

    def _may_encode(self, index: int, ahead: int) -> bool:
        return self._stop.is_set() or len(self._served) + ahead > index

    def get(self, policy: Policy, sample: TrainSample) -> PromptParts:
        """The step's encoded prompt: from the cache, from the prefetch (waiting for it if it
        is being encoded), or encoded here."""
        started = time.perf_counter()
        with self._lock:
            first = sample.step_id not in self._served
            if first:
                self._served.add(sample.step_id)
                self._lock.notify_all()  # the prefetch may go one step further
            self._lock.wait_for(lambda: sample.step_id not in self._busy)
            parts = self._parts.get(sample.step_id)
            if parts is not None:
                self._parts.move_to_end(sample.step_id)
                if first:  # prefetched: count what the update waited for it
                    self.seconds += time.perf_counter() - started
                else:
                    self.reused += 1
                return parts
            self._busy.add(sample.step_id)
        try:
            with self._encoding:
                parts = self._encode(policy, sample)
        finally:
            with self._lock:
                self._busy.discard(sample.step_id)
                self._lock.notify_all()
        with self._lock:
            self.seconds += time.perf_counter() - started
            if self.max_bytes > 0:
                self._insert(sample.step_id, parts)
        return parts

    def _encode(self, policy: Policy, sample: TrainSample) -> PromptParts:
        """Encode one prompt (the caller holds `_encoding`), its screenshots once each."""
        return prompt_parts(
            policy, sample.messages, ids=sample.prompt_token_ids, image_cache=self._screens
        )

    def _insert(self, step_id: int, parts: PromptParts) -> None:
        self._parts[step_id] = parts
        self._bytes += parts.nbytes
        while self._bytes > self.max_bytes and len(self._parts) > 1:
            _, dropped = self._parts.popitem(last=False)
            self._bytes -= dropped.nbytes

    def clear(self) -> None:
        """Stop the prefetch and forget everything (between updates)."""
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._parts.clear()
        self._bytes = 0
        self.seconds = 0.0
        self.reused = 0
        if self._screens is not None:
            self._screens.clear()
        self._served.clear()
        self._busy.clear()
