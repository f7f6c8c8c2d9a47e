"""The read side: what a run directory says, for people (`report`, `status`, `plan`, the notebook's helpers in
`notebook` and `hidden`). Everything here reads a run directory (local or s3://) and writes nothing; it works on
a run that is still being written. The readings themselves (which shards exist, which read whole, when stage 2
is done with a shard) are `job/scan.py`'s, which the stages use too."""
