"""The run's length mix: what `max_num_seqs: auto` sizes a sequence for (engine_sizing.py).

A paged KV cache holds each sequence's *current* length, not its final one. A sequence met at a random moment of a
run is a length-biased draw (a 10,000-token completion is in flight 10x as long as a 1,000-token one) at a uniform
point of its life, so on average a sequence in flight holds

    in-flight tokens = mean prompt + E[L^2] / (2 E[L])       (L: output tokens, capped at sampling.max_tokens)

For thinking mode (mean 2,500, p99 16,000: a lognormal with sigma 1.02, capped at 32,768) that is the prompt + 3,263
tokens (3,520 with 256-token prompts), where sizing each sequence for a fixed 8,192 sized it for about 2.3x that: 17
sequences on an H100 where 24 fit on average. The total in flight moves around that average; when it outgrows the
pool vLLM preempts the newest sequence and recomputes it later (bench/sim_concurrency.py measures what that costs at
each max_num_seqs).

Where the mix comes from, best first:
- measured: the run's own completions so far (prompt and output tokens of every row of the units done, counted in
  stage 1's totals and kept in run.json from the canary on): a later job's engines size for them;
- configured: `generate.output_tokens_mean` and `generate.output_tokens_p99` (a lognormal through both, capped at
  sampling.max_tokens) and `generate.prompt_tokens_mean`.
`generate.kv_tokens_per_seq` set pins a fixed number of tokens a sequence instead (the old rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Z99 = 2.3263478740408408  # the standard normal's 99th percentile
MIN_MEASURED_ROWS = 64  # fewer measured rows than this: the configured mix stays (a canary's 64 rows are enough)


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def lognormal_sigma(mean: float, p99: float) -> float:
    """The sigma of the lognormal whose mean and 99th percentile are these: ln p99 = mu + Z99 sigma with
    mu = ln mean - sigma^2 / 2, the smaller root (the other puts the mean in the far tail)."""
    if mean <= 0 or p99 <= 0:
        raise ValueError(f"output lengths: the mean ({mean}) and the p99 ({p99}) must be positive")
    if p99 < mean:
        raise ValueError(f"output lengths: p99 {p99:,} is below the mean {mean:,}: a long tail has its p99 above "
                         "the mean (generate.output_tokens_p99)")
    gap = math.log(p99 / mean)
    if Z99 ** 2 < 2 * gap:
        raise ValueError(f"output lengths: no lognormal has mean {mean:,} and p99 {p99:,}: its p99 is at most "
                         f"{math.exp(Z99 ** 2 / 2):.1f}x its mean ({mean * math.exp(Z99 ** 2 / 2):,.0f}); lower "
                         "generate.output_tokens_p99 or raise generate.output_tokens_mean")
    return Z99 - math.sqrt(Z99 ** 2 - 2 * gap)


def capped_lognormal_moments(mean: float, sigma: float, cap: float) -> tuple[float, float]:
    """E[min(L, cap)] and E[min(L, cap)^2] for L lognormal with this mean and sigma (closed form: the partial moments
    E[L^k; L < cap] = exp(k mu + k^2 sigma^2 / 2) Phi((ln cap - mu - k sigma^2) / sigma), plus cap^k P(L >= cap))."""
    if sigma == 0:
        length = min(mean, cap)
        return length, length ** 2
    mu = math.log(mean) - sigma ** 2 / 2
    above = 1 - _phi((math.log(cap) - mu) / sigma)
    moments = []
    for k in (1, 2):
        below = math.exp(k * mu + k * k * sigma ** 2 / 2) * _phi((math.log(cap) - mu - k * sigma ** 2) / sigma)
        moments.append(below + cap ** k * above)
    return moments[0], moments[1]


@dataclass(frozen=True)
class LengthMix:
    """Mean prompt tokens and the first two moments of the output lengths, where they came from (for the log)."""
    prompt_mean: float
    output_mean: float
    output_second_moment: float  # E[L^2]
    source: str
    sigma: float | None = None  # configured: the lognormal's sigma and mean (before the cap), for `draw`
    lognormal_mean: float | None = None
    cap: int | None = None

    @classmethod
    def configured(cls, output_mean: int, output_p99: int, cap: int, prompt_mean: int = 0) -> LengthMix:
        sigma = lognormal_sigma(output_mean, output_p99)
        first, second = capped_lognormal_moments(output_mean, sigma, cap)
        source = (f"configured: output mean {output_mean:,} and p99 {output_p99:,} (lognormal, sigma {sigma:.2f}, "
                  f"capped at {cap:,}), prompt mean {prompt_mean:,}")
        return cls(prompt_mean=float(prompt_mean), output_mean=first, output_second_moment=second, sigma=sigma,
                   lognormal_mean=float(output_mean), cap=int(cap), source=source)

    @classmethod
    def measured(cls, rows: int, prompt_tokens: int, output_tokens: int, output_tokens_sq: int) -> LengthMix:
        return cls(prompt_mean=prompt_tokens / rows, output_mean=output_tokens / rows,
                   output_second_moment=output_tokens_sq / rows,
                   source=f"measured on the run's first {rows:,} rows: output mean {output_tokens / rows:,.0f}, "
                          f"prompt mean {prompt_tokens / rows:,.0f}")

    @property
    def in_flight_tokens(self) -> float:
        """Tokens a sequence in flight holds on average (module docstring)."""
        return self.prompt_mean + (self.output_second_moment / (2 * self.output_mean) if self.output_mean else 0.0)

    def draw(self, rng) -> int:
        """One output length from a configured mix (benches and simulations), `rng` a random.Random."""
        if self.sigma is None:
            raise ValueError("a measured mix has no distribution to draw from")
        mu = math.log(self.lognormal_mean) - self.sigma ** 2 / 2
        return max(1, min(self.cap, round(rng.lognormvariate(mu, self.sigma))))


LENGTH_KEYS = ("rows", "prompt_tokens", "output_tokens", "output_tokens_sq")
"""run.json's `generate.lengths`: sums over the completed rows (error rows left out) that a measured mix is made of. A
sample of the mix, not a ledger: a unit made again (a damaged shard) counts again."""


def add_lengths(total: dict | None, more: dict) -> dict:
    return {k: int((total or {}).get(k, 0)) + int(more.get(k, 0)) for k in LENGTH_KEYS}


def row_lengths(prompt_tokens: list[int], output_tokens: list[int]) -> dict:
    """The sums of one unit's rows, for `add_lengths`."""
    return {"rows": len(output_tokens), "prompt_tokens": sum(prompt_tokens), "output_tokens": sum(output_tokens),
            "output_tokens_sq": sum(n * n for n in output_tokens)}


def check_config(gen) -> None:
    """The configured mix refused before any work when no lognormal has it, naming the keys (stage 1's preflight)."""
    from job.config import ConfigError

    if gen.kv_tokens_per_seq:
        return
    try:
        lognormal_sigma(gen.output_tokens_mean, gen.output_tokens_p99)
    except ValueError as e:
        raise ConfigError(f"config: generate.output_tokens_mean / output_tokens_p99: {e}") from None


def sizing_tokens(gen, max_tokens: int | None, max_model_len: int, measured: dict | None = None) -> tuple[int, str]:
    """The tokens `max_num_seqs: auto` sizes a sequence for, and where they came from: `gen.kv_tokens_per_seq` when
    pinned; else the in-flight tokens of the run's measured mix (`measured`, run.json's `generate.lengths`, once it
    holds MIN_MEASURED_ROWS rows); else of the configured one (`gen`: a GenerateConfig), capped at `max_tokens`
    (sampling.max_tokens; unset: what max_model_len leaves after the mean prompt)."""
    if gen.kv_tokens_per_seq:
        return int(gen.kv_tokens_per_seq), f"generate.kv_tokens_per_seq {gen.kv_tokens_per_seq:,}, pinned"
    if measured and int(measured.get("rows", 0)) >= MIN_MEASURED_ROWS and int(measured.get("output_tokens", 0)) > 0:
        mix = LengthMix.measured(**{k: int(measured[k]) for k in LENGTH_KEYS})
    else:
        cap = int(max_tokens or max(1, int(max_model_len) - gen.prompt_tokens_mean))
        mix = LengthMix.configured(gen.output_tokens_mean, gen.output_tokens_p99, cap, gen.prompt_tokens_mean)
    tokens = max(1, math.ceil(mix.in_flight_tokens))
    return tokens, f"{tokens:,} tokens a sequence in flight on average, {mix.source}"


def run_sizing_tokens(config, measured: dict | None = None) -> tuple[int, str]:
    """`sizing_tokens` for a RunConfig: its sampling's max_tokens (the model's generation_config under the config's)
    and engine_kwargs.max_model_len (unset: 32,768)."""
    from job.generate.engine_start import resolved_sampling  # here: it imports vLLM-side helpers

    max_tokens = resolved_sampling(config.model, config.generate.sampling).get("max_tokens")
    return sizing_tokens(config.generate, max_tokens, config.engine_kwargs.get("max_model_len") or 32768, measured)


def canary_line(config, lengths: dict, sized_from: dict | None = None) -> str | None:
    """What the canary's rows say of the mix the engines were sized for (`sized_from`: the lengths they were given).
    None when `auto` sized nothing, a number is pinned, or the rows are too few. Engines are not restarted for it
    mid-job (a new max_num_seqs compiles again: ~150 s on an H100); a later job of the run sizes for the measured
    mix."""
    from job.generate import engine_sizing  # here: its vLLM imports are lazy, but keep this module light

    if not engine_sizing.is_auto(config.engine_kwargs) or config.generate.kv_tokens_per_seq:
        return None
    if int(lengths.get("rows", 0)) < MIN_MEASURED_ROWS or not int(lengths.get("output_tokens", 0)):
        return None
    measured = math.ceil(LengthMix.measured(**{k: int(lengths[k]) for k in LENGTH_KEYS}).in_flight_tokens)
    sized, _ = run_sizing_tokens(config, sized_from)
    return (f"length mix: the canary's {int(lengths['rows']):,} rows hold {measured:,} tokens a sequence in flight on "
            f"average; the engines were sized for {sized:,} (generate.output_tokens_mean / p99). A later job of this "
            "run (a resume) sizes for the measured mix")
