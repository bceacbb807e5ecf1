"""A new KV connector needs only its own file: the one below, written against
the connector ABC and its narrow dependencies alone (its role, the cache
layout, the requests and plans the engine hands it), moves a prompt's blocks
from a producer engine to a consumer engine through host memory, and the
consumer answers exactly as an engine that computed the whole prompt.

Both engines share this process (the connector's "store" is a dict), which
proves the seam, not disaggregation: tests/e2e/test_disaggregated.py and
test_direct_transfer.py run the real connectors across processes."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from tandem.engine import CacheConfig, EngineConfig, ModelConfig, SamplingParams
from tandem.engine.connector.base import ConnectorMeta, KVConnector
from tandem.engine.llm_engine import LLMEngine
from tests.support.hf_oracle import tiny_model_dir

BLOCK = 16
PROMPT = [(5 * i + 1) % 400 + 3 for i in range(70)]  # 4 full blocks and 6 tokens


@dataclass
class Move:
    request_id: str
    block_ids: list[int]
    block_hashes: list[bytes]


@dataclass
class HostMeta(ConnectorMeta):
    loads: list[Move] = field(default_factory=list)
    saves: list[Move] = field(default_factory=list)


class HostMemoryConnector(KVConnector):
    """Producers copy each prompt block, every layer, into `blocks` (hash ->
    [layers, 2, block_size, heads, head_dim]); consumers copy them back."""

    def __init__(self, role, layout, blocks: dict) -> None:
        super().__init__(role, layout)
        self.blocks = blocks
        self._admitted: list[Move] = []

    def get_num_new_matched_tokens(self, request, num_local_hit_tokens):
        if not self.consumes:
            return 0
        first = num_local_hit_tokens // self.layout.block_size
        last = (request.num_tokens - 1) // self.layout.block_size  # one token left to compute
        n = 0
        while first + n < last and request.block_hashes[first + n] in self.blocks:
            n += 1
        return n * self.layout.block_size

    def update_state_after_alloc(self, request, block_ids, num_local_hit_tokens, num_external_tokens):
        first = num_local_hit_tokens // self.layout.block_size
        last = first + num_external_tokens // self.layout.block_size
        if last > first:
            self._admitted.append(Move(request.request_id, block_ids[first:last],
                                       request.block_hashes[first:last]))

    def build_meta(self, plan, requests):
        meta = HostMeta(loads=self._admitted)
        self._admitted = []
        if self.produces:
            bs = self.layout.block_size
            for rid, start, n in zip(plan.request_ids, plan.num_computed_tokens, plan.num_new_tokens):
                request = requests[rid]
                first, last = start // bs, min(start + n, request.num_prompt_tokens) // bs
                if last > first:
                    meta.saves.append(Move(rid, request.block_ids[first:last], request.block_hashes[first:last]))
        return meta

    def start_load(self, meta):
        for move in meta.loads:
            for block_id, block_hash in zip(move.block_ids, move.block_hashes):
                self.kv_cache[:, :, block_id] = self.blocks[block_hash]
            self.stats.load_blocks += len(move.block_ids)
        return set()

    def save_layer(self, layer, meta):
        if layer == self.layout.num_layers - 1:  # every layer has written its K/V by now
            for move in meta.saves:
                for block_id, block_hash in zip(move.block_ids, move.block_hashes):
                    self.blocks[block_hash] = self.kv_cache[:, :, block_id].clone()
                self.stats.save_blocks += len(move.block_ids)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path, _ = tiny_model_dir(tmp_path_factory.mktemp("seam"), "llama")
    return path


def engine(model_dir, role="both", blocks=None) -> LLMEngine:
    config = EngineConfig(model=ModelConfig(model=model_dir, dtype="float32"),
                          cache=CacheConfig(block_size=BLOCK, num_blocks=64), device="cpu", kv_role=role)
    if blocks is None:
        return LLMEngine(config)
    return LLMEngine(config, kv_connector=lambda role, layout: HostMemoryConnector(role, layout, blocks))


def run(eng: LLMEngine, max_tokens: int, **kwargs) -> list[int]:
    eng.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), **kwargs)
    tokens: list[int] = []
    while eng.has_unfinished():
        for out in eng.step():
            tokens += out.new_token_ids
    return tokens


def test_a_connector_in_its_own_file_moves_a_prompts_kv(model_dir):
    reference = run(engine(model_dir), 8)
    blocks: dict = {}
    producer = engine(model_dir, "producer", blocks)
    first = run(producer, 1)
    assert len(blocks) == len(PROMPT) // BLOCK and producer.stats().kv_save_blocks == 4
    consumer = engine(model_dir, "consumer", blocks)
    tokens = run(consumer, 8, first_token_ids=first)
    assert tokens == reference
    stats = consumer.stats()
    assert stats.kv_load_blocks == 4 and stats.prompt_tokens_external == 4 * BLOCK
    assert stats.prompt_tokens_computed == len(PROMPT) - 4 * BLOCK
    assert isinstance(next(iter(blocks.values())), torch.Tensor)
