-- depends: lines
--
-- `ray_task_errors`: the headers of Ray task failures as the driver prints them,
-- `ray.exceptions.RayTaskError(<Exc>): ray::<Class>.<method>() (pid=<p>, ip=<ip>, ...)`, and
-- `Unhandled error (suppress with 'RAY_IGNORE_UNHANDLED_ERRORS=1'): ray::<Class>.<method>() (pid=...)`
-- (an error of a task nobody waited for; `exception` is null there). The traceback printed
-- under such a header is the worker's (`pid`), whatever process prefix the lines carry.
-- `exception` is the original exception class (`OutOfMemoryError`, `ActorDiedError`, ...),
-- `method` the task that failed (`actor_rollout_update_actor`, `generate_sequences`, `run`),
-- which tells the phase of the step; `pid` / `ip` identify the worker process.
-- `actor_deaths`: the `ActorDiedError` blocks: the dead actor's `pid`, its `actor_name` and `ip`.
-- verl names a worker group's actors `<prefix><Class>_<p>:<l>`: `p` the placement group (one
-- per node, `pg_index`), `l` the worker's place in it (`local_index`, its local rank), so the
-- global rank is `p * <workers per node> + l`; `member_index` is that rank where the name
-- alone tells it (the first placement group, `p = 0`), else null.
--
-- ```sql
-- SELECT f.path, r.line_no, r.exception, r.actor_class, r.method, r.pid, r.ip
-- FROM ray_task_errors r JOIN files f USING (file_id) ORDER BY r.file_id, r.line_no;
-- SELECT pid, actor_name, member_index, pg_index, local_index, ip FROM actor_deaths;
-- ```
CREATE OR REPLACE VIEW ray_task_errors AS
SELECT
    file_id,
    line_no,
    ts,
    nullif(regexp_extract(message, 'RayTaskError\((\w+)\)', 1), '') AS exception,
    nullif(regexp_extract(message, 'ray::(?:[\w\-]+(?::[\w\-]+)*:)?(?:([\w.<>]+)\.)?\w+\(?\)? \(pid=', 1), '') AS actor_class,
    nullif(regexp_extract(message, 'ray::(?:[\w\-]+(?::[\w\-]+)*:)?(?:[\w.<>]+\.)?(\w+)\(?\)? \(pid=', 1), '') AS method,
    TRY_CAST(nullif(regexp_extract(message, 'ray::\S+ \(pid=(\d+)', 1), '') AS BIGINT) AS pid,
    nullif(regexp_extract(message, 'ray::\S+ \(pid=\d+, ip=([^,)\s]+)', 1), '') AS ip
FROM lines
WHERE contains(message, 'ray::') AND regexp_matches(message, 'ray::\S+ \(pid=\d+');

CREATE OR REPLACE VIEW actor_deaths AS
WITH fields AS (
    SELECT file_id, line_no, ts,
           regexp_extract(message, '^\s+(pid|name|ip|class_name|actor_id): (\S+)\s*$', 1) AS k,
           regexp_extract(message, '^\s+(pid|name|ip|class_name|actor_id): (\S+)\s*$', 2) AS v
    FROM lines
    WHERE regexp_matches(message, '^\s+(pid|name|ip|class_name|actor_id): \S+\s*$')
),
heads AS (
    SELECT file_id, line_no, ts FROM lines
    WHERE contains(message, 'The actor died unexpectedly before finishing this task')
       OR contains(message, 'The actor died because its node has died')
)
SELECT
    h.file_id,
    h.line_no,
    h.ts,
    TRY_CAST(max(f.v) FILTER (WHERE f.k = 'pid') AS BIGINT) AS pid,
    max(f.v) FILTER (WHERE f.k = 'name') AS actor_name,
    CASE WHEN TRY_CAST(nullif(regexp_extract(max(f.v) FILTER (WHERE f.k = 'name'), '_(\d+):\d+$', 1), '') AS INTEGER) = 0
         THEN TRY_CAST(nullif(regexp_extract(max(f.v) FILTER (WHERE f.k = 'name'), '_\d+:(\d+)$', 1), '') AS INTEGER) END AS member_index,
    TRY_CAST(nullif(regexp_extract(max(f.v) FILTER (WHERE f.k = 'name'), '_(\d+):\d+$', 1), '') AS INTEGER) AS pg_index,
    TRY_CAST(nullif(regexp_extract(max(f.v) FILTER (WHERE f.k = 'name'), '_\d+:(\d+)$', 1), '') AS INTEGER) AS local_index,
    max(f.v) FILTER (WHERE f.k = 'ip') AS ip,
    max(f.v) FILTER (WHERE f.k = 'class_name') AS class_name
FROM heads h JOIN fields f ON f.file_id = h.file_id AND f.line_no BETWEEN h.line_no + 1 AND h.line_no + 8
GROUP BY h.file_id, h.line_no, h.ts;
