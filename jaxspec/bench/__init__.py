"""Benchmarks and the advisor: measure τ, per-depth acceptance, draft cost c and speedup for every
speculative method, predict the best configuration, and report it (Markdown, JSON, PNG).

  metrics.py     pure arithmetic on Completion.stats dicts (τ, α_d, time per token, speedup)
  predictor.py   the speedup model (1 − α^(γ+1)) / ((1 − α)(γc + 1)) and the best draft length
  step_costs.py  c and v: draft round, verify and decode steps, each timed alone inside a compiled loop
  runner.py      methods interleaved in one process after a warm-up; repeats; medians
  peer.py        Hugging Face transformers (autoregressive and prompt lookup) on the same model
  report.py      Markdown tables, JSON, PNG plots
  advise.py      `jaxspec advise`: calibration run -> recommended method, draft length, batch cut-off
  cli.py         the `bench` and `advise` subcommands
"""
