"""--tokenizer: a dummy-weight model given as a config.json alone is served with
a borrowed tokenizer (the embedded SmolLM2's), by engines, router and `tandem up`."""
from __future__ import annotations

import argparse

import pytest

from tandem.bench.presets import PLACEHOLDER, preset_config, save_preset
from tandem.engine.loader import load_model_info


@pytest.fixture(scope="module")
def config_only(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("llama-3-tiny"))
    preset_config("llama-3-tiny").save_pretrained(folder)
    return folder


def test_config_only_model_has_no_tokenizer_of_its_own(config_only):
    assert load_model_info(config_only, load_format="dummy").tokenizer is None


def test_smollm2_alias_lends_the_embedded_tokenizer(config_only):
    info = load_model_info(config_only, load_format="dummy", tokenizer="smollm2")
    assert info.tokenizer is not None
    assert info.tokenizer.decode(info.tokenizer.encode(" the water")) == " the water"
    assert info.hf_config.vocab_size == 128256  # the model stays Llama-3's


def test_engine_flag_reaches_the_model_config(config_only):
    from tandem.services.common.engine_process import add_engine_role_arguments, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_role_arguments(p, role="decode", default_port=0, default_metrics_port=0)
    args = p.parse_args(["--model", config_only, "--load-format", "dummy", "--tokenizer", "smollm2"])
    assert engine_config_from_args(args, "consumer").model.tokenizer == "smollm2"


def test_router_flag_gives_the_gateway_a_tokenizer(config_only):
    from tandem.services.router.server import _served_model, add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    served = _served_model(p.parse_args(["--model", config_only, "--tokenizer", "smollm2"]))
    assert served.tokenizer is not None


def test_tandem_up_passes_tokenizer_to_engines_and_router(config_only, tmp_path):
    from tandem.services.launcher.plan import plan_stack
    from tandem.services.launcher.up import add_up_arguments

    p = argparse.ArgumentParser()
    add_up_arguments(p)
    args = p.parse_args(["--model", config_only, "--tokenizer", "smollm2", "--prefill", "1", "--decode", "1"])
    _, prefills, decodes, router_flags = plan_stack(args, str(tmp_path))
    for argv in [c.argv for c in prefills + decodes] + [router_flags]:
        assert argv[argv.index("--tokenizer") + 1] == "smollm2"


def test_saved_preset_tokenizer_decodes_every_model_id(tmp_path):
    folder = save_preset("llama-3-tiny", str(tmp_path / "m"), tokenizer="smollm2")
    padded = load_model_info(folder, load_format="dummy", tokenizer=f"{folder}/tokenizer").tokenizer
    original = load_model_info(folder, load_format="dummy", tokenizer="smollm2").tokenizer
    assert len(padded) == 128256
    assert padded.decode([100000]) == PLACEHOLDER.format(100000)
    text = " the water flows over the old stone"
    assert padded.encode(text) == original.encode(text)
