-- depends: lines, files
--
-- `attributed_lines`: every line with its file's path and format and with node, pid, rank and
-- actor taken from the line when it names them, else from its file's hints.
--
-- `error_lines`: every error or warning line with its file, process and effective level.
-- `level` is the header's level when it is WARNING/ERROR/FATAL; for lines whose header
-- printed no level it is inferred from the text: an exception line (`torch.OutOfMemoryError: ...`,
-- `RuntimeError: ...`, `Error executing job ...`) is ERROR, a Python warning
-- (`UserWarning: ...`) is WARNING (`level_inferred` tells which). `weight` counts Ray's
-- deduplicated lines (`[repeated 8x across cluster]`) as the lines they stand for.
--
-- `errors_by_rank`: errors and warnings per (node, rank) per minute, with the first line of
-- each bucket; unstamped lines fall in the bucket `minute IS NULL`.
--
-- ```sql
-- SELECT rank, minute, errors, warnings, first_error FROM errors_by_rank
-- WHERE errors > 0 ORDER BY minute, rank;
-- -- the error lines themselves, earliest first
-- SELECT path, line_no, ts, rank, level, message FROM error_lines
-- WHERE level IN ('ERROR', 'FATAL') ORDER BY ts NULLS LAST, path, line_no LIMIT 20;
-- ```
CREATE OR REPLACE VIEW attributed_lines AS
SELECT
    f.path,
    f.format,
    l.file_id,
    l.line_no,
    l.ts,
    l.ts_quality,
    coalesce(l.node, f.node) AS node,
    coalesce(l.rank, f.rank) AS rank,
    coalesce(l.pid, f.pid) AS pid,
    coalesce(l.actor, f.actor) AS actor,
    l.level,
    coalesce(l.repeat, 1) AS weight,
    l.header,
    l.logger,
    l.event_line,
    l.message,
    l.text
FROM lines l JOIN files f USING (file_id);

CREATE OR REPLACE VIEW error_lines AS
WITH classified AS (
    SELECT
        *,
        CASE
            WHEN level IN ('WARNING', 'ERROR', 'FATAL') THEN level
            WHEN level IS NOT NULL THEN NULL
            WHEN regexp_matches(message, '^\s*([A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(Error|Exception)(: |:$|$)')
              OR regexp_matches(message, '^\s*(Error|ERROR|FATAL|Fatal error)[: ]') THEN 'ERROR'
            WHEN regexp_matches(message, '(^|\s)([A-Za-z_][\w.]*\.)?[A-Z]\w*Warning: ') THEN 'WARNING'
        END AS effective_level
    FROM attributed_lines
)
SELECT
    path, file_id, line_no, ts, ts_quality, node, rank, pid, actor,
    effective_level AS level,
    level IS NULL AS level_inferred,
    weight, header, logger, message, text
FROM classified
WHERE effective_level IS NOT NULL;

CREATE OR REPLACE VIEW errors_by_rank AS
SELECT
    node,
    rank,
    date_trunc('minute', ts) AS minute,
    coalesce(sum(weight) FILTER (WHERE level IN ('ERROR', 'FATAL')), 0)::BIGINT AS errors,
    coalesce(sum(weight) FILTER (WHERE level = 'WARNING'), 0)::BIGINT AS warnings,
    min(ts) AS first_ts,
    max(ts) AS last_ts,
    arg_min(path || ':' || line_no || ' ' || message, (ts, path, line_no)) FILTER (WHERE level IN ('ERROR', 'FATAL')) AS first_error,
    arg_min(path || ':' || line_no || ' ' || message, (ts, path, line_no)) AS first_line
FROM error_lines
GROUP BY ALL;
