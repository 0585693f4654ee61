-- Failed samples by reason, with one example detail each.
SELECT reason, failures, distinct_samples, example_detail, last_seen
FROM failure_stats
ORDER BY failures DESC, reason
