"""Conversions between the wire (protobuf) and the engine's types: sampling
parameters, logprobs, and an engine's load as the router reads it."""
from __future__ import annotations

from tandem.v1 import common_pb2


def sampling_params_from_proto(p: common_pb2.SamplingParams, **overrides):
    """The engine's SamplingParams; raises SamplingParamsError naming a bad field."""
    from tandem.engine import SamplingParams

    kwargs: dict = {
        "n": p.n or 1,
        "stop": list(p.stop),
        "stop_token_ids": list(p.stop_token_ids),
        "ignore_eos": p.ignore_eos,
        "include_stop_str_in_output": p.include_stop_str_in_output,
        "min_tokens": p.min_tokens,
        "max_tokens": p.max_tokens if p.HasField("max_tokens") else None,
    }
    for name in ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "logprobs"):
        if p.HasField(name):
            kwargs[name] = getattr(p, name)
    if p.logit_bias:
        kwargs["logit_bias"] = dict(p.logit_bias)
    if p.HasField("structured_outputs"):
        from tandem.engine.request import SamplingParamsError
        from tandem.engine.structured_outputs import StructuredOutputsError

        try:
            kwargs["structured_outputs"] = structured_outputs_from_proto(p.structured_outputs)
        except StructuredOutputsError as exc:
            raise SamplingParamsError(str(exc)) from None
    kwargs.update(overrides)
    return SamplingParams(**kwargs)


def structured_outputs_from_proto(s: common_pb2.StructuredOutputs):
    """Raises StructuredOutputsError (a ValueError naming the field) when malformed."""
    from tandem.engine.structured_outputs import StructuredOutputs, StructuredOutputsError

    name = s.field_name or "structured_outputs"
    kind = s.WhichOneof("kind")
    if kind is None:
        raise StructuredOutputsError(f"{name}: set one of json_schema, json_object, regex, choice, grammar")
    if kind == "json_schema":
        return StructuredOutputs(json=s.json_schema, field_name=name)
    if kind == "choice":
        return StructuredOutputs(choice=tuple(s.choice.choices), field_name=name)
    return StructuredOutputs(**{kind: getattr(s, kind)}, field_name=name)


def structured_outputs_to_proto(so) -> common_pb2.StructuredOutputs:
    import json

    out = common_pb2.StructuredOutputs(field_name=so.field_name)
    kind = so.kind
    if kind == "json":
        out.json_schema = json.dumps(so.json)
    elif kind == "choice":
        out.choice.choices.extend(so.choice)
    else:
        setattr(out, kind, getattr(so, kind))
    return out


def sampling_params_to_proto(params) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams(
        n=params.n, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        min_p=params.min_p, repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos, include_stop_str_in_output=params.include_stop_str_in_output,
        min_tokens=params.min_tokens)
    if params.max_tokens is not None:
        p.max_tokens = params.max_tokens
    if params.seed is not None:
        p.seed = params.seed
    if params.logprobs is not None:
        p.logprobs = params.logprobs
    if params.logit_bias:
        p.logit_bias.update(params.logit_bias)
    if params.structured_outputs is not None:
        p.structured_outputs.CopyFrom(structured_outputs_to_proto(params.structured_outputs))
    return p


def logprob_to_proto(lp) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                   top={int(k): float(v) for k, v in lp.top.items()})


def load_from_stats(engine, stats) -> common_pb2.Load:
    """The engine's load and what it serves: the router validates requests
    against the model id, context and block size its engines report, and
    keeps out an engine whose KV blocks (kv_key, block size) the others'
    cannot share."""
    return common_pb2.Load(
        num_running=stats.num_running, num_waiting=stats.num_waiting,
        num_waiting_prompt_tokens=stats.num_waiting_prompt_tokens,
        kv_cache_usage=stats.kv_cache_usage, num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks, model_id=engine.model_id,
        max_model_len=engine.max_model_len, block_size=engine.engine.config.cache.block_size,
        kv_key=engine.engine.runner.layout.model_key)
