-- The dflash cache index (format v1): tables merged from the Parquet manifest, and views over them.
-- Used twice: `dflash index` runs it in index.duckdb, `dflash sql` runs it in memory over the live
-- manifest. Keep every statement standalone (split on ';' at line ends) and portable to DuckDB >= 1.0.

CREATE TABLE samples (
    sample_id       VARCHAR NOT NULL,  -- stable id from the data source and the record's content
    source_index    BIGINT NOT NULL,   -- position of the record in its data source
    shard           VARCHAR NOT NULL,  -- shard group under shards/ (without .zarr)
    row_start       BIGINT NOT NULL,   -- first token row in the shard's arrays
    num_tokens      INTEGER NOT NULL,
    num_loss_tokens INTEGER NOT NULL,
    bucket_id       INTEGER NOT NULL,  -- index of the first bucket edge >= num_tokens
    checksum        UINTEGER NOT NULL, -- crc32c of features, input_ids, loss_mask bytes
    worker          INTEGER NOT NULL,
    session         VARCHAR NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL,
    conversation_root VARCHAR          -- the record's conversation (ShareGPT's X_11 -> X); NULL in format 1-2
);

CREATE TABLE failures (
    sample_id    VARCHAR NOT NULL,
    source_index BIGINT NOT NULL,
    reason       VARCHAR NOT NULL,    -- one of dflash_offline.cache.rows.FAILURE_REASONS
    detail       VARCHAR NOT NULL,
    worker       INTEGER NOT NULL,
    session      VARCHAR NOT NULL,
    created_at   TIMESTAMPTZ NOT NULL
);

CREATE TABLE shards (
    shard         VARCHAR NOT NULL,   -- w<worker>-<session>: one Zarr group, one writer session
    worker        INTEGER NOT NULL,
    session       VARCHAR NOT NULL,
    feature_width INTEGER NOT NULL,
    chunk_rows    INTEGER NOT NULL,   -- token rows per compressed inner chunk
    shard_rows    INTEGER NOT NULL,   -- token rows per shard file
    codec         VARCHAR NOT NULL,
    created_at    TIMESTAMPTZ NOT NULL
);

CREATE TABLE runs (
    run_id            VARCHAR NOT NULL,
    command           VARCHAR NOT NULL,
    started_at        TIMESTAMPTZ NOT NULL,
    finished_at       TIMESTAMPTZ,    -- NULL while running (or when killed)
    status            VARCHAR NOT NULL, -- running | finished | interrupted | failed
    num_workers       INTEGER NOT NULL,
    samples_committed BIGINT NOT NULL,
    tokens_committed  BIGINT NOT NULL,
    bytes_written     BIGINT NOT NULL,
    failures          BIGINT NOT NULL,
    fingerprint_json  VARCHAR NOT NULL,
    host              VARCHAR NOT NULL,
    config_json       VARCHAR NOT NULL,
    error             VARCHAR NOT NULL,
    plan_ended_at     TIMESTAMPTZ     -- generate: its last job holding a training sample was handed out
);

-- Bucket edges from cache.json: bucket b holds samples with edge[b-1] < num_tokens <= edge[b];
-- the last bucket (max_tokens NULL) holds anything longer than the last edge.
CREATE TABLE buckets (
    bucket_id  INTEGER NOT NULL,
    max_tokens INTEGER
);

-- Rows dropped because their sample_id had been committed before (kept for inspection).
CREATE TABLE duplicates (
    sample_id  VARCHAR NOT NULL,
    shard      VARCHAR NOT NULL,
    row_start  BIGINT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL
);

-- The manifest parts this index was built from: `dflash sql` uses the index only when it covers
-- every part on disk, so a stale index is never read silently.
CREATE TABLE parts (
    manifest_table VARCHAR NOT NULL, -- samples | failures | shards | runs
    file           VARCHAR NOT NULL, -- path relative to the cache root
    mtime_ns       BIGINT NOT NULL   -- a part rewritten in place (by hand, by a tool) makes the index stale
);

CREATE TABLE meta (
    key   VARCHAR NOT NULL,
    value VARCHAR NOT NULL
);

CREATE VIEW bucket_stats AS
SELECT
    b.bucket_id,
    b.max_tokens,
    count(s.sample_id) AS samples,
    coalesce(sum(s.num_tokens), 0) AS tokens,
    coalesce(sum(s.num_loss_tokens), 0) AS loss_tokens,
    round(count(s.sample_id) / greatest((SELECT count(*) FROM samples), 1), 4) AS share_samples,
    round(coalesce(sum(s.num_tokens), 0) / greatest((SELECT sum(num_tokens) FROM samples), 1), 4) AS share_tokens,
    min(s.num_tokens) AS shortest,
    max(s.num_tokens) AS longest
FROM buckets AS b
LEFT JOIN samples AS s ON s.bucket_id = b.bucket_id
GROUP BY b.bucket_id, b.max_tokens;

CREATE VIEW shard_stats AS
SELECT
    h.shard,
    h.worker,
    h.session,
    h.codec,
    count(s.sample_id) AS samples,
    coalesce(sum(s.num_tokens), 0) AS tokens,
    coalesce(sum(s.num_loss_tokens), 0) AS loss_tokens,
    coalesce(max(s.row_start + s.num_tokens), 0) AS rows_spanned,
    h.created_at AS opened_at,
    max(s.created_at) AS last_commit
FROM shards AS h
LEFT JOIN samples AS s ON s.shard = h.shard
GROUP BY h.shard, h.worker, h.session, h.codec, h.created_at;

CREATE VIEW failure_stats AS
SELECT
    reason,
    count(*) AS failures,
    count(DISTINCT sample_id) AS distinct_samples,
    min(detail) AS example_detail,
    max(created_at) AS last_seen
FROM failures
GROUP BY reason;

-- A commit (created_at) lands only every --flush-seconds, so the span from a worker's first commit to its
-- last misses the time before the first one (a short run committed twice 0.03 s apart read as 1000x its
-- rate); the time base is each writer session's span from opening its shard to its last commit.
CREATE VIEW session_spans AS
SELECT
    h.worker,
    h.session,
    min(h.created_at) AS opened_at,
    max(s.created_at) AS last_commit,
    epoch(max(s.created_at)) - epoch(min(h.created_at)) AS seconds
FROM shards AS h
JOIN samples AS s ON s.shard = h.shard
GROUP BY h.worker, h.session;

CREATE VIEW progress AS
WITH committed AS (
    SELECT
        worker,
        count(*) AS samples,
        sum(num_tokens) AS tokens,
        sum(num_loss_tokens) AS loss_tokens,
        min(created_at) AS first_commit,
        max(created_at) AS last_commit
    FROM samples
    GROUP BY worker
),
writing AS (
    SELECT worker, sum(seconds) AS seconds FROM session_spans GROUP BY worker
),
failed AS (
    SELECT worker, count(*) AS failures FROM failures GROUP BY worker
)
SELECT
    coalesce(c.worker, f.worker) AS worker,
    coalesce(c.samples, 0) AS samples,
    coalesce(c.tokens, 0) AS tokens,
    coalesce(c.loss_tokens, 0) AS loss_tokens,
    coalesce(f.failures, 0) AS failures,
    c.first_commit,
    c.last_commit,
    round(c.tokens / nullif(w.seconds, 0), 1) AS tokens_per_s
FROM committed AS c
LEFT JOIN writing AS w ON w.worker = c.worker
FULL OUTER JOIN failed AS f ON f.worker = c.worker;

-- The disk window (docs/follow.md): stores sealed by their writer, stores retired by a training run.
CREATE TABLE seals (
    shard       VARCHAR NOT NULL,
    validation  BOOLEAN NOT NULL,  -- a store of validation samples: never retired
    num_samples BIGINT NOT NULL,   -- its final committed samples
    num_tokens  BIGINT NOT NULL,
    reason      VARCHAR NOT NULL,  -- size | close | recovered
    sealed_at   TIMESTAMPTZ NOT NULL
);

CREATE TABLE retirements (
    shard       VARCHAR NOT NULL,  -- its files are deleted; its sample rows stay in samples
    run_id      VARCHAR NOT NULL,  -- the training run that retired it
    num_samples BIGINT NOT NULL,
    num_tokens  BIGINT NOT NULL,
    retired_at  TIMESTAMPTZ NOT NULL
);

-- One row per store: open (pending a seal), sealed (trainable and retirable), or retired (gone).
CREATE VIEW window_stores AS
SELECT
    h.shard,
    h.worker,
    coalesce(z.validation, h.shard LIKE '%-val-r%') AS validation,
    CASE WHEN r.shard IS NOT NULL THEN 'retired' WHEN z.shard IS NOT NULL THEN 'sealed' ELSE 'open' END AS state,
    count(s.sample_id) AS samples,
    coalesce(sum(s.num_tokens), 0) AS tokens,
    h.created_at AS opened_at,
    z.sealed_at,
    r.retired_at,
    r.run_id AS retired_by
FROM shards AS h
LEFT JOIN (SELECT DISTINCT ON (shard) * FROM seals) AS z ON z.shard = h.shard
LEFT JOIN (SELECT DISTINCT ON (shard) * FROM retirements) AS r ON r.shard = h.shard
LEFT JOIN samples AS s ON s.shard = h.shard
GROUP BY ALL;

-- The window in one row: what is on disk (committed, not retired) and what training has retired.
CREATE VIEW window_totals AS
SELECT
    count(*) FILTER (WHERE state <> 'retired') AS stores_present,
    coalesce(sum(samples) FILTER (WHERE state <> 'retired'), 0) AS samples_present,
    coalesce(sum(tokens) FILTER (WHERE state <> 'retired'), 0) AS tokens_present,
    coalesce(sum(samples) FILTER (WHERE state = 'open'), 0) AS samples_in_open_stores,
    count(*) FILTER (WHERE state = 'retired') AS stores_retired,
    coalesce(sum(samples) FILTER (WHERE state = 'retired'), 0) AS samples_retired,
    coalesce(sum(tokens) FILTER (WHERE state = 'retired'), 0) AS tokens_retired
FROM window_stores;

CREATE TABLE waits (
    run_id     VARCHAR NOT NULL,
    side       VARCHAR NOT NULL,  -- generate: the window was full | train: nothing left to train on
    started_at TIMESTAMPTZ NOT NULL,
    seconds    DOUBLE NOT NULL
);

-- How long each side of the window waited for the other, per run.
CREATE VIEW window_waits AS
SELECT run_id, side, count(*) AS waits, round(sum(seconds), 3) AS seconds, min(started_at) AS first_wait
FROM waits
GROUP BY run_id, side;
