"""Per-job event streams in Redis: write.py is the workers' side (fenced appends, fences, a job's end
sealed, marks), read.py the API's (the shared-read `Hub`, replay, resume ids), keys.py what both
share (the keys, an entry's payload)."""
