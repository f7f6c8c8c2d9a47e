"""The read side: what a run directory says, for people (`status`, `plan`, the notebook's helpers in `notebook` and
`hidden`). Everything here reads a run directory (local or s3://) and writes nothing; it works on a run that is still
being written. The readings themselves (which shards exist, which read whole, how much of a shard stage 2 has done)
are job/scan/'s, which the stages use too; each stage's report is its own (job/generate/report.py, stage 2's in
job/hidden_states/report.py)."""
