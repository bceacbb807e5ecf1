"""ModelRunner.prepare() has a branch for decode-only plans (one token per
entry). It must build exactly what the general branch builds: every step of
a real engine (requests of staggered lengths crossing block boundaries,
finishing at different steps, new ones arriving) is prepared by the engine's
runner and, with the decode branch switched off, by a second runner fed the
same plans; every tensor and number must be equal."""
from __future__ import annotations

import dataclasses
import random

from tandem.engine import LLM, SamplingParams
from tandem.engine.model_runner import ModelRunner
from tandem.engine.plan import SchedulerOutput
from tests.support.hf_oracle import tiny_model_dir


class GeneralBranchPlan(SchedulerOutput):
    @property
    def is_decode_only(self) -> bool:
        return False


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
    return values


def test_the_decode_branch_prepares_what_the_general_branch_prepares(tmp_path):
    path, _ = tiny_model_dir(tmp_path, "llama")
    llm = LLM(path, block_size=8, max_num_seqs=16)
    engine, runner = llm.engine, llm.engine.runner
    twin = ModelRunner(engine.config, engine.info)
    twin.bind_kv_cache()
    rng = random.Random(3)
    decode_steps = mixed_steps = 0
    for step in range(120):
        if step < 80 and rng.random() < 0.15:
            prompt = [rng.randrange(2, 512) for _ in range(rng.randrange(1, 40))]
            engine.add_request(f"r{step}", prompt, SamplingParams(
                temperature=0, max_tokens=rng.randrange(1, 40), ignore_eos=True))
        if not engine.has_unfinished():
            continue
        # engine.step(), with the twin preparing the same plan beside it
        plan = engine.scheduler.schedule()
        decode_steps += plan.is_decode_only
        mixed_steps += not plan.is_decode_only
        batch = runner.prepare(plan)
        general = GeneralBranchPlan(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)})
        assert snapshot(batch) == snapshot(twin.prepare(general)), f"step {step}"
        logits = runner.forward(batch, plan)
        result = engine.sampler(logits, engine.scheduler.sampling_requests)
        engine.scheduler.update(result.token_ids, result.logprobs, result.errors)
    assert decode_steps > 40 and mixed_steps >= 8, (decode_steps, mixed_steps)
