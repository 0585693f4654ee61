-- The disk window (docs/follow.md): each store's state (open, sealed, retired) and what it holds.
SELECT shard, worker, validation, state, samples, tokens, opened_at, sealed_at, retired_at, retired_by
FROM window_stores
ORDER BY worker, opened_at
