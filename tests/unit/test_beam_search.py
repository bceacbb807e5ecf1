"""LLM.beam_search returns what HF transformers' beam search returns
(`generate(num_beams=4, do_sample=False, ...)`) on the embedded SmolLM2,
fp32 on CPU: the best sequence token for token and its score, for 10 chat
prompts, with the default settings, a length penalty other than 1, and each
early_stopping rule. Also: its parameters are checked, field by field."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tandem.engine import LLM, BeamSearchParams, BeamSearchParamsError
from tests.support.hf_oracle import embedded_hf_model

pytestmark = pytest.mark.timeout(1200)

WIDTH = 4
MAX_NEW = 16

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Say hello in Spanish.",
    "What is 2 + 2?",
    "Give me a synonym for happy.",
    "Who wrote Romeo and Juliet?",
    "What colour is the sky on a clear day?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Translate 'thank you' into French.",
]


@dataclass
class HFBeam:
    tokens: list[int]
    score: float  # HF's sequences_scores: sum_logprobs / len ** length_penalty


def hf_beam_search(hf, prompt: list[int], eos: int, max_new: int, length_penalty: float,
                   early_stopping) -> HFBeam:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_new, num_beams=WIDTH, do_sample=False,
                          length_penalty=length_penalty, early_stopping=early_stopping,
                          eos_token_id=eos, pad_token_id=eos, output_scores=True,
                          return_dict_in_generate=True, temperature=None, top_p=None, top_k=None)
    # The best beam's own length: HF crops the output to it (one sequence returned).
    return HFBeam(out.sequences[0, len(prompt):].tolist(), float(out.sequences_scores[0]))


@pytest.fixture(scope="module")
def setup():
    # One intra-op thread: both sides run many small steps, and on a small
    # shared CI machine spinning threads made them 5x slower, not faster.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    hf, _ = embedded_hf_model()
    llm = LLM("smollm2")  # prefix caching is on by default: the beams share blocks
    prompts = [llm.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
    yield hf, llm, prompts
    torch.set_num_threads(threads)


def check_against_hf(setup, length_penalty: float, early_stopping, prompts=None) -> list[str]:
    """Asserts the best sequences equal HF's; returns a note per near tie
    (a different sequence whose score differs from HF's best's by less than
    the engine's and HF's fp32 rounding can account for)."""
    hf, llm, all_prompts = setup
    prompts = prompts or all_prompts
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_NEW, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    ours = llm.beam_search(prompts, params)
    notes = []
    for i, (prompt, out) in enumerate(zip(prompts, ours)):
        ref = hf_beam_search(hf, prompt, llm.engine.eos_token_id, MAX_NEW, length_penalty, early_stopping)
        best = out.sequences[0]
        assert len(out.sequences) == WIDTH
        assert [s.score for s in out.sequences] == sorted((s.score for s in out.sequences), reverse=True)
        # The engine's fp32 logprobs differ from HF's in the last bits; a score
        # multiplied by its length (length_penalty < 0) carries that along.
        tolerance = max(1e-4, 1e-5 * abs(ref.score))
        if best.token_ids != ref.tokens and abs(best.score - ref.score) < tolerance:
            notes.append(f"prompt {i}: near tie, ours {best.score:.6f} vs HF {ref.score:.6f}")
            continue
        assert best.token_ids == ref.tokens, (f"prompt {i}: ours {best.token_ids} ({best.score:.6f}) vs "
                                              f"HF {ref.tokens} ({ref.score:.6f})")
        assert best.score == pytest.approx(ref.score, abs=tolerance)
    return notes


def test_matches_hf_defaults(setup):
    # HF's defaults: length_penalty=1.0, early_stopping=False
    notes = check_against_hf(setup, 1.0, False)
    print("\n".join(notes))
    assert len(notes) <= 1, notes


# Each rule on a few prompts (an HF beam search takes seconds on CPU): a
# length penalty that favours long and short sequences, early_stopping=True,
# and "never", whose heuristic looks ahead to max_tokens when the penalty is > 0.
@pytest.mark.parametrize("length_penalty,early_stopping", [(2.0, False), (-1.0, False), (1.0, True),
                                                           (2.0, "never")])
def test_matches_hf_length_penalty_and_early_stopping(setup, length_penalty, early_stopping):
    _, _, prompts = setup
    notes = check_against_hf(setup, length_penalty, early_stopping, prompts[:2])
    print("\n".join(notes))
    assert len(notes) <= 1, notes


def test_finished_beams_and_text(setup):
    _, llm, prompts = setup
    out = llm.beam_search(prompts[0], BeamSearchParams(beam_width=2, max_tokens=8))[0]
    assert out.prompt_token_ids == prompts[0]
    for beam in out.sequences:
        assert beam.finish_reason in ("stop", "length")
        if beam.finish_reason == "stop":
            assert beam.token_ids[-1] == llm.engine.eos_token_id
        else:
            assert len(beam.token_ids) == 8
        assert beam.text == llm.tokenizer.decode(beam.token_ids, skip_special_tokens=True)
    # ignore_eos: EOS is a token like any other, so every beam runs to max_tokens.
    out = llm.beam_search(prompts[0], BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True))[0]
    assert all(len(b.token_ids) == 8 and b.finish_reason == "length" for b in out.sequences)
    assert not llm.engine.has_unfinished()


def test_shares_prefix_blocks(setup):
    """The beams of one step share their prompt's blocks through the prefix
    cache: the prompt is computed once, not once per beam per step."""
    _, llm, prompts = setup
    long_prompt = prompts[0] * 8  # several full blocks
    computed = []
    schedule = llm.engine.scheduler.schedule

    def observed():
        plan = schedule()
        computed.append(sum(plan.num_new_tokens))
        return plan

    llm.engine.scheduler.schedule = observed
    try:
        llm.beam_search(long_prompt, BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True))
    finally:
        llm.engine.scheduler.schedule = schedule
    block = llm.engine.kv.block_size
    # Without sharing: 4 beams x 5 later steps x the whole prompt again.
    assert sum(computed) < len(long_prompt) + 4 * 5 * (block + 6)


@pytest.mark.parametrize("field,value", [("beam_width", 0), ("beam_width", 11), ("beam_width", 2.0),
                                         ("max_tokens", 0), ("length_penalty", float("nan")),
                                         ("length_penalty", "1"), ("early_stopping", "always"),
                                         ("early_stopping", 1), ("ignore_eos", "yes")])
def test_params_name_the_bad_field(field, value):
    kwargs = dict(beam_width=4, max_tokens=8)
    kwargs[field] = value
    with pytest.raises(BeamSearchParamsError) as info:
        BeamSearchParams(**kwargs)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_context_limit_names_max_tokens(setup):
    _, llm, prompts = setup
    with pytest.raises(BeamSearchParamsError, match="^max_tokens: "):
        llm.beam_search(prompts[0], BeamSearchParams(beam_width=2, max_tokens=llm.engine.max_model_len))
