-- One row per writer session (shard group): what it committed and when.
SELECT shard, worker, session, codec, samples, tokens, loss_tokens, rows_spanned, opened_at, last_commit
FROM shard_stats
ORDER BY worker, opened_at
