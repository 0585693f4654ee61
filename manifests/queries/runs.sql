-- Every run that wrote to the cache, newest first.
SELECT run_id, command, status, started_at, finished_at, num_workers, samples_committed, tokens_committed,
    bytes_written, failures, host, error
FROM runs
ORDER BY started_at DESC
