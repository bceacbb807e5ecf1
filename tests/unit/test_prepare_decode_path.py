"""ModelRunner.prepare() has a decode path for plans whose every entry is a
plain decode (SchedulerOutput.num_plain_decodes). It must build exactly what
the general path builds: each step of a real engine (requests of staggered
lengths crossing block boundaries, finishing at different steps, new ones
arriving) is prepared both ways and every tensor and number compared."""
from __future__ import annotations

import dataclasses
import random


from tandem.engine import LLM, SamplingParams
from tests.support.hf_oracle import tiny_model_dir


def snapshot(batch) -> dict:
    """A batch's contents as plain values (its tensors are reused by the next prepare())."""
    meta = batch.meta
    values = {name: getattr(meta, name) for name in
              ("max_query_len", "max_seq_len", "query_start_loc_cpu", "seq_lens_cpu")}
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        tensor = getattr(meta, name)
        values[name] = (tensor.dtype, tensor.tolist())
    for name in ("input_ids", "positions"):
        tensor = getattr(batch, name)
        values[name] = (tensor.dtype, tensor.tolist())
    rows = batch.logits_indices  # None: every row, in order
    values["logits_rows"] = list(range(len(batch.input_ids))) if rows is None else rows.tolist()
    values["sampling"] = [id(s) for s in batch.sampling]
    return values


def test_the_decode_path_prepares_what_the_general_path_prepares(tmp_path):
    path, _ = tiny_model_dir(tmp_path, "llama")
    llm = LLM(path, block_size=8, max_num_seqs=16)
    engine, runner = llm.engine, llm.engine.runner
    rng = random.Random(3)
    decode_steps = mixed_steps = 0
    for step in range(120):
        if step < 80 and rng.random() < 0.15:
            prompt = [rng.randrange(2, 512) for _ in range(rng.randrange(1, 40))]
            engine.add_request(f"r{step}", prompt, SamplingParams(
                temperature=0, max_tokens=rng.randrange(1, 40), ignore_eos=True))
        if not engine.has_unfinished():
            continue
        plan = engine.scheduler.schedule()
        decode_path = plan.num_plain_decodes == len(plan.scheduled) > 0
        decode_steps += decode_path
        mixed_steps += not decode_path
        first = snapshot(runner.prepare(plan))
        general = snapshot(runner.prepare(dataclasses.replace(plan, num_plain_decodes=0)))
        assert first == general, f"step {step}"
        for s in plan.scheduled:  # undo the probe's progress: step() plans again
            s.request.num_computed_tokens = s.start
        engine.step()
    assert decode_steps > 40 and mixed_steps > 10, (decode_steps, mixed_steps)


def test_plain_decode_counts_only_entries_that_are_plain_decodes(tmp_path):
    """num_plain_decodes never counts an entry that is not a one-token step at
    the request's last known token inside a block it holds."""
    path, _ = tiny_model_dir(tmp_path, "llama")
    llm = LLM(path, block_size=4, max_num_seqs=8, num_blocks=40, max_num_batched_tokens=24)
    engine = llm.engine
    rng = random.Random(5)
    for i in range(12):
        engine.add_request(f"r{i}", [rng.randrange(2, 512) for _ in range(rng.randrange(1, 30))],
                           SamplingParams(temperature=0, max_tokens=rng.randrange(5, 30), ignore_eos=True))
    counted = 0
    while engine.has_unfinished():
        plan = engine.scheduler.schedule()
        plain = [s for s in plan.scheduled if s.num_new_tokens == 1 and s.samples
                 and s.start < len(s.block_ids) * 4]
        assert plan.num_plain_decodes <= len(plain)
        counted += plan.num_plain_decodes
        for s in plan.scheduled:
            s.request.num_computed_tokens = s.start
        engine.step()
    assert counted > 50 and engine.stats().num_preemptions > 0, (counted, engine.stats().num_preemptions)
