-- depends: metrics
--
-- `step_metrics`: one value per (step, metric key): the same metric logged twice (console
-- line and JSONL record, or several ranks) is kept once, preferring the JSONL record (full
-- precision), then the lowest rank, then the earliest line. Engine statistics without a
-- step are left out (they stay in `metrics`).
--
-- `metrics_by_step`: the run one row per step, wide: `ts` (first time the step was logged),
-- columns for the common verl keys (named as logged, quote them: `"timing_s/gen"`), and
-- `metrics`, a MAP of every key of that step (`metrics['critic/vf_loss']`). A view cannot
-- pivot on keys it does not know yet; for every key as a column, pivot `step_metrics` in
-- the query (or call `run.metrics(wide=True)` in Python).
--
-- ```sql
-- SELECT step, "timing_s/step", "timing_s/gen", "timing_s/update_actor", "actor/grad_norm"
-- FROM metrics_by_step ORDER BY step;
-- -- every key as a column
-- PIVOT step_metrics ON key USING first(value) GROUP BY step ORDER BY step;
-- ```
CREATE OR REPLACE VIEW step_metrics AS
SELECT
    step,
    key,
    arg_min(value, (CASE source WHEN 'jsonl' THEN 0 ELSE 1 END, coalesce(rank, 2147483647), file_id, line_no)) AS value,
    arg_min(value_text, (CASE source WHEN 'jsonl' THEN 0 ELSE 1 END, coalesce(rank, 2147483647), file_id, line_no)) AS value_text,
    min(ts) AS ts,
    count(*) AS reports
FROM metrics
WHERE step IS NOT NULL
GROUP BY step, key;

CREATE OR REPLACE VIEW metrics_by_step AS
SELECT
    step,
    min(ts) AS ts,
    first(value) FILTER (WHERE key = 'timing_s/step') AS "timing_s/step",
    first(value) FILTER (WHERE key = 'timing_s/gen') AS "timing_s/gen",
    first(value) FILTER (WHERE key = 'timing_s/reward') AS "timing_s/reward",
    first(value) FILTER (WHERE key = 'timing_s/old_log_prob') AS "timing_s/old_log_prob",
    first(value) FILTER (WHERE key = 'timing_s/ref') AS "timing_s/ref",
    first(value) FILTER (WHERE key = 'timing_s/values') AS "timing_s/values",
    first(value) FILTER (WHERE key = 'timing_s/adv') AS "timing_s/adv",
    first(value) FILTER (WHERE key = 'timing_s/update_critic') AS "timing_s/update_critic",
    first(value) FILTER (WHERE key = 'timing_s/update_actor') AS "timing_s/update_actor",
    first(value) FILTER (WHERE key = 'timing_s/update_weights') AS "timing_s/update_weights",
    first(value) FILTER (WHERE key = 'actor/pg_loss') AS "actor/pg_loss",
    first(value) FILTER (WHERE key = 'actor/entropy') AS "actor/entropy",
    first(value) FILTER (WHERE key = 'actor/grad_norm') AS "actor/grad_norm",
    first(value) FILTER (WHERE key = 'actor/pg_clipfrac') AS "actor/pg_clipfrac",
    first(value) FILTER (WHERE key = 'actor/ppo_kl') AS "actor/ppo_kl",
    first(value) FILTER (WHERE key = 'actor/lr') AS "actor/lr",
    first(value) FILTER (WHERE key = 'critic/score/mean') AS "critic/score/mean",
    first(value) FILTER (WHERE key = 'critic/rewards/mean') AS "critic/rewards/mean",
    first(value) FILTER (WHERE key = 'response_length/mean') AS "response_length/mean",
    first(value) FILTER (WHERE key = 'perf/throughput') AS "perf/throughput",
    first(value) FILTER (WHERE key = 'perf/max_memory_allocated_gb') AS "perf/max_memory_allocated_gb",
    map_from_entries(list((key, value) ORDER BY key)) AS metrics
FROM step_metrics
GROUP BY step;
