"""`python -m tandem.bench.host_probe` times the pieces of a steady decode
step's host work; on the CPU with a tiny model it must time every piece, leave
no request behind and keep the engine usable."""
from tandem.bench.host_probe import main, probe
from tandem.bench.presets import preset_config
from tandem.engine import LLM, SamplingParams


def test_probe_times_every_piece_and_leaves_the_engine_clean():
    llm = LLM("llama-3-tiny", load_format="dummy", hf_config=preset_config("llama-3-tiny"),
              max_num_seqs=8, device="cpu")
    medians = probe(llm.engine, batch=8, steps=3)
    assert list(medians)[:2] == ["schedule", "block tables"]
    assert {"schedule again", "prepare() whole", "copy 5 (positions)"} <= medians.keys()
    assert all(v > 0 for v in medians.values())
    assert not llm.engine.has_unfinished()
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_probe_command_prints_a_line_per_batch_size(capsys):
    assert main(["--preset", "llama-3-tiny", "--device", "cpu", "--batch-sizes", "1,4", "--steps", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["batch 1", "batch 4"]
