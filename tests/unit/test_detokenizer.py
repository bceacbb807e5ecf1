"""The incremental detokenizer writes what decoding the whole output writes:
the same text, cut at the same stop string, at the same token, while a
fast tokenizer decodes each token once (the whole output only at the end).
The oracle is the same class over a tokenizer without its Rust backend,
which re-decodes every output id per token (the behaviour before)."""
from __future__ import annotations

import random

import pytest

from tandem.engine.detokenizer import Detokenizer
from tandem.engine.loader import load_model_info


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_info("smollm2").tokenizer


class _Counting:
    """The real tokenizer, counting whole-output decodes; `backend=False`
    hides its Rust backend (the re-decoding path)."""

    def __init__(self, tokenizer, backend: bool) -> None:
        self._tokenizer = tokenizer
        self.decodes = 0
        if backend:
            self.backend_tokenizer = tokenizer.backend_tokenizer

    def decode(self, ids, **kwargs):
        self.decodes += 1
        return self._tokenizer.decode(ids, **kwargs)


def _run(tokenizer, ids: list[int], stop: list[str], backend: bool):
    detok = Detokenizer(_Counting(tokenizer, backend), stop)
    deltas, stopped_at, stop_str = [], None, None
    for i, t in enumerate(ids):
        stop_str = detok.add(t)
        last = stop_str is not None or i == len(ids) - 1
        if last and stop_str is None:
            stop_str = detok.finish()
        deltas.append(detok.delta(last))
        if stop_str is not None:
            stopped_at = i
            break
    return "".join(deltas), stop_str, stopped_at, detok


def _sequences(tokenizer) -> list[list[int]]:
    rng = random.Random(7)
    vocab = len(tokenizer)
    texts = ["I love pizza 🍕🍕🍕 and 猫 cats, 一, 二, 三!", "Hello there, friend! How are you today?",
             "emoji 👩‍👩‍👧 family, flags 🇫🇷🇩🇪, math ∑∫ and accents éàü."]
    seqs = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    seqs += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 80))] for _ in range(60)]
    seqs.append(seqs[0] + [tokenizer.eos_token_id] + seqs[1])  # a special token in the middle
    return seqs


@pytest.mark.parametrize("stop", [[], ["there"], ["🍕"], [", "], ["zzzz-never"]])
def test_the_stream_writes_what_a_whole_decode_writes(tokenizer, stop):
    for ids in _sequences(tokenizer):
        fast = _run(tokenizer, ids, stop, backend=True)
        slow = _run(tokenizer, ids, stop, backend=False)
        assert fast[:3] == slow[:3], ids
        if fast[1] is None:
            assert fast[0] == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_fast_tokenizer_decodes_the_whole_output_once(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 60, add_special_tokens=False)
    text, _, _, detok = _run(tokenizer, ids, [], backend=True)
    assert detok.tokenizer.decodes == 1  # at finish()
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    _, _, _, slow = _run(tokenizer, ids, [], backend=False)
    assert slow.tokenizer.decodes == len(ids)


def test_a_split_character_is_held_back_until_it_is_whole(tokenizer):
    ids = tokenizer.encode("🍕", add_special_tokens=False)
    assert len(ids) > 1
    detok = Detokenizer(tokenizer, [])
    for t in ids[:-1]:
        detok.add(t)
        assert detok.delta(False) == ""
    detok.add(ids[-1])
    assert detok.delta(False) == "🍕"
