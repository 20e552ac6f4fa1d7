"""The offline batch job: JSONL requests in, JSONL results out, resumable.

job          the job itself (`jaxspec generate --input ... --output ...`, scripts/generate.py)
requests     request parsing and validation (errors name the file and line)
schedule     batch planning of the pending requests
results      appending results as they finish, the errors file
output_file  claiming and checking the output files
summary      the run summary (text, JSON, plot)
"""
