"""Batch-aware speculation policy: how much to draft for a given batch size, and when not to.

Speculation turns one target forward over 1 token into one forward over a draft tree of N tokens.
When a decode step is bound by reading the weights (small batches on an accelerator), the extra
tokens are nearly free and every accepted draft token is a win. As the batch grows the step becomes
compute bound, the N-token forward costs up to N times a 1-token one, and the drafts must be accepted
more and more often to pay for themselves; past some batch size speculation only costs throughput.
A `SpeculationPolicy` maps the batch size (rows of the compiled batch) to a draft shape (draft length,
branches) or to "off". The same table serves every drafting method.

Defaults (`default_policy(backend)`):

- "cpu": measured on this project's development machine (2 CPU cores, float32,
  SmolLM2-135M-Instruct, n-gram drafting, greedy, the 24 dev prompts with the chat template repeated
  to fill the batch, 128 new tokens), in one run (23 min, at the fused [out, in] weight layout):

      python scripts/bench_batch.py --prompts ../shared/prompts_dev.jsonl --max-new-tokens 128 \
          --calibrate --depths 1,2 --json docs/bench/batch_calibrate.json

  Speedup of n-gram drafting at draft length k over autoregressive decoding (median of per-batch
  paired ratios; mean accepted length in parentheses):

      batch  autoregressive tok/s  k=1           k=2           policy
      1      24.4                  0.78x (1.32)  0.91x (1.51)  off
      4      57.6                  1.02x (1.24)  0.88x (1.35)  off
      16     58.1                  0.91x (1.24)  0.80x (1.35)  off
      64     72.4                  0.89x (1.22)  0.71x (1.31)  off

  No draft shape beats autoregressive decoding by the 5% margin at any batch size, so the CPU policy
  never speculates. (The calibration before the fused weight layout had k=1 at batch 1 at 1.07x; the
  faster one-token step took that margin away.) Why so little: on this CPU the verify forward over
  k + 1 tokens costs 1.3x (k=2) to 1.8x (k=4) a one-token step (XLA:CPU's small-row matmuls), the step
  is compute bound from batch 16 on, and n-gram drafts of these chat answers are accepted rarely
  (1.2-1.5 tokens per forward).
- "gpu" / "tpu": NOT measured here (no accelerator was available): a prior, k=4 up to 4 rows, k=2
  up to 16, off beyond. Re-measure with `bench_batch.py --calibrate` on the target machine and pass
  the printed table with `--policy-json`.

Override from the batch job with `--policy-json FILE_OR_JSON`:

    {"rules": [{"max_batch": 1, "num_speculative_tokens": 3},
               {"max_batch": 4, "num_speculative_tokens": 2, "topk": 1}]}

Rules are tried in order of `max_batch`; the first with batch_size <= max_batch applies; a rule with
num_speculative_tokens 0 turns speculation off; batches larger than every rule run autoregressive.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxspec.config import SpecConfig
from jaxspec.errors import InputError

POLICY_MODES = ("auto", "off", "fixed")


@dataclasses.dataclass(frozen=True)
class PolicyRule:
    """Batches of at most `max_batch` rows draft `num_speculative_tokens` deep with `topk` branches
    (num_draft_tokens: tree size for dynamic-tree methods, None = keep the method's setting).
    num_speculative_tokens == 0 means speculation off."""

    max_batch: int
    num_speculative_tokens: int
    topk: int = 1
    num_draft_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.num_speculative_tokens < 0 or self.topk < 1:
            raise InputError(
                f"policy rule {dataclasses.asdict(self)}: need max_batch >= 1, num_speculative_tokens >= 0, "
                "topk >= 1"
            )


@dataclasses.dataclass(frozen=True)
class SpeculationPolicy:
    """Ordered rules (ascending max_batch); batches beyond the last rule run without speculation."""

    rules: tuple[PolicyRule, ...]

    def __post_init__(self) -> None:
        limits = [r.max_batch for r in self.rules]
        if limits != sorted(set(limits)):
            raise InputError(f"policy rules must have strictly increasing max_batch, got {limits}")

    def rule_for(self, batch_size: int) -> PolicyRule | None:
        """The rule that applies to `batch_size`, or None when speculation is off for it."""
        for rule in self.rules:
            if batch_size <= rule.max_batch:
                return rule if rule.num_speculative_tokens > 0 else None
        return None

    def spec_for(self, base: SpecConfig, batch_size: int) -> SpecConfig | None:
        """`base` (method, acceptance, ...) with the draft shape for `batch_size`; None = autoregressive."""
        rule = self.rule_for(batch_size)
        if rule is None or base.method is None:
            return None
        shape: dict[str, Any] = {"num_speculative_tokens": rule.num_speculative_tokens, "topk": rule.topk}
        if rule.num_draft_tokens is not None:
            shape["num_draft_tokens"] = rule.num_draft_tokens
        return dataclasses.replace(base, **shape)

    def to_dict(self) -> dict[str, Any]:
        return {"rules": [dataclasses.asdict(r) for r in self.rules]}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | Sequence[dict[str, Any]]) -> SpeculationPolicy:
        """{"rules": [rule, ...]} or a bare list of rules; a rule is a dict of PolicyRule fields."""
        rules = data.get("rules") if isinstance(data, dict) else data
        if not isinstance(rules, list):
            raise InputError('policy: expected {"rules": [...]} or a list of rules')
        known = {f.name for f in dataclasses.fields(PolicyRule)}
        parsed = []
        for i, rule in enumerate(rules):
            if not isinstance(rule, dict) or not set(rule) <= known or "max_batch" not in rule:
                raise InputError(f"policy rule {i}: expected an object with max_batch and {sorted(known)}")
            parsed.append(PolicyRule(**rule))
        return cls(tuple(sorted(parsed, key=lambda r: r.max_batch)))


CPU_POLICY = SpeculationPolicy(rules=())  # measured: speculation off at every batch size (module docstring)
ACCELERATOR_PRIOR = SpeculationPolicy(
    rules=(
        PolicyRule(max_batch=4, num_speculative_tokens=4),
        PolicyRule(max_batch=16, num_speculative_tokens=2),
    )
)  # not measured here: re-measure on the accelerator (module docstring)
DEFAULT_POLICIES = {"cpu": CPU_POLICY, "gpu": ACCELERATOR_PRIOR, "tpu": ACCELERATOR_PRIOR}


def default_policy(backend: str | None = None) -> SpeculationPolicy:
    """The default table for `backend` ("cpu" | "gpu" | "tpu"; None = jax's default backend)."""
    if backend is None:
        import jax

        backend = jax.default_backend()
    return DEFAULT_POLICIES.get(backend, ACCELERATOR_PRIOR)


def load_policy(text_or_path: str | None) -> SpeculationPolicy:
    """None -> default_policy(); else a JSON string (starts with '{' or '[') or the path of a JSON file."""
    if text_or_path is None:
        return default_policy()
    text = text_or_path.strip()
    try:
        if not text.startswith(("{", "[")):
            text = Path(text_or_path).read_text(encoding="utf-8")
        data = json.loads(text)
    except OSError as exc:
        raise InputError(f"policy: cannot read {text_or_path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"policy: malformed JSON: {exc}") from None
    return SpeculationPolicy.from_dict(data)


def choose_spec(
    mode: str, base: SpecConfig | None, batch_size: int, policy: SpeculationPolicy | None = None
) -> SpecConfig | None:
    """The SpecConfig one batch runs with (None = autoregressive).

    mode "off": never speculate. "fixed": `base` as given at every batch size. "auto": `base`'s method
    (n-gram when `base` is None: it needs no weights) with the draft shape `policy` picks for
    `batch_size` (default_policy() when `policy` is None).
    """
    if mode not in POLICY_MODES:
        raise InputError(f"policy mode must be one of {POLICY_MODES}, got {mode!r}")
    if mode == "off":
        return None
    if mode == "fixed":
        return base if base is not None and base.method is not None else None
    return (policy or default_policy()).spec_for(base or SpecConfig(method="ngram"), batch_size)


def describe_spec(spec: SpecConfig | None) -> str:
    """Short label: "off" or "ngram k=4 topk=1"."""
    if spec is None or spec.method is None:
        return "off"
    label = f"{spec.method} k={spec.num_speculative_tokens} topk={spec.topk}"
    return label + (f" tree={spec.num_draft_tokens}" if spec.num_draft_tokens else "")
