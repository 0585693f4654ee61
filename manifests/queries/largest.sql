-- The 20 longest samples (ties by sample_id).
SELECT sample_id, source_index, num_tokens, num_loss_tokens, bucket_id, shard, row_start
FROM samples
ORDER BY num_tokens DESC, sample_id
LIMIT 20
