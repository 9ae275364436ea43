-- depends: lines
--
-- `tracebacks`: one row per Python traceback (a multi-line event grouped by the text parser:
-- `lines.event_line` is its first line). `exception` is its last line (the exception and its
-- message), `body` all its lines joined by newlines (the frames name the code path, which
-- diagnose reads to tell e.g. a rollout-side OOM from a training-side one). `pid`, `rank`,
-- `actor` and `node` are those of the process that printed it; `ts` its first stamp.
--
-- ```sql
-- SELECT f.path, t.event_line, t.rank, t.exception FROM tracebacks t JOIN files f USING (file_id)
-- ORDER BY t.ts NULLS LAST LIMIT 20;
-- -- tracebacks that pass through the actor update
-- SELECT file_id, event_line, exception FROM tracebacks WHERE body LIKE '%update_actor%';
-- ```
CREATE OR REPLACE VIEW tracebacks AS
SELECT
    file_id,
    event_line,
    max(line_no) AS last_line,
    count(*) AS n_lines,
    arg_max(message, line_no) AS exception,
    any_value(pid) AS pid,
    any_value(rank) AS rank,
    any_value(actor) AS actor,
    any_value(node) AS node,
    min(ts) AS ts,
    string_agg(message, chr(10) ORDER BY line_no) AS body
FROM lines
WHERE event_line IS NOT NULL
GROUP BY file_id, event_line;
