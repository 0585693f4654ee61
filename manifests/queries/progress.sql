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
    round(sum(tokens) / nullif(epoch(max(last_commit)) - epoch(min(first_commit)), 0), 1)
FROM progress
ORDER BY worker = 'total', worker
