-- depends: attributed_lines, error_lines, rank_pids
--
-- `tail_lines(n := 20, until := NULL)`: a table macro, the last `n` non-blank lines of every
-- process stream up to and including the time `until` (a TIMESTAMP; NULL = the end of the
-- run). A stream is one process: its (node, pid) as far as they are known for a line (the
-- line's own prefix, else its file's hints; a pid seen on one node only takes that node, a
-- line with a rank but no pid takes the pid that rank ran as when `rank_pids` names just
-- one); lines with a rank and no known pid form one stream per (node, rank), lines with
-- neither one stream per file. `rank` is the line's rank, else the one most lines of its
-- stream carry, else the one `rank_pids` gives its pid. `back` = 1 is the stream's last
-- line. Lines are ordered by `ts`, then by file and line; unstamped lines take part only
-- when `until` is NULL.
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
WITH pid_node AS (
    SELECT pid, min(node) AS node FROM attributed_lines
    WHERE pid IS NOT NULL AND node IS NOT NULL GROUP BY pid HAVING count(DISTINCT node) = 1
), rank_pid AS (
    SELECT rank, min(pid) AS pid FROM rank_pids
    WHERE rank IS NOT NULL AND pid IS NOT NULL GROUP BY rank HAVING count(DISTINCT pid) = 1
), pid_rank AS (
    SELECT pid, arg_max(rank, n) AS rank
    FROM (SELECT pid, rank, sum(n) AS n FROM rank_pids WHERE pid IS NOT NULL AND rank IS NOT NULL GROUP BY pid, rank)
    GROUP BY pid
), placed AS (
    SELECT a.* REPLACE (coalesce(a.pid, rp.pid) AS pid), coalesce(a.node, pn.node, pn2.node) AS proc_node
    FROM attributed_lines a
    LEFT JOIN rank_pid rp ON a.pid IS NULL AND rp.rank = a.rank
    LEFT JOIN pid_node pn ON pn.pid = a.pid
    LEFT JOIN pid_node pn2 ON a.pid IS NULL AND pn2.pid = rp.pid
    WHERE trim(a.message) <> ''
      AND (until IS NULL OR a.ts <= until)
), keyed AS (
    SELECT
        CASE WHEN pid IS NOT NULL THEN concat_ws(' ', 'node ' || proc_node, 'pid ' || pid)
             WHEN rank IS NOT NULL THEN concat_ws(' ', 'node ' || proc_node, 'rank ' || rank)
             ELSE 'file ' || path END AS stream,
        *
    FROM placed
), numbered AS (
    SELECT
        row_number() OVER (PARTITION BY stream ORDER BY ts DESC NULLS LAST, file_id DESC, line_no DESC) AS back,
        coalesce(k.rank, mode(k.rank) OVER (PARTITION BY k.stream), pr.rank) AS stream_rank,
        k.*
    FROM keyed k LEFT JOIN pid_rank pr ON pr.pid = k.pid
)
SELECT stream, back, proc_node AS node, pid, stream_rank AS rank, actor, path, file_id, line_no, ts, level, message
FROM numbered
WHERE back <= n;

CREATE OR REPLACE VIEW last_lines AS
SELECT * FROM tail_lines(20);

CREATE OR REPLACE VIEW last_lines_before_error AS
SELECT * FROM tail_lines(20, (SELECT min(ts) FROM error_lines WHERE level IN ('ERROR', 'FATAL')));
