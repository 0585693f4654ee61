-- Bucket histogram: samples, tokens and loss tokens per length bucket, with their shares.
SELECT bucket_id, max_tokens, samples, tokens, loss_tokens, share_samples, share_tokens, shortest, longest
FROM bucket_stats
ORDER BY bucket_id
