-- `tail_lines(n := 20, until := NULL)`: a table macro, the last `n` non-blank lines of every
-- process stream up to and including the time `until` (a TIMESTAMP; NULL = the end of the
-- run). A stream is one (node, pid, rank) as far as they are known for a line (the line's own
-- prefix, else its file's hints); lines with neither pid nor rank form one stream per file.
-- `back` = 1 is the stream's last line. Lines are ordered by `ts`, then by file and line;
-- unstamped lines take part only when `until` is NULL.
--
-- `last_lines`: `tail_lines(20)`, what every process printed last.
-- `last_lines_before_error`: what every process printed last up to the run's first
-- ERROR/FATAL line (see `error_lines`); the same as `last_lines` when there is no error.
--
-- ```sql
-- -- the very last line of each rank before the failure
-- SELECT node, rank, pid, path, line_no, ts, message FROM last_lines_before_error
-- WHERE back = 1 ORDER BY rank;
-- -- the last 5 lines of each stream before a given moment
-- SELECT stream, back, path, line_no, message
-- FROM tail_lines(5, TIMESTAMP '2026-11-30 00:33:00') ORDER BY stream, back DESC;
-- ```
CREATE OR REPLACE MACRO tail_lines(n := 20, until := NULL::TIMESTAMP) AS TABLE
WITH keyed AS (
    SELECT
        CASE WHEN pid IS NULL AND rank IS NULL THEN 'file ' || path
             ELSE concat_ws(' ', 'node ' || node, 'pid ' || pid, 'rank ' || rank) END AS stream,
        *
    FROM attributed_lines
    WHERE trim(message) <> ''
      AND (until IS NULL OR ts <= until)
), numbered AS (
    SELECT
        row_number() OVER (PARTITION BY stream ORDER BY ts DESC NULLS LAST, file_id DESC, line_no DESC) AS back,
        *
    FROM keyed
)
SELECT stream, back, node, pid, rank, actor, path, file_id, line_no, ts, level, message
FROM numbered
WHERE back <= n;

CREATE OR REPLACE VIEW last_lines AS
SELECT * FROM tail_lines(20);

CREATE OR REPLACE VIEW last_lines_before_error AS
SELECT * FROM tail_lines(20, (SELECT min(ts) FROM error_lines WHERE level IN ('ERROR', 'FATAL')));
