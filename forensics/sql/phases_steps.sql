-- depends: _phase_log_markers, _phase_trace, _phase_setting
--
-- Phase attribution, step windows: `phase_log_steps`, `phase_profiler_steps`.
--
-- * `phase_log_steps(rank, step, start_ts, end_ts, start_us, end_us)`: when each step ran
--   according to the step/phase marker lines (`step 3: [gen] start`, ...; lines with a time
--   stamp of their own, when there are any): a step starts at its first marker line and ends where the
--   next step starts (the last step at its last marker, NULL when it has only one). One row
--   per rank that printed markers, plus `rank IS NULL` rows for the run as a whole.
-- * `phase_profiler_steps(file_id, rank, profiler_step, step, step_from, start_us, end_us, step_s)`:
--   the `ProfilerStep#k` spans of each PyTorch profiler trace. `step` is the training step:
--   `k` plus the offset that matches the spans' start times to step-start marker lines
--   (`step_from = 'log markers'`), else `k` plus `profiler_step_offset` from
--   signatures/phases.yaml (`step_from = 'default offset'`).
--
-- ```sql
-- SELECT rank, profiler_step, step, step_from, round(step_s, 3) AS step_s
-- FROM phase_profiler_steps ORDER BY rank, step;
-- ```
CREATE OR REPLACE VIEW phase_log_steps AS
WITH stamped AS (
    -- lines with a stamp of their own date steps; inherited stamps only when no line has one
    SELECT * FROM _phase_log_markers
    WHERE step IS NOT NULL
      AND (NOT ts_inherited OR NOT EXISTS (SELECT 1 FROM _phase_log_markers WHERE NOT ts_inherited))
), per AS (
    SELECT rank, step, min(ts) AS first_ts, max(ts) AS last_ts FROM stamped GROUP BY rank, step
), run AS (
    SELECT NULL::INTEGER AS rank, step, min(first_ts) AS first_ts, max(last_ts) AS last_ts FROM per GROUP BY step
), both_levels AS (
    SELECT * FROM per WHERE rank IS NOT NULL
    UNION ALL
    SELECT * FROM run
), w AS (
    SELECT rank, step, first_ts AS start_ts,
           coalesce(lead(first_ts) OVER (PARTITION BY rank ORDER BY step), nullif(last_ts, first_ts)) AS end_ts
    FROM both_levels
)
SELECT rank, step, start_ts, end_ts, epoch_us(start_ts)::DOUBLE AS start_us, epoch_us(end_ts)::DOUBLE AS end_us
FROM w;

CREATE OR REPLACE VIEW phase_profiler_steps AS
WITH cfg AS (
    SELECT TRY_CAST(_phase_setting('profiler_step_offset') AS BIGINT) AS default_offset,
           TRY_CAST(_phase_setting('align_tolerance_s') AS DOUBLE) AS tol_s
), ps AS (
    SELECT t.file_id, t.rank, TRY_CAST(regexp_extract(t.name, _phase_setting('profiler_step_regex'), 1) AS BIGINT) AS profiler_step,
           t.start_us, t.end_us
    FROM _phase_trace t
    WHERE t.source = 'kineto' AND t.ph = 'X' AND t.category = 'user_annotation'
      AND regexp_matches(t.name, _phase_setting('profiler_step_regex'))
), ps_b AS (
    SELECT ps.*, ps.start_us + least(cfg.tol_s * 1e6, (ps.end_us - ps.start_us) / 2) AS bound
    FROM ps, cfg
), run_starts AS (
    SELECT step, start_us FROM phase_log_steps WHERE rank IS NULL
), rank_starts AS (
    SELECT rank, step, start_us FROM phase_log_steps WHERE rank IS NOT NULL
), by_rank AS (
    SELECT b.file_id, b.profiler_step, b.start_us, s.step, s.start_us AS marker_us
    FROM ps_b b ASOF JOIN rank_starts s ON b.rank = s.rank AND s.start_us <= b.bound
), by_run AS (
    SELECT b.file_id, b.profiler_step, b.start_us, s.step, s.start_us AS marker_us
    FROM ps_b b ASOF JOIN run_starts s ON s.start_us <= b.bound
), cand AS (
    SELECT c.file_id, c.profiler_step, coalesce(r.step, u.step) - c.profiler_step AS off
    FROM ps_b c
    LEFT JOIN by_rank r ON r.file_id = c.file_id AND r.profiler_step = c.profiler_step AND r.start_us = c.start_us
         AND abs(r.marker_us - c.start_us) <= (SELECT tol_s FROM cfg) * 1e6
    LEFT JOIN by_run u ON u.file_id = c.file_id AND u.profiler_step = c.profiler_step AND u.start_us = c.start_us
         AND abs(u.marker_us - c.start_us) <= (SELECT tol_s FROM cfg) * 1e6
    WHERE coalesce(r.step, u.step) IS NOT NULL
), offs AS (
    SELECT file_id, mode(off) AS off FROM cand GROUP BY file_id
)
SELECT ps.file_id, ps.rank, ps.profiler_step,
       ps.profiler_step + coalesce(offs.off, cfg.default_offset) AS step,
       CASE WHEN offs.off IS NULL THEN 'default offset' ELSE 'log markers' END AS step_from,
       ps.start_us, ps.end_us, (ps.end_us - ps.start_us) / 1e6 AS step_s
FROM ps CROSS JOIN cfg LEFT JOIN offs USING (file_id);
