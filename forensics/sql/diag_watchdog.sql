-- depends: lines
--
-- `watchdog_timeouts`: every PyTorch ProcessGroupNCCL watchdog timeout line
-- (`[Rank r] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=s, OpType=op, ...,
-- Timeout(ms)=t) ran for m milliseconds`), in all torch formats (with or without the
-- `[rankN]:` prefix and glog timestamp). `pg` is the process group named on the line's
-- neighbours when printed (`PG ID 1` / `PG 1`), else null (the default group on old torch).
-- `watchdog_progress`: the `last enqueued / last completed NCCL work` counters each rank
-- printed with its timeout: a rank whose last enqueued work is below the SeqNum the others
-- time out on never reached that collective.
--
-- ```sql
-- SELECT rank, seq, optype, timeout_ms, ran_ms, ts FROM watchdog_timeouts ORDER BY ts, rank;
-- SELECT rank, pg, work, last_enqueued, last_completed FROM watchdog_progress ORDER BY rank;
-- ```
CREATE OR REPLACE VIEW watchdog_timeouts AS
SELECT
    file_id,
    line_no,
    ts,
    ts_quality,
    coalesce(TRY_CAST(nullif(regexp_extract(message, '\[Rank (\d+)\] Watchdog caught', 1), '') AS INTEGER), rank) AS rank,
    pid,
    node,
    TRY_CAST(regexp_extract(message, 'SeqNum=(\d+)', 1) AS BIGINT) AS seq,
    regexp_extract(message, 'OpType=(\w+)', 1) AS optype,
    TRY_CAST(nullif(regexp_extract(message, 'NumelIn=(\d+)', 1), '') AS BIGINT) AS numel_in,
    TRY_CAST(nullif(regexp_extract(message, 'Timeout\(ms\)=(\d+)', 1), '') AS BIGINT) AS timeout_ms,
    TRY_CAST(nullif(regexp_extract(message, 'ran for (\d+) milliseconds', 1), '') AS BIGINT) AS ran_ms,
    message
FROM lines
WHERE (contains(message, 'Watchdog caught collective operation timeout: WorkNCCL(SeqNum=')
       OR contains(message, 'Watchdog caught collective operation timeout: WorkHCCL(SeqNum='))  -- torch_npu
  AND NOT contains(message, 'thread terminated with exception')
  AND NOT regexp_matches(message, '^\s*what\(\)')
  AND NOT contains(message, 'DistBackendError');

CREATE OR REPLACE VIEW watchdog_progress AS
SELECT
    file_id,
    line_no,
    ts,
    coalesce(TRY_CAST(nullif(regexp_extract(message, 'Rank (\d+)\]', 1), '') AS INTEGER), rank) AS rank,
    pid,
    nullif(regexp_extract(message, '\[PG (?:ID )?(\d+)', 1), '') AS pg,
    TRY_CAST(regexp_extract(message, '(?:at work|NCCL work): (\d+), last enqueued', 1) AS BIGINT) AS work,
    TRY_CAST(regexp_extract(message, 'last enqueued NCCL work: (\d+)', 1) AS BIGINT) AS last_enqueued,
    TRY_CAST(nullif(regexp_extract(message, 'last completed NCCL work: (-?\d+)', 1), '') AS BIGINT) AS last_completed
FROM lines
WHERE contains(message, 'last enqueued NCCL work:');
