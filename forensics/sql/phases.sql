-- depends: metrics, _phase_setting, _phase_engine, _phase_kineto_segments, _phase_collective_matches
-- depends: phase_names, phase_log_steps, phase_profiler_steps, phase_spans, phase_step_placement
--
-- Phase attribution, results: `phases`, `phase_steps`, `phase_run_steps`, `phase_timeline`.
--
-- For every rank and step: seconds in rollout (with its `logprob` sub-phase), reward, train,
-- sync, other (checkpoint, validation) and idle, and the source of the figures. Sources, best
-- first; each (rank, step) takes all its figures from the best source that covers it:
--   1. `kineto`: PyTorch profiler traces. The step is the `ProfilerStep` span; phases are the
--      user annotations (gen, update_actor, ...); `idle` is the part of the step no phase
--      annotation covers. Collective waits (`wait_s`) come with them; GPU time per phase is in
--      `phase_gpu`, per step in `phase_gpu_steps`.
--   2. `ray`: Ray timeline task spans per worker; the step window comes from marker lines.
--   3. `metrics` / `metrics+engine`: verl `timing_s/*` per step (run-level: `rank IS NULL`);
--      `idle` = `timing_s/step` minus the phases it contains. When a step has no sync metric
--      (older verl timed weight sync inside `timing_s/gen`) and vLLM/SGLang sleep/wake lines
--      fall in the step, their seconds become `sync` and leave rollout (`metrics+engine`).
--   4. `log`: phase start/end marker lines.
-- `rank IS NULL` rows describe the run as a whole (the driver's timers).
--
-- * `phases(rank, step, phase, sub_phase, seconds, source, step_s, in_step, wait_s)`:
--   one row per phase and sub-phase (phase `idle` included). `step_s` = the step time the
--   source measured; `in_step = false` marks time measured outside it (verl runs validation
--   and checkpoint saving after its step timer), so per (rank, step)
--   `sum(seconds) = step_s + sum(seconds) FILTER (WHERE NOT in_step)`.
--   `wait_s`: of `seconds`, the time spent in collectives waiting for the last rank.
-- * `phase_steps`: the same, one row per (rank, step): `rollout_s` (incl. `logprob_s`),
--   `reward_s`, `train_s`, `sync_s`, `other_s`, `idle_s`, `outside_s` (the not-in-step part
--   of `other_s`), `step_s`, `wait_s`, and for traces `late_s` (how much later than the first
--   rank this rank reached its collectives, summed). GPU busy/idle/kernel/NCCL time per step:
--   `phase_gpu_steps`.
-- * `phase_run_steps`: one row per step for the run: the run-level row when it comes from the
--   driver's timing metrics (or nothing else covers the step), else the mean over the ranks
--   (`source` says which, `ranks` how many).
-- * `phase_timeline(rank, step, phase, sub_phase, name, start_us, end_us, source, approximate, file_id, line_no, placement)`:
--   the spans to draw on a timeline (microseconds since the epoch). Steps known only from the
--   driver's timing metrics get one span per metric (`name` = the metric key), in the order
--   the trainer runs them (`metric_order`), and an `idle` span for the part of the step timer
--   no phase timer covers; `approximate = true`. `placement` says where their times come from:
--   `step start marker` (laid forward from the step's start marker line), else
--   `phase_step_placement`'s `step line` / `progress bar` / `step durations` (laid backwards
--   from the step's end). `file_id`, `line_no` of those spans: the step's metric line.
--
-- ```sql
-- SELECT step, rank, source, round(rollout_s, 3) AS rollout, round(train_s, 3) AS train,
--        round(sync_s, 3) AS sync, round(idle_s, 3) AS idle, round(step_s, 3) AS step
-- FROM phase_steps ORDER BY step, rank NULLS FIRST;
-- ```
CREATE OR REPLACE VIEW phases AS
WITH seg AS (
    SELECT * FROM _phase_kineto_segments
), kin_base AS (
    SELECT s.rank, s.step, s.phase, s.sub_phase, sum(s.seconds) AS seconds
    FROM seg s GROUP BY s.rank, s.step, s.phase, s.sub_phase
), coll_seg AS (
    -- the pieces the ASOF join below can pick: none that starts after the file's last collective
    SELECT s.* FROM seg s
    JOIN (SELECT file_id, max(start_us) AS last_us FROM _phase_collective_matches GROUP BY file_id) l
      ON l.file_id = s.file_id AND s.start_us <= l.last_us
), kin_wait AS (
    SELECT s.rank, s.step, s.phase, s.sub_phase, sum(m.wait_s) AS wait_s
    FROM _phase_collective_matches m ASOF JOIN coll_seg s ON m.file_id = s.file_id AND m.start_us >= s.start_us
    GROUP BY s.rank, s.step, s.phase, s.sub_phase
), kin_step AS (
    SELECT rank, step, sum(step_s) AS step_s FROM phase_profiler_steps GROUP BY rank, step
), kin AS (
    SELECT b.rank, b.step, b.phase, b.sub_phase, b.seconds, 'kineto' AS source, k.step_s, true AS in_step,
           coalesce(w.wait_s, 0) AS wait_s
    FROM kin_base b
    JOIN kin_step k ON k.rank IS NOT DISTINCT FROM b.rank AND k.step = b.step
    LEFT JOIN kin_wait w ON w.rank IS NOT DISTINCT FROM b.rank AND w.step = b.step AND w.phase = b.phase
         AND w.sub_phase IS NOT DISTINCT FROM b.sub_phase
), win AS (
    SELECT rank, step, (end_us - start_us) / 1e6 AS win_s FROM phase_log_steps
), ray_base AS (
    SELECT rank, step, phase, sub_phase, sum(seconds) AS seconds
    FROM phase_spans WHERE source = 'ray' AND rank IS NOT NULL GROUP BY rank, step, phase, sub_phase
), ray_tot AS (
    SELECT r.rank, r.step, sum(r.seconds) AS busy,
           coalesce(max(w.win_s), sum(r.seconds)) AS step_s
    FROM ray_base r LEFT JOIN win w ON w.rank IS NULL AND w.step = r.step
    GROUP BY r.rank, r.step
), ray AS (
    SELECT rank, step, phase, sub_phase, seconds, 'ray' AS source, NULL::DOUBLE AS step_s FROM ray_base
    UNION ALL
    SELECT rank, step, 'idle', NULL, greatest(step_s - busy, 0), 'ray', NULL FROM ray_tot
), log_base AS (
    SELECT rank, step, phase, sub_phase, (max(end_us) - min(start_us)) / 1e6 AS seconds
    FROM phase_spans WHERE source = 'log' GROUP BY rank, step, phase, sub_phase
), log_tot AS (
    SELECT l.rank, l.step, sum(l.seconds) AS busy, coalesce(max(w.win_s), sum(l.seconds)) AS step_s
    FROM log_base l LEFT JOIN win w ON w.rank IS NOT DISTINCT FROM l.rank AND w.step = l.step
    GROUP BY l.rank, l.step
), lg AS (
    SELECT rank, step, phase, sub_phase, seconds, 'log' AS source, NULL::DOUBLE AS step_s FROM log_base
    UNION ALL
    SELECT rank, step, 'idle', NULL, greatest(step_s - busy, 0), 'log', NULL FROM log_tot
), met_raw AS (
    SELECT step, key, value, source FROM metrics
    WHERE step IS NOT NULL AND value IS NOT NULL AND isfinite(value)
      AND regexp_matches(key, _phase_setting('timing_prefix_regex'))
), met AS (
    SELECT step, key, arg_min(value, CASE source WHEN 'jsonl' THEN 0 WHEN 'console' THEN 1 ELSE 2 END) AS value
    FROM met_raw GROUP BY step, key
), met_total AS (
    SELECT step, max(value) AS step_s FROM met
    WHERE lower(regexp_replace(key, _phase_setting('timing_prefix_regex'), '')) = lower(_phase_setting('step_metric'))
    GROUP BY step
), met_phase AS (
    SELECT m.step, n.phase, n.sub_phase, n.in_step, sum(m.value) AS seconds
    FROM met m JOIN phase_names n ON n.source = 'metrics' AND n.name = m.key
    GROUP BY m.step, n.phase, n.sub_phase, n.in_step
), run_win AS (
    SELECT step, start_ts, end_ts FROM phase_log_steps WHERE rank IS NULL
), eng AS (
    SELECT w.step, sum(e.seconds) AS seconds
    FROM _phase_engine e ASOF JOIN run_win w ON e.ts >= w.start_ts
    WHERE (w.end_ts IS NULL OR e.ts < w.end_ts) AND e.seconds IS NOT NULL AND e.kind IN ('sleep', 'wake')
    GROUP BY w.step
), eng_steps AS (
    SELECT e.step, e.seconds FROM eng e
    WHERE e.step NOT IN (SELECT step FROM met_phase WHERE phase = 'sync')
      AND e.step IN (SELECT step FROM met_phase WHERE phase = 'rollout')
), met_rows AS (
    SELECT p.step, p.phase, p.sub_phase, p.in_step,
           CASE WHEN p.phase = 'rollout' AND p.sub_phase = 'generate' AND e.seconds IS NOT NULL
                THEN greatest(p.seconds - e.seconds, 0) ELSE p.seconds END AS seconds,
           CASE WHEN e.step IS NULL THEN 'metrics' ELSE 'metrics+engine' END AS source
    FROM met_phase p LEFT JOIN eng_steps e USING (step)
    UNION ALL
    SELECT step, 'sync', 'sleep/wake', true, seconds, 'metrics+engine' FROM eng_steps
), met_tot AS (
    SELECT r.step, any_value(r.source) AS source,
           coalesce(max(t.step_s), sum(r.seconds) FILTER (WHERE r.in_step)) AS step_s,
           coalesce(sum(r.seconds) FILTER (WHERE r.in_step), 0) AS busy
    FROM met_rows r LEFT JOIN met_total t USING (step)
    GROUP BY r.step
), metr AS (
    SELECT NULL::INTEGER AS rank, r.step, r.phase, r.sub_phase, r.seconds, r.source, t.step_s, r.in_step
    FROM met_rows r JOIN met_tot t USING (step)
    UNION ALL
    SELECT NULL::INTEGER, step, 'idle', NULL, greatest(step_s - busy, 0), source, step_s, true FROM met_tot
), others AS (
    SELECT rank, step, phase, sub_phase, seconds, source, step_s, true AS in_step FROM ray
    UNION ALL SELECT rank, step, phase, sub_phase, seconds, source, step_s, true FROM lg
), others_tot AS (
    SELECT o.rank, o.step, o.phase, o.sub_phase, o.seconds, o.source,
           sum(o.seconds) OVER (PARTITION BY o.rank, o.step, o.source) AS step_s, o.in_step
    FROM others o
), all_rows AS (
    SELECT rank, step, phase, sub_phase, seconds, source, step_s, in_step, wait_s FROM kin
    UNION ALL
    SELECT rank, step, phase, sub_phase, seconds, source, step_s, in_step, NULL FROM others_tot
    UNION ALL
    SELECT rank, step, phase, sub_phase, seconds, source, step_s, in_step, NULL FROM metr
), ranked AS (
    SELECT *, CASE WHEN source = 'kineto' THEN 1 WHEN source = 'ray' THEN 2
                   WHEN source LIKE 'metrics%' THEN 3 ELSE 4 END AS pref
    FROM all_rows
), best AS (
    SELECT rank, step, min(pref) AS pref FROM ranked GROUP BY rank, step
)
SELECT r.rank, r.step, r.phase, r.sub_phase, r.seconds, r.source, r.step_s, r.in_step, r.wait_s
FROM ranked r JOIN best b ON b.rank IS NOT DISTINCT FROM r.rank AND b.step = r.step AND b.pref = r.pref;

CREATE OR REPLACE VIEW phase_steps AS
WITH p AS (
    SELECT rank, step, any_value(source) AS source, max(step_s) AS step_s,
           coalesce(sum(seconds) FILTER (WHERE phase = 'rollout'), 0) AS rollout_s,
           coalesce(sum(seconds) FILTER (WHERE phase = 'rollout' AND sub_phase = 'logprob'), 0) AS logprob_s,
           coalesce(sum(seconds) FILTER (WHERE phase = 'reward'), 0) AS reward_s,
           coalesce(sum(seconds) FILTER (WHERE phase = 'train'), 0) AS train_s,
           coalesce(sum(seconds) FILTER (WHERE phase = 'sync'), 0) AS sync_s,
           coalesce(sum(seconds) FILTER (WHERE phase = 'other'), 0) AS other_s,
           coalesce(sum(seconds) FILTER (WHERE phase = 'idle'), 0) AS idle_s,
           coalesce(sum(seconds) FILTER (WHERE NOT in_step), 0) AS outside_s,
           sum(wait_s) AS wait_s
    FROM phases GROUP BY rank, step
), c AS (
    SELECT rank, step, sum(late_s) AS late_s FROM _phase_collective_matches GROUP BY rank, step
)
SELECT p.*, CASE WHEN p.source = 'kineto' THEN coalesce(c.late_s, 0) END AS late_s
FROM p
LEFT JOIN c ON c.rank IS NOT DISTINCT FROM p.rank AND c.step = p.step;

CREATE OR REPLACE VIEW phase_run_steps AS
WITH s AS (
    SELECT *,
           -- the driver's timers describe the run best; a run-level row from marker lines only
           -- when no rank has better figures
           bool_or(rank IS NULL AND source LIKE 'metrics%') OVER (PARTITION BY step)
           OR NOT bool_or(rank IS NOT NULL) OVER (PARTITION BY step) AS use_run
    FROM phase_steps
)
SELECT step,
       CASE WHEN any_value(use_run) THEN max(source) FILTER (WHERE rank IS NULL)
            ELSE 'mean of ranks (' || string_agg(DISTINCT source, ', ') FILTER (WHERE rank IS NOT NULL) || ')' END AS source,
       CASE WHEN any_value(use_run) THEN 1 ELSE count(*) FILTER (WHERE rank IS NOT NULL) END AS ranks,
       CASE WHEN any_value(use_run) THEN max(step_s) FILTER (WHERE rank IS NULL) ELSE avg(step_s) FILTER (WHERE rank IS NOT NULL) END AS step_s,
       CASE WHEN any_value(use_run) THEN max(rollout_s) FILTER (WHERE rank IS NULL) ELSE avg(rollout_s) FILTER (WHERE rank IS NOT NULL) END AS rollout_s,
       CASE WHEN any_value(use_run) THEN max(logprob_s) FILTER (WHERE rank IS NULL) ELSE avg(logprob_s) FILTER (WHERE rank IS NOT NULL) END AS logprob_s,
       CASE WHEN any_value(use_run) THEN max(reward_s) FILTER (WHERE rank IS NULL) ELSE avg(reward_s) FILTER (WHERE rank IS NOT NULL) END AS reward_s,
       CASE WHEN any_value(use_run) THEN max(train_s) FILTER (WHERE rank IS NULL) ELSE avg(train_s) FILTER (WHERE rank IS NOT NULL) END AS train_s,
       CASE WHEN any_value(use_run) THEN max(sync_s) FILTER (WHERE rank IS NULL) ELSE avg(sync_s) FILTER (WHERE rank IS NOT NULL) END AS sync_s,
       CASE WHEN any_value(use_run) THEN max(other_s) FILTER (WHERE rank IS NULL) ELSE avg(other_s) FILTER (WHERE rank IS NOT NULL) END AS other_s,
       CASE WHEN any_value(use_run) THEN max(idle_s) FILTER (WHERE rank IS NULL) ELSE avg(idle_s) FILTER (WHERE rank IS NOT NULL) END AS idle_s,
       CASE WHEN any_value(use_run) THEN max(outside_s) FILTER (WHERE rank IS NULL) ELSE avg(outside_s) FILTER (WHERE rank IS NOT NULL) END AS outside_s
FROM s
GROUP BY step;

CREATE OR REPLACE VIEW phase_timeline AS
WITH p AS (
    SELECT * FROM phases
), best AS (
    SELECT DISTINCT rank, step, source FROM p
), measured AS (
    SELECT s.rank, s.step, s.phase, s.sub_phase, s.name, s.start_us, s.end_us, s.source, false AS approximate,
           s.file_id, s.line_no
    FROM phase_spans s
    JOIN best b ON b.rank IS NOT DISTINCT FROM s.rank AND b.step = s.step AND b.source = s.source
    WHERE s.source <> 'kineto'
    UNION ALL
    SELECT k.rank, k.step, k.phase, k.sub_phase, k.name, k.start_us, k.end_us, 'kineto', false, k.file_id, NULL
    FROM _phase_kineto_segments k WHERE k.phase <> 'idle'
), met_steps AS (
    -- steps whose run-level figures come from the driver's timing metrics
    SELECT step, max(step_s) AS step_s FROM p WHERE rank IS NULL AND source LIKE 'metrics%' GROUP BY step
), met_val AS (
    SELECT step, key, arg_min(value, CASE source WHEN 'jsonl' THEN 0 WHEN 'console' THEN 1 ELSE 2 END) AS seconds
    FROM metrics
    WHERE step IN (SELECT step FROM met_steps) AND value IS NOT NULL AND isfinite(value) AND value > 0
      AND regexp_matches(key, _phase_setting('timing_prefix_regex'))
    GROUP BY step, key
), met_keys AS (
    -- one span per timing metric, in the order the trainer runs them (`metric_order`), then by phase
    SELECT v.step, v.key, v.seconds, n.phase, n.sub_phase, coalesce(n.in_step, true) AS in_step,
           coalesce(list_position(string_split(lower(_phase_setting('metric_order')), '|'), n.bare),
                    1000 + CASE n.phase WHEN 'rollout' THEN 1 WHEN 'reward' THEN 2 WHEN 'train' THEN 3 WHEN 'sync' THEN 4 ELSE 5 END) AS ord
    FROM met_val v JOIN phase_names n ON n.source = 'metrics' AND n.name = v.key
), anchored AS (
    -- a step start marker lays the step out forward from it; else its placement from
    -- durations (phase_step_placement) lays it out backwards from the step's end
    SELECT s.step, s.step_s, w.start_us AS marker_us, pl.end_us, pl.placed_by, pl.file_id, pl.line_no,
           coalesce((SELECT sum(k.seconds) FROM met_keys k WHERE k.step = s.step AND k.in_step), 0) AS in_s,
           coalesce((SELECT sum(k.seconds) FROM met_keys k WHERE k.step = s.step AND NOT k.in_step), 0) AS out_s
    FROM met_steps s
    LEFT JOIN phase_log_steps w ON w.rank IS NULL AND w.step = s.step
    LEFT JOIN phase_step_placement pl ON pl.step = s.step
    WHERE w.start_us IS NOT NULL OR pl.end_us IS NOT NULL
), bases AS (
    SELECT *, coalesce(step_s, in_s) AS span_s,
           CASE WHEN marker_us IS NOT NULL THEN marker_us ELSE end_us - (out_s + in_s) * 1e6 END AS in_base,
           CASE WHEN marker_us IS NOT NULL THEN marker_us + greatest(coalesce(step_s, in_s), in_s) * 1e6 ELSE end_us - out_s * 1e6 END AS out_base,
           CASE WHEN marker_us IS NOT NULL THEN 'step start marker' ELSE placed_by END AS placement
    FROM anchored
), laid AS (
    SELECT k.step, k.key, k.seconds, k.phase, k.sub_phase, b.placement, b.file_id, b.line_no,
           CASE WHEN k.in_step THEN b.in_base ELSE b.out_base END
           + coalesce(sum(k.seconds) OVER (PARTITION BY k.step, k.in_step ORDER BY k.ord, k.key
                                           ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) * 1e6 AS start_us
    FROM met_keys k JOIN bases b USING (step)
), idle AS (
    -- the part of the step timer no phase timer covers: after the phases (forward), before them (backwards)
    SELECT step, placement, file_id, line_no,
           CASE WHEN marker_us IS NOT NULL THEN marker_us + in_s * 1e6 ELSE in_base - (span_s - in_s) * 1e6 END AS start_us,
           (span_s - in_s) AS seconds
    FROM bases WHERE span_s - in_s > 1e-3  -- not the rounding of the printed timers
)
SELECT rank, step, phase, sub_phase, name, start_us, end_us, source, approximate, file_id, line_no,
       NULL::VARCHAR AS placement
FROM measured
UNION ALL
SELECT NULL::INTEGER, step, phase, sub_phase, key, start_us, start_us + seconds * 1e6, 'metrics', true,
       file_id, line_no, placement
FROM laid
UNION ALL
SELECT NULL::INTEGER, step, 'idle', NULL, 'untimed part of the step', start_us, start_us + seconds * 1e6, 'metrics', true,
       file_id, line_no, placement
FROM idle;
