"""Pieces of the offline batch job (`jaxspec.batch.job`): request parsing and validation, resumable
output, batch planning, and the run summary."""
