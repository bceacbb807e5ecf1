"""Admission by expected output (engine/admission.py): the scheduler keeps KV
blocks for what the running requests are still expected to write, so a cache
too small for the whole batch delays requests instead of preempting and
recomputing them. Driven as tests/unit/test_scheduler.py drives the
scheduler (real scheduler, KV cache manager and stop rules, no model), and
through the engine on a tiny model for the outputs."""
import itertools

import pytest

from tandem.engine.admission import DEFAULT_TAIL, MIN_SAMPLES, PRIOR_TOKENS, OutputLengthEstimate
from tandem.engine.config import SchedulerConfig
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import Request, RequestStatus, SamplingParams
from tandem.engine.scheduler import Scheduler

_ids = itertools.count()
BS = 16


def make(num_blocks: int, admission: str, budget: int = 256, max_num_seqs: int = 256,
         overcommit: float = 0.0, tail: float = DEFAULT_TAIL) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, admission=admission,
                                     admission_overcommit=overcommit, admission_tail=tail),
                     KVCacheManager(num_blocks, BS))


def request(n_prompt: int, max_tokens: int, stop_token_ids=()) -> Request:
    ids = [next(_ids) % 1000 + 20 for _ in range(n_prompt)]  # no prefix shared between requests
    return Request(f"r{next(_ids)}", ids, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                         stop_token_ids=list(stop_token_ids)))


def run(sched: Scheduler, requests: list[Request], limit: int = 5000) -> list[int]:
    """Every request to its end, one stand-in token (7) a sampled row; the
    number of requests running after each step."""
    for r in requests:
        sched.add_request(r)
    running = []
    for _ in range(limit):
        if not sched.has_unfinished():
            return running
        sched.schedule()
        n = len(sched.sampling_requests)
        sched.update([7] * n, [None] * n, {})
        running.append(len(sched.running))
    raise AssertionError("requests did not finish")


def test_the_estimate_is_the_prior_until_enough_requests_finish_then_their_recent_mean():
    est = OutputLengthEstimate(window=3, min_samples=3)
    assert est.expected_tokens() == PRIOR_TOKENS
    r = request(40, max_tokens=100)
    assert est.expected_output(r) == 100  # the client's max_tokens is below the prior
    for n in (10, 20):
        est.observe(n)
    assert est.expected_tokens() == PRIOR_TOKENS  # two finished: too few (a warm-up's)
    est.observe(31)
    assert est.expected_tokens() == 21  # 61 / 3, rounded up
    est.observe(1)  # the window keeps the last three: 20, 31, 1
    assert est.expected_tokens() == 18 and est.expected_output(r) == 18


def test_reserving_for_known_outputs_replaces_preemption_with_waiting():
    # 40 usable blocks (640 tokens); 8 requests of 48-token prompts and 64
    # output tokens end at 7 blocks each: 56 blocks if all ran at once.
    def workload():
        return [request(48, max_tokens=64) for _ in range(8)]

    greedy = make(41, "greedy")
    greedy_requests = workload()
    run(greedy, greedy_requests)
    assert greedy.stats.num_preemptions > 0, "the cache is sized so that admitting every prompt preempts"

    reserve = make(41, "reserve")
    reserve_requests = workload()
    for r in reserve_requests:
        reserve.add_request(r)
    assert len(reserve.schedule().request_ids) == 5  # 5 x 7 blocks fit in 40; the sixth waits
    reserve.update([7] * 5, [None] * 5, {})
    run(reserve, [])
    assert reserve.stats.num_preemptions == 0
    assert reserve.stats.num_admissions_deferred > 0
    for r in greedy_requests + reserve_requests:
        assert r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 64
    for sched in (greedy, reserve):
        assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks


def test_an_overcommit_admits_past_the_cache_and_preemption_absorbs_the_overshoot():
    # The cache of the test above: 5 requests fit, projected at 8 blocks each
    # at their ends (7, and one for the partial block the bound allows). Half
    # over it (60 blocks) admits 7 (56), the eighth waits; the blocks too
    # many are found by preemption, and every answer completes.
    sched = make(41, "reserve", budget=1024, overcommit=0.5)
    requests = [request(48, max_tokens=64) for _ in range(8)]
    for r in requests:
        sched.add_request(r)
    assert len(sched.schedule().request_ids) == 7
    sched.update([7] * 7, [None] * 7, {})
    run(sched, [])
    assert sched.stats.num_preemptions > 0 and sched.stats.num_admissions_deferred > 0
    for r in requests:
        assert r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 64
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks


def test_a_short_tail_is_admitted_past_the_projection_and_a_long_queue_waits():
    # The cache of the tests above: 5 requests of 48 + 64 tokens fit (8
    # projected blocks each at their ends). A sixth alone is a tail of 112
    # tokens, 7 blocks: 0.175 of the 40, so a share of 0.2 admits it (48
    # projected blocks); the default 0.1 does not.
    def first_plan(n: int, tail: float) -> tuple[Scheduler, list[Request], int]:
        """The scheduler after its first plan, its requests, and how many that plan started."""
        sched = make(41, "reserve", budget=1024, tail=tail)
        requests = [request(48, max_tokens=64) for _ in range(n)]
        for r in requests:
            sched.add_request(r)
        started = len(sched.schedule().request_ids)
        sched.update([7] * started, [None] * started, {})
        return sched, requests, started

    short, requests, started = first_plan(6, tail=0.2)
    assert started == 6 and short.stats.num_admissions_tail == 1
    run(short, [])
    assert short.stats.num_admissions_deferred == 0
    assert short.stats.num_preemptions > 0, "42 blocks for 40: preemption takes the overshoot"
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 64 for r in requests)
    assert short.kv.pool.num_free_blocks == short.kv.pool.num_usable_blocks
    # the default share, or no tail, keeps the sixth waiting
    for tail in (DEFAULT_TAIL, 0.0):
        strict, _, started = first_plan(6, tail=tail)
        assert started == 5 and strict.stats.num_admissions_tail == 0
        assert strict.stats.num_admissions_deferred > 0
    # three waiting (21 blocks, over half the cache) are no tail: they wait for batches of their own
    long, _, started = first_plan(8, tail=0.2)
    assert started == 5 and long.stats.num_admissions_tail == 0
    run(long, [])
    assert long.stats.num_preemptions == 0


def test_under_srtf_the_staged_requests_count_in_the_queue_a_tail_is_judged_by():
    # --policy srtf moves all eight into its staging queue, leaving `waiting`
    # empty: the three the cache cannot take are still no short tail.
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=256, admission="reserve",
                                      policy="srtf", staging_queue_size=8, admission_tail=0.2),
                      KVCacheManager(41, BS))
    for r in [request(48, max_tokens=64) for _ in range(8)]:
        sched.add_request(r)
    assert len(sched.schedule().request_ids) == 5
    assert sched.stats.num_admissions_tail == 0 and len(sched.staging) == 3 and not sched.waiting


def test_admission_widens_once_finished_answers_turn_out_short():
    # max_tokens 512 but every answer stops at its first token (the stand-in
    # token 7 is a stop token): until MIN_SAMPLES have finished the prior
    # reserves 512 tokens a request (34 blocks with its prompt); afterwards
    # the mean, 1 token, does (3 blocks).
    sched = make(200, "reserve", budget=4096, max_num_seqs=64)  # 199 usable blocks
    first_wave = [request(32, max_tokens=512, stop_token_ids=[7]) for _ in range(MIN_SAMPLES)]
    for r in first_wave:
        sched.add_request(r)
    plan = sched.schedule()
    assert len(plan.request_ids) == 5  # 5 x 34 blocks fit in 199, 6 do not
    sched.update([7] * 5, [None] * 5, {})
    run(sched, [])
    second_wave = [request(32, max_tokens=512, stop_token_ids=[7]) for _ in range(40)]
    for r in second_wave:
        sched.add_request(r)
    assert len(sched.schedule().request_ids) == 40
    assert sched.stats.num_preemptions == 0


def test_blocks_that_requests_finishing_soon_give_back_serve_a_newcomer():
    # 40 usable blocks. One request near its end holds 19 (302 tokens of 304),
    # one early in its answer holds 5 and will hold 12. A newcomer needs 4 now
    # and 12 at its end: with everyone's final blocks reserved at once (19 +
    # 12 + 12 > 40) it would wait, but the first finishes within 2 steps, long
    # before the others have grown: the projection peaks at about 29.
    sched = make(41, "reserve", budget=512)
    old = request(288, max_tokens=16)
    young = request(64, max_tokens=128)
    for r in (old, young):
        sched.add_request(r)
    sched.schedule()
    sched.update([7, 7], [None] * 2, {})
    for _ in range(13):  # old at 302 tokens, 2 steps left
        sched.schedule()
        sched.update([7, 7], [None] * 2, {})
    assert len(old.block_ids) == 19 and old.num_output_tokens == 14
    newcomer = request(64, max_tokens=128)
    sched.add_request(newcomer)
    plan = sched.schedule()
    assert newcomer.request_id in plan.request_ids
    n = len(sched.sampling_requests)
    sched.update([7] * n, [None] * n, {})
    run(sched, [])
    assert sched.stats.num_preemptions == 0


def test_a_request_is_admitted_when_nothing_runs_whatever_its_reserve():
    # Its prompt fits; prompt plus expected output (the prior) does not:
    # alone it must still run, or it would wait for ever.
    sched = make(9, "reserve")  # 8 usable blocks
    r = request(64, max_tokens=200)
    sched.add_request(r)
    plan = sched.schedule()
    assert plan.request_ids == [r.request_id]


def test_aborted_requests_do_not_teach_the_estimate():
    sched = make(64, "reserve")
    r = request(16, max_tokens=8)
    sched.add_request(r)
    sched.schedule()
    sched.abort(r.request_id)
    assert sched.output_estimate.expected_tokens() == PRIOR_TOKENS


def test_admission_is_an_engine_flag_and_bad_values_are_refused():
    from tandem.engine.config import ConfigError, EngineArgs

    assert EngineArgs().create_engine_config().scheduler.admission == "reserve"
    assert EngineArgs(admission="greedy").create_engine_config().scheduler.admission == "greedy"
    with pytest.raises(ConfigError, match="--admission"):
        EngineArgs(admission="optimistic").create_engine_config()
    assert EngineArgs().create_engine_config().scheduler.admission_overcommit == 0.0
    assert EngineArgs(admission_overcommit=0.1).create_engine_config().scheduler.admission_overcommit == 0.1
    with pytest.raises(ConfigError, match="--admission-overcommit"):
        EngineArgs(admission_overcommit=-0.5).create_engine_config()
    with pytest.raises(ConfigError, match="--admission-overcommit applies to --admission reserve"):
        EngineArgs(admission="greedy", admission_overcommit=0.1).create_engine_config()
    assert EngineArgs().create_engine_config().scheduler.admission_tail == DEFAULT_TAIL == 0.1
    assert EngineArgs(admission_tail=0.0).create_engine_config().scheduler.admission_tail == 0.0
    with pytest.raises(ConfigError, match="--admission-tail: a share of the cache"):
        EngineArgs(admission_tail=-0.1).create_engine_config()


@pytest.mark.parametrize("admission", ["reserve", "greedy"])
def test_the_engine_gives_the_same_greedy_tokens_under_either_admission(tmp_path, admission):
    """The schedule changes, the answers do not: a tiny Llama, a cache of 30
    blocks for 8 requests that end at 5-8 blocks each."""
    from tandem.engine import LLM, SamplingParams as Params
    from tests.support.hf_oracle import tiny_model_dir

    path, _ = tiny_model_dir(tmp_path, "llama")
    prompts = [[(7 * i + j) % 500 + 1 for j in range(40 + 9 * i)] for i in range(8)]
    params = Params(temperature=0, max_tokens=40, ignore_eos=True)
    reference = LLM(path, device="cpu", num_blocks=400, admission="greedy")
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    reference.shutdown()
    llm = LLM(path, device="cpu", num_blocks=31, admission=admission)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    stats = llm.engine.stats()
    llm.shutdown()
    assert got == expected
    if admission == "reserve":
        assert stats.num_preemptions == 0 and stats.num_admissions_deferred > 0
    else:
        assert stats.num_preemptions > 0
