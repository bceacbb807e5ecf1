"""Generated benchmark datasets: what each request asks for (no downloads).

Prompts are made of common English words, each of which is one token in the
BPE vocabularies of the usual model families (a leading space included), so a
prompt of N words is close to N tokens. The exact count is taken from the
server's usage report when it sends one; `prompt_len` here is the intent.

Datasets (all deterministic for a given seed):

- random: input and output lengths uniform in [L*(1-r), L*(1+r)] (r is
  --random-range-ratio, 0 means every request has exactly L).
- sharegpt: a ShareGPT-like mix: input and output lengths drawn from
  log-normal distributions (long right tail: most requests are short, a few
  are very long), see ShareGPTLike for the parameters and their median/mean.
- shared-prefix: --prefix-groups groups; every request of a group starts with
  the same --prefix-len word system prompt, followed by its own question
  (random lengths as above). Groups are assigned round-robin.
- multi-turn: conversations of --turns turns; turn k sends the whole history
  (user and assistant messages of turns 1..k-1) plus a new user message, so
  later turns extend earlier ones. Assistant messages are generated text of
  the length that turn asked for (not the server's real reply: the dataset is
  fixed before the run so every deployment gets the same requests). Requests
  are ordered turn by turn across conversations, so turn k of a conversation
  is always sent after its turn k-1.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

DATASETS = ("random", "sharegpt", "shared-prefix", "multi-turn")

# Common words that are single tokens (with their leading space) for Llama,
# Mistral, Qwen and SmolLM tokenizers.
WORDS = tuple("""
the of and to in is it you that he was for on are with as his they be at one
have this from or had by word but what some we can out other were all there
when up use your how said an each she which do their time if will way about
many then them write would like so these her long make thing see him two has
look more day could go come did number sound no most people my over know water
than call first who may down side been now find any new work part take get
place made live where after back little only round man year came show every
good me give our under name very through just form great think say help low
line differ turn cause much mean before move right boy old too same tell does
set three want air well also play small end put home read hand port large
spell add even land here must big high such follow act why ask men change went
light kind off need house picture try us again animal point mother world near
build self earth father head stand own page should country found answer school
grow study still learn plant cover food sun four between state keep eye never
last let thought city tree cross farm hard start might story saw far sea draw
left late run while press close night real life few north open seem together
next white children begin got walk example ease paper group always music those
both mark often letter until mile river car feet care second book carry took
science eat room friend began idea fish mountain stop once base hear horse cut
sure watch color face wood main enough plain girl usual young ready above ever
red list though feel talk bird soon body dog family direct pose leave song
measure door product black short class wind question happen complete
ship area half rock order fire south problem piece told knew pass since top
whole king space heard best hour better true during hundred five remember step
early hold west ground interest reach fast verb sing listen six table travel
less morning ten simple several toward war lay against pattern slow center
love person money serve appear road map rain rule govern pull cold notice
voice unit power town fine certain fly fall lead cry dark machine note wait
plan figure star box noun field rest correct able pound done beauty drive stood
contain front teach week final gave green quick develop ocean warm free minute
strong special mind behind clear tail produce fact street inch multiply nothing
course stay wheel full force blue object decide surface deep moon island foot
system busy test record boat common gold possible plane age dry wonder laugh
thousand ago ran check game shape yes hot miss brought heat snow tire bring
distant fill east paint language among
""".split())


@dataclass(frozen=True)
class Message:
    role: str  # "system", "user" or "assistant"
    content: str


@dataclass(frozen=True)
class BenchRequest:
    """One request of a benchmark: what to send and how long an answer to ask for."""

    messages: tuple[Message, ...]
    prompt_len: int  # words in all messages (~tokens, before any chat template)
    output_len: int  # max_tokens (and min_tokens where the server honours it)
    group: int = -1  # shared-prefix group or conversation id; -1 when none
    turn: int = 0  # turn within a multi-turn conversation (0-based)

    def prompt_text(self) -> str:
        """The prompt for the completions endpoint: messages in order, so a
        shared prefix stays a prefix."""
        return "\n\n".join(m.content for m in self.messages)


@dataclass(frozen=True)
class ShareGPTLike:
    """Log-normal length distributions shaped like the ShareGPT conversations
    that serving benchmarks commonly use.

    With the defaults: input median 160, mean 160*exp(1.0**2/2) ~ 264 words;
    output median 130, mean 130*exp(0.9**2/2) ~ 195 words; both clipped to
    [4, max] (which lowers the means slightly, by < 2% at these caps).
    """

    input_median: float = 160.0
    input_sigma: float = 1.0
    output_median: float = 130.0
    output_sigma: float = 0.9
    max_input_len: int = 4096
    max_output_len: int = 2048

    def draw(self, rng: random.Random) -> tuple[int, int]:
        inp = rng.lognormvariate(math.log(self.input_median), self.input_sigma)
        out = rng.lognormvariate(math.log(self.output_median), self.output_sigma)
        return (min(max(4, round(inp)), self.max_input_len), min(max(4, round(out)), self.max_output_len))


@dataclass(frozen=True)
class DatasetConfig:
    name: str = "random"
    num_prompts: int = 100
    seed: int = 0
    input_len: int = 256  # random / shared-prefix question / multi-turn user message
    output_len: int = 128
    range_ratio: float = 0.0
    sharegpt: ShareGPTLike = field(default_factory=ShareGPTLike)
    prefix_groups: int = 4
    prefix_len: int = 512
    turns: int = 4

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"unknown dataset {self.name!r}; choose one of {', '.join(DATASETS)}")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--random-input-len and --random-output-len must be >= 1")
        if self.prefix_groups < 1 or self.turns < 1 or self.prefix_len < 0:
            raise ValueError("--prefix-groups and --turns must be >= 1, --prefix-len >= 0")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def uniform_len(rng: random.Random, mean: int, ratio: float) -> int:
    lo = max(1, math.floor(mean * (1.0 - ratio)))
    hi = max(lo, math.ceil(mean * (1.0 + ratio)))
    return rng.randint(lo, hi)


def generate(config: DatasetConfig) -> list[BenchRequest]:
    rng = random.Random(config.seed)
    make = {"random": _random, "sharegpt": _sharegpt, "shared-prefix": _shared_prefix,
            "multi-turn": _multi_turn}[config.name]
    requests = make(config, rng)
    assert len(requests) == config.num_prompts
    return requests


def _single(text: str, n_words: int, output_len: int, group: int = -1) -> BenchRequest:
    return BenchRequest(messages=(Message("user", text),), prompt_len=n_words, output_len=output_len, group=group)


def _random(c: DatasetConfig, rng: random.Random) -> list[BenchRequest]:
    out = []
    for _ in range(c.num_prompts):
        n_in = uniform_len(rng, c.input_len, c.range_ratio)
        out.append(_single(words(rng, n_in), n_in, uniform_len(rng, c.output_len, c.range_ratio)))
    return out


def _sharegpt(c: DatasetConfig, rng: random.Random) -> list[BenchRequest]:
    out = []
    for _ in range(c.num_prompts):
        n_in, n_out = c.sharegpt.draw(rng)
        out.append(_single(words(rng, n_in), n_in, n_out))
    return out


def _shared_prefix(c: DatasetConfig, rng: random.Random) -> list[BenchRequest]:
    prefixes = [words(rng, c.prefix_len) for _ in range(c.prefix_groups)]
    out = []
    for i in range(c.num_prompts):
        g = i % c.prefix_groups
        n_q = uniform_len(rng, c.input_len, c.range_ratio)
        messages = (Message("system", prefixes[g]), Message("user", words(rng, n_q)))
        out.append(BenchRequest(messages=messages, prompt_len=c.prefix_len + n_q,
                                output_len=uniform_len(rng, c.output_len, c.range_ratio), group=g))
    return out


def _multi_turn(c: DatasetConfig, rng: random.Random) -> list[BenchRequest]:
    n_conv = math.ceil(c.num_prompts / c.turns)
    # conversations[k] is the list of requests of conversation k, turn by turn.
    conversations: list[list[BenchRequest]] = []
    for conv in range(n_conv):
        history: list[Message] = []
        history_len = 0
        turns = []
        for turn in range(c.turns):
            n_user = uniform_len(rng, c.input_len, c.range_ratio)
            n_out = uniform_len(rng, c.output_len, c.range_ratio)
            history.append(Message("user", words(rng, n_user)))
            history_len += n_user
            turns.append(BenchRequest(messages=tuple(history), prompt_len=history_len, output_len=n_out,
                                      group=conv, turn=turn))
            # Stand-in for the assistant's reply, of the length this turn asked for.
            history.append(Message("assistant", words(rng, n_out)))
            history_len += n_out
        conversations.append(turns)
    ordered = [conversations[conv][turn] for turn in range(c.turns) for conv in range(n_conv)]
    return ordered[:c.num_prompts]
