-- Per worker: committed samples and tokens, failures, and the commit rate so far; then the total.
SELECT CAST(worker AS VARCHAR) AS worker, samples, tokens, loss_tokens, failures, first_commit, last_commit, tokens_per_s
FROM progress
UNION ALL
SELECT
    'total',
    coalesce(sum(samples), 0),
    coalesce(sum(tokens), 0),
    coalesce(sum(loss_tokens), 0),
    coalesce(sum(failures), 0),
    min(first_commit),
    max(last_commit),
    -- the sessions of one run write side by side: a run's time is its sessions' span, runs add up
    round(sum(tokens) / nullif((
        SELECT sum(seconds) FROM (
            SELECT epoch(max(last_commit)) - epoch(min(opened_at)) AS seconds FROM session_spans GROUP BY session
        )
    ), 0), 1)
FROM progress
ORDER BY worker = 'total', worker
