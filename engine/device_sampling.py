"""Sampling a whole batch where its logits are (the GPU): the pipeline of
sampler.py (logit_bias -> penalties -> min_tokens -> temperature -> top-k ->
top-p -> min-p -> draw, logprobs before all but the grammar's mask) as batch
tensor operations, with one transfer of results to the host.

Why: sampler.py draws on the CPU, row by row, after copying the logits there:
on a GPU that is every row of [batch, vocabulary] in fp32 over PCIe each step
(512 MiB for 1,024 rows of Llama-3's 128,256 tokens) and a softmax per row
on a few cores, which outweighed the model's own step. Greedy rows never
needed it; sampled rows (temperature above 0, the OpenAI API's default) did.

The edits before the draw (logit bias, penalties, min_tokens) are these
functions on the CPU too (sampler.py calls them on its rows); its row-by-row
filters and draw stay the oracle of filtered_probs and draw here.

The draw is the exponential race: with E_i independent Exp(1), the index of
the largest p_i / E_i is i with probability p_i, so one argmax draws every
row at once. A seeded request draws its row's E with a generator of its own
on the device (kept on the request), so its samples repeat run to run on the
same device; they differ from the CPU's for the same seed, as in vLLM.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from tandem.engine.request import Request, RequestFailedError, TokenLogprob

if TYPE_CHECKING:
    from tandem.engine.sampler import SampleResult


def _on(device: torch.device, values, dtype) -> torch.Tensor:
    """A small host list on the device without waiting for the device's queue
    (a blocking copy would wait for the step before, which asynchronous
    scheduling leaves running; a pageable source is staged at once)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _column(values: Sequence[float], device: torch.device, dtype=torch.float32) -> torch.Tensor:
    return _on(device, values, dtype).unsqueeze(1)


def _scatter_rows(logits: torch.Tensor, rows: list[int], cols: list[int], values, accumulate: bool) -> None:
    """logits[rows[j], cols[j]] = values[j] (or += with accumulate), in one launch."""
    device = logits.device
    index = (_on(device, rows, torch.long), _on(device, cols, torch.long))
    if not torch.is_tensor(values):
        values = _on(device, values, logits.dtype)
    logits.index_put_(index, values, accumulate=accumulate)


def apply_logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    rows, cols, values = [], [], []
    for i, r in enumerate(requests):
        bias = r.params.logit_bias
        if bias:
            rows += [i] * len(bias)
            cols += list(bias.keys())
            values += list(bias.values())
    if rows:
        _scatter_rows(logits, rows, cols, values, accumulate=True)


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request], vocab_size: int) -> None:
    """Repetition penalty (HF's: every token seen, prompt or output) and
    presence and frequency penalties (OpenAI's: output tokens only), in
    place; only rows that ask pay."""
    device = logits.device
    for i, r in enumerate(requests):
        p = r.params
        if p.repetition_penalty != 1.0:
            seen = _on(device, sorted(t for t in set(r.all_token_ids) if t < vocab_size), torch.long)
            values = logits[i, seen]
            logits[i, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
            out = _on(device, r.output_token_ids, torch.long)
            counts = torch.bincount(out, minlength=vocab_size)[:vocab_size].float()
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def mask_early_stop(logits: torch.Tensor, requests: Sequence[Request], vocab_size: int) -> set[int]:
    """-inf for stop tokens and EOS while min_tokens holds; the rows masked."""
    rows, cols, masked = [], [], set()
    for i, r in enumerate(requests):
        if r.num_output_tokens >= r.params.min_tokens:
            continue
        banned = list(r.params.stop_token_ids)
        if r.eos_token_id is not None and not r.params.ignore_eos:
            banned.append(r.eos_token_id)
        banned = [t for t in banned if t < vocab_size]
        if banned:
            rows += [i] * len(banned)
            cols += banned
            masked.add(i)
    if rows:
        _scatter_rows(logits, rows, cols, [float("-inf")] * len(rows), accumulate=False)
    return masked


def filtered_probs(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Every row's distribution after temperature, top-k, top-p and min-p, as
    sampler.Sampler.filtered_probs makes one row's (rows of greedy requests
    are computed too, at temperature 1, and not used)."""
    device = logits.device
    params = [r.params for r in requests]
    temperature = _column([p.temperature if p.temperature > 0 else 1.0 for p in params], device)
    x = logits / temperature
    vocab = x.shape[1]
    top_k = [p.top_k if p.top_k and 0 < p.top_k < vocab else 0 for p in params]
    top_p = [p.top_p for p in params]
    if any(top_k):
        # Each row's k-th largest from one topk of the largest k asked (not a
        # sort of the vocabulary); rows without top-k keep everything.
        largest = x.topk(max(top_k), dim=1).values
        k = _column(top_k, device, torch.long)
        kth = largest.gather(1, (k - 1).clamp(min=0)).masked_fill(k == 0, float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=1)
    if any(tp < 1.0 for tp in top_p):
        sorted_probs, order = probs.sort(dim=1, descending=True)
        cumulative = sorted_probs.cumsum(dim=1)
        # keep the smallest prefix whose mass reaches top_p (always the top token)
        drop = cumulative - sorted_probs >= _column(top_p, device)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    min_p = [p.min_p for p in params]
    if any(mp > 0.0 for mp in min_p):
        floor = _column(min_p, device) * probs.max(dim=1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(dim=1, keepdim=True)


def draw(probs: torch.Tensor, requests: Sequence[Request], rows: list[int]) -> torch.Tensor:
    """One token per row of probs (the exponential race): rows[j] is the
    batch row of probs' row j (for its request's generator)."""
    races = torch.empty_like(probs).exponential_()
    for j, i in enumerate(rows):
        r = requests[i]
        if r.params.seed is not None:
            if r.device_generator is None:
                r.device_generator = torch.Generator(device=probs.device)
                r.device_generator.manual_seed(r.params.seed)
            races[j].exponential_(generator=r.device_generator)
    return (probs / races).argmax(dim=1)


def sample(logits: torch.Tensor, requests: Sequence[Request], vocab_size: int) -> "SampleResult":
    """sampler.Sampler's result for a batch of logits on the device (grammar
    masks applied already). Rows no token can be drawn from fail their
    request, with sampler.py's messages."""
    _, result = launch(logits, requests, vocab_size)
    return result()


def launch(logits: torch.Tensor, requests: Sequence[Request],
           vocab_size: int) -> tuple[torch.Tensor, Callable[[], "SampleResult"]]:
    """Queue the batch's sampling on the device: (its tokens there, a call that
    waits for them on the host and returns the SampleResult). The results
    travel to the host by one non-blocking copy per kind, so the host may
    queue the next step before it waits."""
    from tandem.engine.sampler import SampleResult, _nothing_allowed, no_probability_error

    logits = logits.to(torch.float32, copy=True)  # edited in place below; the caller's rows stay as they were
    num_top = [r.params.logprobs for r in requests]
    raw_logprobs = torch.log_softmax(logits, dim=1) if any(n is not None for n in num_top) else None
    apply_logit_bias(logits, requests)
    apply_penalties(logits, requests, vocab_size)
    masked = mask_early_stop(logits, requests, vocab_size)
    broken = (torch.isnan(logits) | torch.isposinf(logits)).any(dim=1)
    empty = torch.isneginf(logits).all(dim=1)
    tokens = logits.argmax(dim=1)
    sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
    unusable = torch.zeros_like(broken)
    if sampled:
        rows = _on(logits.device, sampled, torch.long)
        probs = filtered_probs(logits[rows], [requests[i] for i in sampled])
        # Finite logits can still overflow once divided by the temperature.
        unusable[rows] = ~torch.isfinite(probs).all(dim=1)
        tokens[rows] = draw(torch.nan_to_num(probs, nan=0.0), requests, sampled)
    # Tokens, then the flags of rows that cannot be drawn from: one copy.
    flags = to_host(torch.stack([tokens, broken.long(), empty.long(), unusable.long()]))
    k = max((n for n in num_top if n is not None), default=0)
    chosen = top = None
    if raw_logprobs is not None:
        chosen = to_host(raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1))
        if k > 0:
            values, ids = torch.topk(raw_logprobs, k, dim=1)
            top = (to_host(values), to_host(ids))
    copied = torch.cuda.current_stream(logits.device).record_event() if logits.is_cuda else None

    def result() -> SampleResult:
        if copied is not None:
            copied.synchronize()  # only this step's sampling: a later step may be running already
        token_list, broken_list, empty_list, unusable_list = flags.tolist()
        errors: dict[int, RequestFailedError] = {}
        for i, r in enumerate(requests):
            if empty_list[i] and i in masked:
                errors[i] = RequestFailedError(
                    "min_tokens: while it holds, stop_token_ids and EOS ban every token of the "
                    "vocabulary, so no token can be sampled", field="min_tokens")
            elif empty_list[i] and r.grammar is not None:
                errors[i] = _nothing_allowed(r)
            elif broken_list[i] or empty_list[i] or unusable_list[i]:
                errors[i] = no_probability_error(r)
        logprobs: list[Optional[TokenLogprob]] = [None] * len(requests)
        if chosen is not None:
            chosen_list = chosen.tolist()
            tops = (top[0].tolist(), top[1].tolist()) if top is not None else None
            for i, n in enumerate(num_top):
                if n is None or i in errors:
                    continue
                alternatives = {}
                if n > 0:
                    # A grammar may leave fewer than n tokens: forbidden ones are not alternatives.
                    alternatives = {t: v for t, v in zip(tops[1][i][:n], tops[0][i][:n]) if v != float("-inf")}
                logprobs[i] = TokenLogprob(token_list[i], chosen_list[i], alternatives)
        return SampleResult(token_list, logprobs, errors)

    return tokens, result


def to_host(x: torch.Tensor) -> torch.Tensor:
    """x on the host; from a GPU, a non-blocking copy into pinned memory (read
    it only after an event recorded behind it)."""
    return x.to("cpu", non_blocking=True) if x.is_cuda else x
