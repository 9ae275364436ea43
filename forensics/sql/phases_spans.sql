-- depends: _phase_trace, _phase_log_markers, _phase_setting, phase_names, phase_profiler_steps, phase_log_steps
--
-- Phase attribution, spans: `phase_spans`.
--
-- * `phase_spans(source, file_id, line_no, rank, step, phase, sub_phase, name, start_us, end_us, seconds)`:
--   every interval known to belong to one phase of one step, with its wall-clock bounds in
--   microseconds since the epoch:
--   - `kineto`: PyTorch profiler user annotations whose name maps to a phase, inside the
--     `ProfilerStep` window that contains their start, clipped to it;
--   - `ray`: Ray timeline task spans (`ActorRolloutRefWorker.update_actor`, ...); the rank is the
--     trace's, else the index of the Ray actor (`actor_rollout_ref_1` -> 1); the step is the
--     run-level marker step (`phase_log_steps`) the task starts in, else its ordinal among the
--     worker's tasks of that name;
--   - `log`: a phase's start and end marker lines (`step 3: [gen] start` ... `[gen] end (0.47s)`);
--     with only an end line and a printed duration, start = end - duration.
--   `rank IS NULL` means the span is run-level (driver), not one rank's.
--
-- ```sql
-- SELECT rank, step, phase, round(sum(seconds), 3) AS s FROM phase_spans
-- GROUP BY ALL ORDER BY rank, step, phase;
-- ```
CREATE OR REPLACE VIEW phase_spans AS
WITH kin_ann AS (
    SELECT t.file_id, t.line_no, t.name, t.start_us, t.end_us, n.phase, n.sub_phase
    FROM _phase_trace t
    JOIN phase_names n ON n.source = 'kineto' AND n.name = t.name
    WHERE t.source = 'kineto' AND t.ph = 'X' AND t.category = 'user_annotation'
), kin AS (
    SELECT 'kineto' AS source, a.file_id, a.line_no, w.rank, w.step, a.phase, a.sub_phase, a.name,
           a.start_us, least(a.end_us, w.end_us) AS end_us
    FROM kin_ann a ASOF JOIN phase_profiler_steps w ON a.file_id = w.file_id AND a.start_us >= w.start_us
    WHERE a.start_us < w.end_us
), ray_workers AS (
    SELECT file_id, tid,
           max(TRY_CAST(nullif(regexp_extract(coalesce(category, '') || ' ' || name, _phase_setting('ray_actor_index_regex'), 2), '') AS INTEGER)) AS idx
    FROM _phase_trace
    WHERE source = 'ray' AND regexp_matches(coalesce(category, '') || ' ' || name, _phase_setting('ray_actor_index_regex'))
    GROUP BY file_id, tid
), ray_tasks AS (
    SELECT t.file_id, t.line_no, coalesce(t.rank, w.idx) AS rank, t.tid, n.phase, n.sub_phase, t.name,
           t.start_us, t.end_us
    FROM _phase_trace t
    JOIN phase_names n ON n.source = 'ray' AND n.name = t.name
    LEFT JOIN ray_workers w ON w.file_id = t.file_id AND w.tid IS NOT DISTINCT FROM t.tid
    WHERE t.source = 'ray' AND t.ph = 'X'
), run_steps AS (
    SELECT step, start_us FROM phase_log_steps WHERE rank IS NULL
), ray AS (
    SELECT 'ray' AS source, r.file_id, r.line_no, r.rank,
           CASE WHEN (SELECT count(*) FROM run_steps) > 0 THEN s.step
                ELSE row_number() OVER (PARTITION BY r.file_id, r.tid, r.name ORDER BY r.start_us) END AS step,
           r.phase, r.sub_phase, r.name, r.start_us, r.end_us
    FROM ray_tasks r ASOF LEFT JOIN run_steps s ON r.start_us >= s.start_us
), marks AS (
    SELECT m.file_id, m.rank, m.pid, m.step, m.marker_name,
           min(m.line_no) FILTER (WHERE m.edge = 'start') AS start_line,
           min(m.line_no) AS first_line,
           min(epoch_us(m.ts)) FILTER (WHERE m.edge = 'start')::DOUBLE AS s_us,
           max(epoch_us(m.ts)) FILTER (WHERE m.edge = 'end')::DOUBLE AS e_us,
           max(m.seconds) FILTER (WHERE m.edge = 'end') AS secs
    FROM _phase_log_markers m
    GROUP BY m.file_id, m.rank, m.pid, m.step, m.marker_name
), log_spans AS (
    SELECT 'log' AS source, k.file_id, coalesce(k.start_line, k.first_line) AS line_no, k.rank, k.step,
           n.phase, n.sub_phase, k.marker_name AS name,
           coalesce(k.s_us, k.e_us - k.secs * 1e6) AS start_us, k.e_us AS end_us
    FROM marks k JOIN phase_names n ON n.source = 'log' AND n.name = k.marker_name
    WHERE k.e_us IS NOT NULL AND coalesce(k.s_us, k.e_us - k.secs * 1e6) IS NOT NULL
), all_spans AS (
    SELECT * FROM kin
    UNION ALL SELECT * FROM ray
    UNION ALL SELECT * FROM log_spans
)
SELECT source, file_id, line_no, rank, step, phase, sub_phase, name, start_us, end_us,
       greatest(end_us - start_us, 0) / 1e6 AS seconds
FROM all_spans
WHERE step IS NOT NULL AND end_us >= start_us;

-- Each profiler step cut into consecutive pieces (file_id, rank, step, phase, sub_phase, name,
-- start_us, end_us, seconds), each owned by the innermost phase span covering it, or by `idle`
-- (no phase annotation is open: the CPU thread ran un-annotated code or waited). The pieces of
-- one step add up exactly to its `ProfilerStep` duration.
CREATE OR REPLACE VIEW _phase_kineto_segments AS
WITH sp AS (
    SELECT file_id, rank, step, phase, sub_phase, name, start_us, end_us FROM phase_spans WHERE source = 'kineto'
), w AS (
    SELECT file_id, rank, step, start_us, end_us FROM phase_profiler_steps
), b AS (
    -- a boundary repeated makes zero-length pieces, which `owned` drops: no need for UNION's DISTINCT
    SELECT file_id, step, start_us AS t FROM w
    UNION ALL SELECT file_id, step, end_us FROM w
    UNION ALL SELECT file_id, step, start_us FROM sp
    UNION ALL SELECT file_id, step, end_us FROM sp
), seg AS (
    -- the next boundary of the same step (one partition per file: cheaper than one per step)
    SELECT file_id, step, t AS s, CASE WHEN lead(step) OVER o = step THEN lead(t) OVER o END AS e
    FROM b WINDOW o AS (PARTITION BY file_id ORDER BY step, t)
), owned AS (
    SELECT seg.file_id, seg.step, seg.s, seg.e,
           arg_min(sp.phase, sp.end_us - sp.start_us) AS phase,
           arg_min(sp.sub_phase, sp.end_us - sp.start_us) AS sub_phase,
           arg_min(sp.name, sp.end_us - sp.start_us) AS name
    FROM seg
    LEFT JOIN sp ON sp.file_id = seg.file_id AND sp.step = seg.step AND sp.start_us <= seg.s AND sp.end_us >= seg.e
    WHERE seg.e IS NOT NULL AND seg.e > seg.s
    GROUP BY seg.file_id, seg.step, seg.s, seg.e
)
SELECT o.file_id, w.rank, o.step, coalesce(o.phase, 'idle') AS phase, o.sub_phase, o.name,
       o.s AS start_us, o.e AS end_us, (o.e - o.s) / 1e6 AS seconds
FROM owned o JOIN w ON w.file_id = o.file_id AND w.step = o.step;
