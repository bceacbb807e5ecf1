"""Whether speculation pays, measured as the engine runs: the speculator
proposes for a step only while proposing has given more decode tokens per
second than not proposing, at this batch size, on this host and device.

Why measure rather than rule: a verifying step computes 1 + k rows per
request and, on a small model, does host work that does not overlap the
device. At batch 1 prompt lookup doubles decode speed; at batch 64 the same
setting ran 0.76-1.20x on H100s, by the host's speed, the answers' length
and how closely they follow their prompts (docs/benchmarks.md). No fixed
threshold such as vLLM's disable_by_batch_size is right for all of these,
and the costs that decide it (host, device, acceptance) are all visible
from inside the engine.

The rule:
- Steps are grouped by the number of running requests when the step was
  decided, in powers of two (1, 2-3, 4-7, ...): a group's steps cost about
  the same.
- Two policies: SPECULATE (propose whenever the proposer finds drafts, as
  without this module) and PLAIN (propose nothing, and skip the lookup too).
  Each group has a leader: a new group takes the leader of the nearest
  group that has measured one (costs change smoothly with the batch, and a
  batch draining from 64 to 1 would otherwise pay to learn each size
  afresh), and SPECULATE when there is none: the user asked for it.
- A step's tokens (a plain row one, a verified row one plus its accepted
  drafts) and the wall time from its start to the next step's start, which
  counts the host's work and the device's, overlapped or not, once each,
  are its measure.
- Steps that carry a prompt chunk beside the decodes are their own groups
  (keyed by the negated batch group, with their own leaders, bursts and
  pauses). The two kinds cost differently (on the H200, SmolLM2 at batch
  64: 4.05 ms a verifying step beside a chunk against 1.60 ms a plain
  decode-only one) and a batch with arrivals has such steps all along, so
  one rate for both would mix them; measured apart, speculating beside a
  chunk there paid (the chunk makes the step long, not the drafts). The
  decode decision is made at the end of the step before (the drafts are
  proposed then); whether the next step carries a prompt chunk is known
  only at its start, after the arrivals, and then the engine asks
  decide_beside_prompt() for the batch that step will run, which replaces
  the decision and may drop the drafts. A step is measured only as the
  kind it was decided as; one that turned out otherwise (a chunk expected
  and none scheduled, or the reverse) is not measured.
- Under SPECULATE a step where the proposer found no drafts decodes what
  PLAIN would, at PLAIN's cost plus the lookup's and the pipeline's: it is
  charged only that overhead (its time less what its tokens take at
  PLAIN's measured rate, never below zero), not its tokens. Otherwise
  SPECULATE's rate would follow the share of the answer the lookup can
  predict, which swings within one answer (a copied sentence, then a
  changed word), and a lone request would drop speculation just before its
  next copied stretch. So SPECULATE's rate is the verifying steps' tokens
  over their time plus the overhead of the others: SPECULATE beats PLAIN at
  that rate exactly when it decodes the same tokens in less time.
- Now and then the other policy runs for a short burst (BURST steps). Its
  first step is a transition (the asynchronous pipeline fills or drains)
  and is not measured, nor is the first step back; the rest give the
  burst's tokens per second. If that beats the leader's recent rate by more
  than MARGIN, it leads.
- The pause between bursts starts at FIRST_PAUSE leader steps and doubles
  while the leader holds (quadruples when it won by more than WIDE_MARGIN),
  up to MAX_PAUSE; a change of leader resets it. So a settled group spends
  about BURST / MAX_PAUSE of its steps exploring, and a change (another mix
  of requests, another acceptance) is seen within a few hundred steps.

- A burst of SPECULATE under a PLAIN leader costs what speculating loses
  (on answers that quote nothing, at batch 64: half of each step), and a
  draining batch pays it again in every group it reaches. So such a burst
  runs only when speculating may have come to pay: in the leader steps
  before it, the proposer is asked now and then for the drafts it would
  propose (a shadow lookup; prompt lookup only, where asking costs
  microseconds and changes nothing), and they are checked against the
  tokens the plain steps then produce. A draft token the target would
  have accepted is one that plain decoding produced (for greedy requests
  exactly; for sampled ones with the same probability, since the
  rejection sampler accepts a point-mass draft with the target's
  probability of it). The shadow's tokens a row, against the tokens a
  row SPECULATE had when it was last compared with PLAIN (in this group
  or the nearest that was), scale that comparison's ratio; a burst whose
  predicted ratio is below 1 - SHADOW_SLACK is skipped as if the leader
  had held, at most MAX_SKIPPED times in a row (the prediction is a
  model: a burst still runs now and then). Without shadow data the burst
  runs, as before; so does the first burst after PLAIN took the lead (a
  new group inherits its neighbour's count): one comparison can be
  noise (a lease's host drifts by tens of percent between rounds), and
  skipping on it would keep a wrong PLAIN for over a thousand steps.

Nothing here changes what is sampled: a step either verifies drafts, which
keeps the target's distribution, or decodes plainly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class GovernorSettings:
    burst: int = 5  # steps of the other policy per exploration, the first unmeasured
    first_pause: int = 8  # leader steps before a group's first burst
    max_pause: int = 256  # the pause doubles up to this while the leader holds
    margin: float = 0.03  # the other policy leads once it is this much faster
    wide_margin: float = 0.25  # a leader this much faster than the burst quadruples the pause
    # The leader's rate: each step's tokens and seconds decay by this per new
    # step, so about the last 1 / (1 - decay) steps count.
    decay: float = 0.9
    # A step this many times longer than its policy's mean is not measured
    # (a garbage-collection pause, a first compile, an idle engine).
    outlier: float = 10.0
    # Shadow lookups (module docstring): in the last shadow_window leader
    # steps before a SPECULATE burst is due, one in shadow_every.
    shadow_window: int = 16
    shadow_every: int = 4
    shadow_slack: float = 0.1  # a burst runs when its predicted ratio is at least 1 - this
    max_skipped: int = 4  # bursts skipped in a row before one runs anyway
    shadow_decay: float = 0.8  # each resolved shadow lookup's weight decays by this per newer one


SPECULATE, PLAIN = True, False


@dataclass
class _Rate:
    """Tokens and seconds of recent steps, each step's weight decayed by
    `decay` per newer step (1.0: a plain sum)."""

    tokens: float = 0.0
    seconds: float = 0.0
    weight: float = 0.0  # the steps' weights summed
    steps: int = 0

    def add(self, tokens: int, seconds: float, decay: float = 1.0) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds
        self.weight = self.weight * decay + 1.0
        self.steps += 1

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_seconds(self) -> float:
        """A step's seconds, weighted as the rate is; 0 before any step."""
        return self.seconds / self.weight if self.weight else 0.0


@dataclass
class _Group:
    leader: bool = SPECULATE
    leader_rate: _Rate = field(default_factory=_Rate)
    plain_per_second: float = 0.0  # PLAIN's last measured rate (0: not yet): what overhead is charged against
    # Each policy's raw step time, for the outlier rule.
    step_seconds: dict = field(default_factory=lambda: {SPECULATE: _Rate(), PLAIN: _Rate()})
    burst_rate: _Rate = field(default_factory=_Rate)
    burst_left: int = 0  # steps of the other policy still to decide in this burst
    burst_open: bool = False  # a burst began and its result is not taken yet
    back_from_burst: bool = False  # the next leader step follows a burst: a transition
    until_burst: int = 0  # leader steps before the next burst
    pause: int = 0
    leads_changed: int = 0  # how often the leader changed (metrics, tests)
    # SPECULATE's measured steps: tokens and sampled rows ("seconds" holds the rows).
    spec_rows: _Rate = field(default_factory=_Rate)
    # The last comparison of the two policies: SPECULATE's rate over PLAIN's
    # (0: none yet) and SPECULATE's tokens a row then.
    spec_vs_plain: float = 0.0
    spec_tokens_per_row: float = 0.0
    skipped: int = 0  # SPECULATE bursts skipped in a row on the shadow's prediction
    held: int = 0  # bursts the leader has won since it took the lead (or its neighbour's, inherited)


@dataclass
class _Decided:
    """A step as decided: its group, its policy, whether it is a burst's step and which."""

    group: int  # negative: a group of steps beside a prompt chunk
    policy: bool
    burst_step: Optional[int]  # 0 for a burst's first (unmeasured) step; None for a leader step
    transition: bool = False  # a leader step right after a burst: not measured

    @property
    def beside_prompt(self) -> bool:
        return self.group < 0


@dataclass
class GovernorCounts:
    """What the governor did, for metrics and the benchmark."""

    speculate_steps: int = 0  # decode steps decided to speculate
    plain_steps: int = 0  # decode steps decided to decode plainly
    leader_changes: int = 0
    skipped_bursts: int = 0  # SPECULATE bursts the shadow lookups predicted to lose
    shadow_lookups: int = 0


class SpeculationGovernor:
    def __init__(self, settings: GovernorSettings = GovernorSettings()) -> None:
        self.settings = settings
        self._groups: dict[int, _Group] = {}
        self._decided: Optional[_Decided] = None  # the policy in force for the next step
        # The last step: its decision, tokens, start, whether it verified drafts, its sampled rows.
        self._ran: Optional[tuple[_Decided, int, float, bool, int]] = None
        self.counts = GovernorCounts()
        # Resolved shadow lookups: tokens a speculating step would have
        # emitted, over their rows ("seconds" holds the rows), decayed per lookup.
        self._shadow = _Rate()
        self._shadow_fresh = 0  # lookups resolved since the last burst was decided on them
        self._wants_shadow = False

    @staticmethod
    def group_of(num_running: int) -> int:
        """Powers of two: 1 -> 1, 2-3 -> 2, 4-7 -> 3, ..."""
        return max(num_running, 1).bit_length()

    def decide(self, num_running: int) -> bool:
        """The policy of the next step for a batch of num_running requests:
        True to let it propose (SPECULATE). Called once per step."""
        return self._decide(self.group_of(num_running))

    def decide_beside_prompt(self, num_requests: int) -> bool:
        """The step just decided to speculate turns out to carry a prompt
        chunk beside its drafts (known only at its start, after the
        arrivals) and about num_requests requests: whether it keeps the
        drafts, by the groups of steps beside a prompt chunk, which are
        measured apart (module docstring). Replaces the decision; without
        one (speculation was off) the drafts stay. The group is the batch
        this step will run, not the one the decision was made for: under
        asynchronous scheduling a newcomer's first step comes two steps
        after the one its predecessor finished in, and was decided for the
        survivors (63 of 64, the next smaller group)."""
        if self._decided is None:
            return True
        return self._decide(-self.group_of(num_requests))

    def _decide(self, key: int) -> bool:
        s = self.settings
        group = self._groups.get(key)
        if group is None:
            nearest = self._nearest_measured(key)
            group = self._groups[key] = _Group(leader=nearest.leader if nearest else SPECULATE,
                                               held=nearest.held if nearest else 0,
                                               until_burst=s.first_pause, pause=s.first_pause)
        if group.burst_left > 0:
            step = s.burst - group.burst_left
            group.burst_left -= 1
            group.back_from_burst = group.burst_left == 0
            self._decided = _Decided(key, not group.leader, step)
            return not group.leader
        self._wants_shadow = False
        group.until_burst -= 1
        if group.until_burst < 0:
            if group.burst_open:  # the last one's final step went unmeasured (a prompt chunk came)
                self._burst_over(group, not group.leader)
            if group.leader == PLAIN and self._skips_burst(key, group):
                group.pause = min(group.pause * 2, s.max_pause)
                group.until_burst = group.pause
                self._decided = _Decided(key, group.leader, None)
                return group.leader
            group.skipped = 0
            group.burst_rate = _Rate()
            group.burst_left = s.burst - 1
            group.burst_open = True
            group.until_burst = group.pause
            self._decided = _Decided(key, not group.leader, 0)
            return not group.leader
        self._decided = _Decided(key, group.leader, None, transition=group.back_from_burst)
        group.back_from_burst = False
        self._wants_shadow = (group.leader == PLAIN and group.until_burst < s.shadow_window
                              and group.until_burst % s.shadow_every == 0)
        return group.leader

    def wants_shadow(self) -> bool:
        """Whether the step just decided (PLAIN, a burst of SPECULATE coming)
        should also ask the proposer what it would have proposed, to be
        checked later (shadow_resolved): the module docstring."""
        return self._wants_shadow

    def shadow_resolved(self, tokens: int, rows: int) -> None:
        """A shadow lookup over `rows` requests, checked against the tokens
        that followed: a speculating step would have emitted `tokens`."""
        if rows > 0:
            self._shadow.add(tokens, rows, self.settings.shadow_decay)
            self._shadow_fresh += 1
            self.counts.shadow_lookups += 1

    @property
    def shadow_tokens_per_row(self) -> float:
        """What the resolved shadow lookups say a speculating step would emit
        a row (recent lookups weigh most); 0 before any."""
        return self._shadow.per_second

    def _skips_burst(self, key: int, group: _Group) -> bool:
        """Whether the SPECULATE burst now due is predicted to lose by more
        than the slack (module docstring); a skip is counted."""
        s = self.settings
        fresh, self._shadow_fresh = self._shadow_fresh, 0
        if not fresh or group.skipped >= s.max_skipped or group.held < 1:
            return False
        compared = [(abs(k - key), -abs(k), g) for k, g in self._groups.items()
                    if g.spec_vs_plain > 0 and (k < 0) == (key < 0)]
        if not compared:
            return False
        then = min(compared, key=lambda c: c[:2])[2]
        if then.spec_tokens_per_row <= 0:
            return False
        predicted = then.spec_vs_plain * self.shadow_tokens_per_row / then.spec_tokens_per_row
        if predicted >= 1.0 - s.shadow_slack:
            return False
        group.skipped += 1
        self.counts.skipped_bursts += 1
        return True

    def _nearest_measured(self, key: int) -> Optional[_Group]:
        """The nearest group that measured its leader (the larger on a tie); None if none."""
        known = [(abs(k - key), -abs(k), k) for k, g in self._groups.items()
                 if g.leader_rate.steps and (k < 0) == (key < 0)]
        return self._groups[min(known)[2]] if known else None

    def forget_decision(self) -> None:
        """The next step is not one the governor decided (speculation was
        off for it anyway): measure nothing of it."""
        self._decided = None

    def step_started(self, now: float) -> None:
        """A step starts at `now` (time.perf_counter): the step before it, if
        it was a measured decode step, ends here."""
        ran, self._ran = self._ran, None
        if ran is None:
            return
        decided, tokens, start, verified, rows = ran
        self._measure(decided, tokens, now - start, verified, rows)

    def step_ran(self, start: float, decode_only: bool, tokens: int, verified: bool, rows: int = 0) -> None:
        """The step begun at `start` ran under the last decision: `tokens`
        tokens for its `rows` sampled requests, `verified` whether it carried
        drafts. Only decode-only steps are measured (a SPECULATE step without
        drafts as its overhead, _add); its time is known when the next one
        starts."""
        decided, self._decided = self._decided, None
        self._wants_shadow = False
        if decided is None or tokens <= 0 or decode_only == decided.beside_prompt:
            return  # not the kind of step it was decided as (a prompt chunk came, or none did)
        if decided.policy:
            self.counts.speculate_steps += 1
        else:
            self.counts.plain_steps += 1
        self._ran = (decided, tokens, start, verified, rows)

    def _measure(self, decided: _Decided, tokens: int, seconds: float, verified: bool, rows: int) -> None:
        s = self.settings
        group = self._groups[decided.group]
        steps = group.step_seconds[decided.policy]
        if steps.steps >= 3 and seconds > s.outlier * steps.mean_seconds:
            return  # a pause, not the policy's cost
        steps.add(1, seconds, s.decay)
        if decided.policy == SPECULATE and rows > 0:
            group.spec_rows.add(tokens, rows, s.decay)
        if decided.burst_step is None:
            if decided.transition or decided.policy != group.leader:  # or the leader changed since
                return
            if self._add(group, group.leader_rate, decided.policy, tokens, seconds, verified, s.decay) \
                    and decided.policy == PLAIN:
                group.plain_per_second = group.leader_rate.per_second
            return
        if decided.burst_step == 0 or decided.policy == group.leader or not group.burst_open:
            return  # the transition into a burst; or a burst the leader's change overtook
        self._add(group, group.burst_rate, decided.policy, tokens, seconds, verified, 1.0)
        if decided.burst_step == s.burst - 1:
            self._burst_over(group, decided.policy)

    @staticmethod
    def _add(group: _Group, rate: _Rate, policy: bool, tokens: int, seconds: float, verified: bool,
             decay: float) -> bool:
        """A measured step into `rate`: PLAIN's and verifying steps whole, a
        SPECULATE step without drafts as its overhead over PLAIN (module
        docstring), or nothing while PLAIN's rate is unknown. Whether it counted."""
        if policy == PLAIN or verified:
            rate.add(tokens, seconds, decay)
            return True
        if group.plain_per_second <= 0:
            return False
        rate.add(0, max(seconds - tokens / group.plain_per_second, 0.0), decay)
        return True

    def _burst_over(self, group: _Group, policy: bool) -> None:
        """The burst's last step was measured: the burst's policy leads if it was faster."""
        s, burst, leader = self.settings, group.burst_rate, group.leader_rate
        group.burst_open = False
        if policy == PLAIN and burst.steps:
            group.plain_per_second = burst.per_second
        if leader.per_second > 0 and burst.per_second > 0 and group.spec_rows.seconds > 0:
            spec, plain = (burst, leader) if policy == SPECULATE else (leader, burst)
            group.spec_vs_plain = spec.per_second / plain.per_second
            group.spec_tokens_per_row = group.spec_rows.per_second
        if leader.steps and burst.steps and leader.per_second > burst.per_second * (1.0 + s.wide_margin):
            group.pause = min(group.pause * 4, s.max_pause)
        else:
            group.pause = min(group.pause * 2, s.max_pause)
        group.until_burst = group.pause
        group.held += 1  # undone below if the burst's policy takes the lead
        if leader.steps and burst.steps and burst.per_second > leader.per_second * (1.0 + s.margin):
            group.leader = policy
            group.leader_rate, group.burst_rate = burst, _Rate()
            group.pause = s.first_pause
            group.until_burst = s.first_pause
            group.leads_changed += 1
            group.held = 0
            self.counts.leader_changes += 1
            # The step after the burst was decided before this (its time was not
            # known yet) under the old leader: the next is a switch again.
            group.back_from_burst = True

    def report(self) -> list[str]:
        """One line per group, smallest batch first: its leader, the leader's
        recent rate, PLAIN's last rate, the last comparison and its tokens a
        row, the bursts skipped in a row and the changes of lead (the
        benchmark prints it: why a group chose what it did)."""
        lines = []
        for key, g in sorted(self._groups.items(), key=lambda kv: (kv[0] < 0, abs(kv[0]))):
            kind = " beside a prompt chunk" if key < 0 else ""
            lines.append(f"batch {1 << (abs(key) - 1)}+{kind}: {'speculate' if g.leader else 'plain'}, "
                         f"leader {g.leader_rate.per_second:.0f} tok/s over {g.leader_rate.steps} steps, "
                         f"plain last {g.plain_per_second:.0f}, speculate/plain at the last comparison "
                         f"{g.spec_vs_plain:.2f} at {g.spec_tokens_per_row:.2f} tokens a row, "
                         f"skipped {g.skipped}, held {g.held}, changes {g.leads_changed}")
        lines.append(f"shadow: {self.shadow_tokens_per_row:.2f} tokens a row over {self.counts.shadow_lookups} lookups")
        return lines

    def leaders(self) -> dict[int, bool]:
        """Each group's leader by its smallest batch (1, 2, 4, ...): True if it speculates."""
        return {1 << (key - 1): g.leader for key, g in sorted(self._groups.items()) if key > 0}

    def leaders_beside_prompt(self) -> dict[int, bool]:
        """The same for the groups of steps beside a prompt chunk."""
        return {1 << (-key - 1): g.leader for key, g in sorted(self._groups.items()) if key < 0}
