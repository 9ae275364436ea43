-- depends: lines, metrics, _phase_setting, phase_names
--
-- Phase attribution, steps placed in time from durations: `phase_step_placement`.
--
-- A verl driver log often dates nothing of its training loop: the `step:N - ...` line has no
-- time stamp of its own, and the `timing_s/*` metrics say how long each phase took, not
-- when. This view gives each step that has timing metrics a wall-clock end, best first:
--   1. `step line`: the step's metric line (or record) carries a time stamp of its own (a
--      stamp printed on the line, a Ray driver prefix with a time, a JSONL record's time);
--   2. `progress bar`: the training progress bar (`Training Progress: ... | 3/42 [09:48<...`,
--      `progress_bar_regex` in signatures/phases.yaml) says how long after its start step N
--      was done; the bar's start is the time its own stamped lines imply, else the time the
--      steps placed by 1 imply, else the stamp of
--      the last stamped line before its first update (the bar is created just before the
--      first step), kept within what the stamped lines around each update allow (a line
--      printed before an update happened before it, a line printed after it later);
--   3. `step durations`: steps laid end to end by their durations (`timing_s/step` plus the
--      time verl measures after its step timer), from the last step placed by 1 or 2, else
--      from the stamp of the last stamped line before the first step's line.
-- `end_us` is when the step's line was written (the step timer's end plus validation and
-- checkpoint time measured outside it); `start_us` = `end_us` - (`step_s` + `outside_s`).
-- `file_id`, `line_no`: the step's metric line (a console line before a JSONL record).
--
-- `phase_timeline` lays each such step's timing metrics out backwards from `end_us` in the
-- order verl runs them (`metric_order`), with `approximate = true`.
--
-- ```sql
-- SELECT step, placed_by, to_timestamp(end_us / 1e6) AS ended, round(step_s, 1) AS step_s
-- FROM phase_step_placement ORDER BY step;
-- ```

-- Updates of a progress bar: one row per `n/total [elapsed<` seen in a line (a line holds
-- several when the bar redrew itself with `\r`), numbered per file in the order written;
-- `bar` counts the bars of a file (a new one starts when the total changes or the count or
-- the elapsed time goes back).
CREATE OR REPLACE VIEW _phase_progress AS
WITH m AS (
    SELECT l.file_id, l.line_no, l.ts, l.ts_quality,
           regexp_extract_all(l.message, _phase_setting('progress_bar_regex'), 1) AS ns,
           regexp_extract_all(l.message, _phase_setting('progress_bar_regex'), 2) AS totals,
           regexp_extract_all(l.message, _phase_setting('progress_bar_regex'), 3) AS elapsed
    FROM lines l
    WHERE l.message LIKE '%/%[%' AND regexp_matches(l.message, _phase_setting('progress_bar_regex'))
), u AS (
    SELECT file_id, line_no, ts, ts_quality, i,
           TRY_CAST(ns[i] AS BIGINT) AS n, totals[i] AS total,
           string_split(elapsed[i], ':') AS parts
    FROM (SELECT *, unnest(range(1, len(ns) + 1)) AS i FROM m)
), s AS (
    SELECT file_id, line_no, ts, ts_quality, i, n, total,
           coalesce(TRY_CAST(parts[-3] AS BIGINT), 0) * 3600 + TRY_CAST(parts[-2] AS BIGINT) * 60
               + TRY_CAST(parts[-1] AS BIGINT) AS elapsed_s
    FROM u WHERE n IS NOT NULL
), b AS (
    SELECT *,
           CASE WHEN lag(total) OVER w IS DISTINCT FROM total OR n < lag(n) OVER w OR elapsed_s < lag(elapsed_s) OVER w
                THEN 1 ELSE 0 END AS new_bar
    FROM s WINDOW w AS (PARTITION BY file_id ORDER BY line_no, i)
)
SELECT file_id, line_no, ts, ts_quality, i, n, total, elapsed_s::DOUBLE AS elapsed_s,
       sum(new_bar) OVER (PARTITION BY file_id ORDER BY line_no, i) AS bar
FROM b WHERE elapsed_s IS NOT NULL;

CREATE OR REPLACE VIEW phase_step_placement AS
WITH met AS (
    -- one value per (step, timing key), as `phases` picks it
    SELECT step, key, arg_min(value, CASE source WHEN 'jsonl' THEN 0 WHEN 'console' THEN 1 ELSE 2 END) AS value
    FROM metrics
    WHERE step IS NOT NULL AND value IS NOT NULL AND isfinite(value)
      AND regexp_matches(key, _phase_setting('timing_prefix_regex'))
    GROUP BY step, key
), dur AS (
    SELECT m.step,
           max(m.value) FILTER (WHERE lower(regexp_replace(m.key, _phase_setting('timing_prefix_regex'), ''))
                                    = lower(_phase_setting('step_metric'))) AS step_total,
           sum(m.value) FILTER (WHERE n.in_step) AS in_s,
           coalesce(sum(m.value) FILTER (WHERE NOT n.in_step), 0) AS outside_s
    FROM met m LEFT JOIN phase_names n ON n.source = 'metrics' AND n.name = m.key
    GROUP BY m.step
), steps AS (
    SELECT step, coalesce(step_total, in_s, 0) AS step_s, outside_s,
           sum(coalesce(step_total, in_s, 0) + outside_s) OVER (ORDER BY step) AS cum_s
    FROM dur
), step_lines AS (
    -- the line (or record) of each step's timing metrics, with its stamp and how good it is
    SELECT m.step, m.file_id, m.line_no, m.ts, l.ts_quality,
           m.ts IS NOT NULL AND coalesce(l.ts_quality, 'full') <> 'inherited' AS own
    FROM metrics m LEFT JOIN lines l ON l.file_id = m.file_id AND l.line_no = m.line_no
    WHERE m.step IS NOT NULL AND regexp_matches(m.key, _phase_setting('timing_prefix_regex'))
), line_of AS (
    SELECT step, arg_min(file_id, (CASE WHEN ts_quality IS NULL THEN 1 ELSE 0 END, file_id, line_no)) AS file_id,
           arg_min(line_no, (CASE WHEN ts_quality IS NULL THEN 1 ELSE 0 END, file_id, line_no)) AS line_no,
           min(epoch_us(ts)) FILTER (WHERE own)::DOUBLE AS own_us,
           min(epoch_us(ts)) FILTER (WHERE NOT own)::DOUBLE AS inherited_us
    FROM step_lines GROUP BY step
), stamped AS (
    SELECT file_id, line_no, epoch_us(ts)::DOUBLE AS ts_us FROM lines
    WHERE ts IS NOT NULL AND ts_quality <> 'inherited'
), upd AS (
    SELECT p.*, epoch_us(p.ts)::DOUBLE AS ts_us, coalesce(p.ts_quality, 'inherited') <> 'inherited' AS own
    FROM _phase_progress p WHERE p.n IN (SELECT step FROM steps)
), after AS (
    -- the first stamped line written after each update: the update happened before it
    SELECT u.file_id, u.bar, min(a.ts_us - u.elapsed_s * 1e6) AS ub
    FROM upd u ASOF JOIN stamped a ON a.file_id = u.file_id AND a.line_no > u.line_no
    GROUP BY u.file_id, u.bar
), bars AS (
    SELECT u.file_id, u.bar,
           median(u.ts_us - u.elapsed_s * 1e6) FILTER (WHERE u.own AND u.i = 1) AS own_t0,
           median(l.own_us - u.elapsed_s * 1e6) AS step_t0,
           arg_min(u.ts_us, (u.line_no, u.i)) AS first_ts,
           max(u.ts_us - u.elapsed_s * 1e6) FILTER (WHERE NOT u.own) AS lb
    FROM upd u LEFT JOIN line_of l ON l.step = u.n
    GROUP BY u.file_id, u.bar
), bar_t0 AS (
    -- the bar's own stamps, else the steps whose line has a stamp, else the last stamp before it
    SELECT b.file_id, b.bar,
           coalesce(b.own_t0, b.step_t0,
                    least(greatest(b.first_ts, coalesce(b.lb, b.first_ts)), coalesce(a.ub, b.first_ts + 1e18))) AS t0_us
    FROM bars b LEFT JOIN after a USING (file_id, bar)
), bar_end AS (
    SELECT u.n AS step, arg_max(t.t0_us + u.elapsed_s * 1e6, (u.file_id, u.line_no, u.i)) AS end_us
    FROM upd u JOIN bar_t0 t USING (file_id, bar)
    WHERE t.t0_us IS NOT NULL
    GROUP BY u.n
), direct AS (
    SELECT s.step, s.step_s, s.outside_s, s.cum_s, l.file_id, l.line_no, l.inherited_us,
           coalesce(l.own_us, b.end_us) AS end_us,
           CASE WHEN l.own_us IS NOT NULL THEN 'step line' WHEN b.end_us IS NOT NULL THEN 'progress bar' END AS placed_by
    FROM steps s LEFT JOIN line_of l USING (step) LEFT JOIN bar_end b USING (step)
), base AS (
    SELECT step, end_us, cum_s FROM direct WHERE end_us IS NOT NULL
), origin AS (
    -- the run's first step, when nothing before it is placed: it began at the last stamp before its line
    SELECT arg_min(inherited_us, step) AS t0_us FROM direct WHERE inherited_us IS NOT NULL
), chained AS (
    SELECT d.step, d.step_s, d.outside_s, d.file_id, d.line_no,
           CASE WHEN d.end_us IS NOT NULL THEN d.end_us
                WHEN b.step IS NOT NULL THEN b.end_us + (d.cum_s - b.cum_s) * 1e6
                ELSE (SELECT t0_us FROM origin) + d.cum_s * 1e6 END AS end_us,
           coalesce(d.placed_by, 'step durations') AS placed_by
    FROM direct d ASOF LEFT JOIN base b ON b.step <= d.step
)
SELECT NULL::INTEGER AS rank, step, end_us - (step_s + outside_s) * 1e6 AS start_us, end_us,
       step_s, outside_s, placed_by, file_id, line_no
FROM chained WHERE end_us IS NOT NULL;
