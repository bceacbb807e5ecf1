"""Grammar masks on CUDA logits: xgrammar's kernel and the torch twin agree,
every row and some rows, bf16 and fp32, at a Qwen3-sized vocabulary."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4, 5, 6, 7], [1, 6]])
def test_masks_agree_on_cuda(dtype, rows):
    from tandem.engine import grammar

    vocab, batch = 151936, 8
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (batch, grammar.bitmask_width(vocab)), generator=gen,
                            dtype=torch.int64).to(torch.int32).pin_memory()
    logits = torch.randn(batch, vocab + 64, generator=gen).to("cuda", dtype)
    expected = logits.clone()
    grammar.apply_bitmask_torch(expected[:, :vocab], bitmask, rows)
    grammar.TokenMasks(bitmask, rows).apply(logits[:, :vocab])
    assert torch.equal(logits, expected)
    allowed = grammar.allowed_tokens(bitmask, vocab)
    for r in range(batch):
        finite = torch.isfinite(expected[r, :vocab].float()).cpu()
        assert torch.equal(finite, allowed[r] if r in rows else torch.ones(vocab, dtype=torch.bool))
