-- depends: files, lines, metrics
--
-- Phase attribution, inputs: `phase_rules`, `phase_settings`, `phase_names`.
--
-- * `phase_rules(priority, phase, sub_phase, pattern, sources, in_step)` and
--   `phase_settings(key, value)` hold `signatures/phases.yaml` (which span, task, metric and
--   log-marker names are rollout / reward / train / sync / other). `forensics.phases.attach()`
--   fills them whenever forensics opens a database (a read-only connection gets TEMP copies
--   that shadow the stored ones); with them empty the phase views return no rows.
-- * `phase_names`: each distinct span / task / metric / marker name, per source, with the phase
--   of the first rule that matches it (a rule applies to the sources it names, or to all).
--
-- This file also creates `trace_events` and `engine_events` with their provenance columns
-- only when no parser has declared them yet, so the views can be created on any database.
--
-- ```sql
-- SELECT source, name, phase, sub_phase FROM phase_names ORDER BY source, phase, name;
-- ```
CREATE TABLE IF NOT EXISTS phase_rules (priority INTEGER, phase VARCHAR, sub_phase VARCHAR, pattern VARCHAR, sources VARCHAR, in_step BOOLEAN);
CREATE TABLE IF NOT EXISTS phase_settings (key VARCHAR, value VARCHAR);
CREATE TABLE IF NOT EXISTS trace_events (file_id INTEGER, line_no BIGINT);
CREATE TABLE IF NOT EXISTS engine_events (file_id INTEGER, line_no BIGINT);

-- The value of a setting of signatures/phases.yaml. forensics.phases.attach() redefines it as a
-- CASE over the settings' literal values, so that a pattern from a setting folds to a constant.
CREATE OR REPLACE MACRO _phase_setting(k) AS (SELECT max(value) FROM phase_settings WHERE key = k);

-- The priority of the first rule whose pattern matches `bare` as a whole and that applies to
-- `src` (NULL when none does). forensics.phases.attach() redefines it as a CASE over the rules'
-- literal patterns, so that each regular expression is compiled once, not once per name.
CREATE OR REPLACE MACRO _phase_rule_priority(bare, src) AS (
    SELECT min(r.priority) FROM phase_rules r
    WHERE regexp_full_match(bare, r.pattern)
      AND (r.sources IS NULL OR list_contains(string_split(r.sources, ','), src))
);

-- Whether a trace category is GPU activity (`gpu_categories`, matched as a whole).
-- forensics.phases.attach() redefines it as `c IN (...)` when the setting is a plain list of
-- words (`kernel|gpu_memcpy|gpu_memset`): the same test without a regular expression per event.
CREATE OR REPLACE MACRO _phase_gpu_category(c) AS regexp_full_match(c, _phase_setting('gpu_categories'));

-- `trace_events` (PyTorch profiler and Ray timeline events) with every column of its contract
-- present (NULL where the table lacks one), the rank completed from the file's rank, and
-- `start_us` / `end_us`: the event's wall clock in microseconds since the epoch when the trace
-- has one (`ts`), else trace time.
CREATE OR REPLACE VIEW _phase_trace AS
WITH t AS (
    SELECT * FROM (
        SELECT NULL::INTEGER AS file_id, NULL::BIGINT AS line_no, NULL::VARCHAR AS source, NULL::BIGINT AS seq,
               NULL::INTEGER AS rank, NULL::VARCHAR AS pid, NULL::VARCHAR AS tid, NULL::VARCHAR AS ph,
               NULL::VARCHAR AS category, NULL::VARCHAR AS name, NULL::DOUBLE AS ts_us, NULL::DOUBLE AS dur_us,
               NULL::TIMESTAMP AS ts, NULL::INTEGER AS device, NULL::BIGINT AS stream, NULL::BIGINT AS correlation,
               NULL::BIGINT AS external_id, NULL::VARCHAR AS args, NULL::VARCHAR AS coll_name,
               NULL::BIGINT AS coll_in_nelems, NULL::BIGINT AS coll_out_nelems, NULL::VARCHAR AS coll_dtype,
               NULL::INTEGER AS coll_group_size, NULL::VARCHAR AS pg_name
    ) WHERE false
    UNION ALL BY NAME
    SELECT * FROM trace_events
)
SELECT t.file_id, t.line_no, t.source, t.seq, coalesce(t.rank, f.rank)::INTEGER AS rank, t.pid, t.tid, t.ph,
       t.category, t.name, t.ts_us, t.dur_us, t.ts, t.device, t.stream, t.correlation, t.external_id, t.args,
       t.coll_name, t.coll_in_nelems, t.coll_out_nelems, t.coll_dtype, t.coll_group_size, t.pg_name,
       coalesce(epoch_us(t.ts)::DOUBLE, t.ts_us) AS start_us,
       coalesce(epoch_us(t.ts)::DOUBLE, t.ts_us) + coalesce(t.dur_us, 0) AS end_us
FROM t LEFT JOIN files f USING (file_id);

-- vLLM/SGLang sleep and wake events (`kind`, `ts`, `seconds`), whatever columns `engine_events` has.
CREATE OR REPLACE VIEW _phase_engine AS
SELECT file_id, line_no, lower(kind) AS kind, ts, seconds::DOUBLE AS seconds
FROM (
    SELECT * FROM (
        SELECT NULL::INTEGER AS file_id, NULL::BIGINT AS line_no, NULL::VARCHAR AS kind,
               NULL::TIMESTAMP AS ts, NULL::DOUBLE AS seconds
    ) WHERE false
    UNION ALL BY NAME
    SELECT * FROM engine_events
);

-- Log lines that mark a step or a phase, such as `step 3: [gen] start`,
-- `[actor rank 1] step 3: update_actor done in 0.52s`: `step`, `marker_name`, `edge`
-- (`start`/`end`), the printed `seconds`, the `rank` (from the line prefix or `rank N]`),
-- `ts_inherited` (the line has no stamp of its own: its `ts` is the previous line's).
CREATE OR REPLACE VIEW _phase_log_markers AS
WITH m AS (
    SELECT l.file_id, l.line_no, l.ts, l.ts_quality, l.rank, l.pid, l.actor, l.message
    FROM lines l
    WHERE l.ts IS NOT NULL AND l.message ILIKE '%step%' AND regexp_matches(l.message, _phase_setting('log_marker_regex'))
)
SELECT file_id, line_no, ts, ts_quality = 'inherited' AS ts_inherited,
       coalesce(rank, TRY_CAST(nullif(regexp_extract(message, _phase_setting('log_rank_regex'), 1), '') AS INTEGER)) AS rank,
       pid, actor,
       CAST(regexp_extract(message, _phase_setting('log_marker_regex'), 1) AS BIGINT) AS step,
       coalesce(nullif(regexp_extract(message, _phase_setting('log_marker_regex'), 2), ''),
                regexp_extract(message, _phase_setting('log_marker_regex'), 3)) AS marker_name,
       CASE WHEN regexp_full_match(lower(regexp_extract(message, _phase_setting('log_marker_regex'), 4)), _phase_setting('log_end_words'))
            THEN 'end' ELSE 'start' END AS edge,
       TRY_CAST(nullif(regexp_extract(message, _phase_setting('log_seconds_regex'), 1), '') AS DOUBLE) AS seconds
FROM m;

CREATE OR REPLACE VIEW phase_names AS
WITH names AS (
    SELECT DISTINCT source, name,
           lower(CASE WHEN source = 'ray' THEN regexp_replace(name, '^.*[.]', '') ELSE name END) AS bare
    FROM _phase_trace
    WHERE ph = 'X' AND name IS NOT NULL AND source IN ('kineto', 'ray')
      AND (source = 'ray' OR category = 'user_annotation')
    UNION
    SELECT DISTINCT 'metrics', key, lower(regexp_replace(key, _phase_setting('timing_prefix_regex'), ''))
    FROM metrics WHERE regexp_matches(key, _phase_setting('timing_prefix_regex'))
    UNION
    SELECT DISTINCT 'log', marker_name, lower(marker_name) FROM _phase_log_markers
)
, matched AS (
    SELECT source, name, bare, _phase_rule_priority(bare, source) AS priority FROM names
)
SELECT n.source, n.name, n.bare,
       arg_min(r.phase, r.priority) AS phase,
       arg_min(r.sub_phase, r.priority) AS sub_phase,
       arg_min(coalesce(r.in_step, true), r.priority) AS in_step
FROM matched n
JOIN phase_rules r ON r.priority = n.priority
GROUP BY n.source, n.name, n.bare;
