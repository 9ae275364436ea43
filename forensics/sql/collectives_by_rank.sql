-- depends: _phase_trace, _phase_setting, phase_collectives, nccl_collectives
--
-- `collectives_by_rank`: the collectives each rank ran, per process group and operation,
-- from every source that shows them (`source`):
-- * `trace`: NCCL kernels of PyTorch profiler traces (`trace_events`; the operation is the
--   kernel's `Collective name`, else read from the kernel name): `calls`, `elements` (input
--   elements), GPU `total_s` / `mean_ms` / `max_ms`, and from the cross-rank matching in
--   `phase_collectives`: `wait_s` (time this rank's kernels spent waiting for the last rank)
--   and `late_s` (how much later than the first rank it arrived). A rank with a large
--   `late_s` is a straggler; the others show the same time as `wait_s`.
-- * `nccl_log`: `NCCL INFO ... opCount` lines (NCCL_DEBUG_SUBSYS=COLL; view `nccl_collectives`):
--   `calls`, `elements` and the last `op_count` seen, no durations.
--
-- ```sql
-- SELECT source, rank, coll_name, calls, round(total_s, 3) AS total_s,
--        round(wait_s, 3) AS wait_s, round(late_s, 3) AS late_s
-- FROM collectives_by_rank ORDER BY coll_name, rank;
-- ```
CREATE OR REPLACE VIEW collectives_by_rank AS
WITH kernels AS (
    SELECT rank, coalesce(pg_name, '') AS pg_name,
           coalesce(coll_name, nullif(regexp_extract(name, _phase_setting('nccl_coll_from_kernel_regex'), 1), ''), name) AS coll_name,
           coll_in_nelems, dur_us / 1e6 AS seconds
    FROM _phase_trace
    WHERE source = 'kineto' AND ph = 'X' AND category = 'kernel'
      AND (coll_name IS NOT NULL OR regexp_matches(name, _phase_setting('nccl_kernel_regex')))
), matched AS (
    SELECT rank, pg_name, coll_name, sum(wait_s) AS wait_s, sum(late_s) AS late_s
    FROM phase_collectives GROUP BY ALL
), trace AS (
    SELECT 'trace' AS source, k.rank, k.pg_name, k.coll_name, count(*) AS calls,
           sum(k.coll_in_nelems)::BIGINT AS elements, sum(k.seconds) AS total_s,
           avg(k.seconds) * 1e3 AS mean_ms, max(k.seconds) * 1e3 AS max_ms,
           any_value(m.wait_s) AS wait_s, any_value(m.late_s) AS late_s, NULL::BIGINT AS last_op_count
    FROM kernels k
    LEFT JOIN matched m ON m.rank IS NOT DISTINCT FROM k.rank AND m.pg_name = k.pg_name AND m.coll_name = k.coll_name
    GROUP BY k.rank, k.pg_name, k.coll_name
), log AS (
    SELECT 'nccl_log' AS source, rank, coalesce(comm_id, comm, '') AS pg_name, op AS coll_name, count(*) AS calls,
           sum(count)::BIGINT AS elements, NULL::DOUBLE AS total_s, NULL::DOUBLE AS mean_ms,
           NULL::DOUBLE AS max_ms, NULL::DOUBLE AS wait_s, NULL::DOUBLE AS late_s, max(op_count)::BIGINT AS last_op_count
    FROM nccl_collectives
    GROUP BY ALL
)
SELECT * FROM trace
UNION ALL
SELECT * FROM log;
